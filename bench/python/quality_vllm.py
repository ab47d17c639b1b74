"""Quality inside vLLM against oasiskv.transformers': teacher-forced KL to dense and top-1 agreement.

    build/vllm-venv/bin/python bench/python/quality_vllm.py --side vllm --json /tmp/q-vllm.json
    build/python-venv/bin/python bench/python/quality_vllm.py --side transformers --json /tmp/q-hf.json

The same model in float32 on both sides (the GGUF's weights dequantized: bench/python/gguf_to_safetensors.py
--dtype float32 for vLLM, the GGUF itself for transformers), the same token ids (the Hugging Face tokenizer's
tokens of GPL-3: a prompt of ``--prompt`` tokens and the text's next ``--window`` tokens), the same budget and
remainders. Each step of the window is fed the text's own token (teacher forcing), and its next-token
distribution is compared with dense attention's at that step: the mean KL(dense || sparse) and how often
the argmax agrees.

- vLLM side: a dense engine and an OasisKV engine (one process each); a logits processor forces the text's
  token while ``logprobs_mode="raw_logprobs"`` returns the full distribution before it.
- transformers side: ``OasisKVCache`` fed one token a forward after the prompt, against one dense forward
  over prompt + window.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEXT = "/usr/share/common-licenses/GPL-3"
GGUF = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
F32 = REPO / ".cache" / "models" / "smollm2-135m-f32"


def text_ids(tokenizer, count):
    return tokenizer(open(TEXT).read())["input_ids"][:count]


def summary(dense, sparse):
    """KL(dense || sparse) mean and top-1 agreement of two [steps][vocab] log-probability tensors."""
    import torch

    kl = float((dense.exp() * (dense - sparse)).sum(-1).mean())
    top1 = float((dense.argmax(-1) == sparse.argmax(-1)).float().mean())
    return {"kl": kl, "top1": top1}


# ---- vLLM -------------------------------------------------------------------------------------------------

def vllm_engine_run(args, mode, remainder):
    """One engine (in this process): the window's teacher-forced log-probabilities, [window][vocab]."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessor

    import oasiskv.vllm

    class ForceTokens(LogitsProcessor):
        """Sets each step's logits to the request's next forced token (SamplingParams.extra_args["force"])."""

        def __init__(self, vllm_config, device, is_pin_memory):
            self.force = {}  # batch index -> (tokens, output ids so far)

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.force.pop(index, None)
            for index, params, _, output in batch_update.added:
                tokens = (params.extra_args or {}).get("force") if params is not None else None
                if tokens:
                    self.force[index] = (tokens, output)
            for a, b, _ in batch_update.moved:
                self.force[a], self.force[b] = self.force.get(b), self.force.get(a)

        def apply(self, logits):
            for index, entry in self.force.items():
                if entry is None:
                    continue
                tokens, output = entry
                target = tokens[min(len(output), len(tokens) - 1)]
                logits[index].fill_(float("-inf"))
                logits[index, target] = 0.0
            return logits

    kwargs = dict(model=str(F32), dtype="float32", max_model_len=args.prompt + args.window + 64, enforce_eager=True,
                  enable_prefix_caching=False, max_num_batched_tokens=2048, max_num_seqs=1,
                  kv_cache_memory_bytes=512 * 2**20, logits_processors=[ForceTokens], logprobs_mode="raw_logprobs",
                  max_logprobs=-1)
    if mode == "oasiskv":
        kwargs.update(oasiskv.vllm.engine_args(budget_tokens=args.budget, max_num_seqs=1, remainder=remainder))
    llm = LLM(**kwargs)
    ids = text_ids(llm.get_tokenizer(), args.prompt + args.window)
    params = SamplingParams(max_tokens=args.window, temperature=0, ignore_eos=True, logprobs=-1,
                            extra_args={"force": ids[args.prompt:]})
    out = llm.generate([{"prompt_token_ids": ids[:args.prompt]}], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == ids[args.prompt:], "the forced tokens were not the ones generated"
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rows = torch.full((args.window, vocab), float("-inf"), dtype=torch.float64)
    for step, entries in enumerate(out.logprobs):
        for token, entry in entries.items():
            rows[step, token] = entry.logprob
    return rows


def vllm_side(args):
    sys.path.insert(0, str(HERE))
    from gguf_to_safetensors import convert

    convert(out=F32, dtype="float32")
    results = {}
    for mode, remainder in (("dense", "none"), ("oasiskv", "none"), ("oasiskv", "quantized")):
        path = Path(args.work) / f"{mode}-{remainder}.pt"
        run = subprocess.run([sys.executable, __file__, "--side", "vllm-engine", "--mode", mode, "--remainder",
                              remainder, "--out", str(path), "--prompt", str(args.prompt), "--window", str(args.window),
                              "--budget", str(args.budget)], capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-3000:] + run.stderr[-6000:])
            raise SystemExit(f"quality_vllm: the {mode} engine failed")
    import torch

    dense = torch.load(Path(args.work) / "dense-none.pt")
    for remainder in ("none", "quantized"):
        results[remainder] = summary(dense, torch.load(Path(args.work) / f"oasiskv-{remainder}.pt"))
    return results


# ---- transformers -----------------------------------------------------------------------------------------

def transformers_side(args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import oasiskv.transformers as okt

    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    ids = torch.tensor([text_ids(AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name),
                                 args.prompt + args.window)])
    with torch.inference_mode():
        dense = torch.log_softmax(model(ids).logits[0, args.prompt - 1:-1].double(), -1)
    results = {}
    for remainder in ("none", "quantized"):
        cache = okt.OasisKVCache(model, budget_tokens=args.budget, max_batch=1,
                                 max_tokens=args.prompt + args.window + 8, remainder=remainder)
        rows = []
        with torch.inference_mode():
            logits = model(input_ids=ids[:, :args.prompt], **{okt.CACHE_KWARG: cache}).logits[0, -1:]
            rows.append(logits)
            for t in range(args.prompt, args.prompt + args.window - 1):
                rows.append(model(input_ids=ids[:, t:t + 1], **{okt.CACHE_KWARG: cache}).logits[0, -1:])
        results[remainder] = summary(dense, torch.log_softmax(torch.cat(rows).double(), -1))
        cache.reset()
    okt.detach(model)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", required=True, choices=("vllm", "transformers", "vllm-engine"))
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--work", default="/tmp")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--remainder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "vllm-engine":
        import torch

        torch.save(vllm_engine_run(args, args.mode, args.remainder), args.out)
        return 0
    results = vllm_side(args) if args.side == "vllm" else transformers_side(args)
    for remainder, r in results.items():
        print(f"{args.side}: budget {args.budget} of {args.prompt}, remainder {remainder}: KL {r['kl']:.5f}, "
              f"top-1 {r['top1']:.4f} over {args.window} teacher-forced steps")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
