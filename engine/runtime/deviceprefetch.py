"""Prefetching with the `device` install: each predictor's guess for layer l+d, made on the device
from what the device already holds, and issued through the target layer's slot map and fill
(with the layer's own step on the decode stream, `DeviceCache.step`, or on a stream of its own,
`DeviceCache.prefetch`), so that no prediction reads anything back.

- oracle: the trace of the very run, uploaded once it is bound, as one evaluated row a token and
  layer (a token's graph then holds no operation of the oracle's);
- popularity: a constant per target layer;
- previous: the experts the target layer used at the last decode step (kept on the device);
- transition: the fitted counts of layer l -> l+d on the device, summed over this token's experts
  (ties by popularity, then index, as the host's `_top`);
- probe: `Probe.device_scores` of this layer's MoE input, its top experts.

A confidence floor (`min_prob`) drops the unsure ones as -1 entries (shapes stay static). What the
host path counts as late has no meaning here: a prefetch not yet copied when its layer computes
is waited for on the device, in the stream's order.
"""

import mlx.core as mx
import numpy as np

from ..predict import predictors as P
from .slots import device_indices


class DevicePrefetch:
    """A fitted (or bound) host predictor's device-side counterpart, at depth `depth`."""

    def __init__(self, predictor, depth: int, num_layers: int, num_experts: int):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, not {depth}")
        self.predictor, self.depth, self.L, self.E = predictor, depth, num_layers, num_experts
        self.size, self.floor = predictor.size, predictor.min_prob
        self._const = {}  # popularity: target -> its prediction
        self._counts = {}  # transition: layer -> (E, E) counts, target -> popularity tie-break
        self.last = [None] * num_layers  # previous: each layer's last decode step's experts
        self._bound = (None, None)  # oracle: the bound trace and its rows on the device

    def target(self, layer: int):
        return P.target_of(layer, self.depth, self.L)

    def predict(self, layer: int, x: mx.array, inds: mx.array, position: int) -> mx.array | None:
        """Layer `layer+depth`'s predicted experts, (m,) with -1 for dropped ones, lazily, from this
        layer's MoE input `x` and router indices `inds` (as the layer has them); None when there is
        nothing to predict (the oracle past its trace)."""
        p = self.predictor
        target, offset = self.target(layer)
        if isinstance(p, P.Oracle):
            t = position + offset
            if t >= len(p.sets):
                return None
            return self.rows(p.sets)[t][target]
        if isinstance(p, P.Popularity):
            if target not in self._const:
                ctx = P.Context(0, layer, target, offset, np.zeros(0, np.int64), None, [None] * self.L)
                self._const[target] = device_indices(p.predict(ctx), np.int32)
            return self._const[target]
        if isinstance(p, P.Previous):
            last = self.last[target]
            return None if last is None else last.reshape(-1)[: self.size]
        if isinstance(p, P.Transition):
            return self._transition(layer, target, inds)
        if isinstance(p, P.Probe):
            scores = p.device_scores(layer, x.reshape(-1, x.shape[-1])[-1])
            top = mx.argsort(-scores)[: self.size].astype(mx.int32)
            if self.floor > 0:
                top = mx.where(mx.sigmoid(scores[top]) >= self.floor, top, -1)
            return top
        raise ValueError(f"predictor {p.name!r} has no device-side prediction")

    def rows(self, sets: np.ndarray) -> list:
        """The bound trace's predictions on the device, uploaded once per binding and evaluated
        there as one row a token and layer: a token's prediction is then an array already made,
        not an operation of its graph (`Engine.bind_oracle` makes them, so that no decode token
        waits for them)."""
        if self._bound[0] is not sets:  # held here, so never another array at the same address
            trace = device_indices(sets[:, :, : self.size], np.int32)
            rows = [[trace[t, layer] for layer in range(self.L)] for t in range(len(sets))]
            mx.eval(rows)
            self._bound = (sets, rows)
        return self._bound[1]

    def _transition(self, layer, target, inds):
        p = self.predictor
        if layer not in self._counts:
            self._counts[layer] = mx.array(p.counts[layer].astype(np.int32))
        if ("pop", target) not in self._counts:
            self._counts[("pop", target)] = mx.array(p.popularity[target].astype(np.int64))
        rows = self._counts[layer][inds.reshape(-1).astype(mx.int32)]  # (K, E)
        scores = rows.sum(0).astype(mx.int64)
        pop = self._counts[("pop", target)]
        # `_top`'s order (score, then popularity, then the lower index) as one integer key
        key = (scores * (pop.max() + 1) + pop) * self.E + (self.E - 1 - mx.arange(self.E, dtype=mx.int64))
        top = mx.argsort(-key)[: self.size].astype(mx.int32)
        if self.floor > 0:
            prob = scores.astype(mx.float32) / mx.maximum(1.0, rows.sum().astype(mx.float32) / p.top_k)
            top = mx.where(prob[top] >= self.floor, top, -1)
        return top

    def remember(self, layer: int, inds: mx.array):
        """This decode step's experts at `layer`, as the router gave them (for `previous`)."""
        self.last[layer] = inds
