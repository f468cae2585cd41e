"""The bus a miss crosses, measured in the run that reads its bytes: the benches that state a
bus-bound limit (`bench families`, `bench batch`) divide the bytes a token or step reads by it."""

import os
import statistics
import time

import mlx.core as mx

from engine import EngineConfig, device
from engine.runtime.engine import build_cache
from engine.runtime.store import aligned_empty

BUS_BYTES = 256 << 20  # what one bandwidth sample moves


def bus_gb_s(store) -> dict:
    """The bandwidth a miss crosses, measured now: on a CUDA GPU a `cudaMemcpy` from pinned host
    memory to the device; on the CPU a `preadv` of a store file from the page cache into memory
    (where the CPU's installs read). Median GB/s of 7 samples of up to 256 MiB."""
    layer = store.path / store.layers[0]["file"]
    n = min(BUS_BYTES, os.path.getsize(layer) // 4096 * 4096)
    buf = aligned_empty(n)
    samples = []
    if device.pinned_unavailable() is None:
        rt = device.cuda_runtime()
        reg = device.Registration(buf, rt)
        dev = rt.malloc(n)
        try:
            for _ in range(8):
                t0 = time.perf_counter()
                rt.memcpy_h2d(dev, buf.ctypes.data, n)
                rt.synchronize()
                samples.append(time.perf_counter() - t0)
        finally:
            rt.free(dev)
            reg.release()
        how = "cudaMemcpy from pinned host memory"
    else:
        fd = os.open(layer, os.O_RDONLY)
        try:
            for _ in range(8):
                t0 = time.perf_counter()
                os.preadv(fd, [buf], 0)
                samples.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
        how = "preadv of a store file from the page cache"
    samples = samples[1:]  # the first touches the pages
    return dict(gb_s=n / statistics.median(samples) / 1e9, bytes=n, samples=len(samples), how=how)


def tier_gb_s(store, layers: int = 8) -> dict | None:
    """The rate at which the `device` install reads its own host tier, where it reads it with a
    kernel (a CUDA GPU: mapped host memory across PCIe, the path of its misses), beside the bus's
    `cudaMemcpy` above: the many-rows area of every expert of up to `layers` layers spread over the
    tier (a tier of many GB may lie on more than one NUMA node), each copied and timed alone after
    one untimed (the kernel's compilation). Median GB/s; None where the install has no kernel
    (the CPU's operations gather by view: nothing is copied there to time); `gb_s` None, and why,
    where the host tier cannot be made."""
    if device.pinned_unavailable() is not None:
        return None
    try:  # one slot a layer, nothing in it: every expert of an area comes from the host tier
        cache = build_cache(store, 1, EngineConfig(install="device"), device_ok=True)
    except (ValueError, RuntimeError) as e:  # its host tier does not fit, or CUDA refused it
        return dict(gb_s=None, how=f"not measured: {e}")
    try:
        if cache.mode != "kernel":
            return None
        n = store.num_layers
        picks = sorted({round(i * (n - 1) / max(1, layers - 1)) for i in range(min(layers, n))})
        nbytes = cache.num_experts * sum(t.nbytes for t in cache.tensors)
        mx.eval(cache.area(picks[0], None))
        samples = []
        for layer in picks:
            t0 = time.perf_counter()
            area = cache.area(layer, None)
            mx.eval(area)
            samples.append(time.perf_counter() - t0)
            del area
    finally:
        cache.close()
    return dict(gb_s=nbytes / statistics.median(samples) / 1e9, bytes=nbytes, layers=picks,
                how="the device install's area kernel reading its mapped host tier")  # fmt: skip
