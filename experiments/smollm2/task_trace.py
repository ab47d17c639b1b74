#!/usr/bin/env python3
"""Where a fact is lost, step by step: a dense greedy run of one task trial, traced, then each block
selection rule replayed offline on the traced queries and keys.

For every answer step t >= 1 (step 0 is the prompt's last row, which the prefill attends densely), the
working set of each (layer, kv head) is the sink block, the recent ring, and K blocks chosen by a rule from
the plan rows (the `previous` drafter: row t-1; `oracle`: row t itself). The dense attention of row t says
what the selection should have held: per (layer, query head) the share of its attention mass, outside the
pinned blocks, that lies on the fact's blocks. Reported per rule:

- fact recall: the fact blocks' dense attention mass held by the selection over that mass in all (the
  heads that copy the fact weigh most);
- mass recall: the share of all non-pinned attention mass held, averaged over (layer, query head).

`--simulate RULES` runs the task suite instead (or, with `--perplexity TEXTS`, teacher-forced perplexity and
KL against dense) with decode attention written in torch over the blocks a rule picks from the previous
row's queries (RULE/REDUCTION[/oracle], e.g. quest/sum, runs:4/max): to try a rule before the library has
it. python/tests/test_tasks.py checks that `quest` and `spread` pick the blocks Cache.select_blocks picks.

Usage: task_trace.py [--task passkey] [--length 1500] [--depths 0.1,0.3,0.5,0.7,0.9] [--seed 0]
                     [--budget 1/8] [--steps 6]
       task_trace.py --simulate quest/sum,runs:4/max [--tasks passkey,niah,copy] [--lengths 1500,3000]
       task_trace.py --simulate quest/sum,runs:4/max --perplexity .cache/texts/gpl-3.txt [--prompt-tokens 4096]
Needs `pip install .[transformers]` and scripts/fetch-model. The rules are written here in torch.
"""
from __future__ import annotations

import argparse
import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402

BLOCK = 16


