"""cache.timings of oasiskv.transformers (its one timer, python/oasiskv/transformers/timing.py) on a small
random Llama on the CPU: None times nothing; a dict from new_timings() gets exactly its parts; the prefill
adds to none of them; each decode forward adds to the parts the CPU path runs (append, plan, acquire,
attention, release; remainder only with a remainder configured; gather only on a GPU); a crop between
forwards adds to plan. Only whether a part was timed is asserted, never how long it took. Skipped, saying why, without torch or transformers."""
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("torch", "transformers")),
    reason="torch or transformers is absent (pip install .[transformers])")

DECODE_PARTS = ("append", "plan", "acquire", "attention", "release")


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    yield model
    import oasiskv.transformers as okt
    okt.detach(model)


def forward(model, cache, ids, seen):
    import torch
    import oasiskv.transformers as okt

    with torch.inference_mode():
        mask = torch.ones(ids.shape[0], seen + ids.shape[1], dtype=torch.long)
        return model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                     **{okt.CACHE_KWARG: cache}).logits[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("remainder", ["none", "quantized"])
def test_timings_count_the_decode_parts(model, remainder):
    import torch
    import oasiskv.transformers as okt

    cache = okt.OasisKVCache(model, budget_tokens=128, max_batch=1, max_tokens=256, remainder=remainder)
    assert cache.timings is None
    timings = cache.new_timings()
    assert timings == dict.fromkeys(
        ("append", "plan", "acquire", "gather", "attention", "remainder", "release"), 0.0)
    cache.timings = timings
    assert cache.timings is timings
    prompt = torch.randint(0, 97, (1, 160), generator=torch.Generator().manual_seed(7))
    token = forward(model, cache, prompt, 0)
    assert all(seconds == 0.0 for seconds in timings.values()), timings  # the prefill is not timed
    seen = prompt.shape[1]
    for _ in range(3):
        token = forward(model, cache, token, seen)
        seen += 1
    assert set(timings) == set(cache.new_timings())
    assert all(timings[part] > 0 for part in DECODE_PARTS), timings
    assert timings["gather"] == 0.0  # the GPU path's part
    assert (timings["remainder"] > 0) == (remainder != "none"), timings
    plan = timings["plan"]
    cache.crop(-1)
    assert timings["plan"] > plan  # crop plans again, between forwards
    before = dict(timings)
    cache.timings = None  # nothing timed, nothing changed
    forward(model, cache, token, seen - 1)
    assert timings == before

