"""oasiskv.transformers on a GPU: a randomly initialised Llama (4 layers, 8 query heads over 2 kv heads,
head dim 128, hidden 1024, vocabulary 4,096, bfloat16, on CUDA; no download) generating through an
OasisKVCache whose oasiskv.Cache is a CUDA cache. At a budget covering the context, greedy generation (plain,
with prompt-lookup drafts, and a left-padded batch) gives dense SDPA's tokens; a smaller budget runs, its
first token (the prefill's) is dense's and it fetches blocks; the decode path makes no synchronising torch
call from oasiskv.transformers; a padded decode row and a forward on another stream are refused.

Skipped, saying why, without torch, transformers, a module built with the CUDA backend
(pip install . -C cmake.define.OASISKV_PYTHON_CUDA=ON) or a GPU. Not yet run on a GPU in this repository:
scripts/gpu-check runs it when a GPU is lent, and the score tolerance below waits for that run to be
confirmed.

Greedy equality in bfloat16: the cache's attention (a gather of the resident blocks, then SDPA with a mask)
and dense SDPA round differently, so a random model's near tie between its two best tokens can go either
way. The tests hold the tokens equal, or else parting at a step where dense's top two scores are closer
than the two runs' scores differ there, with every score before that step within SCORE_TOL of dense's.
The q and k projections are scaled up so attention is peaked (a random model's is nearly uniform, which
would hide a block missing from the view).
"""
import time
import warnings

import pytest

import oasiskv

torch = pytest.importorskip("torch", reason="the GPU transformers tests need torch")
pytest.importorskip("transformers", reason="the GPU transformers tests need transformers (pip install .[transformers])")
if not oasiskv.built_with_cuda():
    pytest.skip("this oasiskv module has no CUDA backend (pip install . -C cmake.define.OASISKV_PYTHON_CUDA=ON)",
                allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)
if not oasiskv.cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import oasiskv.transformers as okt  # noqa: E402

LAYERS, PROMPT, NEW = 4, 512, 64
VOCAB = 4096
# Largest |score difference| allowed between the cache's run and dense's at a step where both have the same
# tokens so far. Logits of this model have a spread of about 0.6; bfloat16 rounding differences stay far
# below this, a wrong view (a block missing, a wrong mask) moves them by about the spread.
SCORE_TOL = 0.25
QK_SCALE = 3.0


class Setup:
    pass


@pytest.fixture(scope="module")
def s():
    """The model, a prompt, and the dense references, computed before any OasisKVCache exists."""
    from transformers import LlamaConfig, LlamaForCausalLM

    x = Setup()
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    x.model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for layer in x.model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    gen = torch.Generator().manual_seed(99)
    x.prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=gen).cuda()
    # Prompt lookup needs repeated n-grams: a 64-token piece eight times.
    x.repeated = torch.randint(3, VOCAB, (1, 64), generator=gen).repeat(1, PROMPT // 64).cuda()
    # Two prompts of 300 and 512 tokens, left padded.
    x.batch = torch.stack([torch.cat([torch.zeros(PROMPT - 300, dtype=torch.long),
                                      torch.randint(3, VOCAB, (300,), generator=gen)]),
                           torch.randint(3, VOCAB, (PROMPT,), generator=gen)]).cuda()
    x.batch_mask = torch.ones_like(x.batch)
    x.batch_mask[0, :PROMPT - 300] = 0
    started = time.perf_counter()
    x.dense = generate(x.model, None, x.prompt, NEW)
    x.dense_lookup = generate(x.model, None, x.repeated, NEW, prompt_lookup_num_tokens=3)
    x.dense_batch = generate(x.model, None, x.batch, 16, attention_mask=x.batch_mask)
    torch.cuda.synchronize()
    x.dense_seconds = time.perf_counter() - started
    yield x
    okt.detach(x.model)


def generate(model, cache, ids, new, **kwargs):
    if cache is not None:
        kwargs[okt.CACHE_KWARG] = cache
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True, **kwargs)


