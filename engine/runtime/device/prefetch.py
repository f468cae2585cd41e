"""Prefetching with the `device` install: each predictor's guess for layer l+d, made on the device
from what the device already holds (the predictor's own `device_predict`, engine.predict), and
issued through the target layer's slot map and fill (with the layer's own step on the decode
stream, `DeviceCache.map_step`, or on a stream of its own, `DeviceCache.prefetch`), so that no
prediction reads anything back.

What the host path counts as late has no meaning here: a prefetch not yet copied when its layer
computes is waited for on the device, in the stream's order.
"""

import mlx.core as mx

from ...predict.predictors import DeviceContext, target_of


class DevicePrefetch:
    """A fitted (or bound) host predictor's device-side counterpart, at depth `depth`."""

    def __init__(self, predictor, depth: int, num_layers: int, num_experts: int):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, not {depth}")
        self.predictor, self.depth, self.L, self.E = predictor, depth, num_layers, num_experts
        self.last = [None] * num_layers  # each layer's router indices at the last decode step
        self.memo = {}  # the predictor's device arrays for this engine (DeviceContext.memo)

    def target(self, layer: int):
        return target_of(layer, self.depth, self.L)

    def predict(self, layer: int, x: mx.array, inds: mx.array, position: int) -> mx.array | None:
        """Layer `layer+depth`'s predicted experts, (m,) with -1 for dropped ones, lazily, from this
        layer's MoE input `x` and router indices `inds` (as the layer has them); None when there is
        nothing to predict (the oracle past its trace)."""
        target, offset = self.target(layer)
        ctx = DeviceContext(position, layer, target, offset, x, inds, self.last, self.memo, self.L, self.E)
        return self.predictor.device_predict(ctx)

    def prepare(self):
        """What the predictor needs on the device, made before a decode starts (a bound trace)."""
        self.predictor.device_prepare(self.memo)

    def remember(self, layer: int, inds: mx.array):
        """This decode step's experts at `layer`, as the router gave them (for `previous`)."""
        self.last[layer] = inds
