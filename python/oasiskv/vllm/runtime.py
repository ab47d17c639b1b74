"""The OasisKV state of one vLLM worker: the ``oasiskv.Cache``, which request is which sequence, each layer's
plans, and the map from a forward's rows to sequences (a ``Step``).

vLLM's attention sees no request ids: a forward carries rows, ``query_start_loc``, ``seq_lens`` and
``slot_mapping``. The KV connector (connector.py) tells the worker, before each step, which of vLLM's blocks
each request was given and which requests finished or were preempted; a request of the forward is then the
owner of the block its last row is written to (no two live requests share a block: prefix caching is off).
Where the forward starts below what the cache holds, the drafts of the previous forward were rejected (the
sequence is truncated) or the request was preempted and starts again (a new sequence).

A finished request's sequence is removed after the next forward: the plans made in the previous forward
hold it next to live sequences, and removing it earlier would make those plans stale. An idle step (no
forward) removes them at once, and so does a new request that finds the cache's sequences all taken.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import Cache, Error
from .settings import Settings, model_shape


class Plan:
    """One prefetch of one layer: its ticket and sequences (in the ticket's order)."""

    __slots__ = ("ticket", "seqs", "stale")

    def __init__(self, ticket, seqs):
        self.ticket, self.seqs, self.stale = ticket, tuple(seqs), False


@dataclass
class Entry:
    """One request's rows in a forward: rows [lo, lo + rows) of the forward, at positions [start, start + rows)."""

    seq: int
    lo: int
    rows: int
    start: int
    decode: bool  # attends a plan (else: the prefill, dense)
    plans_next: bool  # joins this forward's plan for the next step (decoding next)
    prompt_len: int = 0


@dataclass
class Step:
    """A forward as the cache sees it, made once by the metadata builder and used by every layer."""

    entries: list = field(default_factory=list)
    tokens: int = 0
    dummy: bool = False  # a warm-up or profiling forward: no request behind its rows
    groups_cache: dict = field(default_factory=dict)  # plan's sequences -> attention index tensors

    def __post_init__(self):
        self.seq_ids = [e.seq for e in self.entries]
        self.rows = [e.rows for e in self.entries]
        self.decode = [e for e in self.entries if e.decode]
        self.prefill = [e for e in self.entries if not e.decode]
        self.planned = [e for e in self.entries if e.plans_next]
        self.by_seq = {e.seq: e for e in self.decode}
        # The next plan's lookahead rows: a verify forward's drafts (every row after the first), else the current
        # row; a prefill's last row. Padded to one count a sequence by repeating its last row.
        looks = []
        for e in self.planned:
            if e.decode and e.rows > 1:
                looks.append(list(range(e.lo + 1, e.lo + e.rows)))
            else:
                looks.append([e.lo + e.rows - 1])
        self.plan_rows = max((len(x) for x in looks), default=0)
        self.look_index = torch.tensor([x[i] if i < len(x) else x[-1] for x in looks for i in range(self.plan_rows)],
                                       dtype=torch.long)


class WorkerState:
    """The OasisKV cache of one worker and the bookkeeping that maps vLLM's requests onto it."""

    def __init__(self, vllm_config, settings: Settings):
        self.vllm_config = vllm_config
        self.settings = settings
        self.cache_config = settings.cache_config(vllm_config)
        shape = model_shape(vllm_config)
        self.shape = shape
        # The cache's work inside a call (planning, LayerView.attention) runs on as many threads as torch's
        # kernels: vLLM's CPU worker sets that to the cores it was given.
        self.native = Cache(self.cache_config, dtype=shape.dtype, threads=max(1, torch.get_num_threads()))
        self.remainder = self.cache_config.remainder != "none"
        spec = vllm_config.speculative_config
        self.spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        self.block_size = int(vllm_config.cache_config.block_size)  # vLLM's block: slot // block_size
        self.owner = {}  # vLLM block id -> request id
        self.prompt_len = {}  # request id -> prompt tokens
        self.seq_of = {}  # request id -> oasiskv sequence id
        self.decoding = set()  # sequences whose prefill is done (they attend plans)
        self.dead = set()  # sequences of finished requests, removed after the next forward
        self.next_seq = 1
        self.step_open = False
        self.plan_of = [dict() for _ in range(shape.layers)]  # layer -> sequence -> Plan
        self.plans_by_seq = {}  # sequence -> plans (every layer) that hold it
        self.lookahead = [dict() for _ in range(shape.layers)]  # layer -> sequence -> its last plan's rows
        self.prefill_kv = {}  # (sequence, layer) -> PrefillBuffer of the prompt so far (prefill.py)
        self.counters = dict(steps=0, forwards=0, requests=0, finished=0, removed=0, truncations=0, restarts=0,
                             fixups=0, draft_rows=0)
        # Seconds of the protocol's parts, summed over layers and forwards (protocol.py): append, the prefill's
        # dense attention, plan (prefetch of the next step), decode_attention (acquire, attention over the view,
        # the remainder merge, release), of which acquire (waiting for the plan's copies).
        self.seconds = dict(append=0.0, prefill_attention=0.0, plan=0.0, decode_attention=0.0, acquire=0.0)

    # ---- between steps (connector) ------------------------------------------------------------------------

    def begin_step(self, meta) -> None:
        """The scheduler's news for this step (the connector's metadata): blocks, prompts, finished requests."""
        self.counters["steps"] += 1
        for req, blocks in meta.blocks.items():
            for block in blocks:
                if block > 0:  # 0: vLLM's null block
                    self.owner[block] = req
        self.prompt_len.update(meta.prompt_lens)
        for req in meta.restarted:
            self._finish(req, keep_prompt=True)
        for req in meta.finished:
            self._finish(req)
        self.step_open = True
        if meta.scheduled_tokens == 0:
            self.end_forward()

    def _finish(self, req, keep_prompt=False):
        seq = self.seq_of.pop(req, None)
        if not keep_prompt:
            self.prompt_len.pop(req, None)
        if seq is not None:
            self.counters["finished"] += 1
            self.dead.add(seq)
            self.decoding.discard(seq)
            self._drop_prefill(seq)

    def _drop_prefill(self, seq):
        for layer in range(self.shape.layers):
            self.prefill_kv.pop((seq, layer), None)

    def end_forward(self) -> None:
        """After a forward's last layer (or an idle step): removes the sequences of finished requests."""
        self._remove_dead()
        self.step_open = False

    def _remove_dead(self) -> None:
        for seq in sorted(self.dead):
            self._invalidate(seq)
            if self.native.has_sequence(seq):
                self.native.remove_sequence(seq)
                self.counters["removed"] += 1
            for layer in range(self.shape.layers):
                self.plan_of[layer].pop(seq, None)
                self.lookahead[layer].pop(seq, None)
        self.dead.clear()

    def _invalidate(self, seq):
        """The plans that hold `seq` can no longer be acquired (it was truncated or removed)."""
        for plan in self.plans_by_seq.pop(seq, ()):
            plan.stale = True

    def register_plan(self, plan: Plan) -> None:
        for seq in plan.seqs:
            self.plans_by_seq.setdefault(seq, set()).add(plan)

    def retire_plan(self, plan: Plan) -> None:
        for seq in plan.seqs:
            held = self.plans_by_seq.get(seq)
            if held is not None:
                held.discard(plan)

    # ---- a forward -----------------------------------------------------------------------------------------

    def build_step(self, num_reqs, query_start_loc, seq_lens, slot_mapping, num_tokens) -> Step:
        """Maps the forward's requests onto sequences; truncates after rejected drafts, starts new sequences.
        Every change to the cache happens here, before the first layer, so that a refusal leaves it as it was."""
        if not self.step_open:
            return Step(tokens=num_tokens, dummy=True)
        qsl = query_start_loc.tolist()
        lens = seq_lens[:num_reqs].tolist()
        last_slots = slot_mapping[torch.tensor(qsl[1:num_reqs + 1], dtype=torch.long) - 1].tolist()
        entries, seen = [], set()
        for i in range(num_reqs):
            lo, rows, end = qsl[i], qsl[i + 1] - qsl[i], lens[i]
            if rows == 0:
                continue
            req = self.owner.get(last_slots[i] // self.block_size)
            if req is None or req in seen:
                raise Error(f"oasiskv.vllm: the rows of batch entry {i} are written to vLLM block "
                            f"{last_slots[i] // self.block_size}, which no running request owns (the connector's "
                            "block map is out of date)")
            seen.add(req)
            start = end - rows
            seq = self.seq_of.get(req)
            if seq is not None:
                held = self.native.sequence_length(seq, 0)
                if start > held:
                    raise Error(f"oasiskv.vllm: request {req} brings rows from position {start}; its sequence {seq} "
                                f"holds {held}")
                if start == 0 and held > 0:  # preempted and started again
                    self.counters["restarts"] += 1
                    self._finish(req, keep_prompt=True)
                    seq = None
                elif start < held:  # the previous forward's rejected drafts
                    self._invalidate(seq)
                    self.native.truncate(seq, start)
                    self.counters["truncations"] += 1
            if seq is None:
                if start != 0:
                    raise Error(f"oasiskv.vllm: request {req} is new to the cache but starts at position {start}")
                seq = self.seq_of[req] = self._new_sequence()
            prompt = self.prompt_len.get(req, 0)
            decode = seq in self.decoding
            plans_next = decode or end >= prompt
            if plans_next and not decode:
                self.decoding.add(seq)
            entries.append(Entry(seq, lo, rows, start, decode, plans_next, prompt))
        step = Step(entries=entries, tokens=qsl[num_reqs])
        self.counters["forwards"] += 1
        self.counters["draft_rows"] += sum(e.rows - 1 for e in step.decode)
        return step

    def _new_sequence(self) -> int:
        if self.dead and self.native.num_sequences >= self.cache_config.max_sequences:
            # No room until the finished requests' sequences go: remove them now. The plans that hold them go
            # stale, and their other sequences are planned again (fixups) in this forward.
            self._remove_dead()
        seq = self.next_seq
        self.next_seq += 1
        self.native.add_sequence(seq)
        self.counters["requests"] += 1
        return seq

    def statistics(self) -> dict:
        """The worker's counters with the cache's sequence count and statistics."""
        return dict(self.counters, sequences=self.native.num_sequences, seconds=dict(self.seconds),
                    statistics=self.native.statistics())


_STATE: WorkerState | None = None


def state_for(vllm_config, settings: Settings) -> WorkerState:
    """The worker state of the engine whose config this is (vLLM runs one engine a process)."""
    global _STATE
    if _STATE is None or _STATE.vllm_config is not vllm_config:
        _STATE = WorkerState(vllm_config, settings)
    return _STATE


def current_state() -> WorkerState | None:
    """This process's worker state (None before the first forward on OasisKV)."""
    return _STATE
