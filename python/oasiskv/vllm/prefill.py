"""Dense attention of a prompt's chunks on the CPU, with vLLM's own CPU attention kernel.

A prompt's rows go to OasisKV (its host tier holds them), but the prefill attends densely over the whole prompt
so far, earlier chunks included. They are kept here, per layer, in a paged buffer of the layout vLLM's CPU kernel
reads ([blocks][kv heads][block][K | V], the block table the identity), written with vLLM's
``cpu_attn_reshape_and_cache`` and attended with ``cpu_attention_with_kv_cache`` at the ISA vLLM chose for the
layer, until the prompt's last chunk. The buffer is the prompt's KV of one request at a time per layer while it
prefills (vLLM's own pool would hold the same), and is dropped after the last chunk.
"""
from __future__ import annotations

import torch
from vllm import _custom_ops as ops

BLOCK = 128  # rows a buffer block: a multiple of 32, as vLLM's CPU kernels take


class PrefillBuffer:
    """The prompt of one sequence at one layer: room for `tokens` rows of `kv_heads` x `head_dim`."""

    __slots__ = ("kv", "keys", "values", "table")

    def __init__(self, tokens, kv_heads, head_dim, dtype):
        blocks = -(-tokens // BLOCK)
        # Zeroed: the kernel reads whole blocks (rows past the end are masked, and NaN * 0 would not be)
        self.kv = torch.zeros(blocks, kv_heads, BLOCK, 2 * head_dim, dtype=dtype)
        paged = self.kv.view(blocks, kv_heads, 2 * BLOCK, head_dim)
        self.keys, self.values = paged.chunk(2, dim=2)
        self.table = torch.arange(blocks, dtype=torch.int32)[None, :]


def attend_chunk(buffer: PrefillBuffer, q, k, v, start: int, out, scale: float, isa: str) -> None:
    """Writes rows k, v ([rows][kv heads][d]) at positions [start, start + rows) and attends q ([rows][q heads][d])
    causally over positions [0, start + rows) into out ([rows][q heads][d])."""
    rows = q.shape[0]
    end = start + rows
    slots = torch.arange(start, end, dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(k, v, buffer.keys, buffer.values, slots, isa)
    query_start = torch.tensor([0, rows], dtype=torch.int32)
    seq_lens = torch.tensor([end], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                                   head_dim=q.shape[2], seq_lens=seq_lens, dtype=q.dtype,
                                                   query_start_loc=query_start, causal=True, sliding_window_size=-1,
                                                   isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=buffer.keys, value_cache=buffer.values, output=out,
                                    query_start_loc=query_start, seq_lens=seq_lens, scale=scale, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=buffer.table, softcap=0.0,
                                    scheduler_metadata=metadata, s_aux=None)
