#!/usr/bin/env python3
"""SmolLM2-135M decoding through oasiskv.Cache: the numpy reference model (tools/model_reference)
as a Python engine, replicating the C++ engine's sparse decode (examples/smollm2:
apps/generate_main.cpp, oasiskv_session.cpp, apps/drafters.cpp) step for step, so that its greedy
tokens equal `smollm2-generate --weights fp32 --kv fp32 --drafter ngram` with the same prompt,
budget and config.

What it does, as the C++ engine does:
  1. dense causal prefill of the prompt (numpy, float32); the first token is the argmax of the last
     row's logits;
  2. a cache of float32 rows (one sequence, max_tokens_per_sequence = prompt + tokens + 2) gets the
     prompt's keys (after RoPE) and values, every layer;
  3. the first working set: the n-gram draft of the next token is run at position P (the first
     generated token's position) with dense attention over the prompt, and its per-layer queries
     plan every layer (prefetch); without a draft, the last prompt row's queries plan them;
  4. each step runs the current token at p and, when the n-gram drafter has a draft (the last 2-3
     tokens occurred before), the draft at p + 1: per layer the current row's k, v are appended,
     the last row's queries plan the next step (prefetch), and the ticket planned in the previous
     step is attended: the current row over the resident blocks, the draft row over them plus its
     own k, v (never appended).

Usage: smollm2_oasiskv.py --model M.gguf (--prompt-ids "1 2 3" | --prompt-file F) [--tokens 16]
       [--budget 256] [--sink-tokens 16] [--recent-tokens 64] [--fetch-ratio 1.0] [--prompt-tokens N]
--prompt-file needs the `tokenizers` package (the reference tokenizer); --prompt-ids does not.
Needs numpy, gguf and the oasiskv module (pip install . at the repository root).
"""
import argparse
import os
import sys

import numpy as np

import oasiskv

_REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "model_reference")
sys.path.insert(0, os.path.normpath(_REFERENCE))
import reference  # noqa: E402  (tools/model_reference/reference.py)


def ngram_draft(history, min_n=2, max_n=3):
    """Prompt lookup, as NgramDrafter: the token after the most recent earlier occurrence of the
    longest suffix (max_n down to min_n tokens); None (no lookahead row) when none occurs."""
    n_hist = len(history)
    for n in range(min(max_n, n_hist - 1), max(min_n, 1) - 1, -1):
        suffix = history[n_hist - n:]
        for start in range(n_hist - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n]
    return history[-1] if min_n == 0 else None


