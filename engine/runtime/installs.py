"""Installs: how read expert records become a slot's bytes, one object per engine, one interface,
and which install runs (`choose`, called once where an engine is built).

- `inplace` (the CPU's and Apple Silicon's): a read lands in its slot's own buffers, the slot
  claimed before the read; nothing is left to install.
- `copy` (the paper's path): a read lands in a host record; MLX arrays made from it are written
  into the slot.
- `pinned` (a CUDA GPU's host-side path): a read lands in a record of mapped pinned memory
  (engine.runtime.staging); one copy kernel moves a batch of them into the slots.
- `device` (a CUDA GPU's default): every expert in pinned host memory and the slot maps on the
  device, so that the host never looks inside a token (engine.runtime.device).

An install object knows its name (for records), what memory it needs beside the slot tables
(`buffer_bytes`, `area_bytes`: what `--memory` plans with) and makes its cache (`cache`). The
host installs share Algorithm 1's host cache (engine.runtime.hostcache.ExpertCache), which decides
what to read and when and owns every slot and counter; such an install says where a read lands
and installs what arrived, returning its timings.
"""

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import device as backend
from . import staging
from .device import DeviceCache, DevicePrefetch, hosttier
from .hostcache import ExpertCache
from .prefetch import NoPrefetch
from .slots import SlotTable, mx_dtype
from .store import NP_DTYPES

# The largest batch of reads done in the decode thread rather than handed to the reader threads:
# below it a hand-off is not repaid by reading in parallel. A choice, not a calibration: the sync
# ablation's records on the development CPU (the workflow's run s27-sync-cpu) show batches of
# 30 kB experts gain by it; full-size experts (3.5 MB) keep the threads; not measured on a GPU.
INLINE_BYTES = 1 << 20


@dataclass
class Destination:
    """Where a read lands: a slot (inplace), a host record (copy) or a staging record (pinned)."""

    buffers: list  # what the read is given: the slot's tensor views, or one record buffer
    slot: int = -1
    record: np.ndarray | None = None
    staged: int = -1


@dataclass
class Loaded:
    """What reading and installing one batch of misses took."""

    seconds: list  # each read's own seconds (on a reader thread or the decode thread)
    wait_s: float  # the decode thread waiting for the reads (the stall)
    array_s: float = 0.0  # making MLX arrays of the records (copy) or enqueueing copy kernels (pinned)


def records_to_mx(block: np.ndarray, tensors, one_array: bool) -> list:
    """Copy mode: each expert's tensors as MLX arrays, from a block of records (one row per
    expert, as the store reads them).

    `one_array` (a GPU's path): one MLX array holds the whole block, so one allocation and one
    host-to-device transfer per batch. On the CPU the per-tensor arrays are the cheaper ones.
    `python -m harness bench install` measures both (its `diagnosis_ms`; figures in docs/gpu.md)."""
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


