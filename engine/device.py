"""What differs between MLX's CPU and CUDA backends, in one place.

On the CPU an evaluated array's memory is plain host memory: a `preadv` can land in a slot
through a NumPy view (`inplace`), the cheapest install. On an NVIDIA GPU (MLX 0.32's CUDA
backend) an array computed on the device lives in device memory, and any host view of it
(the buffer protocol, `np.array(a)`) first moves the whole buffer to CUDA managed memory for
good; the kernels then read the slot table from managed memory, and every host write into a
slot migrates its pages back and forth by page faults. So on the GPU the engine never takes a
host view of a slot table: it installs through pinned staging records and a copy kernel
(`pinned`, engine.staging), or, where that cannot run, by `copy` (a NumPy record, `mx.array`,
`buffer[slot] = array` on the device). `bench install` and `bench miss` measure them.
"""

import sys

import mlx.core as mx

from . import cudart

_SAID = set()


def kind() -> str:
    """'gpu' or 'cpu': the device MLX computes on by default."""
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def rows_alike(device_kind: str | None = None) -> bool:
    """Whether MLX computes each (row, expert) pair of `gather_qmm` alike whatever else the call
    holds, so that a prefill may hand it fewer pairs than mlx-lm does and stay bit-exact
    (moe.prefill_calls). On the CPU it does (tests/test_exactness.py pins it). On CUDA the kernel
    depends on the call's number of pairs (`GatherQMM::eval_gpu`: a vector kernel below eight, a
    tiled one from eight), and on Metal on pairs per expert of the weight stack; there the engine
    keeps mlx-lm's shapes."""
    return (device_kind or kind()) == "cpu"


def pinned_unavailable() -> str | None:
    """Why the pinned install path cannot run here (None: it can)."""
    return cudart.unavailable_reason()


def default_install(device_kind: str | None = None) -> str:
    """The install mode `auto` resolves to on this device: on a CUDA GPU the `device` install
    (engine.runtime.devicemap: no host synchronisation inside a token), which the engine swaps for
    `pinned` where its host tier does not fit (runtime.engine.Engine)."""
    if (device_kind or kind()) != "gpu":
        return "inplace"
    return "copy" if pinned_unavailable() else "device"


def one_array(device_kind: str | None = None) -> bool:
    """Whether copy mode makes a batch's arrays as one MLX array (installs.records_to_mx says why)."""
    return (device_kind or kind()) == "gpu"


def _say(msg: str):
    if msg not in _SAID:
        _SAID.add(msg)
        print(f"[titan] {msg}", file=sys.stderr, flush=True)


def resolve_install(mode: str, device_kind: str | None = None) -> str:
    """The install mode that runs: `auto` per device; `pinned` where it cannot run says why and
    falls back to what `auto` would pick without it; `inplace` on a GPU says why and is `pinned`
    (or what `pinned` falls back to), as `pinned` on the CPU is `inplace`."""
    if mode == "auto":
        chosen = default_install(device_kind)
        if (device_kind or kind()) == "gpu" and chosen == "copy":
            _say(f"install auto: copy, since the pinned path cannot run: {pinned_unavailable()}")
        return chosen
    if mode == "device":
        return mode  # the same bookkeeping runs as MLX operations where the kernels cannot
    if mode == "inplace" and (device_kind or kind()) == "gpu":
        # A host view of a slot table moves it to managed memory for good (module docstring): reader
        # threads would then write into pages the device is reading. The suite's one unexplained
        # device fault of 2026-12-04 was on this path (docs/gpu.md).
        _say("install inplace takes host views of the slot tables, which a GPU cannot share; using pinned")
        return resolve_install("pinned", device_kind)
    if mode == "pinned":
        if (device_kind or kind()) != "gpu":
            _say("install pinned needs MLX's CUDA backend (MLX computes on the CPU here); using inplace")
            return "inplace"
        why = pinned_unavailable()
        if why:
            _say(f"install pinned cannot run: {why}; using copy")
            return "copy"
    return mode
