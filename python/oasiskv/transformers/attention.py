"""Attention of a decode forward's rows over an OasisKV view, and the merge of the remainder estimate.

``ViewAttention`` is one cache's: causal by token position (row r of a sequence of n tokens sits at
n - rows + r), with GQA, returning float32. On the CPU it is one call of ``LayerView.attention``, the
module's kernel straight over the view's blocks (no copy of the resident rows, one call a layer, on the
calling thread). On a GPU it is torch work queued on the cache's stream: one gather of the resident rows
from the view's zero-copy slot pool (DLPack) and one batched masked attention; nothing is read on the
host, so nothing waits for the device. With a remainder configured, the cache's estimate of the blocks
the view leaves out is merged by log-sum-exp (merge_state).
"""
from __future__ import annotations

import torch

from ..merge_state import merge_state


def from_dlpack(array):
    """A torch tensor over a CUDA view's array, without a copy. torch.from_dlpack hands the producer its
    current stream, which is the cache's; a producer whose __dlpack__ takes no arguments gives its plain
    capsule (the view's arrays are already ordered on that stream)."""
    try:
        return torch.from_dlpack(array)
    except TypeError:
        return torch.from_dlpack(array.__dlpack__())


class ViewAttention:
    """Attention over the views of one oasiskv.Cache (`native`) of a model with `kv_heads` kv heads and
    softmax scale `scaling`; its parts are timed by `timer` (timing.py): attention, gather (GPU),
    remainder."""

    def __init__(self, native, *, scaling, kv_heads, block_tokens, on_device, remainder, timer):
        self.native, self.scaling, self.kv_heads = native, scaling, kv_heads
        self.block_tokens, self.on_device, self.remainder = block_tokens, on_device, remainder
        self._timer = timer
        self._arange_cache = {}

    def __call__(self, view, ticket, query, rows):
        """Attention of `query` ([B][q heads][R][d], the forward's rows) over `view` (of `ticket`), merged
        with the remainder estimate where one is configured: [B][R][q heads][d], float32."""
        attend = self._device_attention if self.on_device else self._host_attention
        out, lse = attend(view, query, rows, self.remainder)
        if self.remainder:
            with self._timer.phase("remainder"):
                out = merge_state(out, lse, *self._remainder_state(ticket, query))
        return out

    def _remainder_state(self, ticket, query):
        """The cache's estimate of the blocks the view leaves out: (out [B][R][q heads][d], lse [B][R][q heads]),
        float32. A CUDA cache writes it into device tensors made here, in stream order (no copy to the host)."""
        batch, q_heads, rows, head_dim = query.shape
        q_rows = query.transpose(1, 2).reshape(batch * rows, q_heads, head_dim).contiguous()
        if self.on_device:
            rest = torch.empty(batch * rows, q_heads, head_dim, dtype=torch.float32, device=query.device)
            rest_lse = torch.empty(batch * rows, q_heads, dtype=torch.float32, device=query.device)
            self.native.remainder(ticket, q_rows, rest, rest_lse)
        else:
            rest, rest_lse = self.native.remainder(ticket, q_rows)
            rest, rest_lse = torch.from_numpy(rest), torch.from_numpy(rest_lse)
        return rest.view(batch, rows, q_heads, head_dim), rest_lse.view(batch, rows, q_heads)

    def _aranges(self, n, device):
        """(arange(n)[None, :], arange(block_tokens)) on `device`, made once per (n, device)."""
        pair = self._arange_cache.get((n, device))
        if pair is None:
            pair = self._arange_cache[(n, device)] = (torch.arange(n, device=device)[None, :],
                                                      torch.arange(self.block_tokens, device=device))
        return pair

    def _host_attention(self, view, query, rows, want_lse):
        """LayerView.attention over a CPU cache's view. Returns out [B][R][q heads][d] and lse [B][R][q heads]
        (None without want_lse), float32."""
        with self._timer.phase("attention"):
            batch, q_heads, _, head_dim = query.shape
            q = query.transpose(1, 2).reshape(batch * rows, q_heads, head_dim).to(torch.float32).contiguous()
            out = torch.empty(batch * rows, q_heads, head_dim, dtype=torch.float32)
            lse = torch.empty(batch * rows, q_heads, dtype=torch.float32)
            view.attention(q, self.scaling, out=out, lse=lse)
        return out.view(batch, rows, q_heads, head_dim), lse.view(batch, rows, q_heads) if want_lse else None

    def _device_attention(self, view, query, rows, want_lse):
        """_host_attention's result over a CUDA cache's view: one gather of the resident rows of every
        (sequence, kv head) pair from the view's zero-copy slot pool, then one masked SDPA, from the view's
        device arrays (zero copy), all of it torch work queued on the cache's stream; nothing is read on the
        host. Each pair is padded to the view's room per pair (the largest head budget: len(slot) / pairs)
        rather than to its longest pair, which the host cannot know without waiting for the device. Entries
        past a pair's own (the next pair's, or past the view's last entry: undefined contents) are masked
        and read slot 0. The query heads of a kv head are folded into the query rows (one kv head per pair),
        so SDPA needs no GQA support from its fused kernels."""
        batch, q_heads, _, head_dim = query.shape
        kv_heads = self.kv_heads
        group = q_heads // kv_heads
        bt = self.block_tokens
        pairs = batch * kv_heads
        device = query.device
        with self._timer.phase("gather"):
            indptr = from_dlpack(view.indptr).long()
            slot = from_dlpack(view.slot)  # int32 [pairs * room], of which indptr[-1] are the view's
            valid = from_dlpack(view.valid_tokens)
            capacity = slot.shape[0]
            width = capacity // pairs
            j, offset = self._aranges(width, device)
            start, count = indptr[:-1, None], (indptr[1:] - indptr[:-1])[:, None]
            unused = j >= count  # [P][NB]: padding entries
            entry = (start + j).clamp_(max=capacity - 1)
            slots = slot[entry].masked_fill_(unused, 0).view(-1)
            pool = from_dlpack(view.pool)  # [slots][K|V][block_tokens][d], the cache's dtype (bfloat16 included)
            keys = pool[:, 0].index_select(0, slots).view(pairs, 1, width * bt, head_dim)
            values = pool[:, 1].index_select(0, slots).view(pairs, 1, width * bt, head_dim)
        with self._timer.phase("attention"):
            tokens = valid[entry].masked_fill_(unused, 0)
            key_ok = (offset < tokens[:, :, None]).view(pairs, 1, 1, -1)
            if rows > 1:  # causal by position, as on the CPU path
                block = from_dlpack(view.block)[entry].long()
                seq_len = from_dlpack(view.seq_len).long()
                position = (block[:, :, None] * bt + offset).view(pairs, 1, 1, -1)
                row_pos = (seq_len[:, None] - rows + self._aranges(rows, device)[0]).repeat_interleave(kv_heads, dim=0)
                key_ok = key_ok & (position <= row_pos.view(pairs, 1, rows, 1))
                key_ok = key_ok.expand(pairs, group, rows, -1).reshape(pairs, 1, group * rows, -1)
            q = query.reshape(pairs, 1, group * rows, head_dim)  # query heads h * group + g use kv head h
            compute = torch.float32 if want_lse or keys.dtype != query.dtype else query.dtype
            if keys.dtype != compute or q.dtype != compute:
                q, keys, values = q.to(compute), keys.to(compute), values.to(compute)
            if not want_lse:
                out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=key_ok,
                                                                       scale=self.scaling)
                lse = None
            else:
                scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scaling).masked_fill_(~key_ok,
                                                                                                 float("-inf"))
                lse = torch.logsumexp(scores, dim=-1)  # [P][1][G * R]
                out = torch.matmul(torch.exp_(scores.sub_(lse[..., None])), values)
                lse = lse.view(batch, q_heads, rows).transpose(1, 2)
            out = out.view(batch, q_heads, rows, head_dim).transpose(1, 2)
        return out, lse
