#!/usr/bin/env python3
"""Independent reference for the SmolLM2 C++ engine in examples/smollm2.

It shares nothing with the C++ code: weights are dequantised by the `gguf` package
(gguf.quants.dequantize), the tokenizer is HuggingFace `tokenizers` built from the GGUF vocabulary
and merges, and the forward pass is plain numpy in float32. On purpose the Q/K projections are
un-permuted back to the HuggingFace layout and RoPE is applied the HuggingFace way (rotate_half,
pairs (i, i + d/2)); the C++ engine keeps the GGUF layout and rotates adjacent pairs (2i, 2i+1).
Agreement therefore also checks that the GGUF permutation convention was understood.

Outputs a small binary file (all little-endian):
    magic  b"OKVREF01"
    int32  n_prompt, n_positions, n_ids_per_position, n_text_tokens
    int32  prompt token ids [n_prompt]
    then for each checked position p (the last n_positions of the prompt):
        int32   position
        float32 logsumexp of the full logits row
        int32   token ids [n_ids_per_position]   (reference top ids, then fixed spread ids)
        float32 logits at those ids
    int32  token ids of the whole tokenizer text [n_text_tokens]
Keeping only a subset of logits keeps the file small enough to commit (tests/model/data).

Usage: reference.py --model M.gguf --text GPL-3 --out ref.bin [--prompt-tokens 40]
       reference.py --model M.gguf --tokenize FILE --out ids.bin   (token ids only, int32)
"""
import argparse
import struct
import sys

import numpy as np
import gguf
from gguf import GGUFReader


def field_value(reader, key):
    return reader.fields[key].contents()


def build_tokenizer(reader):
    # Imported here: the model alone (examples/python imports Model) needs only numpy and gguf.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = field_value(reader, "tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    tk = Tokenizer(bpe)
    # tokenizer.ggml.pre == "smollm": digits split one by one, then the GPT-2 byte-level regex.
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    return tk


