"""The decode step of one MoE layer (Algorithm 1 of the paper).

`SlotSwitchGLU` takes the place of mlx-lm's `SwitchGLU` inside the model's own MoE block, so
the router, the top-k, the score weighting and the kernels stay mlx-lm's: the wrapped
SwitchGLU is mlx-lm's object, its three `QuantizedSwitchLinear`s pointed at the slot buffers.
Only the expert indices change, from experts to slots, which selects the same bytes.
"""

import time
from dataclasses import dataclass, fields

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import device
from ..models.anatomy import set_param
from . import installs
from .slots import SlotTable, device_indices


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
    chunks: int = 0  # extra expert batches when one layer's rows need more experts than slots
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


# `batched`: a layer's misses are read together (in the decode thread when they are small, on the
# reader threads otherwise: installs.Install.read) and installed lazily (Algorithm 1);
# `per_miss`: the paper's first version, kept for its ablation: one miss at a time, each read on a
# reader thread and the slot table evaluated after it, whatever the default path does.
SYNC_MODES = ("batched", "per_miss")


class ExpertCache:
    """The engine-wide half of Algorithm 1: makes a layer's experts resident.

    Holds the store, one slot table per MoE layer, the install (how a read becomes a slot's bytes:
    engine.runtime.installs) and the prefetcher, and accounts every read (demand or prefetched) of
    every token: hits, misses, bytes, stall and prefetch counts in `stats`, and each table's
    counters. It is the only writer of both: the install and the prefetcher return their timings.
    """

    def __init__(self, store, tables, prefetcher, sync="batched", staging_records=64, overlap=True, install=None):
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, not {sync!r}")
        self.sync = sync
        self.overlap = overlap
        self.store = store
        self.tables = tables
        self.prefetcher = prefetcher
        self.stats = StepStats()
        self.position, self.rows = 0, 1
        self.history = [None] * len(tables)  # per layer, the most recent token's experts
        modes = {t.install_mode for t in tables}
        if install is None:
            if len(modes) != 1:
                raise ValueError(f"one install for every table of a cache, not {sorted(modes)}")
            install = installs.make(modes.pop(), store, device.one_array(), staging_records)
        self.install = install

    def reset_layer(self, layer: int, slots: int):
        """A fresh, empty slot table of `slots` for `layer` (a multi-node move re-fills it)."""
        old = self.tables[layer]
        self.tables[layer] = SlotTable(layer, old.num_experts, slots, old.tensors, old.policy_name, old.install_mode)
        return self.tables[layer]

    def begin_step(self, position: int, rows: int):
        """A model call over `rows` tokens starting at sequence `position` begins."""
        self.position, self.rows = position, rows
        self.stats.reset()

    def synced(self, seconds: float):
        """The decode thread waited `seconds` at a layer's host synchronisation."""
        self.stats.sync_s += seconds

    def chunked(self, calls: int):
        """A layer's rows needed `calls` calls over the table (a prefill on a small table)."""
        self.stats.chunks += calls - 1

    def fill(self, layer: int):
        """Load every expert of a layer into slot e = expert e (the S = E table)."""
        table = self.tables[layer]
        for e in range(table.num_experts):
            table.claim(e)
        self.install.fill(table, layer)
        table.bytes_read += table.num_experts * self.store.expert_bytes

    def ensure(self, layer: int, experts: np.ndarray, scores=None, last=None):
        """Lines 11-14 of Algorithm 1 for the unique experts `experts` of this layer's rows;
        `scores` are the predictor's device scores of a decode step (Prefetcher.scores_on_device)
        and `last` the last row's experts."""
        table, st = self.tables[layer], self.stats
        # line 12: install finished prefetches; wait for in-flight experts we need (late)
        need = set(experts.tolist())
        drained = self.prefetcher.drain(layer, need, can_abandon=self.install.can_abandon)
        if drained is not None:
            self.absorb(layer, drained, need)
        # line 13: predict and issue layer l+d's prefetch before this layer's compute; when l+d
        # wraps onto this very layer (next token's), only once this layer's misses have slots
        depth = self.prefetcher.depth
        onto_itself = depth > 0 and depth % len(self.tables) == 0
        if not onto_itself:
            st.predict_s += self.prefetcher.predict_and_issue(layer, experts, scores, self)
        self.history[layer] = experts if last is None else last
        # line 14: read the misses as one batch and install them
        resident = table.slot_of[experts] >= 0
        misses = [int(e) for e in experts[~resident]]
        nhit = int(resident.sum())
        table.hits += nhit
        st.hits += nhit
        table.touch(experts[resident])
        if misses:
            self.read_misses(layer, misses, protected=set(experts.tolist()))
        if onto_itself:
            st.predict_s += self.prefetcher.predict_and_issue(layer, experts, scores, self)

    # -- what a prefetcher may ask of the cache (prefetch.Prefetcher.issue) --------------------------
    def resident(self, layer: int) -> np.ndarray:
        """Each expert's slot in `layer` (-1: not resident)."""
        return self.tables[layer].slot_of

    def hint(self, layer: int, experts: list):
        """The predictor's experts for `layer` (an eviction policy may keep them)."""
        self.tables[layer].hint(experts)

    def reserve(self, layer: int, experts, protected) -> list:
        """Destinations for prefetched reads of `experts` into `layer`, in order, as many as there
        is room for (a slot outside `protected`; a staging record beyond those kept for demand)."""
        dests = self.install.reserve(self.tables[layer], experts, protected)
        self.stats.issued += len(dests)
        return dests

    def submit(self, layer: int, reads) -> list:
        """Start prefetched reads `reads` = [(expert, destination)] on the reader threads."""
        return self.store.submit_many(layer, [(e, d.buffers) for e, d in reads], prefetch=True)

    def absorb(self, layer: int, drained, need: set):
        """Install and account what a drain of `layer` found (prefetch.Drained)."""
        table, st, nbytes, install = self.tables[layer], self.stats, self.store.expert_bytes, self.install
        for f in drained.dropped:
            install.discard(table, f)
        for f in drained.failed:
            install.discard(table, f)
        for f in drained.abandoned:  # its bytes are read, into a record nothing will read
            install.abandon(f.dest, f.future)
        read = drained.arrived + drained.abandoned
        useful = sum(f.expert in need for f in drained.arrived)
        st.cancelled += len(drained.dropped)
        st.useful += useful
        st.wasted += len(drained.dropped) + len(read) - useful
        st.late += drained.late
        st.stall_s += drained.late_stall_s
        st.late_stall_s += drained.late_stall_s
        table.bytes_read += len(read) * nbytes
        st.bytes_read += len(read) * nbytes
        if not install.claims_first and drained.arrived:
            # These installs read into host records before a slot is chosen, so an arrival this
            # layer does not use may find every slot held by one it does (S = top_k): it is not
            # placed (already counted wasted). The used ones go first so that none is left out.
            placed, slots = [], []
            t0 = time.perf_counter()
            for f in sorted(drained.arrived, key=lambda f: f.expert not in need):
                try:
                    slots.append(table.claim(f.expert, protected=need))
                    placed.append(f)
                except RuntimeError:
                    if f.expert in need:
                        raise
                    install.discard(table, f)
            st.install_s += time.perf_counter() - t0
            array_s, install_s = install.place(table, placed, slots)
            st.array_s += array_s
            st.install_s += install_s
        if drained.failed:
            raise drained.failed[0].future.exception()

    def read_misses(self, layer: int, misses, protected):
        if self.sync == "per_miss":
            for e in misses:
                self._read(layer, [e], protected, evaluate=True)
        else:
            self._read(layer, misses, protected)

    def _read(self, layer: int, misses, protected, evaluate=False):
        """Read `misses` as one batch and install them; with `evaluate`, the slot table is
        evaluated before returning (the per-miss ablation's synchronisation, counted as install)."""
        table, st, store = self.tables[layer], self.stats, self.store
        t0 = time.perf_counter()
        slots = [table.claim(e, protected) for e in misses]
        t1 = time.perf_counter()
        try:
            loaded = self.install.load(table, layer, misses, slots, inline=not evaluate)
            if evaluate:
                mx.eval(table.buffers)
        except BaseException:
            for e in misses:
                table.release(e)
            raise
        t2 = time.perf_counter()
        n = len(misses)
        table.misses += n
        table.bytes_read += n * store.expert_bytes
        st.misses += n
        st.bytes_read += n * store.expert_bytes
        st.stall_s += loaded.wait_s
        st.pread_s += sum(loaded.seconds)
        st.array_s += loaded.array_s
        st.install_s += (t1 - t0) + (t2 - t1 - loaded.wait_s - loaded.array_s)

    def close(self):
        self.prefetcher.close()
        self.install.close()


