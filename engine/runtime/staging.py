"""Pinned staging: how a miss reaches a GPU's slot table at about the cost of a pinned `cudaMemcpy`.

MLX 0.32's CUDA backend puts an array made from host memory (`mx.array(numpy)`) in CUDA managed
memory: the host's first touch of its pages faults them in and the device's first read migrates
them by page faults, about 3.4x the cost of a `preadv` into pinned memory plus one `cudaMemcpy`
(`bench miss`). The `pinned` install mode goes around that:

1. a pool of page-aligned host records, registered once with the CUDA runtime as mapped pinned
   memory (`cudaHostRegister`, through `ctypes`: `libcudart.so.13` ships with the
   `nvidia-cuda-runtime` wheel that `mlx-cuda-13` depends on);
2. reader threads `preadv` expert records straight into them;
3. one copy kernel (`mx.fast.cuda_kernel`) per batch of up to eight records reads them across
   PCIe and writes each expert tensor, stacked over the batch, into fresh device arrays;
4. each slot buffer then takes the batch with one scatter (`buffer[slots] = stacked`), not one
   write per expert and tensor.

MLX is lazy and its streams are asynchronous, so the kernel that reads a record runs some time
after the engine enqueued it. A record may be written again only once that kernel has run: each
batch leaves a *fence* (an output of its kernel) on its records, and `StagingPool.acquire` waits
on a record's fence before handing the record out again (`mx.eval` of an array that is already
scheduled only waits for it; one that is complete costs nothing).

On a machine without MLX's CUDA backend the same pool runs over `HostMemory`, whose records are
rows of an evaluated MLX array and whose "kernel" is a lazy gather from it: reads then happen at
evaluation time exactly as on the GPU, so the pool's bookkeeping and the engine's batched
installs are tested on the CPU (tests/test_staging.py). It is not a user-facing install mode on
the CPU, where `inplace` is cheaper (`installs.choose`).
"""

import functools
import hashlib
from collections import deque

import mlx.core as mx
import numpy as np

from .. import device
from ..device import device_indices
from .slots import aligned_zeros
from .store import PAGE, aligned_empty

BATCH = 8  # records per copy kernel


# -- the copy kernel ---------------------------------------------------------------------------------
CTYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def grain(offset: int, nbytes: int, record_bytes: int) -> int:
    """The widest load (bytes) that tiles a tensor at `offset` in every record."""
    return next(g for g in (16, 8, 4, 2, 1) if offset % g == 0 and nbytes % g == 0 and record_bytes % g == 0)


GRID_STRIDE = [
    "const size_t step = (size_t)gridDim.x * blockDim.x;",
    "const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;",
]


def record_loops(tensors, record_bytes: int, count: str, record: str, dest) -> list:
    """One grid-stride loop per tensor, copying tensor i of records at `area` (a device address):
    for each row r < `count` (a C expression), record number `record` (a C expression of r) to
    `dest(i, ctype, words)` (a C pointer expression of r), at the widest load that tiles it."""
    lines = []
    for i, t in enumerate(tensors):
        g = grain(t.offset, t.nbytes, record_bytes)
        ct, w = CTYPES[g], t.nbytes // g
        src = f"(const {ct}*)(area + (unsigned long long){record} * {record_bytes}ULL + {t.offset}ULL)"
        lines.append(
            f"for (size_t i = first; i < (size_t){count} * {w}; i += step) {{ const size_t r = i / {w}; "
            f"const size_t k = i - r * {w}; const {ct}* src = {src}; {ct}* dst = {dest(i, ct, w)}; dst[k] = src[k]; }}"
        )
    return lines


def kernel_source(tensors, record_bytes: int) -> str:
    """One grid-stride loop per tensor: output `o{i}` (n, *shape) row r is tensor i of record recs[r]
    of the staging area at device address base[0]."""
    head = ["const unsigned long long area = base[0];", *GRID_STRIDE, "const size_t n = recs_shape[0];"]
    return "\n".join(
        head + record_loops(tensors, record_bytes, "n", "recs[r]", lambda i, ct, w: f"(({ct}*)o{i}) + r * {w}")
    )


@functools.cache
def cuda_kernel(name: str, inputs: tuple, outputs: tuple, source: str, header: str = ""):
    """One `mx.fast.cuda_kernel` per body, header and signature, named by their digest (MLX compiles
    it at its first launch). Cached: a decode step asks for its kernels at every layer."""
    digest = hashlib.sha256("\0".join([header, source, *inputs, "|", *outputs]).encode()).hexdigest()[:16]
    return mx.fast.cuda_kernel(
        name=f"titan_{name}_{digest}", input_names=list(inputs), output_names=list(outputs), source=source,
        header=header,
    )  # fmt: skip


def copy_kernel(tensors, record_bytes: int):
    n = len(tensors)
    return cuda_kernel(
        "stage", ("base", "recs"), tuple(f"o{i}" for i in range(n)) + ("fence",), kernel_source(tensors, record_bytes)
    )


def _dtype(name):
    return getattr(mx, name)


