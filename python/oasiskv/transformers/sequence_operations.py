"""What transformers does to an OasisKVCache between forwards: crop, beam reorder and batch selection.

``crop`` is ``truncate`` plus a new plan from the surviving last row's query (prompt lookup and assisted
decoding drop the rejected drafts with it); beam search and ``num_return_sequences`` map to ``fork`` and
``remove_sequence``, with new plans from the kept queries. Each acts on every layer at once and is
refused during a forward, on a broken cache, or from another CUDA stream.

``SequenceOperations`` is a mixin of OasisKVCache (cache.py); it plans with the decode protocol's
``_plan`` (protocol.py).
"""
from __future__ import annotations

import torch

from .. import Error


class SequenceOperations:
    """crop, reorder_cache, batch_select_indices and batch_repeat_interleave of an OasisKVCache."""

    def _require_idle(self, what):
        if self._forward is not None:
            raise Error(f"OasisKVCache.{what}: called during a forward")
        if self._broken is not None:
            raise Error(f"OasisKVCache.{what}: {self._broken}; call reset()")
        self._check_stream(what)

    def crop(self, tokens_to_remove):
        """Drops rows from the end of every sequence: a negative count (transformers >= 5.18) or an
        absolute length (<= 5.17); then plans every layer again from the surviving last row's query."""
        self._require_idle("crop")
        n = int(tokens_to_remove)
        if not self._seq_ids or n == 0:
            return
        drop = -n if n < 0 else max(0, self._seen - n)
        if drop == 0:
            return
        shortest = min(self.sequence_lengths())
        if drop >= shortest:
            raise Error(f"OasisKVCache.crop({n}): would drop {drop} rows of a sequence of {shortest} tokens "
                        "(at least one must stay)")
        for seq, length in zip(self._seq_ids, self.sequence_lengths()):
            self.native.truncate(seq, length - drop)
        self._seen -= drop
        for layer in range(len(self.layers)):
            last = self._last_q[layer]
            keep = max(1, last.shape[2] - drop)  # a crop past the last forward plans from its first row
            self._last_q[layer] = last[:, :, :keep]
            self._plan(layer, self._last_q[layer], rows_from=keep - 1, next_step_rows=self._rows_hint)
        self.counters["crops"] += 1
        self.counters["rows_dropped"] += drop * len(self._seq_ids)

    def reorder_cache(self, beam_idx):
        """Beam search: sequence i becomes the old sequence beam_idx[i] (fork and remove)."""
        self._select(beam_idx, "reorder_cache")

    def batch_select_indices(self, indices):
        """Keeps the sequences at `indices` (in that order)."""
        self._select(indices, "batch_select_indices")

    def batch_repeat_interleave(self, repeats):
        """Each sequence `repeats` times in a row (forks sharing its blocks)."""
        repeats = int(repeats)
        if repeats < 1:
            raise Error(f"OasisKVCache.batch_repeat_interleave: repeats must be >= 1, got {repeats}")
        self._select([i for i in range(len(self._seq_ids)) for _ in range(repeats)], "batch_repeat_interleave")

    def _select(self, indices, what):
        self._require_idle(what)
        if isinstance(indices, torch.Tensor):
            # Forks and removals are host calls: a device tensor of indices (beam search's) is read here,
            # which waits for the device; beam search itself reads its scores on the host every step too.
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            indices = indices.tolist()
        indices = [int(i) for i in indices]
        old = len(self._seq_ids)
        if not self._seq_ids:
            if indices:
                raise Error(f"OasisKVCache.{what}: the cache holds no sequence")
            return
        if not indices:
            raise Error(f"OasisKVCache.{what}: no sequence selected")
        bad = [i for i in indices if not 0 <= i < old]
        if bad:
            raise Error(f"OasisKVCache.{what}: index {bad[0]} outside the batch of {old} sequences")
        if len(indices) > self.max_batch:
            raise Error(f"OasisKVCache.{what}: {len(indices)} sequences, above max_batch={self.max_batch}")
        if indices == list(range(old)):
            return
        used = set(indices)
        for i, seq in enumerate(self._seq_ids):  # first free what no one keeps: forks then fit max_batch
            if i not in used:
                self.native.remove_sequence(seq)
                self.counters["removed"] += 1
        taken, ids = set(), []
        for i in indices:
            if i in taken:
                seq = self._next_id
                self._next_id += 1
                self.native.fork(self._seq_ids[i], seq)
                self.counters["forks"] += 1
            else:
                taken.add(i)
                seq = self._seq_ids[i]
            ids.append(seq)
        self._seq_ids = ids
        index = torch.tensor(indices, dtype=torch.long)
        self._pad = self._pad[index]
        for layer in range(len(self.layers)):  # new plans for the new batch from the kept queries
            self._last_q[layer] = self._last_q[layer][index]
            self._plan(layer, self._last_q[layer], rows_from=self._last_q[layer].shape[2] - 1,
                       next_step_rows=self._rows_hint)
            self.counters["replans"] += 1
