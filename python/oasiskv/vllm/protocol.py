"""What one layer of a vLLM forward does to the OasisKV cache (the paper's protocol inside vLLM).

Per layer, for the forward's ``Step`` (runtime.py):

1. append every request's rows (prefill chunks and decode rows) in one call;
2. the prefill rows attend densely over the prompt so far with vLLM's CPU kernel (prefill.py: the earlier
   chunks are kept, per layer, until the prompt's last chunk);
3. the next step is planned for every sequence that decodes next, in one prefetch: from the drafts of a verify
   forward (every row after the first), else the current row, else (a prompt's last chunk) its last row, with
   ``next_step_rows`` = 1 + the drafts vLLM may verify;
4. the decode rows attend the plans the previous forward made: each plan is acquired, attended with
   ``LayerView.attention`` over its resident blocks (merged with the remainder estimate where one is
   configured) and released. A sequence without a live plan (new to the batch after an idle step, or whose
   plan went stale: a rejected draft, a removed neighbour) is planned again first from its last lookahead rows
   (``fixups``).

Rows of a plan's sequences that this forward does not carry (a finished request awaiting removal, one vLLM
did not schedule) are attended as zero queries and dropped; a sequence with fewer rows than the plan's
widest is padded in front (the view puts row r of R at position seq_len - R + r).
"""
from __future__ import annotations

import time

import torch

from ..merge_state import merge_state
from .prefill import PrefillBuffer, attend_chunk
from .runtime import Plan, Step, WorkerState


def forward_layer(state: WorkerState, layer: int, step: Step, query, key, value, output, scale: float,
                  isa: str) -> None:
    """Attention of `layer` for `step`'s rows: query [T][q heads][d], key / value [T][kv heads][d] (vLLM's
    views), written into output [T][q heads][d]."""
    tokens = step.tokens
    if step.dummy or tokens == 0:
        output[:tokens].zero_()
        return
    seconds = state.seconds
    t0 = time.perf_counter()
    q, k, v = query[:tokens], key[:tokens].contiguous(), value[:tokens].contiguous()
    state.native.append(step.seq_ids, layer, k, v, rows_per_seq=step.rows)
    t1 = time.perf_counter()
    seconds["append"] += t1 - t0
    for entry in step.prefill:
        _prefill_attention(state, layer, entry, q, k, v, output, scale, isa)
    t2 = time.perf_counter()
    seconds["prefill_attention"] += t2 - t1
    if step.decode or step.planned:
        _decode_attention(state, layer, step, q, output, scale)
    if layer == state.shape.layers - 1:
        state.end_forward()


def _prefill_attention(state, layer, entry, q, k, v, output, scale, isa):
    lo, hi = entry.lo, entry.lo + entry.rows
    key = (entry.seq, layer)
    buffer = state.prefill_kv.get(key)
    if buffer is None:
        tokens = max(entry.prompt_len, entry.start + entry.rows)
        buffer = state.prefill_kv[key] = PrefillBuffer(tokens, k.shape[1], k.shape[2], k.dtype)
    attend_chunk(buffer, q[lo:hi], k[lo:hi], v[lo:hi], entry.start, output[lo:hi], scale, isa)
    if entry.plans_next:  # the prompt's last chunk
        del state.prefill_kv[key]


def _decode_attention(state, layer, step, q, output, scale):
    plans = state.plan_of[layer]
    groups, fixups = {}, []
    for entry in step.decode:
        plan = plans.get(entry.seq)
        if plan is None or plan.stale:
            fixups.append(entry.seq)
        else:
            groups.setdefault(id(plan), plan)
    native = state.native
    next_rows = 1 + state.spec_tokens
    if fixups:
        looks = [state.lookahead[layer][seq] for seq in fixups]
        width = max(x.shape[0] for x in looks)
        lookahead = torch.cat([torch.cat([x, x[-1:].expand(width - x.shape[0], *x.shape[1:])]) for x in looks])
        plan = Plan(native.prefetch(fixups, layer, lookahead.contiguous(), next_step_rows=next_rows), fixups)
        state.register_plan(plan)
        groups[id(plan)] = plan
        state.counters["fixups"] += 1
    t0 = time.perf_counter()
    new_plan = None
    if step.planned:
        lookahead = q.index_select(0, step.look_index)
        seqs = [e.seq for e in step.planned]
        new_plan = Plan(native.prefetch(seqs, layer, lookahead, next_step_rows=next_rows), seqs)
        rows = step.plan_rows
        looks = state.lookahead[layer]
        for i, seq in enumerate(seqs):  # views of index_select's new tensor, not of vLLM's query
            looks[seq] = lookahead[i * rows:(i + 1) * rows]
    t1 = time.perf_counter()
    state.seconds["plan"] += t1 - t0
    for plan in groups.values():
        _attend_plan(state, step, plan, q, output, scale)
        state.retire_plan(plan)
        for seq in plan.seqs:
            if plans.get(seq) is plan:
                del plans[seq]
    if new_plan is not None:
        state.register_plan(new_plan)
        for seq in new_plan.seqs:
            plans[seq] = new_plan
    state.seconds["decode_attention"] += time.perf_counter() - t1


def _attend_plan(state, step, plan, q, output, scale):
    """Acquires `plan`, attends the rows of its sequences this forward carries, releases."""
    key = plan.seqs
    index = step.groups_cache.get(key)
    if index is None:
        present = [(i, step.by_seq[seq]) for i, seq in enumerate(plan.seqs) if seq in step.by_seq]
        width = max(e.rows for _, e in present)
        src, dst = [], []
        for i, e in present:
            src.extend(range(e.lo, e.lo + e.rows))
            dst.extend(range(i * width + width - e.rows, (i + 1) * width))
        # The common decode step: the plan's rows are the forward's rows [first, first + rows), in order.
        rows = len(plan.seqs) * width
        first = src[0] if len(src) == rows and all(a - b == src[0] for a, b in zip(src, dst)) else None
        index = step.groups_cache[key] = (width, torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long),
                                          first)
    width, src, dst, first = index
    rows = len(plan.seqs) * width
    if first is not None:
        q_rows = q[first:first + rows].to(torch.float32).contiguous()
    else:
        q_rows = torch.zeros(rows, q.shape[1], q.shape[2], dtype=torch.float32)
        q_rows[dst] = q.index_select(0, src).to(torch.float32)
    native = state.native
    t0 = time.perf_counter()
    view = native.acquire(plan.ticket)
    state.seconds["acquire"] += time.perf_counter() - t0
    try:
        out = torch.empty_like(q_rows)
        lse = torch.empty(rows, q.shape[1], dtype=torch.float32)
        view.attention(q_rows, scale, out=out, lse=lse)
        if state.remainder:
            rest, rest_lse = native.remainder(plan.ticket, q_rows)
            out = merge_state(out, lse, torch.from_numpy(rest), torch.from_numpy(rest_lse))
    finally:
        native.release(plan.ticket)
    if first is not None:
        output[first:first + rows] = out
    else:
        output.index_copy_(0, src, out.index_select(0, dst).to(output.dtype))
