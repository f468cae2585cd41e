"""Offline replay of traces: the hit rate a predictor gives at S slots, beside LRU alone and
Belady's optimal eviction at the same S.

The replay uses the engine's own SlotTable (without buffers) and follows Algorithm 1's order
at every (token, layer): drain the prefetches issued for this layer, predict and issue layer
l+d's, then access this token's experts (hits, then misses with eviction).
"""

import numpy as np

from ..predict.predictors import Context, NoPredictor, Oracle, target_of
from ..runtime.slots import SlotTable


def replay(trace, slots: int, predictor=None, depth: int = 1, eviction: str = "lru") -> dict:
    """Hit rate and prefetch counts of demand loading plus `predictor`, per prompt from cold."""
    predictor = predictor or NoPredictor()
    L, E = trace.num_layers, trace.num_experts
    hits = misses = issued = useful = 0
    for s in trace.sequences():
        if isinstance(predictor, Oracle):
            predictor.bind(trace.experts[s])
        tables = [SlotTable(l, E, slots, [], eviction) for l in range(L)]
        inflight = [set() for _ in range(L)]
        history = [None] * L
        for t in range(s.stop - s.start):
            row = s.start + t
            for l in range(L):
                table, U = tables[l], trace.experts[row, l].astype(np.int64)
                useful += len(inflight[l] & set(U.tolist()))
                inflight[l].clear()
                tgt, off = target_of(l, depth, L)
                if not isinstance(predictor, NoPredictor):
                    ctx = Context(t, l, tgt, off, U, trace.hidden[row, l].astype(np.float32), history)
                    pred = [int(e) for e in predictor.predict(ctx)]
                    tables[tgt].hint(pred)
                    protected = set(pred) | inflight[tgt]
                    for e in pred:
                        if not tables[tgt].resident(e):
                            try:
                                tables[tgt].claim(e, protected)
                            except RuntimeError:
                                break
                            inflight[tgt].add(e)
                            issued += 1
                resident = table.slot_of[U] >= 0
                hits += int(resident.sum())
                misses += int((~resident).sum())
                table.touch(U[resident])
                for e in U[~resident]:
                    table.claim(int(e), set(U.tolist()))
                history[l] = U
    total = hits + misses
    return dict(hit_rate=hits / total, hits=hits, misses=misses, issued=issued, useful=useful)


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