class Engine:
    """The reference model's weights, run one layer at a time so the KV can live in a cache."""

    def __init__(self, model_path):
        reader = reference.GGUFReader(model_path)
        self.m = reference.Model(reader)
        self._reader = reader
        m = self.m
        self.n_layers, self.n_heads, self.n_kv_heads = m.n_layers, m.n_heads, m.n_kv_heads
        self.head_dim, self.dim = m.head_dim, m.dim
        self.group = self.n_heads // self.n_kv_heads
        self.scale = np.float32(1.0 / np.sqrt(self.head_dim))
        self.layers = []
        for l in range(self.n_layers):
            p = f"blk.{l}."
            t = m.t
            self.layers.append(dict(
                attn_norm=t[p + "attn_norm.weight"],
                wq=np.ascontiguousarray(m.unpermute(t[p + "attn_q.weight"], self.n_heads).T),
                wk=np.ascontiguousarray(m.unpermute(t[p + "attn_k.weight"], self.n_kv_heads).T),
                wv=np.ascontiguousarray(t[p + "attn_v.weight"].T),
                wo=np.ascontiguousarray(t[p + "attn_output.weight"].T),
                ffn_norm=t[p + "ffn_norm.weight"],
                gate=np.ascontiguousarray(t[p + "ffn_gate.weight"].T),
                up=np.ascontiguousarray(t[p + "ffn_up.weight"].T),
                down=np.ascontiguousarray(t[p + "ffn_down.weight"].T),
            ))
        self.embedding = m.t["token_embd.weight"]
        self.output_norm = m.t["output_norm.weight"]
        self.output = np.ascontiguousarray(m.output.T)

    def tokenizer(self):
        return reference.build_tokenizer(self._reader)

    # -- the pieces of a layer ----------------------------------------------------------------------
    def attention_inputs(self, l, x, positions):
        w = self.layers[l]
        h = self.m.rms_norm(x, w["attn_norm"])
        T = x.shape[0]
        q = (h @ w["wq"]).reshape(T, self.n_heads, self.head_dim)
        k = (h @ w["wk"]).reshape(T, self.n_kv_heads, self.head_dim)
        v = (h @ w["wv"]).reshape(T, self.n_kv_heads, self.head_dim)
        pos = np.asarray(positions)
        return (self.m.rope_hf(q, pos).astype(np.float32), self.m.rope_hf(k, pos).astype(np.float32),
                v.astype(np.float32))

    def output_and_mlp(self, l, x, out):
        w = self.layers[l]
        x = x + out.reshape(x.shape[0], self.dim) @ w["wo"]
        h = self.m.rms_norm(x, w["ffn_norm"])
        gate, up = h @ w["gate"], h @ w["up"]
        return (x + ((gate / (1.0 + np.exp(-gate))) * up) @ w["down"]).astype(np.float32)

    def logits(self, x):
        return self.m.rms_norm(x, self.output_norm) @ self.output

    def attend(self, q, keys, values):
        """One row's attention: q [n_heads][d], keys / values [n_kv_heads][n][d] -> [n_heads][d]."""
        out = np.empty_like(q)
        for head in range(self.n_heads):
            kv = head // self.group
            s = (keys[kv] @ q[head]) * self.scale
            s = np.exp(s - s.max())
            out[head] = (s / s.sum()) @ values[kv]
        return out

    # -- dense paths ------------------------------------------------------------------------------------
    def prefill(self, tokens):
        """Dense causal prefill: per layer k, v [P][kv heads][d] (keys after RoPE), the last
        row's logits, and per layer the last row's queries [1][heads][d]."""
        T = len(tokens)
        x = self.embedding[np.asarray(tokens)]
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        ks, vs, last_queries = [], [], []
        for l in range(self.n_layers):
            q, k, v = self.attention_inputs(l, x, np.arange(T))
            last_queries.append(q[-1:])
            out = np.empty_like(q)
            for head in range(self.n_heads):
                kv = head // self.group
                s = (q[:, head, :] @ k[:, kv, :].T) * self.scale + mask
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                s /= s.sum(axis=-1, keepdims=True)
                out[:, head, :] = s @ v[:, kv, :]
            ks.append(k)
            vs.append(v)
            x = self.output_and_mlp(l, x, out)
        return ks, vs, self.logits(x[-1:])[0], last_queries

    def dense_row_queries(self, ks, vs, token, position):
        """Per-layer queries of `token` at `position`, attending densely to rows [0, position) and
        itself (dense_row_queries in the C++ engine): the lookahead row of the first working set."""
        x = self.embedding[np.asarray([token])]
        queries = []
        for l in range(self.n_layers):
            q, k, v = self.attention_inputs(l, x, [position])
            keys = np.concatenate([ks[l][:position], k], axis=0).transpose(1, 0, 2)
            values = np.concatenate([vs[l][:position], v], axis=0).transpose(1, 0, 2)
            queries.append(q)
            x = self.output_and_mlp(l, x, self.attend(q[0], keys, values)[None])
        return queries


def view_rows(view):
    """The resident rows of batch entry 0 of a LayerView, per kv head: keys, values [n][d]."""
    indptr, slot, valid = view.indptr, view.slot, view.valid_tokens
    pool = view.pool  # zero-copy [slots][K|V][block_tokens][head_dim]
    keys, values = [], []
    for h in range(view.num_kv_heads):
        entries = range(indptr[h], indptr[h + 1])
        keys.append(np.concatenate([pool[slot[e], 0, :valid[e]] for e in entries], axis=0))
        values.append(np.concatenate([pool[slot[e], 1, :valid[e]] for e in entries], axis=0))
    return keys, values


