"""The CUDA cache from Python (needs a GPU and a module built with OASISKV_PYTHON_CUDA: skipped
otherwise, saying why). Against the CPU cache fed the same rows and queries: the same views (the
blocks each (sequence, kv head) holds, and their rows), float16 and bfloat16; stream order: work the
caller queued on the cache's stream before a call is seen by it, and a buffer overwritten right
after a call does not change what the cache took."""
import numpy as np
import pytest

import oasiskv
from conftest import make_config

torch = pytest.importorskip("torch", reason="the GPU tests drive the CUDA cache with torch tensors")
if not oasiskv.built_with_cuda():
    pytest.skip("this oasiskv module has no CUDA backend (pip install . -C cmake.define.OASISKV_PYTHON_CUDA=ON)",
                allow_module_level=True)
if not oasiskv.cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)


def host_view(view, on_device):
    """(blocks per pair, rows per (pair, block)) of a view, on the host."""
    def arr(x):
        return torch.from_dlpack(x).cpu().numpy() if on_device else np.asarray(x)
    indptr, block, slot, valid = arr(view.indptr), arr(view.block), arr(view.slot), arr(view.valid_tokens)
    pool = torch.from_dlpack(view.pool).cpu() if on_device else torch.from_numpy(np.array(view.pool))
    out = []
    for p in range(len(indptr) - 1):
        entries = {}
        for e in range(indptr[p], indptr[p + 1]):
            entries[int(block[e])] = pool[int(slot[e]), :, :int(valid[e])].float().clone()
        out.append(entries)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_cuda_cache_shows_the_cpu_caches_views(dtype):
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(7)
    config = make_config(num_layers=2, max_sequences=3, max_tokens_per_sequence=2048, budget_tokens=256)
    gpu = oasiskv.Cache(config, dtype=dtype, device="cuda")
    cpu = oasiskv.Cache(config, dtype=dtype)
    assert gpu.device.startswith("cuda")
    ids = [1, 2, 3]
    for c in (gpu, cpu):
        for i in ids:
            c.add_sequence(i)
    lengths = [700, 300, 1000]
    for layer in range(2):
        k = torch.randn(sum(lengths), 2, 64, generator=gen).to(torch_dtype)
        v = torch.randn(sum(lengths), 2, 64, generator=gen).to(torch_dtype)
        gpu.append(ids, layer, k.cuda(), v.cuda(), rows_per_seq=lengths)
        cpu_k = k if dtype == "float16" else k.view(torch.uint16)
        cpu_v = v if dtype == "float16" else v.view(torch.uint16)
        cpu.append(ids, layer, cpu_k, cpu_v, rows_per_seq=lengths)
    for step in range(4):
        for layer in range(2):
            q = torch.randn(3, 8, 64, generator=gen)
            tg, tc = gpu.prefetch(ids, layer, q.cuda()), cpu.prefetch(ids, layer, q)
            vg, vc = gpu.acquire(tg), cpu.acquire(tc)
            torch.cuda.synchronize()
            a, b = host_view(vg, True), host_view(vc, False)
            assert [sorted(x) for x in a] == [sorted(x) for x in b], f"step {step} layer {layer}: other blocks"
            for pa, pb in zip(a, b):
                for blk in pa:
                    if dtype == "float16":
                        torch.testing.assert_close(pa[blk], pb[blk], rtol=0, atol=0)
            gpu.release(tg)
            cpu.release(tc)


def test_inputs_are_consumed_in_the_caches_stream_order():
    config = make_config(num_layers=1, max_sequences=1, max_tokens_per_sequence=1024, budget_tokens=1024)
    stream = torch.cuda.Stream()
    cache = oasiskv.Cache(config, dtype="float16", device="cuda", stream=stream)
    cache.add_sequence(1)
    k = torch.zeros(64, 2, 64, dtype=torch.float16, device="cuda")
    want = torch.randn(64, 2, 64, dtype=torch.float16, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000)  # a long kernel before the write: the cache must wait for both
        k.copy_(want)
        cache.append([1], 0, k, k, rows_per_seq=[64])
        k.zero_()  # overwritten right after the call, on the same stream
        t = cache.prefetch([1], 0, torch.randn(1, 8, 64, device="cuda"))
        view = cache.acquire(t)
        pool = torch.from_dlpack(view.pool)
        indptr = torch.from_dlpack(view.indptr).cpu()
        slot = torch.from_dlpack(view.slot).cpu()
        got = torch.cat([pool[int(slot[e]), 0] for e in range(int(indptr[0]), int(indptr[1]))])
    stream.synchronize()
    torch.testing.assert_close(got, want[:, 0], rtol=0, atol=0)
    cache.release(t)
    with pytest.raises(oasiskv.Error, match=r"append: k is on cpu; this cache \(CUDA backend\) lives on cuda:"):
        cache.append([1], 0, torch.zeros(1, 2, 64, dtype=torch.float16), k[:1])
    out = torch.empty(1, 8, 64, device="cuda")
    with pytest.raises(oasiskv.Error, match=r"remainder: a CUDA cache writes into device arrays"):
        cache.remainder(t, torch.randn(1, 8, 64, device="cuda"))
    del out
