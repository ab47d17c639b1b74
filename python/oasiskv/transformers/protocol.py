"""The decode protocol of an OasisKVCache: what one forward does to the oasiskv.Cache, layer by layer.

The method (the paper's protocol, docs/architecture.md "The decode step as data flow"):

- The prefill (the first forward of a cache) appends the prompt's K/V (left padding never enters the
  cache), attends densely over the prompt with the model's own attention implementation (SDPA for
  most models) and plans each layer's first working set from the last query row.
- Every later forward, per layer: append the forward's rows (in ``update``), plan the next step from the
  forward's lookahead rows (the draft rows when ``prompt_lookup_num_tokens`` or an assistant model
  drafts: every row after the first; else the current row) with ``next_step_rows`` = the rows of this
  forward, then attend the ticket the previous forward planned over the resident blocks (attention.py),
  and release.

A forward is announced by the decoder's pre-hook (``_begin_forward``: every check of the call before the
cache changes), then each layer's ``update`` (``_update``: append) and attention call (``_attend``: plan,
acquire, attend, release) come in layer order, and the decoder's forward hook ends it (``_end_forward``:
the forward counts only if every layer ran; a forward stopped midway leaves the cache refusing until
``reset()``). On a GPU, after the prefill, nothing here waits for the device: the checks that would read
a device tensor are deferred or done on host copies (``_note_padding``).

``DecodeProtocol`` is a mixin of OasisKVCache (cache.py), whose constructor and ``_clear`` make the state
these methods use; sequence_operations.py plans between forwards with the same ``_plan``.
"""
from __future__ import annotations

import math

import torch

from .. import Error
from .dispatch import PENDING, original_attention
from .model_checks import describe

# Lookahead rows a sequence a CUDA cache plans from: CudaOptions::max_query_rows, which the binding leaves
# at its default.
CUDA_QUERY_ROWS = 4


class _Forward:
    __slots__ = ("batch", "rows", "prefill", "real", "real_rows", "appended", "layers_done")

    def __init__(self, batch, rows, prefill, real, real_rows):
        self.batch, self.rows, self.prefill = batch, rows, prefill
        self.real, self.real_rows = real, real_rows  # prefill: [B, R] bool mask, rows per sequence
        self.appended = 0  # layers whose rows were appended
        self.layers_done = 0  # layers attended


