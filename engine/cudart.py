"""The few CUDA runtime calls the engine makes itself, through `ctypes` (MLX's Python API has no
way to pin host memory): registering host memory as mapped pinned memory, device allocations and
copies for the benches' floors. `libcudart.so.13` ships in the `nvidia-cuda-runtime` wheel that
`mlx-cuda-13` depends on. Below `engine.device`, which asks it whether CUDA is there at all."""

import ctypes
import ctypes.util
import os
import sys
import weakref
from pathlib import Path

import mlx.core as mx

HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 0x01, 0x02
MEMCPY_HOST_TO_DEVICE = 1


class CudaError(RuntimeError):
    """A CUDA path cannot run here (no CUDA runtime, a failed registration, ...)."""


def _candidates():
    """Where libcudart may be: already loaded by MLX's CUDA backend (found by its soname), the
    `nvidia-cuda-runtime` wheel's folder, then the system's loader path."""
    yield "libcudart.so.13"
    for root in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib"):
            p = Path(root) / sub / "libcudart.so.13"
            if p.exists():
                yield str(p)
    found = ctypes.util.find_library("cudart")
    if found:
        yield found


class CudaRuntime:
    """The few CUDA runtime calls the pinned path needs."""

    def __init__(self, path=None):
        errors = []
        for cand in [path] if path else _candidates():
            try:
                self.lib = ctypes.CDLL(cand)
                self.path = cand
                break
            except OSError as e:
                errors.append(f"{cand}: {e}")
        else:
            raise CudaError("no CUDA runtime library (libcudart.so.13) found: " + "; ".join(errors))
        L = self.lib
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in (
            ("cudaHostRegister", [vp, sz, ctypes.c_uint]),
            ("cudaHostUnregister", [vp]),
            ("cudaHostGetDevicePointer", [ctypes.POINTER(vp), vp, ctypes.c_uint]),
            ("cudaMalloc", [ctypes.POINTER(vp), sz]),
            ("cudaFree", [vp]),
            ("cudaMemcpy", [vp, vp, sz, ctypes.c_int]),
            ("cudaDeviceSynchronize", []),
            ("cudaGetErrorString", [ctypes.c_int]),
        ):
            fn = getattr(L, name)
            fn.argtypes = args
            fn.restype = ctypes.c_char_p if name == "cudaGetErrorString" else ctypes.c_int

    def check(self, code: int, what: str):
        if code != 0:
            raise CudaError(f"{what} failed: CUDA error {code} ({self.lib.cudaGetErrorString(code).decode()})")

    def host_register(self, ptr: int, nbytes: int) -> int:
        """Pin and map `nbytes` of host memory at `ptr`; returns its device address."""
        self.check(
            self.lib.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED),
            f"cudaHostRegister of {nbytes} bytes",
        )
        dev = ctypes.c_void_p()
        self.check(self.lib.cudaHostGetDevicePointer(ctypes.byref(dev), ptr, 0), "cudaHostGetDevicePointer")
        return dev.value

    def host_unregister(self, ptr: int):
        self.lib.cudaHostUnregister(ptr)

    def malloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self.check(self.lib.cudaMalloc(ctypes.byref(p), nbytes), f"cudaMalloc of {nbytes} bytes")
        return p.value

    def free(self, ptr: int):
        self.lib.cudaFree(ptr)

    def memcpy_h2d(self, dst: int, src: int, nbytes: int):
        self.check(self.lib.cudaMemcpy(dst, src, nbytes, MEMCPY_HOST_TO_DEVICE), "cudaMemcpy")

    def synchronize(self):
        self.check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


class Registration:
    """A NumPy array's memory registered as mapped pinned memory (`device_ptr`, the address the
    device reads it at) until `release()` or until the registration itself is collected.

    The registration holds the array, so its pages cannot go back to the allocator while they are
    registered. (On the H200, an engine dropped without close() left its range registered over
    memory NumPy had freed; a later host allocation that straddled it made MLX's own
    host-to-device copies fail with "invalid argument".) Work still queued on the device may read
    the memory through `device_ptr`, so the release waits for it first."""

    def __init__(self, host, rt: "CudaRuntime | None" = None):
        rt = rt or runtime()
        self.device_ptr = rt.host_register(host.ctypes.data, host.nbytes)
        self._release = weakref.finalize(self, _unregister, rt, host)
        self._release.atexit = False  # at exit the process's registrations end with it

    @property
    def registered(self) -> bool:
        return self._release.alive

    def release(self):
        self._release()


def _unregister(rt: "CudaRuntime", host):
    # MLX's queued work first (mx.synchronize commits this thread's stream), then every stream's,
    # a prefetch stream's included: a collection may run this in any thread.
    mx.synchronize()
    rt.synchronize()
    rt.host_unregister(host.ctypes.data)


_RUNTIME = None


def runtime() -> CudaRuntime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = CudaRuntime(os.environ.get("TITAN_CUDART"))
    return _RUNTIME


def unavailable_reason() -> str | None:
    """Why the engine's own CUDA kernels (the pinned and device installs) cannot run in this
    process, or None when they can."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "MLX computes on the CPU here (no GPU backend)"
    if not mx.cuda.is_available():
        return (
            "MLX's GPU here is not CUDA (on Apple Silicon the paper's copy path stays: unified memory "
            "needs no staging, and whether pinning would help there is not measurable on these machines)"
        )
    if not hasattr(mx.fast, "cuda_kernel"):
        return f"mlx {mx.__version__} has no mx.fast.cuda_kernel"
    try:
        runtime()
    except CudaError as e:
        return str(e)
    return None
