#!/usr/bin/env python3
"""Task accuracy: does the sparse cache retrieve what dense attention retrieves? SmolLM2-135M-Instruct in
Hugging Face transformers (float32, CPU), dense (the model's own attention over a DynamicCache) against
oasiskv.transformers.OasisKVCache, on tasks that must copy a fact from far back:

- passkey (Landmark Attention): "The pass key is 30316. Remember it. 30316 is the pass key." hidden at a
  depth of a natural text; asked for the key;
- niah (RULER's multi-key needle in a haystack): four "One of the special magic numbers for <word> is:
  <number>." sentences at random depths, the other three the distractors; asked for one word's number;
- copy: "The secret numbers are 1011, 3288, 1068 and 3822." at a depth; asked for them (right only when
  every number comes back, in order).

The haystack is one of the licenses in /usr/share/common-licenses (GPL-3, Apache-2.0, LGPL-3: the seed
picks it and the offset), repeated to the length; the needle goes in at the sentence boundary nearest its
depth. The question is the user's turn of the model's chat template, and the assistant's answer is begun
for it ("The pass key is"); greedy decoding. Budgets are fractions of the prompt, rounded to whole blocks.
A trial counts for a configuration "where dense is right" when dense answered it correctly.

Usage: tasks.py [--tasks passkey,niah,copy] [--lengths 1000,2000,4000] [--depths 0.1,0.3,0.5,0.7,0.9]
                [--seeds 0] [--budgets 1/8,1/16] [--remainders none,quantized] [--drafters previous,ngram]
                [--threads 2] [--json PATH] [--quick]
--quick: one passkey at 600 tokens, depth 0.5, budget 1/4 (a check that it runs).
Needs `pip install .[transformers]` and scripts/fetch-model.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import time
from dataclasses import dataclass
from fractions import Fraction

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
         "/usr/share/common-licenses/LGPL-3"]
WORDS = ["lantern", "harbor", "meadow", "quartz", "saffron", "glacier", "violin", "orchard"]


@dataclass
class Trial:
    """One prompt of a task: the user's text, the begun answer, and what a right answer must contain."""

    task: str
    length: int  # tokens asked for (the haystack's); the prompt's own count is `tokens`
    depth: float
    seed: int
    user: str
    answer_start: str
    expected: list  # strings that must appear in the answer, in this order
    max_new_tokens: int
    tokens: int = 0


def haystack_sentences(seed: int) -> list[str]:
    """The sentences (or clauses, up to a ';' or ':') of the seed's text, from an offset the seed picks, repeated
    to plenty."""
    with open(TEXTS[seed % len(TEXTS)], encoding="utf-8", errors="replace") as f:
        text = re.sub(r"\s+", " ", f.read())
    sentences = [s.strip() for s in re.split(r"(?<=[.;:])\s+", text) if s.strip()]
    offset = random.Random(seed).randrange(len(sentences))
    return (sentences[offset:] + sentences[:offset]) * 8


def fill(tokenizer, seed: int, length: int, needles: list[tuple[float, str]]) -> str:
    """A haystack of `length` tokens or a sentence more, with each (depth, sentence) needle at the sentence boundary
    nearest its depth."""
    sentences = haystack_sentences(seed)
    taken, count = [], 0
    for s in sentences:  # up to the first sentence that reaches `length`
        if count >= length:
            break
        taken.append((count, s))
        count += len(tokenizer(" " + s).input_ids)
    out = [s for _, s in taken]
    for depth, needle in sorted(needles, reverse=True):  # deepest first: earlier indices stay valid
        target = depth * count
        index = min(range(len(taken) + 1), key=lambda i: abs((taken[i][0] if i < len(taken) else count) - target))
        out.insert(index, needle)
    return " ".join(out)


