"""What differs between MLX's CPU and CUDA backends, in one place.

On the CPU an evaluated array's memory is plain host memory: a `preadv` can land in a slot
through a NumPy view (`inplace`), the cheapest install. On an NVIDIA GPU (MLX 0.32's CUDA
backend) an array computed on the device lives in device memory, and any host view of it
(the buffer protocol, `np.array(a)`) first moves the whole buffer to CUDA managed memory for
good; the kernels then read the slot table from managed memory, and every host write into a
slot migrates its pages back and forth by page faults. So on the GPU the engine installs by
`copy` (a NumPy record, `mx.array`, `buffer[slot] = array` on the device) and never takes a
host view of a slot table. `bench install` measures both on either backend.
"""

import mlx.core as mx


def kind() -> str:
    """'gpu' or 'cpu': the device MLX computes on by default."""
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def default_install(device_kind: str | None = None) -> str:
    """The install mode `auto` resolves to on this device."""
    return "copy" if (device_kind or kind()) == "gpu" else "inplace"


def one_array(device_kind: str | None = None) -> bool:
    """Whether copy mode makes a batch's arrays as one MLX array (moe.records_to_mx says why)."""
    return (device_kind or kind()) == "gpu"


def resolve_install(mode: str, device_kind: str | None = None) -> str:
    if mode == "auto":
        return default_install(device_kind)
    return mode