class Install:
    """A host install. What every install has: `name`, `buffer_bytes` and `area_bytes` (memory
    beside the slot tables), `overlap` (its default for EngineConfig.overlap), `cache` (its
    engine-wide cache). What the host cache asks of it: `read` a layer's records, `fill` a whole
    table, `load` a batch of misses into claimed slots, `reserve` destinations for prefetched
    reads, `place` arrived ones into claimed slots, `discard`/`abandon` what will never be
    installed, `close`."""

    name = ""
    host_views = False  # its slot tables are written through host views (slots.SlotTable)
    claims_first = False  # a prefetched read's slot is claimed when it is issued (else on arrival)
    can_abandon = False  # a wasted prefetch still reading may be left to finish on its own
    overlap_default = True  # start each layer's compute at once (EngineConfig.overlap's None)
    host_reads = True  # the host reads its misses (a decode's per-miss split means something)

    def __init__(self, store, config=None):
        self.store = store

    @staticmethod
    def buffer_bytes(record_bytes: int, readers: int, staging_records: int) -> int:
        """The memory reads go through, beside the slot tables (engine.memory's plan)."""
        return readers * record_bytes

    @staticmethod
    def area_bytes(experts: int, expert_bytes: int) -> int:
        """The many-rows area's memory: one table of every expert of a layer (hostcache)."""
        return experts * expert_bytes

    def overlap(self, config) -> bool:
        return self.overlap_default if config.overlap is None else config.overlap

    def cache(self, slots, config, prefetcher=None, layers=None) -> ExpertCache:
        """Slot tables of `slots` (one number, or one per layer) for `layers` of the store (all by
        default), each full one filled, and Algorithm 1's host cache over them."""
        store = self.store
        layers = list(range(store.num_layers)) if layers is None else list(layers)
        per_layer = [slots] * len(layers) if isinstance(slots, int) else list(slots)
        tables = [SlotTable(o, store.num_experts(o), s, store.tensors, config.eviction, self.host_views)
                  for o, s in zip(layers, per_layer)]  # fmt: skip
        cache = ExpertCache(store, tables, prefetcher or NoPrefetch(), self, config.sync, self.overlap(config))
        for i, t in enumerate(tables):
            if t.full:
                cache.fill(i)
        return cache

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

    def fill(self, table, layer: int):
        """Every expert of `layer` into slot e = expert e (the S = E table), its slots claimed."""
        raise NotImplementedError

    def load(self, table, layer: int, misses, slots, inline: bool) -> Loaded:
        """Read `misses` into their claimed `slots` and install them (lazily)."""
        raise NotImplementedError

    def reserve(self, table, experts, protected) -> list:
        """Destinations for prefetched reads of `experts`, in order, as many as there is room for."""
        raise NotImplementedError

    def place(self, table, flights, slots) -> tuple[float, float]:
        """Install arrived prefetches `flights` into their claimed `slots`; returns the seconds
        spent making arrays (or enqueueing copies) and installing them."""
        return 0.0, 0.0

    def discard(self, table, flight):
        """Give back what a read (a prefetch.Flight) that will never be installed held."""
        if flight.dest.slot >= 0:
            table.release(flight.expert)

    def abandon(self, dest: Destination, future):
        raise RuntimeError(f"the {self.name} install abandons no read")

    def close(self):
        pass


class InplaceInstall(Install):
    name = "inplace"
    host_views = True
    claims_first = True

    def fill(self, table, layer):
        futures = self.store.submit_many(layer, [(e, table.dests(e)) for e in range(table.num_experts)])
        for f in futures:
            f.result()

    def load(self, table, layer, misses, slots, inline):
        t0 = time.perf_counter()
        seconds = self.read(layer, [(e, table.dests(s)) for e, s in zip(misses, slots)], inline)
        return Loaded(seconds, time.perf_counter() - t0)

    def reserve(self, table, experts, protected):
        dests = []
        for e in experts:
            try:
                slot = table.claim(e, protected)
            except RuntimeError:
                break
            dests.append(Destination(table.dests(slot), slot=slot))
        return dests


