"""Where a decode step's host time goes: the one timer of oasiskv.transformers.

``cache.timings`` is None (nothing is timed: the decode path pays one attribute read a part) or a dict
from part name to seconds, accumulated by every decode forward after the prefill (and by the plans crop
and the batch operations make between forwards). ``OasisKVCache.new_timings()`` makes the dict with
every part at 0.0: append, plan, acquire, gather (GPU), attention, remainder, release. On CUDA a part is
the host's time to queue its work (nothing waits for the device).

Call sites say ``with self._timer.phase("plan"):``; a part's time is added only when its block ends
without an exception (a refused call adds nothing).
"""
from __future__ import annotations

from time import perf_counter

PARTS = ("append", "plan", "acquire", "gather", "attention", "remainder", "release")


class _Untimed:
    """The phase of a timer that times nothing: enters and leaves without reading the clock."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_UNTIMED = _Untimed()


class _Phase:
    __slots__ = ("timings", "part", "started")

    def __init__(self, timings, part):
        self.timings, self.part = timings, part

    def __enter__(self):
        self.started = perf_counter()
        return self

    def __exit__(self, kind, *exc):
        if kind is None:
            self.timings[self.part] += perf_counter() - self.started
        return False


class DecodeTimer:
    """Adds each timed phase's seconds to ``timings`` (a dict by part, or None: nothing is timed)."""

    __slots__ = ("timings",)

    def __init__(self):
        self.timings = None

    @staticmethod
    def new_timings():
        return dict.fromkeys(PARTS, 0.0)

    def phase(self, part, timed=True):
        """A context manager adding the seconds its block takes to ``timings[part]``; untimed where
        ``timed`` is false (the prefill's parts) or ``timings`` is None."""
        timings = self.timings
        if timings is None or not timed:
            return _UNTIMED
        return _Phase(timings, part)