def make_trial(tokenizer, task: str, length: int, depth: float, seed: int) -> Trial:
    rng = random.Random(f"{task}/{length}/{depth}/{seed}")
    if task == "passkey":
        key = str(rng.randrange(10000, 100000))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        text = fill(tokenizer, seed, length, [(depth, needle)])
        user = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
                f"memorize it.\n\n{text}\n\nWhat is the pass key?")
        return Trial(task, length, depth, seed, user, "The pass key is", [key], 8)
    if task == "niah":
        words = rng.sample(WORDS, 4)
        numbers = [str(rng.randrange(1000000, 10000000)) for _ in words]
        depths = [depth] + [rng.random() for _ in words[1:]]  # the asked needle at `depth`, distractors anywhere
        needles = [(d, f"One of the special magic numbers for {w} is: {n}.") for d, w, n in zip(depths, words, numbers)]
        text = fill(tokenizer, seed, length, needles)
        user = (f"Some special magic numbers are hidden within the following text. Make sure to memorize them.\n\n"
                f"{text}\n\nWhat is the special magic number for {words[0]} mentioned in the provided text?")
        return Trial(task, length, depth, seed, user,
                     f"The special magic number for {words[0]} mentioned in the provided text is", [numbers[0]], 12)
    if task == "copy":
        codes = [str(rng.randrange(1000, 10000)) for _ in range(4)]
        needle = f"The secret numbers are {codes[0]}, {codes[1]}, {codes[2]} and {codes[3]}."
        text = fill(tokenizer, seed, length, [(depth, needle)])
        user = (f"Some secret numbers are hidden within the following text. Make sure to memorize them.\n\n{text}"
                "\n\nWhat are the secret numbers?")
        return Trial(task, length, depth, seed, user, "The secret numbers are", codes, 24)
    raise SystemExit(f"tasks: unknown task {task!r} (passkey, niah, copy)")


def prompt_ids(tokenizer, trial: Trial):
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": trial.user}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text + trial.answer_start, return_tensors="pt").input_ids
    trial.tokens = int(ids.shape[1])
    return ids.to(torch.long)


def correct(answer: str, expected: list[str]) -> bool:
    """Every expected string appears in the answer, in order (digits compared without separators)."""
    digits = re.sub(r"[^0-9]", " ", answer)
    pos = 0
    for e in expected:
        m = re.search(rf"(?<![0-9]){e}(?![0-9])", digits[pos:])
        if m is None:
            return False
        pos += m.end()
    return True