def score_gap(a, b):
    """max |a - b| over the entries finite in both (min_new_tokens sets the end token to -inf)."""
    a, b = a.float(), b.float()
    finite = torch.isfinite(a) & torch.isfinite(b)
    return float((a - b).abs()[finite].max())


def assert_greedy_follows_dense(ours, dense, start, what):
    """Tokens from column `start` equal dense's, or part at a near tie explained by the score difference
    (the module docstring). Returns (tokens compared, the step where a row parted or None, the largest
    score difference before it)."""
    a, b = ours.sequences[:, start:], dense.sequences[:, start:]
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} tokens against dense's {tuple(b.shape)}"
    first = None
    worst = 0.0
    for row in range(a.shape[0]):
        parted = (a[row] != b[row]).nonzero().flatten().tolist()
        end = parted[0] if parted else a.shape[1]
        for t in range(min(end + 1, a.shape[1], len(dense.scores), len(ours.scores))):
            gap = score_gap(ours.scores[t][row], dense.scores[t][row])
            if t < end:
                worst = max(worst, gap)
                assert gap < SCORE_TOL, (f"{what}: row {row} step {t}: scores differ from dense's by {gap:.4f} "
                                         f"(tolerance {SCORE_TOL}) with the same tokens so far")
        if parted:
            t = parted[0]
            top = dense.scores[t][row].float().topk(2).values
            margin = float(top[0] - top[1])
            gap = score_gap(ours.scores[t][row], dense.scores[t][row])
            assert gap < SCORE_TOL and margin <= 2 * gap, (
                f"{what}: row {row} parts from dense at step {t} (token {int(a[row, t])} against "
                f"{int(b[row, t])}) where dense's top two differ by {margin:.4f} and the runs' scores by {gap:.4f}: "
                "not a rounding tie")
            first = t if first is None else min(first, t)
    return a.shape[1], first, worst


def report(what, compared, parted, worst):
    tie = "identical" if parted is None else f"equal up to step {parted}, then a rounding tie"
    print(f"\n{what}: {compared} tokens {tie}; largest score difference before that {worst:.4f}")


def test_covering_budget_greedy_equals_dense(s):
    cache = okt.OasisKVCache(s.model, budget_tokens=1024, max_batch=1, max_tokens=PROMPT + NEW + 16)
    assert cache.native.device == "cuda:0" and cache.device.type == "cuda"
    assert cache.native.dtype == "bfloat16"
    started = time.perf_counter()
    out = generate(s.model, cache, s.prompt, NEW)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    report("covering budget", *assert_greedy_follows_dense(out, s.dense, PROMPT, "covering budget"))
    print(f"OasisKV generate {elapsed:.2f} s; the three dense references {s.dense_seconds:.2f} s")
    decode_forwards = cache.counters["forwards"] - 1
    assert cache.counters["prefills"] == 1 and decode_forwards == NEW - 1
    assert cache.statistics().total().acquires == decode_forwards * LAYERS
    assert cache.sequence_lengths() == [PROMPT + NEW - 1]


def test_covering_budget_prompt_lookup_follows_dense(s):
    """Draft forwards of several rows: plans redone for a forward longer than planned, crops of rejected
    drafts (the CUDA cache's two live tickets a layer)."""
    cache = okt.OasisKVCache(s.model, budget_tokens=1024, max_batch=1, max_tokens=PROMPT + NEW + 16)
    out = generate(s.model, cache, s.repeated, NEW, prompt_lookup_num_tokens=3)
    report("prompt lookup 3", *assert_greedy_follows_dense(out, s.dense_lookup, PROMPT, "prompt lookup"))
    c = cache.counters
    print(f"{c['forwards']} forwards, {c['draft_rows']} draft rows, {c['crops']} crops, {c['row_fixups']} plans "
          "redone")
    assert c["draft_rows"] > 0


