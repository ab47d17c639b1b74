"""Converts the project's SmolLM2 GGUF into the folder vLLM loads: bfloat16 (or float32) safetensors, config.json with
its architecture, tokenizer and generation config. vLLM's CPU build loads no GGUF.

    python bench/python/gguf_to_safetensors.py [--gguf .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf]
                                               [--out .cache/models/smollm2-135m-bf16] [--dtype float32]

Needs transformers, gguf, accelerate and safetensors (the vLLM venv has them). Idempotent: a folder that
already holds model.safetensors is left alone. The Q4_1 weights are dequantized, so the folder's model is
the GGUF's exactly (what the C++ engine and oasiskv.transformers run), in bfloat16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_GGUF = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO / ".cache" / "models" / "smollm2-135m-bf16"


def convert(gguf: Path = DEFAULT_GGUF, out: Path = DEFAULT_OUT, dtype: str = "bfloat16") -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    if not Path(gguf).exists():
        raise SystemExit(f"gguf_to_safetensors: {gguf} not found (scripts/fetch-model fetches it)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = Path(gguf)
    torch_dtype = getattr(torch, dtype)
    kwargs = dict(gguf_file=gguf.name, dtype=torch_dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, quantization_config=GgufConfig(dequantize=True),
                                                     **kwargs)
    except TypeError:  # a transformers without GgufConfig dequantizes GGUF weights on load
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    # The whole state dict, tied embeddings included: vLLM reads model.embed_tokens.weight from the file
    # (without it the model emits token 0 forever).
    state = {name: tensor.detach().to(torch_dtype).clone().contiguous()
             for name, tensor in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: vLLM ties it to the embeddings again
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]  # a GGUF load leaves it empty
    config["torch_dtype"] = dtype
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    print(convert(args.gguf, args.out, args.dtype))


if __name__ == "__main__":
    sys.exit(main())