def expert_batches(indices: np.ndarray, slots: int) -> list:
    """The unique experts of rows `indices` (R x K) in batches of at most `slots`, in the order of
    each expert's last use, the last batch full: it holds the experts the latest rows used, which is
    what a table filled row by row under LRU would keep for the next token. Each expert is in one
    batch, so a prefill reads it at most once per layer, however the rows interleave."""
    flat = indices.reshape(-1)
    last = np.full(int(flat.max()) + 1, -1)
    np.maximum.at(last, flat, np.repeat(np.arange(len(indices)), indices.shape[-1]))
    experts = np.unique(flat)
    order = experts[np.argsort(last[experts], kind="stable")]
    cuts = list(range(len(order) % slots, len(order), slots))
    return [b for b in np.split(order, cuts) if len(b)]


@dataclass
class PrefillCall:
    """One call of mlx-lm's SwitchGLU in a prefill whose rows need more experts than slots: the
    experts it makes resident first, and which of the layer's (row, choice) pairs it computes.
    `compact`: only those pairs go in, as rows of their own; otherwise the call takes every pair, in
    mlx-lm's own shapes, and only `pairs`' results are kept (the others point at a resident slot)."""

    experts: np.ndarray
    pairs: np.ndarray  # flat indices into the layer's (rows x K) choices
    compact: bool