class DecodeProtocol:
    """One forward through an OasisKVCache: announced, then update + attention per layer, then ended."""

    def _begin_forward(self, decoder, args, kwargs):
        if decoder is not self._decoder():
            raise Error(f"OasisKVCache: built for a {self._model_name} of shape (layers, q heads, kv heads, head dim)"
                        f" = {self.shape}, called from another model ({type(decoder).__name__} with "
                        f"{describe(decoder)}); a cache serves the model it was built for")
        if self._broken is not None:
            raise Error(f"OasisKVCache: {self._broken}; call reset() before using it again")
        self._check_stream("a forward")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise Error("OasisKVCache: a forward without input_ids or inputs_embeds")
        batch, rows = int(ids.shape[0]), int(ids.shape[1])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict) or (mask is not None and mask.dim() != 2):
            raise Error("OasisKVCache: the forward carries a prepared (4-D or per-layer) attention mask; pass the "
                        "2-D padding mask")
        prefill = not self._seq_ids
        if not prefill and batch != len(self._seq_ids):
            raise Error(f"OasisKVCache: a forward of batch {batch}, the cache holds {len(self._seq_ids)} sequences "
                        "(one cache serves one generate call: reset() it for another)")
        if mask is not None and tuple(mask.shape) != (batch, self._seen + rows):
            raise Error(f"OasisKVCache: attention_mask has shape {tuple(mask.shape)}, expected "
                        f"({batch}, {self._seen + rows}) (the cache holds {self._seen} columns, the forward {rows})")
        if prefill:
            if batch > self.max_batch:
                raise Error(f"OasisKVCache: a batch of {batch} sequences, above max_batch={self.max_batch} "
                            "(num_return_sequences and num_beams multiply the batch)")
            if mask is None:
                real = None
                real_rows = [rows] * batch
            else:
                # The prefill reads the mask on the host (rows per sequence are host arguments of append):
                # on a GPU these are the cache's only waits for the device, once a generate call.
                real = mask.to(torch.bool)
                if rows > 1 and bool((real[:, 1:].int() < real[:, :-1].int()).any()):
                    raise Error("OasisKVCache: the attention mask has padding after a token (right or inner "
                                "padding); only left padding is supported (tokenizer.padding_side='left')")
                real_rows = real.sum(dim=1).tolist()
                if min(real_rows) == 0:
                    raise Error("OasisKVCache: a sequence of the batch is all padding")
            if max(real_rows) > self.max_tokens:
                raise Error(f"OasisKVCache: a prompt of {max(real_rows)} tokens, above max_tokens={self.max_tokens}")
            self._forward = _Forward(batch, rows, True, real, real_rows)
            return
        if rows > self._max_rows:
            raise Error(f"OasisKVCache: a forward of {rows} rows after the prefill, above recent_tokens="
                        f"{self._max_rows} (the view holds a forward's own rows in its recent ring); one cache serves "
                        "one generate call: reset() it for another")
        if mask is not None:
            if mask.device.type == "cpu":
                if not bool(mask[:, -rows:].to(torch.bool).all()):
                    raise Error("OasisKVCache: padding in the rows of a forward after the prefill; not supported")
            else:
                self._note_padding(mask[:, -rows:])
        longest = self._seen + rows - int(self._pad.min())
        if longest > self.max_tokens:
            raise Error(f"OasisKVCache: {longest} tokens in a sequence, above max_tokens={self.max_tokens}")
        self._forward = _Forward(batch, rows, False, None, [rows] * batch)

    def _check_stream(self, what):
        """A CUDA cache orders its work on the stream it was made with: torch work on another stream would
        race with its copies."""
        if self._on_device:
            current = torch.cuda.current_stream(self._device).cuda_stream
            if current != self._stream:
                raise Error(f"OasisKVCache: {what} on CUDA stream {current:#x}; the cache was made on stream "
                            f"{self._stream:#x} of {self._device} (make the cache inside the same "
                            "torch.cuda.stream block as the forwards)")

    def _note_padding(self, rows_mask):
        """The padding check of a decode forward's rows on a device mask, without waiting for the device:
        the forward ORs "a row was padding" into a device flag and queues its copy to pinned host memory;
        the next forward reads that host copy (no synchronisation; a copy not landed yet is read later). A
        padded row is therefore refused one forward or more after it entered the cache, which then refuses
        until reset() (a CPU mask is checked at once, before the cache changes)."""
        if self._padding_flags is None:
            self._padding_flags = (torch.zeros((), dtype=torch.bool, device=self._device),
                                   torch.zeros((), dtype=torch.bool, pin_memory=True))
        on_device, on_host = self._padding_flags
        if bool(on_host):  # pinned host memory: a plain read
            self._broken = "a forward after the prefill had padding in its rows (not supported)"
            raise Error(f"OasisKVCache: {self._broken}; seen from the host copy of the device mask, after that "
                        "forward ran; call reset()")
        on_device.logical_or_(~rows_mask.to(torch.bool).all())
        on_host.copy_(on_device, non_blocking=True)

    def _end_forward(self):
        forward, self._forward = self._forward, None
        PENDING.entry = None
        if forward is None:
            return
        if forward.appended == 0:
            return  # refused before any change
        if forward.layers_done != len(self.layers):
            self._broken = (f"a forward stopped after {forward.layers_done} of {len(self.layers)} layers "
                            "(an exception inside the model)")
            return
        self._seen += forward.rows
        self.counters["forwards"] += 1
        if forward.prefill:
            self.counters["prefills"] += 1
        elif forward.rows > 1:
            self.counters["draft_rows"] += forward.batch * (forward.rows - 1)
            self._rows_hint = max(self._rows_hint, forward.rows)

    def _update(self, layer, key_states, value_states):
        forward = self._forward
        if forward is None:
            raise Error(f"OasisKVCache: update of layer {layer} outside a forward of the {self._model_name} the "
                        "cache was built for (another model, or its decoder's forward hook was removed)")
        batch, kv_heads, rows, head_dim = key_states.shape
        if (batch, rows) != (forward.batch, forward.rows) or (kv_heads, head_dim) != self.shape[2:]:
            raise Error(f"OasisKVCache: layer {layer} got K of shape {tuple(key_states.shape)}, expected "
                        f"({forward.batch}, {self.shape[2]}, {forward.rows}, {self.shape[3]})")
        if layer != forward.appended or forward.appended != forward.layers_done:
            raise Error(f"OasisKVCache: layer {layer} updated out of order (expected layer {forward.layers_done})")
        first = forward.prefill and layer == 0
        if first:
            ids = list(range(self._next_id, self._next_id + batch))
            for seq in ids:
                self.native.add_sequence(seq)
            self._seq_ids = ids
        k = key_states.transpose(1, 2)  # [B][R][kv heads][d]
        v = value_states.transpose(1, 2)
        if forward.real is not None:
            k, v = k[forward.real], v[forward.real]  # left padding never enters the cache (prefill only)
        else:
            k, v = k.reshape(batch * rows, kv_heads, head_dim), v.reshape(batch * rows, kv_heads, head_dim)
        with self._timer.phase("append", timed=not forward.prefill):  # the decode path's parts only
            try:
                self.native.append(self._seq_ids, layer, k.contiguous(), v.contiguous(),
                                   rows_per_seq=forward.real_rows)
            except Exception:
                if first:  # refused: the cache stays as it was
                    for seq in self._seq_ids:
                        self.native.remove_sequence(seq)
                    self._seq_ids = []
                raise
            if first:
                self._next_id += batch
                self._pad = torch.tensor([rows - n for n in forward.real_rows], dtype=torch.long)
        forward.appended += 1
        PENDING.entry = (key_states, self, layer)
        return key_states, value_states

    def _attend(self, layer, module, query, key, value, attention_mask, args, kwargs):
        forward = self._forward
        scaling = kwargs.get("scaling")
        if scaling is not None and not math.isclose(float(scaling), self.scaling, rel_tol=1e-6):
            raise Error(f"OasisKVCache: layer {layer} attends at scaling {scaling}, the cache's softmax scale is "
                        f"{self.scaling}")
        batch, q_heads, rows, head_dim = query.shape
        if forward.prefill:
            # Dense over the prompt's own K/V (key, value: this forward's rows, the model's causal mask).
            out = original_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)
            self._plan(layer, query, rows_from=rows - 1, next_step_rows=self._rows_hint)
            forward.layers_done += 1
            return out
        ticket, planned = self._tickets[layer]
        if rows > planned:  # the plan left blocks that now leave the recent ring out: plan again
            ticket = self.native.prefetch(self._seq_ids, layer, self._plan_q[layer], next_step_rows=1)
            self.counters["row_fixups"] += 1
        # A CUDA cache holds at most two live tickets a layer (CudaOptions.tickets_per_layer). Where this
        # ticket is not the only one (planned again above, or by crop / a batch operation while the previous
        # plan was live), acquiring it first supersedes the older one before the next plan is made.
        early = self._on_device and (rows > planned or self._replanned[layer])
        acquired = False
        try:
            if early:
                view = self._acquire(ticket)
                acquired = True
            self._plan(layer, query, rows_from=1 if rows > 1 else 0, next_step_rows=max(rows, self._rows_hint))
            if not acquired:
                view = self._acquire(ticket)
                acquired = True
            out = self._view_attention(view, ticket, query, rows)
        finally:
            if acquired:
                with self._timer.phase("release"):
                    self.native.release(ticket)
        forward.layers_done += 1
        return out.to(query.dtype), None

    def _acquire(self, ticket):
        with self._timer.phase("acquire"):
            return self.native.acquire(ticket)

    def _plan(self, layer, query, rows_from, next_step_rows):
        """Plans the next step of `layer` from query rows [rows_from:] ([B][q heads][R][d]); untimed in the
        prefill."""
        prefill = self._forward is not None and self._forward.prefill
        with self._timer.phase("plan", timed=not prefill):
            batch, q_heads, _, head_dim = query.shape
            lookahead = query[:, :, rows_from:, :].transpose(1, 2).reshape(-1, q_heads, head_dim).contiguous()
            if self._on_device and lookahead.shape[0] > batch * CUDA_QUERY_ROWS:
                # A CUDA cache takes at most CudaOptions.max_query_rows lookahead rows a sequence (scratch sized
                # at construction): the drafts nearest to the current row plan the step.
                lookahead = query[:, :, rows_from:rows_from + CUDA_QUERY_ROWS, :].transpose(1, 2)
                lookahead = lookahead.reshape(-1, q_heads, head_dim).contiguous()
            self._tickets[layer] = (self.native.prefetch(self._seq_ids, layer, lookahead,
                                                         next_step_rows=next_step_rows), next_step_rows)
            self._replanned[layer] = self._forward is None  # crop or a batch operation, between forwards
        self._plan_q[layer] = lookahead
        self._last_q[layer] = query
