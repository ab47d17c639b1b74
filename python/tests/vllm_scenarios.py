"""Engine runs for test_vllm.py, one per process (vLLM keeps global state: one engine a process).

    python vllm_scenarios.py SCENARIO MODEL_DIR '{"json": "options"}'

prints one line ``RESULT {...}``. Scenarios: ``ids`` (greedy ids of three GPL-3 prompts of different lengths,
dense or on OasisKV, optionally with ngram speculative decoding), ``long_run`` (50 requests of random lengths
through one engine, some aborted midway), ``refuse`` (an engine whose construction must fail: the error).
"""
from __future__ import annotations

import json
import os
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the runs set kv_cache_memory_bytes

TEXT = "/usr/share/common-licenses/GPL-3"


def engine(model, options, oasiskv_args=None):
    from vllm import LLM

    import oasiskv.vllm

    kwargs = dict(model=model, dtype=options.get("dtype", "float32"), max_model_len=options.get("max_model_len", 4096),
                  enforce_eager=True, enable_prefix_caching=False,
                  max_num_batched_tokens=options.get("chunk", 512), max_num_seqs=options.get("max_num_seqs", 4),
                  kv_cache_memory_bytes=int(options.get("kv_mib", 512)) * 2**20)
    if options.get("ngram"):
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 2}
    if oasiskv_args is not None:
        kwargs.update(oasiskv.vllm.engine_args(**oasiskv_args))
    kwargs.update(options.get("override", {}))
    return LLM(**kwargs)


def text_ids(llm):
    return llm.get_tokenizer()(open(TEXT).read())["input_ids"]


def ids(model, options):
    from vllm import SamplingParams

    import oasiskv.vllm

    llm = engine(model, options, options.get("oasiskv"))
    tokens = text_ids(llm)
    prompts = [{"prompt_token_ids": tokens[o:o + n]} for o, n in ((0, 300), (500, 700), (1500, 1200))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = oasiskv.vllm.worker_statistics()
    return {"ids": [list(o.outputs[0].token_ids) for o in outs],
            "counters": None if stats is None else {k: v for k, v in stats.items() if k != "statistics"}}


def long_run(model, options):
    """50 requests of random prompt and output lengths through one engine, arriving over time; every fifth is
    aborted after a few steps. Afterwards: the worker's counters and the cache's statistics."""
    from vllm import SamplingParams

    import oasiskv.vllm

    llm = engine(model, options, options["oasiskv"])
    tokens = text_ids(llm)
    rng = random.Random(options.get("seed", 7))
    core = llm.llm_engine
    pending = []
    for i in range(50):
        n = rng.randrange(40, 1400)
        offset = rng.randrange(0, len(tokens) - n)
        params = SamplingParams(max_tokens=rng.randrange(2, 40), temperature=0, ignore_eos=True)
        pending.append((f"r{i}", {"prompt_token_ids": tokens[offset:offset + n]}, params))
    finished, aborted, steps, live = set(), set(), 0, {}
    while pending or core.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                req, prompt, params = pending.pop(0)
                core.add_request(req, prompt, params)
                live[req] = steps
        for out in core.step():
            if out.finished:
                finished.add(out.request_id)
                live.pop(out.request_id, None)
        steps += 1
        for req, since in list(live.items()):
            if int(req[1:]) % 5 == 4 and steps - since >= 3:
                core.abort_request([req])
                aborted.add(req)
                live.pop(req)
    for _ in range(3):  # idle steps carry the last finished requests to the worker
        core.step()
    stats = oasiskv.vllm.worker_statistics()
    s = stats["statistics"]
    return {"finished": len(finished), "aborted": len(aborted), "steps": steps,
            "counters": {k: v for k, v in stats.items() if k not in ("statistics", "seconds")},
            "host_blocks_in_use": s.host_blocks_in_use, "host_bytes_in_use": s.host_bytes_in_use,
            "plans": s.total().plans, "acquires": s.total().acquires}


def refuse(model, options):
    try:
        engine(model, options, options.get("oasiskv"))
    except Exception as error:  # vLLM may wrap it: the message is what counts
        return {"refused": True, "type": type(error).__name__, "message": str(error)}
    return {"refused": False}


def main():
    scenario, model, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    result = {"ids": ids, "long_run": long_run, "refuse": refuse}[scenario](model, options)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