def budget_tokens(fraction: Fraction, tokens: int, block: int = 16) -> int:
    """`fraction` of `tokens`, rounded to whole blocks (at least one); a fraction of 1 or more covers them all."""
    if fraction >= 1:
        return -(-tokens * fraction // block) * block
    return max(block, round(tokens * fraction / block) * block)


def generate(model, tokenizer, ids, trial: Trial, cache=None, drafter="previous"):
    import torch
    from oasiskv.transformers import CACHE_KWARG

    kwargs = dict(max_new_tokens=trial.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    if drafter == "ngram":
        kwargs["prompt_lookup_num_tokens"] = 3
    if cache is not None:
        kwargs[CACHE_KWARG] = cache
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def plan_prefill_from(rows: int) -> None:
    """The experiment "plan the first working set from the prompt's last `rows` rows" (the question and the
    begun answer) instead of its last row: patches oasiskv.transformers' prefill plan for this process."""
    from oasiskv.transformers.protocol import DecodeProtocol

    original = getattr(DecodeProtocol, "_original_plan", DecodeProtocol._plan)
    DecodeProtocol._original_plan = original
    if rows <= 1:
        DecodeProtocol._plan = original
        return

    def plan(self, layer, query, rows_from, next_step_rows):
        if self._forward is not None and self._forward.prefill:
            rows_from = max(0, query.shape[2] - rows)
        return original(self, layer, query, rows_from, next_step_rows)

    DecodeProtocol._plan = plan


def needle_positions(tokenizer, ids, expected: list[str]) -> list[int]:
    """Token positions of the prompt that spell the first occurrence of each expected string."""
    tokens = [tokenizer.decode([t]) for t in ids[0].tolist()]
    text, starts = "", []
    for t in tokens:
        starts.append(len(text))
        text += t
    positions = []
    for e in expected:
        at = text.find(e)
        positions += [i for i, st in enumerate(starts) if at <= st < at + len(e) or st <= at < st + len(tokens[i])]
    return sorted(set(positions))


def diagnose(model, tokenizer, trial: Trial, fraction: Fraction, block: int = 16):
    """After the prefill at `fraction`'s budget: the blocks that hold the fact, and per layer the share of
    them (over kv heads) in the first working set the prefill planned."""
    import torch
    from oasiskv.transformers import CACHE_KWARG, OasisKVCache

    ids = prompt_ids(tokenizer, trial)
    budget = budget_tokens(fraction, trial.tokens)
    cache = OasisKVCache(model, budget_tokens=budget, max_batch=1, max_tokens=trial.tokens + 8)
    with torch.no_grad():
        model(ids, **{CACHE_KWARG: cache})
    positions = needle_positions(tokenizer, ids, trial.expected)
    blocks = sorted({p // block for p in positions})
    seq = cache._seq_ids[0]
    recall = []
    for layer in range(model.config.num_hidden_layers):
        picked = cache.native.select_blocks(seq, layer, cache._plan_q[layer].numpy())
        recall.append(sum(len(set(blocks) & set(h)) for h in picked) / (len(blocks) * len(picked)))
    return dict(positions=positions, blocks=blocks, budget=budget, recall_by_layer=recall,
                recall=sum(recall) / len(recall))


def load_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=MODEL_NAME, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=MODEL_NAME)
    return model, tokenizer


def configurations(budgets, remainders, drafters):
    """(name, budget fraction or None for dense, remainder, drafter) in the order the tables show them."""
    rows = [("dense", None, "none", d) for d in drafters]
    for b in budgets:
        for r in remainders:
            for d in drafters:
                rows.append((f"{b} {r} {d}", b, r, d))
    return rows


def run_suite(model, tokenizer, trials, configs, log=print, options=None):
    """Every trial under every configuration: a list of result dicts. `options`: CacheConfig fields for every
    OasisKV configuration."""
    from oasiskv import Error
    from oasiskv.transformers import OasisKVCache

    results = []
    for trial in trials:
        ids = prompt_ids(tokenizer, trial)
        for name, fraction, remainder, drafter in configs:
            cache = None
            budget = None
            t0 = time.perf_counter()
            try:
                if fraction is not None:
                    budget = budget_tokens(fraction, trial.tokens)
                    fields = dict(options or {})
                    if remainder != "none":
                        fields["remainder"] = remainder
                    cache = OasisKVCache(model, budget_tokens=budget, max_batch=1,
                                         max_tokens=trial.tokens + trial.max_new_tokens + 8, **fields)
                answer = generate(model, tokenizer, ids, trial, cache, drafter)
                ok = correct(answer, trial.expected)
            except Error as error:  # a budget below the pinned blocks: counted wrong, the reason kept
                answer, ok = f"refused: {error}", False
            results.append(dict(task=trial.task, length=trial.length, tokens=trial.tokens, depth=trial.depth,
                                seed=trial.seed, config=name, budget=budget, remainder=remainder, drafter=drafter,
                                expected=trial.expected, answer=answer, correct=ok,
                                seconds=time.perf_counter() - t0))
            log(f"{trial.task} {trial.tokens} tok depth {trial.depth} seed {trial.seed} | {name:28s} "
                f"{'right' if ok else 'WRONG'} {answer.strip()[:60]!r}")
    return results


def summarize(results, by_length=False):
    """Per configuration and task (and length): accuracy, and accuracy where dense (same drafter) was right."""
    dense = {(r["task"], r["length"], r["depth"], r["seed"], r["drafter"]): r["correct"] for r in results
             if r["budget"] is None}
    table = {}
    for r in results:
        key = (r["config"], r["task"], r["length"]) if by_length else (r["config"], r["task"])
        t = table.setdefault(key, dict(n=0, right=0, dense_right=0, right_where_dense=0))
        t["n"] += 1
        t["right"] += r["correct"]
        if dense.get((r["task"], r["length"], r["depth"], r["seed"], r["drafter"])):
            t["dense_right"] += 1
            t["right_where_dense"] += r["correct"]
    return table


def print_table(table):
    """A Markdown table of summarize()'s output, keys as the first columns."""
    width = len(next(iter(table)))
    heads = ["configuration", "task", "length"][:width]
    print("| " + " | ".join(heads) + " | trials | right | right where dense is right |")
    print("|---" * (width + 3) + "|")
    for key, t in table.items():
        where = f"{t['right_where_dense']}/{t['dense_right']}" if t["dense_right"] else "-"
        print("| " + " | ".join(str(k) for k in key) + f" | {t['n']} | {t['right']} | {where} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="passkey,niah,copy")
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--budgets", default="1/8,1/16")
    parser.add_argument("--remainders", default="none,quantized")
    parser.add_argument("--drafters", default="previous")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", default=os.path.join(REPO, ".cache", "models"))
    parser.add_argument("--prefill-plan-rows", type=int, default=1,
                        help="experiment: plan the first working set from the prompt's last N rows")
    parser.add_argument("--diagnose", action="store_true",
                        help="per trial and budget: the fact's blocks and their recall in the first working set")
    parser.add_argument("--options", default="",
                        help="CacheConfig fields for every OasisKV configuration, e.g. reduction=max,scorer=spread")
    parser.add_argument("--json", default=None)
    parser.add_argument("--from-json", default=None, help="print the tables of an earlier run's JSON and stop")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)["results"]
        print_table(summarize(results))
        print()
        print_table(summarize(results, by_length=True))
        return 0
    if args.quick:
        args.tasks, args.lengths, args.depths, args.budgets, args.remainders = "passkey", "600", "0.5", "1/4", "none"
    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_dir)
    trials = [make_trial(tokenizer, task, int(length), float(depth), int(seed))
              for task in args.tasks.split(",") for length in args.lengths.split(",")
              for depth in args.depths.split(",") for seed in args.seeds.split(",")]
    plan_prefill_from(args.prefill_plan_rows)
    if args.diagnose:
        for trial in trials:
            for b in args.budgets.split(","):
                d = diagnose(model, tokenizer, trial, Fraction(b))
                print(f"{trial.task} {trial.tokens} tok depth {trial.depth} seed {trial.seed} budget {b} "
                      f"({d['budget']}): fact at tokens {d['positions'][0]}-{d['positions'][-1]}, blocks {d['blocks']}, "
                      f"recall in the first working set {d['recall']:.2f} (by layer "
                      f"{' '.join(f'{x:.1f}' for x in d['recall_by_layer'])})", flush=True)
        return 0
    configs = configurations([Fraction(b) for b in args.budgets.split(",")], args.remainders.split(","),
                             args.drafters.split(","))
    options = {}
    for item in filter(None, args.options.split(",")):
        name, _, value = item.partition("=")
        for kind in (int, float, str):
            try:
                options[name] = kind(value)
                break
            except ValueError:
                pass
    results = run_suite(model, tokenizer, trials, configs, log=lambda s: print(s, flush=True), options=options)
    table = summarize(results)
    print()
    print_table(table)
    print()
    print_table(summarize(results, by_length=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=platform.processor() or platform.machine(), argv=sys.argv[1:], results=results,
                           prefill_plan_rows=args.prefill_plan_rows, options=options,
                           table=[dict(config=c, task=t, **v) for (c, t), v in table.items()]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
