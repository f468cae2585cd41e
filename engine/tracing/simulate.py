"""Offline replay of traces: the hit rate a predictor gives at S slots, beside LRU alone and
Belady's optimal eviction at the same S.

The replay drives the engine's own expert cache and prefetcher (engine.runtime.hostcache.ExpertCache,
engine.runtime.prefetch) over slot tables without buffers: at every (token, layer) the cache's
`ensure` follows Algorithm 1's order (drain the prefetches issued for this layer, predict and
issue layer l+d's, then this token's hits and misses with eviction). Only the bytes are left out:
no read, and a prefetch has arrived by the time its layer drains it.
"""

import dataclasses
from concurrent.futures import Future

import numpy as np

from ..predict.predictors import NoPredictor, Oracle
from ..runtime import installs
from ..runtime import prefetch as prefetch_mod
from ..runtime.hostcache import ExpertCache
from ..runtime.moe import StepStats
from ..runtime.slots import SlotTable


class _NoBytes:
    """The replay's store: experts of no bytes, each read done when it is submitted."""

    expert_bytes = 0
    tensors = ()

    def submit_many(self, layer, reads, prefetch=False):
        done = []
        for _ in reads:
            f = Future()
            f.set_result(0.0)
            done.append(f)
        return done


class _Counted(installs.InplaceInstall):
    """Slots are claimed as the engine's default install claims them; nothing is read."""

    def fill(self, table, layer):
        pass

    def load(self, table, layer, misses, slots, inline):
        return installs.Loaded([], 0.0)


class _TraceInput:
    """The predictor, handed each step's MoE input from the trace (the engine hands a device
    score instead, which a trace does not have)."""

    demand_only = False

    def __init__(self, predictor, hidden):
        self.predictor, self.hidden, self.row = predictor, hidden, 0

    def predict(self, ctx):
        return self.predictor.predict(
            dataclasses.replace(ctx, hidden=self.hidden[self.row, ctx.layer].astype(np.float32))
        )


def replay(trace, slots: int, predictor=None, depth: int = 1, eviction: str = "lru") -> dict:
    """Hit rate and prefetch counts of demand loading plus `predictor`, per prompt from cold."""
    predictor = predictor or NoPredictor()
    L, E = trace.num_layers, trace.num_experts
    hits = misses = 0
    total = StepStats()
    store = _NoBytes()
    for s in trace.sequences():
        if isinstance(predictor, Oracle):
            predictor.bind(trace.experts[s])
        given = _TraceInput(predictor, trace.hidden)
        prefetcher = prefetch_mod.make("none" if isinstance(predictor, NoPredictor) else "replay", depth, given)
        tables = [SlotTable(l, E, slots, [], eviction) for l in range(L)]
        cache = ExpertCache(store, tables, prefetcher, _Counted(store))
        for t in range(s.stop - s.start):
            given.row = s.start + t
            cache.begin_step(t, 1)
            for l in range(L):
                U = trace.experts[given.row, l].astype(np.int64)
                cache.ensure(l, np.unique(U), last=U)
            total.add(cache.stats)
        cache.close()
        hits += sum(t.hits for t in tables)
        misses += sum(t.misses for t in tables)
    return dict(hit_rate=hits / (hits + misses), hits=hits, misses=misses, issued=total.issued, useful=total.useful)


def belady(trace, slots: int) -> dict:
    """Belady's optimal demand paging per layer (evict the expert used farthest ahead)."""
    L = trace.num_layers
    hits = misses = 0
    for s in trace.sequences():
        for l in range(L):
            seq = [set(trace.experts[r, l].tolist()) for r in range(s.start, s.stop)]
            # next_use[t][e]: the first step > t that uses e
            nxt, upcoming = [None] * len(seq), {}
            for t in range(len(seq) - 1, -1, -1):
                nxt[t] = dict(upcoming)
                for e in seq[t]:
                    upcoming[e] = t
            resident = set()
            for t, U in enumerate(seq):
                hits += len(U & resident)
                for e in U - resident:
                    misses += 1
                    if len(resident) >= slots:
                        victim = max(resident - U, key=lambda x: (nxt[t].get(x, float("inf")), x))
                        resident.discard(victim)
                    resident.add(e)
    return dict(hit_rate=hits / (hits + misses), hits=hits, misses=misses)
