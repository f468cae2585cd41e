"""Prefetching: the hooks Algorithm 1 calls at every MoE layer's host synchronisation.

`ExpertCache.ensure(l, U)` calls `drain(l, U)` (line 12: install finished prefetches, wait for
in-flight experts of U) and then `predict_and_issue(l, U, hidden)` (line 13: predict layer
l+d's experts and issue their reads on the store's reader threads) before the layer's misses
are read and its kernels are dispatched, so the reads overlap the next d layers' compute.

In the `inplace` install mode an issued expert claims its slot at once and its read lands
there; nothing else touches that table until the target layer drains it. In the `copy` mode
the read lands in a record and is installed at the drain. In the `pinned` mode it lands in a
staging record, and the drain installs every finished prefetch of the layer with one copy
kernel and one scatter per tensor, enqueued without waiting for the device; a wasted read still
running is left to finish on its own (its record is freed when it has) instead of being waited
for. A read that failed is raised in the decode thread at the drain, never swallowed, never a
hang.
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
    slot: int  # -1 in copy and pinned modes, where the slot is claimed at the drain
    future: object
    record: np.ndarray | None  # copy mode's host record
    staged: int = -1  # pinned mode's staging record


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
        pinned = table.install_mode == "pinned"
        failed, staged = None, []
        for f in flights.values():
            useful = f.expert in need
            if not f.future.done():
                if not useful and f.future.cancel():
                    if f.slot >= 0:
                        table.release(f.expert)
                    if pinned:
                        cache.staging.discard([f.staged])
                    st.cancelled += 1
                    st.wasted += 1
                    continue
                if not useful and pinned:
                    # Its bytes land in a staging record nothing reads: no reason to wait.
                    cache.staging.abandon(f.staged, f.future)
                    st.wasted += 1
                    table.bytes_read += store.expert_bytes
                    st.bytes_read += store.expert_bytes
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
                if pinned:
                    cache.staging.discard([f.staged])
                continue
            if pinned:
                staged.append(f)
            elif f.slot < 0:
                self._install_record(table, f, need, cache)
            st.useful += useful
            st.wasted += not useful
            table.bytes_read += store.expert_bytes
            st.bytes_read += store.expert_bytes
        if staged:
            self._install_staged(table, staged, need, cache)
        if failed is not None:
            raise failed

    def _install_staged(self, table, flights, need, cache):
        """Pinned mode: the layer's finished prefetches, installed together (staging.BATCH per kernel)."""
        from .staging import BATCH

        t0 = time.perf_counter()
        slots = [table.claim(f.expert, protected=need) for f in flights]
        t1 = time.perf_counter()
        for b in range(0, len(flights), BATCH):
            table.install_batch(slots[b: b + BATCH], cache.staging.copy([f.staged for f in flights[b: b + BATCH]]))
        cache.stats.array_s += time.perf_counter() - t1
        cache.stats.install_s += t1 - t0

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
            staged = -1
            if table.install_mode == "inplace":
                try:
                    slot = table.claim(e, protected)
                except RuntimeError:
                    break  # every slot holds a protected expert: issue no more
                future, record = store.submit(target, e, table.dests(slot), prefetch=True), None
            elif table.install_mode == "pinned":
                pool = cache.staging
                if pool.available() <= pool.window:
                    break  # the rest of the pool is kept for demand reads
                slot, record, staged = -1, None, pool.acquire(1)[0]
                future = store.submit(target, e, [pool.view(staged)[: store.expert_bytes]], prefetch=True)
            else:
                slot, record = -1, store.empty_record()
                future = store.submit(target, e, [record], prefetch=True)
            flights[e] = Flight(e, slot, future, record, staged)
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
