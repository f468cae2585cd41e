"""The engine's CUDA kernels, checked where there is no GPU: each is called through a stand-in for
`mx.fast.cuda_kernel` that writes the full source MLX would compile (its generated signature: the
inputs as const pointers of their dtypes, `NAME_shape` where the body uses it, the outputs, the
template constants) and has the host's C++ compiler check it, with CUDA's few names stubbed. What
a kernel computes is checked on a GPU (tests/test_devicemap.py, tests/test_staging.py); here, that
every kernel the engine can launch is well-formed C++ with the arguments the engine gives it."""

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from engine.runtime import devicemap, staging
from engine.runtime.devicemap import Fill, MapState
from engine.runtime.store import TensorSpec

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++ or clang++)")

CUDA_TYPES = {mx.int32: "int32_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t", mx.uint8: "uint8_t",
              mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}  # fmt: skip

PRELUDE = """
#include <array>
#include <cstddef>
#include <cstdint>
#define __global__
#define __grid_constant__
#define __shared__ static
inline void __syncwarp(unsigned = 0xffffffffu) {}
template <class T> T __shfl_xor_sync(unsigned, T v, int) { return v; }
struct dim3 { unsigned x, y, z; };
static dim3 blockIdx, threadIdx, blockDim, gridDim;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct __half { unsigned short v; };
struct __nv_bfloat16 { unsigned short v; };
using Shape = std::array<int32_t, 10>;
"""


def full_source(name, input_names, inputs, output_names, output_dtypes, template, body) -> str:
    """What MLX 0.32's `build_kernel` (mlx/backend/cuda/custom_kernel.cpp) wraps a body in."""
    params = []
    for n, a in zip(input_names, inputs):
        params.append(f"const {CUDA_TYPES[a.dtype]}* {n}")
        if a.ndim > 0 and f"{n}_shape" in body:
            params.append(f"const __grid_constant__ Shape {n}_shape")
    params += [f"{CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    consts = "".join(
        f"  constexpr bool {k} = {str(v).lower()};\n" if isinstance(v, bool) else f"  constexpr int {k} = {v};\n"
        for k, v in template or []
    )
    return f"{PRELUDE}\n__global__ void {name}(\n    " + ",\n    ".join(params) + f") {{\n{consts}\n{body}\n}}\n"


class FakeKernels:
    """Stands in for mx.fast.cuda_kernel: records every launch's full source, returns zeros."""

    def __init__(self):
        self.sources = {}

    def __call__(self, name, input_names, output_names, source, **kw):
        def launch(inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, stream=None, **kw2):
            assert len(inputs) == len(input_names) and len(output_shapes) == len(output_names) == len(output_dtypes)
            assert all(isinstance(a, mx.array) for a in inputs)
            assert all(g >= 1 for g in grid) and all(t >= 1 for t in threadgroup)
            text = full_source(name, input_names, inputs, output_names, output_dtypes, template, source)
            self.sources[(name, tuple(str(d) for d in output_dtypes), str(template))] = text
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch


def compiles(text: str, tmp_path) -> subprocess.CompletedProcess:
    f = tmp_path / "k.cpp"
    f.write_text(text)
    return subprocess.run([CXX, "-fsyntax-only", "-std=c++17", "-Wno-unused", str(f)], capture_output=True, text=True)


def test_every_kernel_the_device_install_launches_is_well_formed(tmp_path, monkeypatch):
    fake = FakeKernels()
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake, raising=False)
    staging.cuda_kernel.cache_clear()  # kernels made through the stand-in must not outlive this test
    E, S = 64, 16
    state = MapState.empty(E, S)
    devicemap.map_step_kernel(state, mx.array([3, 9, 40, 63, 1, 2, 5, 7], mx.int32), S)
    for protect in (False, True):
        devicemap.prefetch_step_kernel(state, mx.array([3, -1, 40], mx.int32), S, protect)
    tensors = [
        TensorSpec("gate_proj.weight", (128, 32), "uint32", 0, 16384),
        TensorSpec("gate_proj.scales", (128, 4), "float16", 16384, 1024),
        TensorSpec("gate_proj.biases", (128, 4), "bfloat16", 17408, 1024),
        TensorSpec("odd", (3,), "float32", 18432, 12),
    ]
    tier = type("Tier", (), dict(base=mx.array([0], mx.uint64), record_bytes=20480, num_experts=E))()
    fill = Fill(mx.zeros((8,), mx.uint32), mx.zeros((8,), mx.int32), mx.zeros((8,), mx.int32), mx.zeros((1,), mx.int32))
    for after in ((), (mx.zeros((1, 1, 8, 128)),), (mx.zeros((2,)), mx.zeros((3,)))):
        tables = [mx.zeros((S, *t.shape), getattr(mx, t.dtype)) for t in tensors]
        devicemap.fill_kernel(tier, mx.array([2], mx.uint32), tables, tensors, fill, after)
    staging.copy_kernel(tensors, 20480)(
        inputs=[mx.array([0], mx.uint64), mx.array(np.arange(8, dtype=np.uint8))],
        output_shapes=[(8, *t.shape) for t in tensors] + [(1,)],
        output_dtypes=[getattr(mx, t.dtype) for t in tensors] + [mx.uint32],
        grid=(1024, 1, 1),
        threadgroup=(256, 1, 1),
    )
    staging.cuda_kernel.cache_clear()
    assert len(fake.sources) >= 7  # map, prefetch (2), fill (3 orderings), stage
    for key, text in fake.sources.items():
        r = compiles(text, tmp_path)
        assert r.returncode == 0, f"{key[0]}:\n{r.stderr[:3000]}\n{text}"


def test_a_broken_kernel_is_caught(tmp_path):
    """The check can fail: a body naming an input the kernel does not have."""
    text = full_source("k", ["a"], [mx.zeros((2,), mx.int32)], ["o"], [mx.int32], None, "o[0] = b[0];")
    assert compiles(text, tmp_path).returncode != 0