class Model:
    def __init__(self, reader):
        self.n_layers = int(field_value(reader, "llama.block_count"))
        self.n_heads = int(field_value(reader, "llama.attention.head_count"))
        self.n_kv_heads = int(field_value(reader, "llama.attention.head_count_kv"))
        self.dim = int(field_value(reader, "llama.embedding_length"))
        self.head_dim = self.dim // self.n_heads
        self.eps = float(field_value(reader, "llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(field_value(reader, "llama.rope.freq_base"))
        self.t = {}
        for tensor in reader.tensors:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            self.t[tensor.name] = np.ascontiguousarray(w, dtype=np.float32)
        self.output = self.t.get("output.weight", self.t["token_embd.weight"])

    @staticmethod
    def unpermute(w, n_head):
        # Inverse of llama.cpp convert's permute(): back to HF order so rotate_half RoPE applies.
        rows = w.shape[0]
        return w.reshape(n_head, rows // n_head // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    def rms_norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope_hf(self, x, positions):
        # x: [T, heads, head_dim]; HF Llama: rotate_half over halves.
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_base ** (np.arange(0, d, 2, dtype=np.float64) / d))
        ang = positions[:, None].astype(np.float64) * inv_freq[None, :]
        cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1).astype(np.float32)[:, None, :]
        sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1).astype(np.float32)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        rotated = np.concatenate([-x2, x1], axis=-1)
        return x * cos + rotated * sin

    def forward(self, tokens):
        T = len(tokens)
        positions = np.arange(T)
        x = self.t["token_embd.weight"][np.array(tokens)]
        group = self.n_heads // self.n_kv_heads
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        for l in range(self.n_layers):
            p = f"blk.{l}."
            h = self.rms_norm(x, self.t[p + "attn_norm.weight"])
            wq = self.unpermute(self.t[p + "attn_q.weight"], self.n_heads)
            wk = self.unpermute(self.t[p + "attn_k.weight"], self.n_kv_heads)
            q = (h @ wq.T).reshape(T, self.n_heads, self.head_dim)
            k = (h @ wk.T).reshape(T, self.n_kv_heads, self.head_dim)
            v = (h @ self.t[p + "attn_v.weight"].T).reshape(T, self.n_kv_heads, self.head_dim)
            q, k = self.rope_hf(q, positions), self.rope_hf(k, positions)
            out = np.empty_like(q)
            for head in range(self.n_heads):
                kv = head // group
                s = (q[:, head, :] @ k[:, kv, :].T) / np.sqrt(self.head_dim) + mask
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                s /= s.sum(axis=-1, keepdims=True)
                out[:, head, :] = s @ v[:, kv, :]
            x = x + out.reshape(T, self.dim) @ self.t[p + "attn_output.weight"].T
            h = self.rms_norm(x, self.t[p + "ffn_norm.weight"])
            gate = h @ self.t[p + "ffn_gate.weight"].T
            up = h @ self.t[p + "ffn_up.weight"].T
            x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ self.t[p + "ffn_down.weight"].T
        x = self.rms_norm(x, self.t["output_norm.weight"])
        return x @ self.output.T


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", help="text whose first tokens are the prompt and whose ids are stored")
    ap.add_argument("--tokenize", help="only tokenize this file and write int32 ids to --out")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--positions", type=int, default=8, help="checked positions (last of prompt)")
    ap.add_argument("--top-ids", type=int, default=32)
    ap.add_argument("--spread-ids", type=int, default=96)
    args = ap.parse_args()

    reader = GGUFReader(args.model)
    tk = build_tokenizer(reader)
    if args.tokenize:
        ids = tk.encode(open(args.tokenize, encoding="utf-8", newline="").read()).ids
        np.asarray(ids, dtype="<i4").tofile(args.out)
        print(f"{len(ids)} tokens -> {args.out}", file=sys.stderr)
        return

    text = open(args.text, encoding="utf-8", newline="").read()
    text_ids = tk.encode(text).ids
    assert tk.decode(text_ids) == text, "reference tokenizer does not round-trip the text"
    prompt = text_ids[: args.prompt_tokens]
    model = Model(reader)
    logits = model.forward(prompt).astype(np.float64)
    vocab = logits.shape[1]
    spread = np.linspace(0, vocab - 1, args.spread_ids).astype(np.int64)
    with open(args.out, "wb") as f:
        f.write(b"OKVREF01")
        n_ids = args.top_ids + args.spread_ids
        f.write(struct.pack("<4i", len(prompt), args.positions, n_ids, len(text_ids)))
        f.write(np.asarray(prompt, dtype="<i4").tobytes())
        for pos in range(len(prompt) - args.positions, len(prompt)):
            row = logits[pos]
            lse = row.max() + np.log(np.exp(row - row.max()).sum())
            top = np.argsort(-row)[: args.top_ids]
            ids = np.concatenate([top, spread]).astype("<i4")
            f.write(struct.pack("<if", pos, lse))
            f.write(ids.tobytes())
            f.write(row[ids].astype("<f4").tobytes())
        f.write(np.asarray(text_ids, dtype="<i4").tobytes())
    last = logits[-1]
    print(f"prompt {len(prompt)} tokens, text {len(text_ids)} tokens; last-row top ids "
          f"{np.argsort(-last)[:5].tolist()}, logit range [{last.min():.2f}, {last.max():.2f}]",
          file=sys.stderr)
    # A sanity signal that the forward is right: perplexity of the prompt continuation.
    lp = logits[:-1] - (logits[:-1].max(1, keepdims=True) +
                        np.log(np.exp(logits[:-1] - logits[:-1].max(1, keepdims=True)).sum(1, keepdims=True)))
    nll = -lp[np.arange(len(prompt) - 1), prompt[1:]].mean()
    print(f"prompt perplexity {np.exp(nll):.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