def test_covering_budget_padded_batch_follows_dense(s):
    cache = okt.OasisKVCache(s.model, budget_tokens=1024, max_batch=2, max_tokens=PROMPT + 32)
    out = generate(s.model, cache, s.batch, 16, attention_mask=s.batch_mask)
    report("padded batch", *assert_greedy_follows_dense(out, s.dense_batch, PROMPT, "padded batch"))
    assert cache.sequence_lengths() == [300 + 15, PROMPT + 15]  # padding never entered the cache


@pytest.mark.parametrize("remainder", ["none", "quantized"])
def test_a_smaller_budget_runs_and_starts_with_denses_token(s, remainder):
    cache = okt.OasisKVCache(s.model, budget_tokens=256, max_batch=1, max_tokens=PROMPT + NEW + 16,
                             remainder=remainder)
    out = generate(s.model, cache, s.prompt, NEW)
    tokens, dense = out.sequences[0, PROMPT:], s.dense.sequences[0, PROMPT:]
    assert len(tokens) == NEW
    assert int(tokens[0]) == int(dense[0])  # the prefill attends densely
    same = int((tokens == dense).cumprod(0).sum())
    stats = cache.statistics().total()
    print(f"\nbudget 256 of {PROMPT + NEW}, remainder {remainder}: the first {same} of {NEW} tokens are dense's; "
          f"{stats.blocks_fetched} blocks fetched (the first plans included)")
    assert stats.blocks_fetched > 0 and stats.acquires == (NEW - 1) * LAYERS
    assert cache.sequence_lengths() == [PROMPT + NEW - 1]


def forward(model, cache, ids, mask=None):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                     **{okt.CACHE_KWARG: cache}).logits


def test_the_decode_path_makes_no_synchronising_call(s):
    """torch's sync debug mode warns at every call that waits for the device (.item(), nonzero, a copy to
    pageable memory, ...); none may come from oasiskv.transformers after the prefill (transformers' own are
    not counted)."""
    cache = okt.OasisKVCache(s.model, budget_tokens=256, max_batch=1, max_tokens=PROMPT + 64)
    mask = torch.ones(1, PROMPT + 32, dtype=torch.long, device="cuda")
    token = forward(s.model, cache, s.prompt, mask[:, :PROMPT]).argmax(-1)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in range(16):
                token = forward(s.model, cache, token, mask[:, :PROMPT + step + 1]).argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if "oasiskv/transformers/" in w.filename.replace("\\", "/")]
    others = sum(1 for w in caught if "synchroniz" in str(w.message))
    print(f"\n16 decode forwards: {others} synchronising calls in all (transformers' included), {len(ours)} from "
          "oasiskv.transformers")
    assert not ours, "\n".join(ours)
    assert cache.statistics().total().acquires == 16 * LAYERS


def test_a_padded_decode_row_and_another_stream_are_refused(s):
    cache = okt.OasisKVCache(s.model, budget_tokens=256, max_batch=1, max_tokens=PROMPT + 64)
    mask = torch.ones(1, PROMPT + 8, dtype=torch.long, device="cuda")
    token = forward(s.model, cache, s.prompt, mask[:, :PROMPT]).argmax(-1)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other), pytest.raises(oasiskv.Error, match="the cache was made on stream"):
        forward(s.model, cache, token, mask[:, :PROMPT + 1])
    assert cache.counters["forwards"] == 1  # refused before any change
    token = forward(s.model, cache, token, mask[:, :PROMPT + 1]).argmax(-1)
    mask[0, PROMPT + 1] = 0  # the next forward's row is padding: the device mask is checked a forward later
    token = forward(s.model, cache, token, mask[:, :PROMPT + 2]).argmax(-1)
    torch.cuda.synchronize()
    with pytest.raises(oasiskv.Error, match="padding in its rows"):
        forward(s.model, cache, token, mask[:, :PROMPT + 3])
    with pytest.raises(oasiskv.Error, match="call reset"):
        forward(s.model, cache, token, mask[:, :PROMPT + 3])
    cache.reset()
    forward(s.model, cache, s.prompt[:, :64])
    assert cache.sequence_lengths() == [64]