class CopyInstall(Install):
    name = "copy"

    def __init__(self, store, config=None, one_array: bool | None = None):
        super().__init__(store)
        self.one_array = backend.one_array() if one_array is None else one_array  # how arrays are made (records_to_mx)

    @staticmethod
    def buffer_bytes(record_bytes, readers, staging_records):
        return 2 * max(readers, 8) * record_bytes

    def fill(self, table, layer):
        batch = 8  # bounds the host records held at once
        for first in range(0, table.num_experts, batch):
            experts = range(first, min(first + batch, table.num_experts))
            block, _ = self.store.read_block(layer, experts)
            for e, arrays in zip(experts, records_to_mx(block, table.tensors, self.one_array)):
                table.install_arrays(e, arrays)
            mx.eval(table.buffers)

    def load(self, table, layer, misses, slots, inline):
        store = self.store
        t0 = time.perf_counter()
        block = store.empty_block(len(misses))
        seconds = self.read(layer, [(e, [row[: store.expert_bytes]]) for e, row in zip(misses, block)], inline)
        t1 = time.perf_counter()
        arrays = records_to_mx(block, table.tensors, self.one_array)
        t2 = time.perf_counter()
        for s, arrs in zip(slots, arrays):
            table.install_arrays(s, arrs)
        return Loaded(seconds, t1 - t0, t2 - t1)

    def reserve(self, table, experts, protected):
        dests = []
        for _ in experts:
            record = self.store.empty_record()
            dests.append(Destination([record], record=record))
        return dests

    def place(self, table, flights, slots):
        array_s = install_s = 0.0
        for f, slot in zip(flights, slots):
            t0 = time.perf_counter()
            arrays = records_to_mx(f.dest.record[None], table.tensors, self.one_array)[0]
            t1 = time.perf_counter()
            table.install_arrays(slot, arrays)
            array_s += t1 - t0
            install_s += time.perf_counter() - t1
        return array_s, install_s


class PinnedInstall(Install):
    name = "pinned"
    can_abandon = True

    def __init__(self, store, config=None, records: int | None = None):
        super().__init__(store)
        records = records or (config.staging_records if config is not None else 64)
        self.pool = staging.StagingPool(
            records, store.record_bytes, store.tensors, staging.make_memory(records, store.record_bytes, store.tensors)
        )

    @staticmethod
    def buffer_bytes(record_bytes, readers, staging_records):
        return staging_records * record_bytes

    def fill(self, table, layer):
        everyone = list(range(table.num_experts))
        self.load(table, layer, everyone, everyone, inline=True)
        mx.eval(table.buffers)

    def load(self, table, layer, misses, slots, inline):
        """Read `misses` into staging records on the reader threads and install them into `slots`,
        one copy kernel and one scatter per tensor for each batch of up to `staging.BATCH` (all
        lazily: nothing here waits for the device)."""
        store, pool = self.store, self.pool
        seconds, wait_s, copy_s = [], 0.0, 0.0
        for lo in range(0, len(misses), pool.window):
            exps, sls = misses[lo : lo + pool.window], slots[lo : lo + pool.window]
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
        return Loaded(seconds, wait_s, copy_s)

    def reserve(self, table, experts, protected):
        pool = self.pool
        n = min(len(experts), pool.available() - pool.window)
        if n <= 0:
            return []
        return [Destination([pool.view(r)[: self.store.expert_bytes]], staged=r) for r in pool.acquire(n)]

    def place(self, table, flights, slots):
        t0 = time.perf_counter()
        for b in range(0, len(slots), staging.BATCH):
            batch = flights[b : b + staging.BATCH]
            table.install_batch(slots[b : b + staging.BATCH], self.pool.copy([f.dest.staged for f in batch]))
        return time.perf_counter() - t0, 0.0

    def discard(self, table, flight):
        super().discard(table, flight)
        if flight.dest.staged >= 0:
            self.pool.discard([flight.dest.staged])

    def abandon(self, dest, future):
        self.pool.abandon(dest.staged, future)

    def close(self):
        # Copy kernels still queued (a decode loop evaluates its next token ahead) read the
        # records through their mapped addresses: releasing their registration waits for them.
        self.pool.close()


