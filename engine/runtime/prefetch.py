"""Prefetching: the hooks Algorithm 1 calls at every MoE layer's host synchronisation.

`ExpertCache.ensure(l, U)` calls `drain(l, U)` (line 12: wait for in-flight experts of U, cancel
wasted reads not yet started) and then `predict_and_issue(l, U, scores)` (line 13: predict
layer l+d's experts and issue their reads on the store's reader threads) before the layer's
misses are read and its kernels are dispatched, so the reads overlap the next d layers' compute.

The prefetcher owns the reads in flight and decides what to wait for; the cache owns every
slot, record and count. A prefetcher asks the cache only what is resident (`resident`), hints
its prediction (`hint`), asks for destinations (`reserve`) and starts reads into them (`submit`);
a drain hands back what it found (`Drained`, which `ExpertCache.absorb` installs and accounts),
and predicting returns its seconds for the cache to count. In the `inplace` install an issued
expert claims its slot at once and its read lands there; in `copy` it lands in a host record,
in `pinned` in a staging record, and is installed at the drain (engine.runtime.installs). A
wasted read still running in the pinned install is left to finish on its own (its record is
freed once it has) instead of being waited for. A read that failed is raised in
the decode thread at the drain, never swallowed, never a hang.
"""

import time
from dataclasses import dataclass, field

from ..predict.predictors import Context, target_of


class NoPrefetch:
    """Demand loading only: every hook does nothing."""

    depth = 0
    scores_on_device = False

    def drain(self, layer, need, can_abandon=False):
        return None

    def predict_and_issue(self, layer, experts, scores, cache) -> float:
        return 0.0

    def close(self):
        pass


@dataclass
class Flight:
    expert: int
    dest: object  # what ExpertCache.reserve gave this read
    future: object


@dataclass
class Drained:
    """What a drain of one layer found, for the cache to install and account."""

    arrived: list = field(default_factory=list)  # flights whose bytes are in place
    dropped: list = field(default_factory=list)  # wasted flights cancelled before their read began
    abandoned: list = field(default_factory=list)  # wasted pinned flights still reading
    failed: list = field(default_factory=list)  # flights whose read raised
    late: int = 0  # useful flights still in flight when needed
    late_stall_s: float = 0.0  # the wait for them (and for wasted reads already writing a slot)


class Prefetcher:
    """Issues a predictor's experts for layer l+d from layer l; drains them at l+d."""

    def __init__(self, predictor, depth: int = 1):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, not {depth}")
        self.predictor = predictor
        self.depth = depth
        self.inflight = {}  # target layer -> {expert: Flight}

    @property
    def scores_on_device(self) -> bool:
        """Whether the predictor scores each decode step's MoE input on the device."""
        return self.predictor.scores_on_device

    def device_scores(self, layer, x):
        """The predictor's scores of layer `layer`'s MoE input row `x`, lazily on the device."""
        return self.predictor.device_scores(layer, x)

    def drain(self, layer, need: set, can_abandon: bool = False) -> Drained | None:
        flights = self.inflight.pop(layer, None)
        if not flights:
            return None
        out = Drained()
        for f in flights.values():
            useful = f.expert in need
            if not f.future.done():
                if not useful and f.future.cancel():
                    out.dropped.append(f)
                    continue
                if not useful and can_abandon:
                    out.abandoned.append(f)
                    continue
                # A late expert we need, or a wasted read already writing its slot.
                t0 = time.perf_counter()
                f.future.exception()
                out.late_stall_s += time.perf_counter() - t0
                out.late += useful
            (out.failed if f.future.exception() is not None else out.arrived).append(f)
        return out

    def predict_and_issue(self, layer, experts, scores, cache) -> float:
        """Predict layer l+d's experts and issue their reads; returns the seconds it took (the
        predictor's host work, which the cache counts)."""
        if cache.rows != 1:
            return 0.0  # prefill: one call over the whole prompt; nothing ahead to overlap
        t0 = time.perf_counter()
        self._predict_and_issue(layer, experts, scores, cache)
        return time.perf_counter() - t0

    def _predict_and_issue(self, layer, experts, scores, cache):
        target, offset = target_of(layer, self.depth, len(cache.tables))
        # `scores`: the predictor's scores of this decode step's MoE input, computed on the device
        # and read back by SlotSwitchGLU with the router's indices (`scores_on_device`), else None.
        ctx = Context(cache.position, layer, target, offset, experts, None, cache.history, scores)
        # A depth that wraps onto this very layer (depth a multiple of the layer count) fills the
        # table this layer is about to compute from: its experts must keep their slots.
        busy = experts if target == layer else ()
        self.issue(target, self.predictor.predict(ctx), cache, busy)

    def issue(self, target, predicted, cache, busy=()):
        predicted = list(dict.fromkeys(int(e) for e in predicted))
        cache.hint(target, predicted)
        flights = self.inflight.setdefault(target, {})
        slot_of = cache.resident(target)
        wanted = [e for e in predicted if e not in flights and slot_of[e] < 0]
        if not wanted:
            return
        protected = set(flights) | set(predicted) | {int(e) for e in busy}
        # As many as there is room for, the likeliest first: speculative reads never wait for room.
        dests = cache.reserve(target, wanted, protected)
        futures = cache.submit(target, list(zip(wanted, dests)))
        for e, d, fut in zip(wanted, dests, futures):
            flights[e] = Flight(e, d, fut)

    def close(self):
        """Cancel what has not started, wait for what has; errors no longer matter."""
        for flights in self.inflight.values():
            for f in flights.values():
                if not f.future.cancel():
                    f.future.exception()
        self.inflight.clear()


def make(name: str, depth: int, predictor=None):
    """The prefetcher for a predictor name (`none` means demand loading)."""
    if name == "none" or (predictor is not None and predictor.demand_only):
        return NoPrefetch()
    return Prefetcher(predictor, depth)
