"""What differs between MLX's CPU and CUDA backends, in one place, and the one way to the CUDA
runtime (engine.cudart, which nothing else imports).

On the CPU an evaluated array's memory is plain host memory: a `preadv` can land in a slot
through a NumPy view (`inplace`), the cheapest install. On an NVIDIA GPU (MLX 0.32's CUDA
backend) an array computed on the device lives in device memory, and any host view of it
(the buffer protocol, `np.array(a)`) first moves the whole buffer to CUDA managed memory for
good; the kernels then read the slot table from managed memory, and every host write into a
slot migrates its pages back and forth by page faults. So on the GPU the engine never takes a
host view of a slot table: it installs through pinned staging records and a copy kernel
(`pinned`, engine.staging), keeps every expert in pinned host memory for the `device` install,
or, where neither can run, installs by `copy` (a NumPy record, `mx.array`, `buffer[slot] =
array` on the device). Which install runs is chosen once, by engine.runtime.installs.choose.
"""

import sys

import mlx.core as mx
import numpy as np

from . import cudart

CudaError = cudart.CudaError  # a CUDA path cannot run here
Registration = cudart.Registration  # host memory registered as mapped pinned memory (staging, the host tier)

_SAID = set()


def kind() -> str:
    """'gpu' or 'cpu': the device MLX computes on by default."""
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def pinned_unavailable() -> str | None:
    """Why the engine's own CUDA kernels (the pinned and device installs) cannot run here (None:
    they can)."""
    return cudart.unavailable_reason()


def cuda_runtime() -> cudart.CudaRuntime:
    """The few CUDA runtime calls the engine makes itself (registration, the benches' floors)."""
    return cudart.runtime()


def one_array(device_kind: str | None = None) -> bool:
    """Whether copy mode makes a batch's arrays as one MLX array (installs.records_to_mx says why)."""
    return (device_kind or kind()) == "gpu"


def say(msg: str):
    """A note on stderr, once a process (a fallback the user should know of)."""
    if msg not in _SAID:
        _SAID.add(msg)
        print(f"[titan] {msg}", file=sys.stderr, flush=True)


SMALL_POOL_BYTES = 8  # MLX's CUDA allocator serves an allocation this size or smaller from its small pool
INDEX_BLOCK_BYTES = 16  # the least a host-made index array the device reads is given


def index_block(values, dtype=np.uint32) -> np.ndarray:
    """`values` flat, as `dtype`, in a host array of at least INDEX_BLOCK_BYTES (zeros after them)."""
    a = np.ascontiguousarray(values, dtype).reshape(-1)
    if a.nbytes > SMALL_POOL_BYTES:
        return a
    block = np.zeros(INDEX_BLOCK_BYTES // a.itemsize, dtype)
    block[: a.size] = a
    return block


def device_indices(values, dtype=np.uint32) -> mx.array:
    """Indices, addresses or masks made on the host for the device to read (a layer's slots, a
    batch's staging records, a step's tokens, a staging area's address, a prefill's row mask) as
    an MLX array of `dtype` and `values`' shape.

    Never in MLX's CUDA small pool, which serves every allocation of 8 bytes or fewer: on the
    H200 (mlx 0.32.4), after tests that cleared MLX's cache (`mx.clear_cache`, which mlx-lm's
    generate_step calls) on several streams, decoding with slot indices of 8 uint8s ended in an
    illegal memory access (4 processes of 4); with the indices as uint32 (32 bytes) the same
    order passed, as it did without the cache clearing, with one stream or with blocking
    launches, and more synchronisation did not help (docs/gpu.md). A smaller array is a view of
    a 16-byte block, so that its buffer is never the pool's either."""
    a = np.ascontiguousarray(values, dtype)
    block = index_block(a, dtype)
    if block.size == a.size:
        return mx.array(a)  # in its shape: no reshape on the decode path
    return mx.array(block)[: a.size].reshape(a.shape)