class DeviceInstall(Install):
    """Every expert in the host tier, the slot maps on the device: its cache is engine.runtime.device's."""

    name = "device"
    host_reads = False  # the device reads them from the host tier, inside the token's graph
    # Its prefetches queue on the decode stream unless asked (EngineConfig.overlap): on the H200 a
    # stream of their own cost more host time per token than their reads overlapped (0.40-0.45x of
    # resident against 0.54-0.56x for the oracle at S = 16, docs/gpu.md).
    overlap_default = False

    @staticmethod
    def buffer_bytes(record_bytes, readers, staging_records):
        return 0  # its host tier is host memory, not the device's: no read buffer here

    @staticmethod
    def area_bytes(experts, expert_bytes):
        """Two many-rows areas: a layer's and, copied ahead during its compute, the next one's."""
        return 2 * experts * expert_bytes

    def cache(self, slots, config, prefetcher=None, layers=None) -> DeviceCache:
        store = self.store
        if layers is not None and list(layers) != list(range(store.num_layers)):
            raise ValueError("the device install holds every MoE layer of its store")
        device_pf = None
        if prefetcher is not None and prefetcher.depth > 0:
            device_pf = DevicePrefetch(prefetcher.predictor, prefetcher.depth, store.num_layers, store.num_experts(0))
        ahead = bool(config.area_ahead)  # None: off, as measured faster (docs/engine.md)
        return DeviceCache(store, slots, self, prefetcher=device_pf, overlap=self.overlap(config), area_ahead=ahead)


INSTALLS = {c.name: c for c in (InplaceInstall, CopyInstall, PinnedInstall, DeviceInstall)}
CHOICES = ("auto", *INSTALLS)  # what --install takes


def choose(
    asked: str, host_tier_bytes: int, full: bool = False, device_ok: bool = True, device_kind=None, card: bool = False
):
    """The install class that runs for `--install asked`, chosen once where an engine is built:

    - `auto`: `inplace` on the CPU; on a CUDA GPU `device`, or `pinned` where every expert is
      resident anyway (`full`: no miss, no host tier needed) or its host tier (`host_tier_bytes`)
      does not fit in host memory; `copy` on a GPU where the pinned path cannot run (Apple Silicon);
    - `device`: refused by name where its host tier does not fit; on the CPU its steps run as MLX
      operations, the same bookkeeping, tested there;
    - `inplace` on a GPU is `pinned` (a host view of a slot table cannot be shared with the device),
      `pinned` on the CPU is `inplace`, and `pinned` where it cannot run is `copy`.
    A fallback is said on stderr. `device_ok` False: a host install (a multi-node run's tables).
    `card`: the choice on a CUDA card whose pinned path runs and whose host holds the host tier,
    whatever this machine is (a plan for a card: engine.api.plan)."""
    gpu = card or (device_kind or backend.kind()) == "gpu"

    def pinned_unavailable():
        return None if card else backend.pinned_unavailable()

    def tier_fits():
        return card or hosttier.fits(host_tier_bytes)

    if asked not in CHOICES:
        raise ValueError(f"no install {asked!r} (one of {', '.join(CHOICES)})")
    tier = f"its host tier ({host_tier_bytes / 1e9:.2f} GB) does not fit in this machine's available memory"
    if asked == "auto":
        if not gpu:
            return InplaceInstall
        why = pinned_unavailable()
        if why:
            backend.say(f"install auto: copy, since the pinned path cannot run: {why}")
            return CopyInstall
        if full or not device_ok:
            return PinnedInstall
        if not tier_fits():
            backend.say(f"install auto: pinned, not device: {tier}")
            return PinnedInstall
        return DeviceInstall
    if asked == "device":
        if not device_ok:
            raise ValueError("--install device: this path needs a host install (inplace, copy or pinned)")
        if not tier_fits():
            raise ValueError(f"--install device cannot run here: {tier}")
        return DeviceInstall
    if asked == "inplace" and gpu:
        # A host view of a slot table moves it to managed memory for good (engine.device): reader
        # threads would then write into pages the device is reading. The suite's one unexplained
        # device fault of 2026-12-04 was on this path (docs/gpu.md).
        backend.say("install inplace takes host views of the slot tables, which a GPU cannot share; using pinned")
        return choose("pinned", host_tier_bytes, full, device_ok, device_kind, card)
    if asked == "pinned":
        if not gpu:
            backend.say("install pinned needs MLX's CUDA backend (MLX computes on the CPU here); using inplace")
            return InplaceInstall
        why = pinned_unavailable()
        if why:
            backend.say(f"install pinned cannot run: {why}; using copy")
            return CopyInstall
    return INSTALLS[asked]
