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
from . import staging
from .slots import SlotTable, mx_dtype
from .store import NP_DTYPES


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


def records_to_mx(block: np.ndarray, tensors, one_array: bool) -> list:
    """Copy mode: each expert's tensors as MLX arrays, from a block of records (one row per
    expert, as the store reads them).

    `one_array` (a GPU's path): one MLX array holds the whole block, so one allocation and one
    host-to-device transfer per batch. On the CPU the per-tensor arrays are the cheaper ones.
    `python -m engine bench install` measures both (its `diagnosis_ms`; figures in the README)."""
    n, stride = block.shape
    if one_array:
        flat = mx.array(block.reshape(-1))
        return [
            [
                flat[i * stride + t.offset : i * stride + t.offset + t.nbytes].view(mx_dtype(t.dtype)).reshape(t.shape)
                for t in tensors
            ]
            for i in range(n)
        ]
    out = []
    for row in block:
        arrays = []
        for t in tensors:
            a = mx.array(row[t.offset : t.offset + t.nbytes].view(NP_DTYPES[t.dtype]).reshape(t.shape))
            arrays.append(a.view(mx_dtype(t.dtype)) if t.dtype == "bfloat16" else a)
        out.append(arrays)
    return out


@dataclass
class Destination:
    """Where a read lands: a slot (inplace), a host record (copy) or a staging record (pinned)."""

    buffers: list  # what the read is given: the slot's tensor views, or one record buffer
    slot: int = -1
    record: np.ndarray | None = None
    staged: int = -1


# `batched`: a layer's misses are read together (in the decode thread when they are small, on the
# reader threads otherwise: ExpertCache.read) and installed lazily (Algorithm 1);
# `per_miss`: the paper's first version, kept for its ablation: one miss at a time, each read on a
# reader thread and the slot table evaluated after it, whatever the default path does.
SYNC_MODES = ("batched", "per_miss")
# The largest batch of reads done in the decode thread rather than handed to the reader threads:
# below it a hand-off is not repaid by reading in parallel. A choice, not a calibration: the sync
# ablation's records on the development CPU (the workflow's run s27-sync-cpu) show batches of
# 30 kB experts gain by it; full-size experts (3.5 MB) keep the threads; not measured on a GPU.
INLINE_BYTES = 1 << 20


