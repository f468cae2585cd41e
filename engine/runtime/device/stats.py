"""What the device install counts, and where its prefetches run."""

import threading
import weakref

import mlx.core as mx

from ..moe import StepStats
from .state import STEP_FIGURES


class DeviceStats(StepStats):
    """A step's figures for the decode loop: the device counters' change since the loop last asked,
    captured as an array with the step's graph and read once the step has run (so the read waits
    for nothing, and a pipelined decode's next token is not waited for)."""

    def __init__(self, cache=None):
        super().__init__()
        # Weak: the cache holds its stats, and a cycle between them kept the cache's device arrays
        # alive after close() and del until the garbage collector ran (10 MB of olmoe-tiny-f32 on
        # the CPU; a later configuration's load could then count them or see them freed).
        self._cache = None if cache is None else weakref.proxy(cache)

    def reset(self):
        cache = self._cache
        super().__init__()
        self._cache = cache

    def capture(self) -> dict:
        out = super().capture()
        if self._cache is not None:
            out["counters"] = self._cache.counter_rows()
        return out

    def pending(self, captured: dict) -> list:
        return [captured["counters"]] if "counters" in captured else []

    def figures(self, captured: dict) -> dict:
        out = dict(captured)
        rows = out.pop("counters", None)
        if rows is not None:
            now = self._cache.totals(rows)
            out.update({k: now[k] - self._cache.last_seen[k] for k in STEP_FIGURES})
            self._cache.last_seen = now
        return out


_streams = threading.local()


def thread_streams() -> dict:
    """This thread's prefetch streams, by device."""
    return _streams.__dict__.setdefault("by_device", {})


def prefetch_stream() -> mx.Stream:
    """The calling thread's stream for prefetch work on the default device, made at its first use:
    an MLX stream belongs to the thread that made it (on CUDA another thread cannot use it) and is
    never freed, so one a thread, shared by the engines that thread decodes with."""
    made, dev = thread_streams(), mx.default_device()
    if str(dev) not in made:
        made[str(dev)] = mx.new_stream(dev)
    return made[str(dev)]
