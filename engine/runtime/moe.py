"""An offloaded MoE layer: the switch mlx-lm calls, and the cache interface it asks.

`SlotSwitchGLU` takes the place of mlx-lm's `SwitchGLU` (or `SwitchMLP`) inside the model's own
MoE block, so the router, the top-k, the score weighting and the kernels stay mlx-lm's: the
wrapped SwitchGLU is mlx-lm's object, its `QuantizedSwitchLinear`s pointed at the layer's slot
tables. Only the expert indices change, from experts to slots, which selects the same bytes.

What the switch asks of an install's cache is the `Cache` interface below, and every install
answers it: the host installs with Algorithm 1 on the host (engine.runtime.hostcache), the
`device` install with the same steps on the device (engine.runtime.device). So a layer call is
written once, here:

- a layer whose table holds every expert goes straight to the kernels (line 9 of Algorithm 1);
- otherwise the cache makes the call's experts resident (lines 11-14) and says what to compute
  over (`Step`): the slot table with the indices remapped to slots, or, for rows that route to
  more experts than the table holds (a prompt, a batch of sequences, a speculative draft), a
  *many-rows area*: every expert those rows name at its own index, as mlx-lm holds them, so that
  the call is mlx-lm's own, in its shapes, once per layer;
- mlx-lm's SwitchGLU computes (lines 15-16), and the cache is told (`computed`): a many-rows call
  leaves in the slot table what `kept_after_many_rows` chooses (every install asks it): the
  experts named by most of its rows, and of a batch of sequences those named step after step, so
  that the decode after a prompt starts warm.
"""

from dataclasses import dataclass, fields

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.anatomy import set_param


