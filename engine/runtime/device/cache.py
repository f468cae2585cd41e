"""The device install's cache: every MoE layer's slot tables in device memory, their slot maps on
the device and the host tier behind them (the package's docstring says how a step runs)."""

import contextlib
import time

import mlx.core as mx
import numpy as np

from ... import device as backend
from ...device import device_indices
from ..moe import Cache, Step, kept_after_many_rows
from ..slots import mx_dtype
from . import hosttier
from .hosttier import HostTier
from .kernels import Job, area_kernel, step_kernel
from .ops import area_ops, fill_ops, map_step_ops, prefetch_step_ops
from .state import COUNTERS, STEP_FIGURES, MapState
from .stats import DeviceStats, prefetch_stream, thread_streams

MODES = ("kernel", "ops")


class DeviceCache(Cache):
    """The engine-wide cache of the `device` install (the package's docstring).

    `overlap`: a prefetch's map step and fill run on a stream of their own (`prefetch_stream`), so
    that its reads overlap the decode stream's compute; otherwise they queue on the decode stream.
    `area_ahead`: a many-rows call whose rows name at least E choices (a prompt; a large batch)
    copies the next layer's whole area on the prefetch stream while this layer computes (off by
    default: on the H200 it was no faster for prompts and slower for batches, docs/engine.md)."""

    def __init__(self, store, slots, install=None, mode: str | None = None, tier: HostTier | None = None,
                 prefetcher=None, overlap=True, area_ahead=False):  # fmt: skip
        if mode is None:
            mode = "kernel" if backend.kind() == "gpu" and not backend.pinned_unavailable() else "ops"
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if mode == "kernel" and backend.pinned_unavailable():
            raise RuntimeError(f"the device install's kernels cannot run here: {backend.pinned_unavailable()}")
        self.install = install
        self.mode, self.store, self.tensors = mode, store, list(store.tensors)
        self.prefetcher = prefetcher  # prefetch.DevicePrefetch, or None: demand loading
        t0 = time.perf_counter()
        self.tier = tier or hosttier.acquire(store, cuda=mode == "kernel")
        self.num_experts = self.tier.num_experts
        per_layer = [slots] * store.num_layers if isinstance(slots, int) else list(slots)
        self.slots = per_layer
        self.tables = [[mx.zeros((s, *t.shape), mx_dtype(t.dtype)) for t in self.tensors] for s in per_layer]
        mx.eval(self.tables)
        self.states = [MapState.empty(self.num_experts, s) for s in per_layer]
        self.layer_ids = [device_indices([i]) for i in range(store.num_layers)]
        self.after = [None] * store.num_layers  # each layer's last SwitchGLU output (kernel mode's ordering)
        self.overlap, self.area_ahead = overlap, area_ahead
        self.ahead = {}  # layer -> its area, copied ahead by the layer before it in this call
        self.keep_scores = [None] * store.num_layers  # kept_after_many_rows' score of each layer
        self.streams_used = set()  # the prefetch streams this cache queued work on (close waits for them)
        for layer, s in enumerate(per_layer):
            if s == self.num_experts:  # every expert resident: slot e = expert e, filled once
                self.fill_all(layer)
        self.load_seconds = time.perf_counter() - t0
        self.stats = DeviceStats(self)
        self.last_seen = dict.fromkeys(STEP_FIGURES, 0)  # the counters when the decode loop last asked
        self.position, self.rows = 0, 1

    def buffers(self, layer: int) -> list:
        return self.tables[layer]

    def fill_all(self, layer: int):
        remapped = self.map_step(layer, mx.arange(self.num_experts, dtype=mx.int32))
        mx.eval(remapped, self.tables[layer], self.states[layer].arrays())  # the kernel's output runs it
        self.states[layer] = self.states[layer].without_counts()  # the initial fill is no token's miss
        mx.eval(self.states[layer].arrays())

    # -- the layer call (moe.Cache) ---------------------------------------------------------------
    def step(self, layer: int, x, indices) -> Step:
        S, k = self.slots[layer], indices.shape[-1]
        if indices.size <= S:  # a decode step, or any call whose choices fit: nothing leaves the device
            self.ahead.pop(layer, None)
            pf = self.prefetcher if indices.size == k else None  # prefetch while decoding, one row
            target = pf.target(layer)[0] if pf is not None else None
            ahead = None
            if pf is not None and target != layer:  # line 13: layer l+d's experts, with this layer's step
                pred = pf.predict(layer, x, indices, self.position)
                if pred is not None:
                    ahead = (target, pred)
            return Step(self.map_step(layer, indices, ahead), routed=indices, note=target)
        # Rows that may route to more experts than slots: computed over the layer's many-rows area,
        # which the layer before may have copied already, whole; then what `kept_after_many_rows`
        # chooses of the experts on the device takes the slots (from the area).
        area = self.ahead.pop(layer, None)
        if area is None:
            if layer >= 2 and self.after[layer - 2] is not None:
                # Nothing here waits for the device, so the host would queue every layer's area of
                # a prompt before the device had used the first (on the H200, 13 GB at S = 16 for
                # a 4031-token prompt against resident's 9.8): at most two are held this way.
                mx.eval(self.after[layer - 2])
            area = self.area(layer, indices)
        self.stats.many_rows += 1
        self.keep_scores[layer], keep = kept_after_many_rows(indices, S, self.states[layer].slot_of >= 0,
                                                             self.keep_scores[layer])  # fmt: skip
        return Step(indices, area, routed=indices, note=keep)

    def computed(self, layer: int, x, step: Step, y):
        before, self.after[layer] = self.after[layer], y
        if step.area is None:
            pf, inds = self.prefetcher, step.routed
            if pf is None or inds.size != inds.shape[-1]:
                return
            if step.note == layer:  # onto this very layer (the next token's): once its experts are
                pred = pf.predict(layer, x, inds, self.position)  # read, sparing them
                if pred is not None:
                    self.prefetch(layer, pred, protect_recent=True)
            pf.remember(layer, inds)
            return
        state = self.settle(layer, step.note, step.area, before)
        mx.async_eval(y, *state.arrays())
        nxt = layer + 1
        if self.area_ahead and step.routed.size >= self.num_experts and nxt < len(self.slots) and not self.full(nxt):
            if layer > 0 and self.after[layer - 1] is not None:
                # at most this layer's area, the next one's and the one being let go are held
                mx.eval(self.after[layer - 1])
            self.ahead[nxt] = self.area(nxt, None, prefetch_stream())

    # -- the steps ------------------------------------------------------------------------------
    def map_step(self, layer: int, inds: mx.array, ahead=None) -> mx.array:
        """The map step and fill of `layer` for the router's indices `inds` (any shape, int32 -1 =
        ignore); returns them remapped to slots, in their shape, ready for the layer's SwitchGLU.
        `ahead`: a prefetch (target layer, predicted experts) issued with it, in the same kernel on
        the decode stream, else first, through `prefetch`."""
        S = self.slots[layer]
        if ahead is not None and (self.overlap or self.mode == "ops"):
            self.prefetch(*ahead)
            ahead = None
        if self.mode == "ops":
            state, fill = map_step_ops(self.states[layer], inds.reshape(-1).astype(mx.int32), S)
            fill_ops(self.tier, layer, self.tables[layer], self.tensors, fill)
            # Not all of the new map feeds this step's compute: evaluate it with the step (no wait),
            # or a decode nobody reads counters from would chain every step's map to the next.
            mx.async_eval(state.arrays())
            self.states[layer] = state
            return fill.remapped.reshape(inds.shape)
        jobs = [Job(self.states[layer], inds, S, layer=self.layer_ids[layer], tables=self.tables[layer])]
        # A prefetch's fill of these tables ran before: its map is this step's input.
        after = [self.after[layer]]
        if ahead is not None:
            t, pred = ahead
            jobs.append(Job(self.states[t], pred, self.slots[t], False, False, self.layer_ids[t], self.tables[t]))
            after.append(self.after[t])
        out = step_kernel(jobs, self.tier, self.tensors, after)
        self.states[layer] = out[0][0]
        if ahead is not None:
            self.states[t] = out[1][0]
        return out[0][1].remapped

    def prefetch(self, layer: int, inds: mx.array, protect_recent: bool = False):
        """Fill `layer`'s slots with the predicted experts `inds` (int32, -1 = dropped), lazily,
        ahead of its demand step (prefetch_step_ops), in a launch of its own.

        With `overlap`, on the prefetch stream, and never with a dependency between the two streams
        inside one evaluation: there MLX's CUDA backend makes the host wait for the other stream
        (its `Fence::wait` is a host wait), while on an array of an earlier evaluation the stream
        waits on the device (an event). So what the prefetch reads from the decode stream is
        handed to an evaluation first, and the prefetch's own work gets one of its own, which the
        decode stream's later readers of this layer (its demand step) then wait for on the device."""
        S = self.slots[layer]
        if self.mode == "ops":  # the operations' flat int32 entries, made on the stream inds come from
            inds = inds.reshape(-1).astype(mx.int32)
        stream = self._own_stream([inds, self.after[layer]], layer) if self.overlap else None
        if self.mode == "kernel":
            job = Job(self.states[layer], inds, S, False, protect_recent, self.layer_ids[layer], self.tables[layer])
            ((state, _),) = step_kernel([job], self.tier, self.tensors, (self.after[layer],), stream)
            made = state.arrays()
        else:
            with mx.stream(stream) if stream is not None else contextlib.nullcontext():
                state, fill = prefetch_step_ops(self.states[layer], inds, S, protect_recent)
                fill_ops(self.tier, layer, self.tables[layer], self.tensors, fill)
            made = [*state.arrays(), *self.tables[layer]]
        # On its own stream the prefetch needs an evaluation of its own (above). The ops' map, not
        # all of which feeds a later compute, is evaluated now too (no wait), or a decode nobody
        # reads counters from would chain every step's map to the next; the map kernel reads all of it.
        if stream is not None or self.mode == "ops":
            mx.async_eval(made)
        self.states[layer] = state

    def _own_stream(self, inputs, layer: int) -> mx.Stream:
        """The prefetch stream, once what work on it will read of `layer` (and `inputs`) has been
        handed to an evaluation of its own (`prefetch` says why)."""
        stream = prefetch_stream()
        self.streams_used.add(stream)
        before = [*inputs, *self.states[layer].arrays(), *self.tables[layer]]
        mx.async_eval([a for a in before if a is not None])
        return stream

    def area(self, layer: int, inds, stream=None) -> list:
        """`layer`'s many-rows area for the router's indices `inds` (None: every expert), on `stream`
        (None: the decode stream): one stack of every expert per tensor, as mlx-lm holds them. The
        operations gather the whole layer from the host tier; the kernel copies only the experts
        named, a resident one from its slot."""
        if stream is not None:
            self._own_stream([], layer)
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            if self.mode == "ops":
                area = area_ops(self.tier, layer, self.tensors)
            else:
                # the router's indices of many rows are a slice of their partition: what MLX would
                # copy for the kernel anyway, copied here where it shows
                inds = None if inds is None else mx.contiguous(inds)
                area = area_kernel(self.tier, self.layer_ids[layer], self.states[layer], self.tables[layer],
                                   self.tensors, inds)  # fmt: skip
        if stream is not None:
            mx.async_eval(area)
        return area

    def settle(self, layer: int, last: mx.array, area: list, before) -> MapState:
        """After a many-rows call: the map step of the experts it keeps, `last`, its misses filled from the area."""
        S = self.slots[layer]
        if self.mode == "ops":
            state, fill = map_step_ops(self.states[layer], last.reshape(-1).astype(mx.int32), S)
            fill_ops(self.tier, layer, self.tables[layer], self.tensors, fill, source=area)
            made = state
        else:
            job = Job(self.states[layer], last, S, layer=self.layer_ids[layer], tables=self.tables[layer],
                      source=tuple(area))  # fmt: skip
            ((made, _),) = step_kernel([job], self.tier, self.tensors, (before,))
        self.states[layer] = made
        return made

    # -- what the decode loop and the engine ask -------------------------------------------------
    def begin_step(self, position: int, rows: int):
        self.position, self.rows = position, rows
        self.stats.reset()  # the host's own figures (the device's are counters, read as they change)

    def prepare(self):
        if self.prefetcher is not None:
            self.prefetcher.prepare()

    def counter_rows(self) -> mx.array:
        """Every layer's counters as they will stand once what is queued has run, (L, counters):
        two operations where every layer's map has one shape, not one a layer."""
        shapes = {s.block.shape for s in self.states}
        if len(shapes) > 1:
            return mx.stack([s.counters for s in self.states])
        at, n = MapState.layout(self.states[0].E, self.states[0].S)["counters"]
        return mx.stack([s.block for s in self.states])[:, at : at + n]

    def totals(self, rows: mx.array | None = None) -> dict:
        """Every counter over every layer, the bytes read (demand and prefetch) and the evictions,
        from the device counters (`rows`, `counter_rows()` by default: a read back, so ask after a
        token's evaluation, not inside it). A slot is never emptied once filled, so each layer's
        fills past its first S evicted one. (A many-rows call's area is not counted: the misses of
        what it keeps are, filled from the area.)"""
        per_layer = np.array(self.counter_rows() if rows is None else rows).astype(np.int64)
        out = dict(zip(COUNTERS, (int(c) for c in per_layer.sum(axis=0))))
        out["bytes_read"] = (out["misses"] + out["issued"]) * self.store.expert_bytes
        fills = per_layer[:, COUNTERS.index("misses")] + per_layer[:, COUNTERS.index("issued")]
        out["evictions"] = int(np.maximum(fills - np.array(self.slots), 0).sum())
        return out

    def counters(self) -> dict:
        t = self.totals()
        return dict(
            hits=t["hits"], misses=t["misses"], evictions=t["evictions"], bytes_read=t["bytes_read"],
            issued=t["issued"], useful=t["useful"], wasted=t["wasted"],
        )  # fmt: skip

    def resident(self, layer: int) -> np.ndarray:
        """The experts resident in `layer`'s slots (reads the map back)."""
        return np.array(self.states[layer].expert_in)

    def close(self):
        # Fill kernels still queued (mlx-lm's generate_step evaluates the next token ahead, a
        # prefetch runs on its own stream) read the host tier through its mapped address: once
        # it is unregistered, such a read is an illegal access that poisons every later CUDA call.
        self.ahead.clear()
        mx.synchronize()
        mine = thread_streams().values()  # another thread's streams cannot be named here
        for stream in self.streams_used:
            if stream in mine:
                mx.synchronize(stream)
        hosttier.release(self.tier)