def trace_dense(model, ids, new_tokens):
    """Greedy dense generation recording each layer's post-RoPE queries per forward and its last keys."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    queries = {}  # layer -> list of [heads, rows, d]
    keys = {}  # layer -> [kv_heads, tokens, d]

    def record(module, query, key, value, attention_mask, **kwargs):
        queries.setdefault(module.layer_idx, []).append(query[0].detach().float().clone())
        keys[module.layer_idx] = key[0].detach().float().clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("oasiskv_trace", record)
    previous = model.config._attn_implementation
    model.set_attn_implementation("oasiskv_trace")
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    layers = sorted(queries)
    # Row p of the sequence: the prompt's rows come from the prefill, then one row per decode forward.
    q = [torch.cat(queries[layer], dim=1) for layer in layers]  # [heads, prompt + new - 1, d]
    return out[0, ids.shape[1]:].tolist(), q, [keys[layer] for layer in layers]


def block_mass(q, k, length, scale):
    """Dense attention of rows q [G, d] over keys [0, length): per head the mass of each whole block."""
    import torch

    logits = (q @ k[:length].T) * scale
    p = torch.softmax(logits, dim=-1)
    nblocks = -(-length // BLOCK)
    padded = torch.zeros(q.shape[0], nblocks * BLOCK)
    padded[:, :length] = p
    return padded.reshape(q.shape[0], nblocks, BLOCK).sum(-1)


def top(scores, candidates, k):
    """The k candidates with the highest scores (a 1-d score per block)."""
    import torch

    order = torch.argsort(scores[candidates], descending=True, stable=True)
    return set(candidates[order[:k]].tolist())


# The rules the trace replays (block_scores' names), each reduced over the group by a sum and by a max.
TRACE_RULES = ("quest", "spread:0.5", "spread:0.25", "spread:0", "runs:1", "runs:2", "runs:4", "exact")


def rules(q_plan, k, nblocks, candidates, k_sel):
    """Each rule's selection (a set of block indices) for one kv head from its group's plan queries [G, d]."""
    out = {}
    for rule in TRACE_RULES:
        s = block_scores(rule, q_plan, k, nblocks)
        out[f"{rule}/sum"] = top(s.sum(0), candidates, k_sel)
        out[f"{rule}/max"] = top(s.max(0).values, candidates, k_sel)
    return out


class Geometry:
    """The library's pinned blocks at a budget (CacheConfig's defaults: a 16-token sink, a 64-token recent
    ring plus the tail block), the K blocks left to choose, and where a sequence's ring starts."""

    def __init__(self, budget, sink_tokens=16, recent_tokens=64):
        self.sink_blocks = sink_tokens // BLOCK
        self.ring_blocks = recent_tokens // BLOCK + 1
        self.k_sel = budget // BLOCK - self.sink_blocks - self.ring_blocks

    def ring_start(self, length):
        """First block of the recent ring of a sequence of `length` tokens: candidates are [sink_blocks, it)."""
        return max(self.sink_blocks, (length - 1) // BLOCK - self.ring_blocks + 1)


def analyse(model, tokenizer, trial, fraction, steps):
    import torch

    ids = tasks.prompt_ids(tokenizer, trial)
    answer_ids, q, k = trace_dense(model, ids, steps + 1)
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    prompt = ids.shape[1]
    fact = sorted({p // BLOCK for p in tasks.needle_positions(tokenizer, ids, trial.expected)})
    budget = tasks.budget_tokens(fraction, trial.tokens)
    geometry = Geometry(budget)
    k_sel = geometry.k_sel
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    scale = (cfg.hidden_size // cfg.num_attention_heads) ** -0.5
    totals = {}  # (plan, rule) -> [fact mass held, fact mass, sum of heads' mass recall, heads]
    for t in range(1, steps + 1):
        row = prompt - 1 + t  # the row attending at step t; its sequence has row + 1 tokens
        length = row + 1
        nblocks_full = length // BLOCK
        ring_start = geometry.ring_start(length)
        candidates = torch.arange(geometry.sink_blocks, min(ring_start, nblocks_full))
        for layer in range(cfg.num_hidden_layers):
            for g in range(cfg.num_key_value_heads):
                heads = slice(g * group, (g + 1) * group)
                kk = k[layer][g]
                truth = block_mass(q[layer][heads, row], kk, length, scale)  # [G, blocks]
                nonpinned = truth[:, candidates].sum(-1)
                fact_mass = truth[:, [b for b in fact if b in set(candidates.tolist())]].sum(-1)
                for plan, plan_row in (("previous", row - 1), ("oracle", row)):
                    chosen = rules(q[layer][heads, plan_row], kk, ring_start, candidates, k_sel)
                    for name, sel in chosen.items():
                        sel_fact = [b for b in fact if b in sel]
                        held = truth[:, sorted(sel)].sum(-1)
                        acc = totals.setdefault((plan, name), [0.0, 0.0, 0.0, 0])
                        acc[0] += float(truth[:, sel_fact].sum()) if sel_fact else 0.0
                        acc[1] += float(fact_mass.sum())
                        acc[2] += float((held / nonpinned.clamp_min(1e-30)).sum())
                        acc[3] += group
    return dict(answer=answer, fact=fact, budget=budget, k_sel=k_sel, prompt=prompt, totals=totals)


def block_scores(rule, q, k, nblocks):
    """Per (query head, block) scores of one rule over blocks [0, nblocks): q [G, d], k [tokens, d] -> [G, nblocks].
    quest: Quest's bound (the library's); spread:A: the library's spread score; runs:R: the best of the block's R
    runs' mean keys; far / far2: the mean key and one / two rows by farthest-point sampling; exact: the block's
    largest q.k (what no summary smaller than the rows knows)."""
    import torch

    kb = k[: nblocks * BLOCK].reshape(nblocks, BLOCK, -1)
    kind, _, arg = rule.partition(":")
    if kind in ("quest", "spread"):
        alpha = 1.0 if kind == "quest" else float(arg)
        kmax, kmin = kb.max(dim=1).values, kb.min(dim=1).values
        return q @ ((kmax + kmin) / 2).T + alpha * (q.abs() @ ((kmax - kmin) / 2).T)
    if kind == "runs":  # the best of `arg` runs' mean keys
        parts = int(arg)
        sub = kb.reshape(nblocks, parts, BLOCK // parts, -1).mean(dim=2)
        return torch.einsum("gd,bpd->gbp", q, sub).max(-1).values
    if kind in ("far", "far2"):  # the mean key and the rows farthest from it (farthest-point sampling)
        mean = kb.mean(dim=1)  # [nblocks, d]
        reps, ref = [mean], mean
        for _ in range(1 if kind == "far" else 2):
            far = ((kb - ref[:, None]) ** 2).sum(-1).argmax(-1)  # [nblocks]
            row = kb[torch.arange(nblocks), far]
            reps.append(row)
            ref = row
        return torch.einsum("gd,bpd->gbp", q, torch.stack(reps, 1)).max(-1).values
    if kind == "exact":
        return (q @ kb.reshape(nblocks * BLOCK, -1).T).reshape(q.shape[0], nblocks, BLOCK).max(-1).values
    raise SystemExit(f"task_trace: unknown rule {rule!r}")


class SparseAttention(Geometry):
    """Decode attention over the sink block, the recent ring and K blocks per kv head chosen by `rule`
    (reduced over the group by `reduce`) from the previous row's queries (`oracle`: the row's own): the
    library's protocol written in torch, for trying rules before building one. The prefill is dense."""

    def __init__(self, rule, reduce, budget, oracle=False, sink_tokens=16, recent_tokens=64):
        super().__init__(budget, sink_tokens, recent_tokens)
        self.rule, self.reduce, self.oracle = rule, reduce, oracle
        self.plan_q = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        import torch
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        if query.shape[2] > 1:  # the prefill: dense; its last row plans the first step
            self.plan_q[layer] = query[0, :, -1].float()
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        q = query[0, :, 0].float()  # [heads, d]
        plan = q if self.oracle else self.plan_q[layer]
        self.plan_q[layer] = q
        kv_heads, length = key.shape[1], key.shape[2]
        group = q.shape[0] // kv_heads
        ring_start = self.ring_start(length)
        keep = torch.zeros(kv_heads, length, dtype=torch.bool)
        keep[:, : self.sink_blocks * BLOCK] = True
        keep[:, ring_start * BLOCK:] = True
        if ring_start > self.sink_blocks and self.k_sel > 0:
            # Every kv head at once: the group's scores [kv, G, blocks], reduced over G.
            s = torch.stack([block_scores(self.rule, plan[g * group:(g + 1) * group], key[0, g].float(), ring_start)
                             for g in range(kv_heads)])[:, :, self.sink_blocks:]
            s = s.sum(1) if self.reduce == "sum" else s.max(1).values
            picked = torch.topk(s, min(self.k_sel, s.shape[1]), dim=1).indices + self.sink_blocks  # [kv, K]
            blocks = torch.zeros(kv_heads, -(-length // BLOCK), dtype=torch.bool)
            blocks.scatter_(1, picked, True)
            keep |= blocks.repeat_interleave(BLOCK, 1)[:, :length]
        logits = torch.einsum("hd,htd->ht", q, key[0].float().repeat_interleave(group, 0)) * scaling
        logits = logits.masked_fill(~keep.repeat_interleave(group, 0), -float("inf"))
        out = torch.einsum("ht,htd->hd", torch.softmax(logits, -1), value[0].float().repeat_interleave(group, 0))
        return out[None, None].to(query.dtype), None  # [1, 1, heads, d]: transformers' layout


def simulate(model, tokenizer, trials, fraction, specs, log=print):
    """Each trial dense, then under each rule spec ("rule/reduce[/oracle]"): right where dense is right."""
    import torch
    from transformers import AttentionInterface

    right = {spec: [0, 0] for spec in specs}
    previous = model.config._attn_implementation
    for trial in trials:
        ids = tasks.prompt_ids(tokenizer, trial)
        dense_ok = tasks.correct(tasks.generate(model, tokenizer, ids, trial), trial.expected)
        if not dense_ok:
            continue
        budget = tasks.budget_tokens(fraction, trial.tokens)
        for spec in specs:
            rule, reduce, *oracle = spec.split("/")
            AttentionInterface.register("oasiskv_simulate",
                                        SparseAttention(rule, reduce, budget, oracle=bool(oracle)))
            model.set_attn_implementation("oasiskv_simulate")
            try:
                answer = tasks.generate(model, tokenizer, ids, trial)
            finally:
                model.set_attn_implementation(previous)
            ok = tasks.correct(answer, trial.expected)
            right[spec][0] += ok
            right[spec][1] += 1
            log(f"{trial.task} {trial.tokens} depth {trial.depth} | {spec:24s} {'right' if ok else 'WRONG'} {answer!r}")
    return right


def perplexity(model, tokenizer, text_path, prompt_tokens, decode_tokens, fraction, specs, log=print):
    """Teacher-forced decode of `decode_tokens` after a dense prefill of `prompt_tokens` of a text, dense and
    under each rule spec: perplexity of the decoded tokens and the mean KL(dense || rule) per step."""
    import math

    import torch
    from transformers import AttentionInterface, DynamicCache

    from oasiskv.transformers import CACHE_KWARG

    with open(text_path, encoding="utf-8", errors="replace") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, : prompt_tokens + decode_tokens]
    previous = model.config._attn_implementation
    budget = tasks.budget_tokens(fraction, prompt_tokens)

    def run(spec):
        if spec != "dense":
            rule, reduce, *oracle = spec.split("/")
            AttentionInterface.register("oasiskv_simulate", SparseAttention(rule, reduce, budget, oracle=bool(oracle)))
            model.set_attn_implementation("oasiskv_simulate")
        try:
            cache = DynamicCache()
            with torch.no_grad():
                out = model(ids[:, :prompt_tokens], use_cache=True, **{CACHE_KWARG: cache})
                logits = [out.logits[0, -1]]
                for t in range(prompt_tokens, prompt_tokens + decode_tokens - 1):
                    out = model(ids[:, t:t + 1], use_cache=True, **{CACHE_KWARG: cache})
                    logits.append(out.logits[0, -1])
        finally:
            model.set_attn_implementation(previous)
        return torch.log_softmax(torch.stack(logits).float(), -1)

    dense = run("dense")
    targets = ids[0, prompt_tokens: prompt_tokens + decode_tokens]
    results = {}
    for spec in ["dense"] + specs:
        lp = dense if spec == "dense" else run(spec)
        nll = -lp[torch.arange(len(targets)), targets].mean().item()
        kl = (dense.exp() * (dense - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == dense.argmax(-1)).float().mean().item()
        results[spec] = (math.exp(nll), kl, top1)
        log(f"{os.path.basename(text_path)} {prompt_tokens}+{decode_tokens} budget {budget} | {spec:24s} "
            f"ppl {math.exp(nll):.3f}  KL {kl:.4f}  top-1 {top1:.3f}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="passkey")
    parser.add_argument("--length", type=int, default=1500)
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", default="1/8")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--simulate", default="",
                        help="rules to run the tasks with in torch, e.g. quest/sum,spread:0.25/sum,exact/max/oracle")
    parser.add_argument("--tasks", default="passkey,niah,copy", help="with --simulate")
    parser.add_argument("--perplexity", default="",
                        help="with --simulate: texts (paths) to measure teacher-forced perplexity on instead of tasks")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="with --perplexity")
    parser.add_argument("--decode-tokens", type=int, default=128, help="with --perplexity")
    parser.add_argument("--lengths", default="1500,3000", help="with --simulate")
    parser.add_argument("--model-dir", default=os.path.join(tasks.REPO, ".cache", "models"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    model, tokenizer = tasks.load_model(args.model_dir)
    if args.simulate and args.perplexity:
        for path in args.perplexity.split(","):
            perplexity(model, tokenizer, path, args.prompt_tokens, args.decode_tokens, Fraction(args.budget),
                       args.simulate.split(","), log=lambda s: print(s, flush=True))
        return 0
    if args.simulate:
        trials = [tasks.make_trial(tokenizer, task, int(length), float(depth), args.seed)
                  for task in args.tasks.split(",") for length in args.lengths.split(",")
                  for depth in args.depths.split(",")]
        right = simulate(model, tokenizer, trials, Fraction(args.budget), args.simulate.split(","),
                         log=lambda s: print(s, flush=True))
        for spec, (r, n) in right.items():
            print(f"{spec:24s} {r}/{n} where dense is right")
        return 0
    grand = {}
    for depth in map(float, args.depths.split(",")):
        trial = tasks.make_trial(tokenizer, args.task, args.length, depth, args.seed)
        r = analyse(model, tokenizer, trial, Fraction(args.budget), args.steps)
        ok = tasks.correct(r["answer"], trial.expected)
        print(f"\n{trial.task} {r['prompt']} tokens, depth {depth}: dense {'right' if ok else 'wrong'} "
              f"({r['answer']!r}); fact blocks {r['fact']}; budget {r['budget']} = {r['k_sel']} selected blocks")
        for (plan, name), (fh, fa, mh, n) in sorted(r["totals"].items()):
            print(f"  {plan:8s} {name:32s} fact recall {fh / max(fa, 1e-30):.2f}   mass recall {mh / n:.2f}")
            if ok:
                acc = grand.setdefault((plan, name), [0.0, 0.0, 0.0, 0])
                acc[0] += fh
                acc[1] += fa
                acc[2] += mh
                acc[3] += n
    print("\nover the trials dense answered right:")
    for (plan, name), (fh, fa, mh, n) in sorted(grand.items()):
        print(f"  {plan:8s} {name:32s} fact recall {fh / max(fa, 1e-30):.2f}   mass recall {mh / n:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