class ExpertCache:
    """The engine-wide half of Algorithm 1: makes a layer's experts resident.

    Holds the store, one slot table per MoE layer and the prefetcher, and accounts every read
    (demand or prefetched) of every token: hits, misses, bytes, stall and prefetch counts in
    `stats`, and each table's counters.
    """

    def __init__(self, store, tables, prefetcher, sync="batched", staging_records=64, overlap=True):
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
        self.one_array = device.one_array()  # how copy mode makes arrays (records_to_mx)
        self.staging = None
        if any(t.install_mode == "pinned" for t in tables):
            self.staging = staging.StagingPool(
                staging_records,
                store.record_bytes,
                store.tensors,
                staging.make_memory(staging_records, store.record_bytes, store.tensors),
            )

    def reset_layer(self, layer: int, slots: int):
        """A fresh, empty slot table of `slots` for `layer` (a multi-node move re-fills it)."""
        old = self.tables[layer]
        self.tables[layer] = SlotTable(layer, old.num_experts, slots, old.tensors, old.policy_name, old.install_mode)
        return self.tables[layer]

    def begin_step(self, position: int, rows: int):
        """A model call over `rows` tokens starting at sequence `position` begins."""
        self.position, self.rows = position, rows
        self.stats.reset()

    def fill(self, layer: int):
        """Load every expert of a layer into slot e = expert e (the S = E table)."""
        table = self.tables[layer]
        for e in range(table.num_experts):
            table.claim(e)
        if table.install_mode == "inplace":
            futures = self.store.submit_many(layer, [(e, table.dests(e)) for e in range(table.num_experts)])
            for f in futures:
                f.result()
        elif table.install_mode == "pinned":
            self.read_staged(layer, list(range(table.num_experts)), list(range(table.num_experts)))
            mx.eval(table.buffers)
        else:
            batch = 8  # bounds the host records held at once
            for first in range(0, table.num_experts, batch):
                experts = range(first, min(first + batch, table.num_experts))
                block, _ = self.store.read_block(layer, experts)
                for e, arrays in zip(experts, records_to_mx(block, table.tensors, self.one_array)):
                    table.install_arrays(e, arrays)
                mx.eval(table.buffers)
        table.bytes_read += table.num_experts * self.store.expert_bytes

    def ensure(self, layer: int, experts: np.ndarray, scores=None, last=None):
        """Lines 11-14 of Algorithm 1 for the unique experts `experts` of this layer's rows;
        `scores` are the predictor's device scores of a decode step (Prefetcher.scores_on_device)
        and `last` the last row's experts."""
        table, st = self.tables[layer], self.stats
        # line 12: install finished prefetches; wait for in-flight experts we need (late)
        need = set(experts.tolist())
        drained = self.prefetcher.drain(layer, need, can_abandon=table.install_mode == "pinned")
        if drained is not None:
            self.absorb(layer, drained, need)
        # line 13: predict and issue layer l+d's prefetch before this layer's compute; when l+d
        # wraps onto this very layer (next token's), only once this layer's misses have slots
        depth = self.prefetcher.depth
        onto_itself = depth > 0 and depth % len(self.tables) == 0
        if not onto_itself:
            self.prefetcher.predict_and_issue(layer, experts, scores, self)
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
            self.prefetcher.predict_and_issue(layer, experts, scores, self)

    def reserve(self, layer: int, experts, protected) -> list:
        """Destinations for prefetched reads of `experts` into `layer`, in order, as many as there
        is room for (a slot outside `protected`; a staging record beyond those kept for demand)."""
        table, dests = self.tables[layer], []
        if table.install_mode == "inplace":
            for e in experts:
                try:
                    slot = table.claim(e, protected)
                except RuntimeError:
                    break
                dests.append(Destination(table.dests(slot), slot=slot))
        elif table.install_mode == "pinned":
            pool = self.staging
            n = min(len(experts), pool.available() - pool.window)
            if n > 0:
                dests = [Destination([pool.view(r)[: self.store.expert_bytes]], staged=r) for r in pool.acquire(n)]
        else:
            for _ in experts:
                record = self.store.empty_record()
                dests.append(Destination([record], record=record))
        self.stats.issued += len(dests)
        return dests

    def _free(self, table, flight):
        """Give back what a read that will never be installed held."""
        if flight.dest.slot >= 0:
            table.release(flight.expert)
        if flight.dest.staged >= 0:
            self.staging.discard([flight.dest.staged])

    def absorb(self, layer: int, drained, need: set):
        """Install and account what a drain of `layer` found (prefetch.Drained)."""
        table, st, nbytes = self.tables[layer], self.stats, self.store.expert_bytes
        for f in drained.dropped:
            self._free(table, f)
        for f in drained.failed:
            self._free(table, f)
        for f in drained.abandoned:  # its bytes are read, into a record nothing will read
            self.staging.abandon(f.dest.staged, f.future)
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
        placed, slots = [], []
        if table.install_mode in ("copy", "pinned") and drained.arrived:
            # These paths read into host records before a slot is chosen, so an arrival this layer
            # does not use may find every slot held by one it does (S = top_k): it is not placed
            # (already counted wasted). The used ones go first so that none is left out.
            t0 = time.perf_counter()
            for f in sorted(drained.arrived, key=lambda f: f.expert not in need):
                try:
                    slots.append(table.claim(f.expert, protected=need))
                    placed.append(f)
                except RuntimeError:
                    if f.expert in need:
                        raise
                    self._free(table, f)
            st.install_s += time.perf_counter() - t0
        if table.install_mode == "copy":
            for f, slot in zip(placed, slots):
                t0 = time.perf_counter()
                arrays = records_to_mx(f.dest.record[None], table.tensors, self.one_array)[0]
                t1 = time.perf_counter()
                table.install_arrays(slot, arrays)
                st.array_s += t1 - t0
                st.install_s += time.perf_counter() - t1
        elif table.install_mode == "pinned" and placed:
            t1 = time.perf_counter()
            for b in range(0, len(slots), staging.BATCH):
                batch = placed[b : b + staging.BATCH]
                table.install_batch(slots[b : b + staging.BATCH], self.staging.copy([f.dest.staged for f in batch]))
            st.array_s += time.perf_counter() - t1
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
            if table.install_mode == "inplace":
                seconds = self.read(layer, [(e, table.dests(s)) for e, s in zip(misses, slots)], inline=not evaluate)
                t2 = t3 = time.perf_counter()
            elif table.install_mode == "pinned":
                seconds, wait_s, copy_s = self.read_staged(layer, misses, slots, inline=not evaluate)
                t2 = t1 + wait_s
                t3 = t2 + copy_s
            else:
                block = store.empty_block(len(misses))
                seconds = self.read(
                    layer, [(e, [row[: store.expert_bytes]]) for e, row in zip(misses, block)], not evaluate
                )
                t2 = time.perf_counter()
                arrays = records_to_mx(block, table.tensors, self.one_array)
                t3 = time.perf_counter()
                for s, arrs in zip(slots, arrays):
                    table.install_arrays(s, arrs)
            if evaluate:
                mx.eval(table.buffers)
        except BaseException:
            for e in misses:
                table.release(e)
            raise
        t4 = time.perf_counter()
        n = len(misses)
        table.misses += n
        table.bytes_read += n * store.expert_bytes
        st.misses += n
        st.bytes_read += n * store.expert_bytes
        st.stall_s += t2 - t1
        st.pread_s += sum(seconds)
        st.array_s += t3 - t2
        st.install_s += (t1 - t0) + (t4 - t3)

    def read(self, layer: int, reads, inline: bool = True) -> list:
        """Read `reads` = [(expert, destinations)] of one layer; returns each read's seconds. A batch
        of at most INLINE_BYTES is read in the decode thread, one `preadv` after another: for small
        experts handing reads to the reader threads costs more than the reads (issue 32: the
        batched path lost to the per-miss ablation on olmoe-tiny-f32; `snakemake claims_check`
        shows it); larger batches go to the reader threads, which read them at once. Without
        `inline` every read goes to a reader thread (the paper's first version, which the per-miss
        ablation keeps)."""
        store = self.store
        if inline and len(reads) * store.expert_bytes <= INLINE_BYTES:
            return [store.read_into(layer, e, dests) for e, dests in reads]
        futures = store.submit_many(layer, reads)
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel() or f.exception()
            raise

    def read_staged(self, layer: int, experts, slots, inline: bool = True):
        """Pinned mode: read `experts` into staging records on the reader threads and install them
        into `slots`, one copy kernel and one scatter per tensor for each batch of up to
        `staging.BATCH` (all lazily: nothing here waits for the device). Returns the read
        seconds, the time spent waiting for reads and the time spent enqueueing copies."""
        table, store, pool = self.tables[layer], self.store, self.staging
        seconds, wait_s, copy_s = [], 0.0, 0.0
        for lo in range(0, len(experts), pool.window):
            exps, sls = experts[lo : lo + pool.window], slots[lo : lo + pool.window]
            t0 = time.perf_counter()
            recs = pool.acquire(len(exps))
            try:
                seconds += self.read(
                    layer, [(e, [pool.view(r)[: store.expert_bytes]]) for e, r in zip(exps, recs)], inline
                )
            except BaseException:
                pool.discard(recs)
                raise
            t1 = time.perf_counter()
            for b in range(0, len(recs), staging.BATCH):
                table.install_batch(sls[b : b + staging.BATCH], pool.copy(recs[b : b + staging.BATCH]))
            wait_s += t1 - t0
            copy_s += time.perf_counter() - t1
        return seconds, wait_s, copy_s

    def close(self):
        self.prefetcher.close()
        if self.staging is not None:
            # Copy kernels still queued (a decode loop evaluates its next token ahead) read the
            # records through their mapped addresses: those must outlive them.
            mx.synchronize()
            self.staging.close()
            self.staging = None


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
        cache.stats.sync_s += time.perf_counter() - t0
        k, d = idx.shape[-1], x.shape[-1]
        flat = idx.reshape(-1, k)
        experts, last = np.unique(flat), np.sort(flat[-1])
        if len(experts) <= table.slots:
            cache.ensure(self._layer, experts, scores, last)
            # lines 15-16: same kernel, same bytes as mlx-lm
            y = self.glu(x, mx.array(table.slot_indices(idx)))
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
        dtype = np.uint8 if table.slots <= 256 else np.uint32
        parts, out = [], None
        for call in calls:
            cache.ensure(self._layer, np.sort(call.experts), None, last)
            if call.compact:
                y = self.glu(
                    x.reshape(-1, d)[mx.array(call.pairs // k)],
                    mx.array(table.slot_indices(pairs[call.pairs])[:, None]),
                )
                parts.append(y.reshape(-1, d))
                mx.eval(parts[-1])
            else:
                keep = np.zeros(pairs.size, bool)
                keep[call.pairs] = True
                slots = table.slot_of[pairs]
                slots[~keep] = slots[call.pairs[0]]  # any resident slot: these pairs' results are dropped
                y = self.glu(x, mx.array(slots.astype(dtype).reshape(idx.shape)))
                out = y if out is None else mx.where(mx.array(keep.reshape(idx.shape))[..., None], y, out)
                mx.eval(out)
        cache.stats.chunks += len(calls) - 1
        if out is not None:
            return out
        back = mx.array(np.argsort(np.concatenate([c.pairs for c in calls])))
        return mx.concatenate(parts, axis=0)[back].reshape(*idx.shape, d)


def engine_layers(model) -> list:
    """The offloaded switch (SlotSwitchGLU, devicemap.DeviceSwitchGLU) of every MoE block of an
    engine model, in layer order."""
    return [m for _, m in sorted(model.named_modules(), key=lambda p: p[0]) if isinstance(m, OffloadedSwitch)]