def prefill_calls(indices: np.ndarray, slots: int, compact: bool) -> list:
    """How a prefill on a small table is computed: one call per expert batch (expert_batches), each
    expert read once. Compact calls hand the kernel fewer (row, choice) pairs than mlx-lm's call,
    which is exact only where the backend computes every pair alike whatever the call holds
    (engine.device.rows_alike: MLX's CPU). On CUDA `gather_qmm` picks its kernel by the number of
    pairs (a vector kernel below eight, a tiled one from eight: their sums round differently), so
    there every call has mlx-lm's shapes and costs a full layer's compute, not a batch's."""
    flat = indices.reshape(-1)
    return [PrefillCall(b, np.flatnonzero(np.isin(flat, b)), compact) for b in expert_batches(indices, slots)]


class OffloadedSwitch(nn.Module):
    """What an engine puts in place of an MoE block's SwitchGLU: its `_cache` is the engine's."""


class SlotSwitchGLU(OffloadedSwitch):
    """mlx-lm's SwitchGLU (or SwitchMLP) computing over a slot table (lines 9-16 of Algorithm 1)."""

    def __init__(self, glu, table, cache: ExpertCache, layer: int):
        super().__init__()
        for t, buf in zip(table.tensors, table.buffers):
            set_param(glu, t.name, buf)
        self.glu = glu
        self._table = table
        self._cache = cache
        self._layer = layer

    def __call__(self, x, indices):
        table = self._table
        if table.full:
            # line 9: slot e holds expert e; straight to the kernels, no host synchronisation
            return self.glu(x, indices)
        cache = self._cache
        scores = None
        t0 = time.perf_counter()
        if cache.prefetcher.scores_on_device and cache.rows == 1:
            # A decode step's predictor scores this token's MoE input on the device; its scores
            # ride back in one array with the router's indices (their bits, as uint32), so the
            # synchronisation reads back a few hundred bytes once rather than the MoE input.
            ids = indices.reshape(-1).astype(mx.uint32)
            s = cache.prefetcher.device_scores(self._layer, x.reshape(-1, x.shape[-1])[-1])
            both = np.array(mx.concatenate([ids, mx.view(s, mx.uint32)]))
            idx = both[: ids.size].reshape(indices.shape)
            scores = both[ids.size :].view(np.float32)
        else:
            idx = np.array(indices)  # line 11: the one unavoidable synchronisation
        cache.synced(time.perf_counter() - t0)
        k, d = idx.shape[-1], x.shape[-1]
        flat = idx.reshape(-1, k)
        experts, last = np.unique(flat), np.sort(flat[-1])
        if len(experts) <= table.slots:
            cache.ensure(self._layer, experts, scores, last)
            # lines 15-16: same kernel, same bytes as mlx-lm
            y = self.glu(x, device_indices(table.slot_indices(idx)))
            if cache.overlap:
                # Start the device on this layer now: the host builds the next layer's graph
                # meanwhile, instead of the two taking turns at every synchronisation.
                mx.async_eval(y)
            return y
        # More experts than slots among these rows (a prefill on a small table): the experts in
        # batches that fit, each read once, each batch's pairs computed by the same SwitchGLU and
        # evaluated before the next batch reuses the slots (prefill_calls says which pairs go in).
        # Each output pair is its expert's function of its input row alone, so the bytes are mlx-lm's.
        calls = prefill_calls(flat, table.slots, device.rows_alike())
        pairs = flat.reshape(-1)
        parts, out = [], None
        for call in calls:
            cache.ensure(self._layer, np.sort(call.experts), None, last)
            if call.compact:
                y = self.glu(
                    x.reshape(-1, d)[device_indices(call.pairs // k)],
                    device_indices(table.slot_indices(pairs[call.pairs])[:, None]),
                )
                parts.append(y.reshape(-1, d))
                mx.eval(parts[-1])
            else:
                keep = np.zeros(pairs.size, bool)
                keep[call.pairs] = True
                slots = table.slot_of[pairs]
                slots[~keep] = slots[call.pairs[0]]  # any resident slot: these pairs' results are dropped
                y = self.glu(x, device_indices(slots.reshape(idx.shape)))
                mask = device_indices(keep.reshape(idx.shape), np.bool_)
                out = y if out is None else mx.where(mask[..., None], y, out)
                mx.eval(out)
        cache.chunked(len(calls))
        if out is not None:
            return out
        back = device_indices(np.argsort(np.concatenate([c.pairs for c in calls])))
        return mx.concatenate(parts, axis=0)[back].reshape(*idx.shape, d)


def engine_layers(model) -> list:
    """The offloaded switch (SlotSwitchGLU, devicemap.DeviceSwitchGLU) of every MoE block of an
    engine model, in layer order."""
    return [m for _, m in sorted(model.named_modules(), key=lambda p: p[0]) if isinstance(m, OffloadedSwitch)]