# -- the memory behind a pool ------------------------------------------------------------------------
class CudaMemory:
    """Page-aligned host records registered with the CUDA runtime as mapped pinned memory."""

    kind = "cuda"

    def __init__(self, records: int, record_bytes: int, tensors):
        self.rt = device.cuda_runtime()
        self.record_bytes, self.tensors = record_bytes, list(tensors)
        self.host = aligned_empty(records * record_bytes).reshape(records, record_bytes)
        self.registration = device.Registration(self.host, self.rt)
        self.device_ptr = self.registration.device_ptr
        self.base = device_indices([self.device_ptr], np.uint64)  # the area's address, for the kernel
        mx.eval(self.base)
        self.kernel = copy_kernel(self.tensors, record_bytes)

    def row(self, rec: int) -> np.ndarray:
        return self.host[rec]

    def copy(self, recs):
        n = len(recs)
        widths = [t.nbytes // grain(t.offset, t.nbytes, self.record_bytes) for t in self.tensors]
        threads = min(n * max(widths), 132 * 2048)
        outs = self.kernel(
            inputs=[self.base, device_indices(recs)],
            output_shapes=[(n, *t.shape) for t in self.tensors] + [(1,)],
            output_dtypes=[_dtype(t.dtype) for t in self.tensors] + [mx.uint32],
            grid=(max(threads, 1), 1, 1),
            threadgroup=(256, 1, 1),
        )
        return outs[:-1], outs[-1]

    def close(self):
        self.registration.release()


class HostMemory:
    """The same records as rows of an evaluated MLX array, read by a lazy gather: the pinned
    path's stand-in where there is no CUDA (the CPU tests). Host writes go through a writable
    view of the MLX buffer, so, as on the GPU, what the "kernel" reads is what the records hold
    when the graph is evaluated, not when it was built."""

    kind = "host"

    def __init__(self, records: int, record_bytes: int, tensors):

        self.record_bytes, self.tensors = record_bytes, list(tensors)
        self.area = aligned_zeros((records, record_bytes), mx.uint8)
        self.host = np.frombuffer(memoryview(self.area).cast("B"), np.uint8).reshape(records, record_bytes)

    def row(self, rec: int) -> np.ndarray:
        return self.host[rec]

    def copy(self, recs):
        n = len(recs)
        rows = self.area[mx.array(np.asarray(recs, np.uint32))]
        outs = [
            rows[:, t.offset : t.offset + t.nbytes].view(_dtype(t.dtype)).reshape(n, *t.shape) for t in self.tensors
        ]
        return outs, rows[:1, :1]

    def close(self):
        pass


def make_memory(records: int, record_bytes: int, tensors):
    """The memory behind the engine's staging pool: pinned and mapped on a CUDA GPU. (The CPU
    tests swap in HostMemory here.)"""
    return CudaMemory(records, record_bytes, tensors)


# -- the pool ----------------------------------------------------------------------------------------
class StagingPool:
    """A fixed set of staging records and what may still read or write each of them.

    A record is free, held (acquired: a reader thread may be writing it), fenced (a copy kernel
    reads it; free once the fence has run) or abandoned (a read nobody will install is still
    writing it; free once its future is done).
    """

    def __init__(self, records: int, record_bytes: int, tensors, memory=None):
        if not BATCH <= records <= 256:
            raise ValueError(f"staging records must be between {BATCH} and 256, not {records}")
        if record_bytes % PAGE:
            raise ValueError(f"record_bytes ({record_bytes}) must be a multiple of {PAGE}")
        self.records = records
        self.window = max(BATCH, records // 2)  # demand reads in flight at once; prefetches leave it free
        self.memory = memory or CudaMemory(records, record_bytes, tensors)
        self._free = deque(range(records))
        self._fenced = deque()  # (fence, [records]) in the order their kernels were enqueued
        self._abandoned = []  # (future, record)
        self.held = set()
        self.waits = 0  # fences waited on while they were not known to be complete

    def view(self, rec: int) -> np.ndarray:
        if rec not in self.held:
            raise RuntimeError(f"staging record {rec} is not held: it must be acquired before it is written")
        return self.memory.row(rec)

    def _reclaim_abandoned(self):
        still = []
        for fut, rec in self._abandoned:
            if fut.done():
                self._free.append(rec)
            else:
                still.append((fut, rec))
        self._abandoned = still

    def available(self) -> int:
        """Records that could be handed out now or after waiting on fences (not held, not abandoned)."""
        return len(self._free) + sum(len(r) for _, r in self._fenced)

    def acquire(self, n: int, wait: bool = True):
        """`n` records no kernel will read any more, held for the caller. Without `wait`, None
        when that would mean waiting on a fence; with it, the oldest fences are waited on."""
        if n > self.records:
            raise ValueError(f"{n} staging records asked for, the pool has {self.records}")
        self._reclaim_abandoned()
        while len(self._free) < n and self._fenced:
            if not wait:
                return None
            fence, recs = self._fenced.popleft()
            mx.eval(fence)  # returns at once if the kernel already ran; otherwise waits for it
            self.waits += 1
            self._free.extend(recs)
        if len(self._free) < n:
            if not wait:
                return None
            raise RuntimeError(
                f"staging pool exhausted: {n} records asked for, {len(self._free)} free, "
                f"{len(self.held)} held, {len(self._abandoned)} still being read"
            )
        recs = [self._free.popleft() for _ in range(n)]
        self.held.update(recs)
        return recs

    def copy(self, recs):
        """Enqueue the copy kernel over held records; they are fenced by it and no longer held.
        Returns one stacked device array per expert tensor, rows in `recs` order."""
        arrays, fence = self.memory.copy(recs)
        self.held.difference_update(recs)
        self._fenced.append((fence, list(recs)))
        return arrays

    def discard(self, recs):
        """Held records that nothing will read (a failed read): free at once."""
        for r in recs:
            self.held.discard(r)
            self._free.append(r)

    def abandon(self, rec: int, future):
        """A held record whose read is still running but will never be installed."""
        self.held.discard(rec)
        self._abandoned.append((future, rec))

    def close(self):
        for fut, _ in self._abandoned:
            fut.cancel() or fut.exception()
        for fence, _ in self._fenced:
            mx.eval(fence)
        self._fenced.clear()
        self.memory.close()
