"""Prefetching: the hooks Algorithm 1 calls at every MoE layer's host synchronisation.

`ExpertCache.ensure(l, U)` calls `drain(l, U)` (line 12: install finished prefetches, wait for
in-flight experts of U) and then `predict_and_issue(l, U, hidden)` (line 13: predict layer
l+d's experts and issue their reads on the store's reader threads) before the layer's misses
are read and its kernels are dispatched, so the reads overlap the next d layers' compute.

In the `inplace` install mode an issued expert claims its slot at once and its read lands
there; nothing else touches that table until the target layer drains it. In the `copy` mode
the read lands in a record and is installed at the drain. A read that failed is raised in the
decode thread at the drain, never swallowed, never a hang.
"""

import time
from dataclasses import dataclass

import numpy as np

from .predictors import Context, NoPredictor, target_of


class NoPrefetch:
    """Demand loading only: every hook does nothing."""

    depth = 0

    def drain(self, layer, experts, cache):
        pass

    def predict_and_issue(self, layer, experts, hidden, cache):
        pass

    def close(self):
        pass


@dataclass
class Flight:
    expert: int
    slot: int  # -1 in copy mode, where the slot is claimed at the drain
    future: object
    record: np.ndarray | None


class Prefetcher:
    """Issues a predictor's experts for layer l+d from layer l; drains them at l+d."""

    def __init__(self, predictor, depth: int = 1):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, not {depth}")
        self.predictor = predictor
        self.depth = depth
        self.inflight = {}  # target layer -> {expert: Flight}

    def drain(self, layer, experts, cache):
        flights = self.inflight.pop(layer, None)
        if not flights:
            return
        table, st, store = cache.tables[layer], cache.stats, cache.store
        need = set(experts.tolist())
        failed = None
        for f in flights.values():
            useful = f.expert in need
            if not f.future.done():
                if not useful and f.future.cancel():
                    if f.slot >= 0:
                        table.release(f.expert)
                    st.cancelled += 1
                    st.wasted += 1
                    continue
                # A late expert we need, or a wasted read already writing its slot.
                t0 = time.perf_counter()
                f.future.exception()
                dt = time.perf_counter() - t0
                st.stall_s += dt
                st.late_stall_s += dt
                st.late += useful
            if f.future.exception() is not None:
                failed = failed or f.future.exception()
                if f.slot >= 0:
                    table.release(f.expert)
                continue
            if f.slot < 0:
                self._install_record(table, f, need, cache)
            st.useful += useful
            st.wasted += not useful
            table.bytes_read += store.expert_bytes
            st.bytes_read += store.expert_bytes
        if failed is not None:
            raise failed

    def _install_record(self, table, f, need, cache):
        from .moe import records_to_mx

        st = cache.stats
        t0 = time.perf_counter()
        arrays = records_to_mx(f.record[None], table.tensors, cache.one_array)[0]
        t1 = time.perf_counter()
        table.install_arrays(table.claim(f.expert, protected=need), arrays)
        st.array_s += t1 - t0
        st.install_s += time.perf_counter() - t1

    def predict_and_issue(self, layer, experts, hidden, cache):
        if cache.rows != 1:
            return  # prefill: one call over the whole prompt; nothing ahead to overlap
        target, offset = target_of(layer, self.depth, len(cache.tables))
        h = None
        if self.predictor.needs_hidden and hidden is not None:
            import mlx.core as mx

            h = np.array(hidden.reshape(-1, hidden.shape[-1])[-1].astype(mx.float32))
        ctx = Context(cache.position, layer, target, offset, experts, h, cache.history)
        # A depth that wraps onto this very layer (depth a multiple of the layer count) fills the
        # table this layer is about to compute from: its experts must keep their slots.
        busy = experts if target == layer else ()
        self.issue(target, self.predictor.predict(ctx), cache, busy)

    def issue(self, target, predicted, cache, busy=()):
        table, st, store = cache.tables[target], cache.stats, cache.store
        predicted = [int(e) for e in predicted]
        table.hint(predicted)
        flights = self.inflight.setdefault(target, {})
        protected = set(flights) | set(predicted) | {int(e) for e in busy}
        for e in predicted:
            if e in flights or table.resident(e):
                continue
            if table.install_mode == "inplace":
                try:
                    slot = table.claim(e, protected)
                except RuntimeError:
                    break  # every slot holds a protected expert: issue no more
                future, record = store.submit(target, e, table.dests(slot), prefetch=True), None
            else:
                slot, record = -1, store.empty_record()
                future = store.submit(target, e, [record], prefetch=True)
            flights[e] = Flight(e, slot, future, record)
            st.issued += 1

    def close(self):
        """Cancel what has not started, wait for what has; errors no longer matter."""
        for flights in self.inflight.values():
            for f in flights.values():
                if not f.future.cancel():
                    f.future.exception()
        self.inflight.clear()


def make(name: str, depth: int, predictor=None):
    """The prefetcher for a predictor name (`none` means demand loading)."""
    if name == "none" or isinstance(predictor, NoPredictor):
        return NoPrefetch()
    return Prefetcher(predictor, depth)