@dataclass
class StepStats:
    """What one decode step (all MoE layers of one token) cost the expert cache."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    stall_s: float = 0.0  # the decode thread waiting on reads it needs now
    pread_s: float = 0.0  # summed over reader threads
    array_s: float = 0.0  # MLX arrays made from read records (copy mode)
    install_s: float = 0.0  # slot bookkeeping and buffer writes
    many_rows: int = 0  # layer calls computed over a many-rows area (their rows needed more experts than slots)
    issued: int = 0  # prefetches issued
    useful: int = 0  # prefetched experts the target layer then used
    wasted: int = 0  # prefetched experts it did not use (cancelled ones included)
    late: int = 0  # useful prefetches still in flight when needed
    cancelled: int = 0  # wasted prefetches cancelled before their read began
    late_stall_s: float = 0.0  # the part of stall_s spent waiting on prefetches
    sync_s: float = 0.0  # waiting at the host synchronisations for the device (its compute included)
    predict_s: float = 0.0  # the predictor's host work: reading the MoE input back, predicting, issuing

    def reset(self):
        self.__init__()

    def add(self, other: "StepStats"):
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def capture(self) -> dict:
        """The step's figures once its graph is built: what the host counted, and what the device
        counts as arrays still to evaluate (`pending`), read by `figures` after the step ran."""
        return self.as_dict()

    def pending(self, captured: dict) -> list:
        return []

    def figures(self, captured: dict) -> dict:
        return captured


@dataclass
class Step:
    """What a layer call computes over, as its cache says: `indices` into the slot table's buffers
    (`area` None: the indices remapped to slots) or into a many-rows area (`area`: one stack per
    expert tensor, every expert at its own index, so `indices` are the router's own). `routed`:
    the router's indices as the layer got them; `note`: what the cache itself needs once the layer
    has computed (`Cache.computed`)."""

    indices: mx.array
    area: list | None = None
    routed: mx.array | None = None
    note: object = None


KEEP_DECAY = 0.6


def kept_after_many_rows(indices: mx.array, slots: int, held: mx.array, score: mx.array | None,
                         decay: float = KEEP_DECAY) -> tuple:  # fmt: skip
    """What a layer's `slots` hold after a many-rows call over the router's `indices` (..., top-k):
    of the experts then on the device (those its slots `held`, bool (E,), before the call, and
    those the call named, which its area brought), the `slots` named by the largest share of each
    call's rows over the calls so far, each earlier call's share weighed `decay` times less
    (`score`, float32 (E,), this layer's so far; None: none yet).

    Every row votes, not the latest alone: many families hand the switch a batch's rows flattened,
    so the latest rows of a batch of sequences are its last sequences', and keeping theirs brought
    in every other sequence's experts at every step. Kept by share, those that some sequences name
    step after step stay: `scripts/probe_batch_slots.py` counts a third fewer brought in a step on
    `olmoe-tiny-f32` at B = 4, S = 16 (for any decay in 0.3-0.8). A prompt from an empty table
    keeps the experts most of its rows named. Returns (score, keep): `keep` (slots,) int32, the
    experts best first, -1 past the last on the device with a score. numpy arrays in, numpy out
    (the host installs); MLX arrays in, MLX out (the device install)."""
    k, flat = indices.shape[-1], indices.reshape(-1)
    if isinstance(indices, np.ndarray):  # a host install's (its routing is read back already): no MLX graph
        votes = np.bincount(flat, minlength=held.shape[0]).astype(np.float32) * np.float32(k / flat.size)
        xp = np
    else:  # the device install's, queued on the device with the layer's call (no read back)
        votes = mx.zeros(held.shape, mx.float32).at[flat].add(k / flat.size)
        xp = mx
    score = votes if score is None else score * np.float32(decay) + votes
    ranked = xp.where((held | (votes > 0)) & (score > 0), score, np.float32(-1))
    # ties to the lower expert (MLX's argsort on the CPU is stable, as numpy's is asked to be here)
    order = np.argsort(-ranked, kind="stable").astype(np.int32) if xp is np else mx.argsort(-ranked).astype(mx.int32)
    order = order[:slots]
    return score, xp.where(ranked[order] > 0, order, np.int32(-1))


class Cache:
    """What an offloaded layer asks of an install's cache (one object per engine, all layers).

    Attributes: `install` (the install object: its name for records, its memory needs), `stats`
    (a StepStats: the figures of the current model call), `prefetcher`, `slots` (per layer),
    `tensors` (the store's expert tensors, in the order of `buffers`), `tier` (the host tier the
    cache reads from, where it keeps one)."""

    tier = None

    def buffers(self, layer: int) -> list:
        """The layer's slot table, one stacked array per expert tensor: what its SwitchGLU holds."""
        raise NotImplementedError

    def full(self, layer: int) -> bool:
        """Whether slot e holds expert e for every expert of the layer (S = E)."""
        return self.slots[layer] == self.num_experts

    def begin_step(self, position: int, rows: int):
        """A model call over `rows` tokens starting at sequence `position` begins."""

    def prepare(self):
        """What a decode needs made before it starts, made now (a bound trace, on the device)."""

    def step(self, layer: int, x: mx.array, indices: mx.array) -> Step:
        """Make the experts of the layer call `x`, `indices` (the router's) resident: Algorithm 1's
        lines 11-14, and what to compute over."""
        raise NotImplementedError

    def computed(self, layer: int, x: mx.array, step: Step, y: mx.array):
        """The layer's SwitchGLU built `y` over `step`."""

    def counters(self) -> dict:
        """hits, misses, evictions, bytes_read (and the prefetch counts) since the engine was made."""
        raise NotImplementedError

    def close(self):
        pass


def point(glu, tensors, buffers):
    """Point mlx-lm's SwitchGLU `glu` at `buffers` (one per expert tensor, in `tensors`' order)."""
    for t, buf in zip(tensors, buffers):
        set_param(glu, t.name, buf)


class SlotSwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU (or SwitchMLP) computing over a layer's slot table, filled by `cache`."""

    def __init__(self, glu, cache: Cache, layer: int):
        super().__init__()
        point(glu, cache.tensors, cache.buffers(layer))
        self.glu = glu
        self._cache = cache
        self._layer = layer

    def __call__(self, x, indices):
        cache, layer = self._cache, self._layer
        if cache.full(layer):
            return self.glu(x, indices)  # line 9: slot e holds expert e; no host synchronisation
        step = cache.step(layer, x, indices)
        if step.area is None:
            y = self.glu(x, step.indices)  # lines 15-16: same kernel, same bytes as mlx-lm
        else:
            # mlx-lm's own call over the area; the graph holds the area's arrays, so the switch
            # points back at its slot table at once
            point(self.glu, cache.tensors, step.area)
            try:
                y = self.glu(x, step.indices)
            finally:
                point(self.glu, cache.tensors, cache.buffers(layer))
        cache.computed(layer, x, step, y)
        return y


def engine_layers(model) -> list:
    """The offloaded switch of every MoE block of an engine model, in layer order."""
    return sorted((m for _, m in model.named_modules() if isinstance(m, SlotSwitchGLU)), key=lambda m: m._layer)
