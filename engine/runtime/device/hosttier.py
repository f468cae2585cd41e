"""The host tier: every MoE layer's expert records in host memory, filled once from the expert store.

The `device` install keeps each layer's misses off the host: a kernel driven by the router's
indices on the GPU reads them from here (engine.runtime.device). On a CUDA GPU the records are
page-aligned host memory registered once as mapped pinned memory (`cudaHostRegister`), which a
kernel reads across PCIe at about a pinned `cudaMemcpy`'s speed; elsewhere (the CPU, CI) they are
an evaluated MLX array read by MLX ops, so that the same bookkeeping runs and is tested there.

One row per (layer, expert), `record_bytes` each, in the store's own record layout, so a row is
filled by one `preadv` and the store's CRC-32 checks it on the way in.
"""

import os
import sys
import time
import weakref

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ... import device
from ...device import device_indices
from ..slots import aligned_zeros, host_view
from ..store import aligned_empty


class HostTierError(RuntimeError):
    """The host tier cannot be made here (it does not fit in host memory, CUDA refused it, ...)."""


def available_bytes() -> int | None:
    """Host memory that can be had without swapping: Linux's MemAvailable, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def fits(nbytes: int, margin: float = 0.8) -> bool:
    """Whether `nbytes` of host tier leave a fifth of the available memory to everything else."""
    avail = available_bytes()
    return avail is None or nbytes <= margin * avail


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


class HostTier:
    """All experts of `store` in host memory: `rows` (a NumPy view, one row per (layer, expert)),
    and, on a CUDA GPU, `device_ptr`/`base` (the rows' device address as a one-element uint64
    array), else `array` (the rows as an MLX uint8 array)."""

    def __init__(self, store, cuda: bool, progress: bool = True):
        self.store = store
        self.layers = store.num_layers
        self.experts = [store.num_experts(layer) for layer in range(self.layers)]
        if len(set(self.experts)) != 1:
            raise HostTierError(f"{store.path}: layers with different expert counts are not supported by the host tier")
        self.num_experts = self.experts[0]
        self.record_bytes = store.record_bytes
        self.nbytes = self.layers * self.num_experts * self.record_bytes
        avail = available_bytes()
        if not fits(self.nbytes):
            raise HostTierError(
                f"the host tier of {store.model} needs {_gb(self.nbytes)} of host memory ({self.layers} MoE layers x "
                f"{self.num_experts} experts x {store.record_bytes} bytes), and this machine has {_gb(avail)} "
                "available: use another install (--install pinned reads misses from the store instead)"
            )
        self.cuda = cuda
        self.device_ptr = None
        self.users = 0  # engines reading it (acquire/release)
        if cuda:
            self.rows = aligned_empty(self.nbytes).reshape(-1, self.record_bytes)
            self.array = None
        else:
            self.array = aligned_zeros((self.layers * self.num_experts, self.record_bytes), mx.uint8)
            self.rows = host_view(self.array)
        self.fill_seconds = self._fill(progress)
        if cuda:
            rt = device.cuda_runtime()
            t0 = time.perf_counter()
            self.registration = device.Registration(self.rows, rt)
            self.device_ptr = self.registration.device_ptr
            self.register_seconds = time.perf_counter() - t0
            self.base = device_indices([self.device_ptr], np.uint64)  # the rows' address, for the kernels
            mx.eval(self.base)

    def row(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def _fill(self, progress: bool) -> float:
        """Read every record from the store (its reader threads, its CRC check on first read), with
        tqdm's progress bar (mlx-lm's own dependency, through transformers) for a large model."""
        t0 = time.perf_counter()
        store = self.store
        show = progress and sys.stderr.isatty() and self.nbytes > 1 << 30
        bar = tqdm(total=self.nbytes, unit="B", unit_scale=True, desc="[titan] host tier", disable=not show)
        with bar:
            for layer in range(self.layers):
                reads = [(e, [self.rows[self.row(layer, e), : store.expert_bytes]]) for e in range(self.num_experts)]
                for f in store.submit_many(layer, reads):
                    f.result()
                bar.update(self.num_experts * self.record_bytes)
        return time.perf_counter() - t0

    def close(self):
        if self.device_ptr is not None:
            self.registration.release()
            self.device_ptr = None


# (store folder, cuda) -> HostTier. Weak: a tier whose engines were dropped without close() goes
# with the last of them (its registration's finalizer unregisters its memory first).
_SHARED = weakref.WeakValueDictionary()


def acquire(store, cuda: bool) -> HostTier:
    """The host tier of `store`'s folder, shared by every engine of this process that decodes the
    same store (a bench loads several): filled and registered once, freed with its last user."""
    key = (str(store.path.resolve()), cuda)
    tier = _SHARED.get(key)
    if tier is None:
        tier = _SHARED[key] = HostTier(store, cuda)
    tier.users += 1
    return tier


def release(tier: HostTier):
    tier.users -= 1
    if tier.users <= 0:
        for key, other in list(_SHARED.items()):
            if other is tier:
                del _SHARED[key]
        tier.close()