def generate(engine, prompt, n_new, budget=256, sink_tokens=16, recent_tokens=64, fetch_ratio=1.0, seq=1):
    """Greedy decode of n_new tokens (the first from the dense prefill) through an oasiskv.Cache.
    Returns (tokens, cache statistics)."""
    P = len(prompt)
    ks, vs, last_logits, last_queries = engine.prefill(prompt)
    config = oasiskv.CacheConfig(num_layers=engine.n_layers, num_q_heads=engine.n_heads,
                                 num_kv_heads=engine.n_kv_heads, head_dim=engine.head_dim,
                                 budget_tokens=budget, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                 fetch_ratio=fetch_ratio, max_sequences=1,
                                 max_tokens_per_sequence=P + n_new + 2)
    cache = oasiskv.Cache(config, dtype="float32")
    cache.add_sequence(seq)
    for l in range(engine.n_layers):
        cache.append([seq], l, ks[l], vs[l], rows_per_seq=[P])
    out = [int(np.argmax(last_logits))]
    history = list(prompt) + [out[-1]]
    # The first working set, from the draft's queries at position P (or the last prompt row's).
    first_draft = ngram_draft(history)
    queries = last_queries if first_draft is None else engine.dense_row_queries(ks, vs, first_draft, P)
    tickets = [cache.prefetch([seq], l, queries[l]) for l in range(engine.n_layers)]
    del ks, vs
    while len(out) < n_new:
        p = len(history) - 1  # the current token's position
        draft = ngram_draft(history)  # None: one row this step
        rows = [history[-1]] if draft is None else [history[-1], draft]
        x = engine.embedding[np.asarray(rows)]
        for l in range(engine.n_layers):
            q, k, v = engine.attention_inputs(l, x, [p, p + 1][:len(rows)])
            cache.append([seq], l, k[:1], v[:1])
            nxt = cache.prefetch([seq], l, q[-1:])

            def attention(view):
                keys, values = view_rows(view)
                o0 = engine.attend(q[0], keys, values)
                if draft is None:
                    return o0[None]
                keys1 = [np.concatenate([keys[h], k[1:2, h]], axis=0) for h in range(engine.n_kv_heads)]
                values1 = [np.concatenate([values[h], v[1:2, h]], axis=0) for h in range(engine.n_kv_heads)]
                return np.stack([o0, engine.attend(q[1], keys1, values1)])

            o = cache.attend(tickets[l], attention)
            tickets[l] = nxt
            x = engine.output_and_mlp(l, x, o)
        out.append(int(np.argmax(engine.logits(x[:1])[0])))
        history.append(out[-1])
    return out, cache.statistics()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(os.path.dirname(_REFERENCE), "..", ".cache", "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--prompt-ids", help="token ids, separated by spaces or commas")
    ap.add_argument("--prompt-file", help="text file (needs the tokenizers package)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="keep only the last N prompt tokens (0: all)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--sink-tokens", type=int, default=16)
    ap.add_argument("--recent-tokens", type=int, default=64)
    ap.add_argument("--fetch-ratio", type=float, default=1.0)
    args = ap.parse_args()
    engine = Engine(args.model)
    tk = None
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
    elif args.prompt_file:
        tk = engine.tokenizer()
        prompt = tk.encode(open(args.prompt_file, encoding="utf-8", newline="").read()).ids
    else:
        ap.error("--prompt-ids or --prompt-file is required")
    if args.prompt_tokens > 0:
        prompt = prompt[-args.prompt_tokens:]
    tokens, stats = generate(engine, prompt, args.tokens, args.budget, args.sink_tokens, args.recent_tokens,
                             args.fetch_ratio)
    print("oasiskv ids:", " ".join(str(t) for t in tokens))
    if tk is not None:
        print(tk.decode(tokens))
    print(stats)


if __name__ == "__main__":
    main()
