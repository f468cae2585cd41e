"""The engine's CUDA kernels where there is no GPU: a stand-in for `mx.fast.cuda_kernel` that writes
the full source MLX 0.32 would compile (`build_kernel` in mlx/backend/cuda/custom_kernel.cpp: the
header, the inputs as const pointers of their dtypes, `NAME_shape`/`NAME_ndim` where the body uses
them, the outputs, the template constants) and has the host's C++ compiler build it against a
small CUDA runtime made of threads: one thread per CUDA thread, a block at a time, `__syncthreads`
and `__syncwarp` as barriers, `__shfl_xor_sync` through a barrier-guarded exchange, `__shared__`
as per-kernel statics. Inputs and outputs are the MLX arrays' own memory (a CPU array's buffer
is writable from C), so a kernel writing through an input's pointer, as the device install's fill
does into the slot tables, writes the array itself.

`Emulator(run=False)` only checks that each source compiles; `run=True` also runs it, with at most
`blocks` blocks of at most `threads` threads (the engine's kernels are grid-stride, so any grid
covers the work; whole warps, as their map steps are a warp's). A launch runs when it
is called, not when its outputs are evaluated: the emulator checks what a kernel computes, not
how MLX orders it."""

import atexit
import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

CXX = shutil.which("g++") or shutil.which("clang++")
CUDA_TYPES = {mx.int32: "int32_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t", mx.uint8: "uint8_t",
              mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}  # fmt: skip
MAX_NDIM = 10  # MLX's Shape: cuda::std::array<int32_t, MAX_NDIM>

PRELUDE = """
#include <array>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __grid_constant__
#define __shared__ static
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
struct EmuBlock {
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<unsigned long long> lanes;
  explicit EmuBlock(unsigned n) : all(n), lanes(n) {
    for (unsigned w = 0; w < n / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
  }
};
static EmuBlock* emu_block;
inline void __syncthreads() { emu_block->all.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_block->warps[threadIdx.x / 32]->arrive_and_wait(); }
template <class T> T __shfl_xor_sync(unsigned, T v, int o) {
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu_block->lanes[threadIdx.x] = bits;
  __syncwarp();
  bits = emu_block->lanes[threadIdx.x ^ o];
  __syncwarp();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct __half { unsigned short v; };
struct __nv_bfloat16 { unsigned short v; };
using Shape = std::array<int32_t, 10>;
"""


def params(input_names, inputs, output_names, output_dtypes, body) -> list:
    """The kernel's parameters as MLX makes them: (kind, C declaration, name) in order."""
    out = []
    for n, a in zip(input_names, inputs):
        out.append(("in", f"const {CUDA_TYPES[a.dtype]}* {n}", n))
        if a.ndim > 0 and f"{n}_shape" in body:
            out.append(("shape", f"const __grid_constant__ Shape {n}_shape", n))
        if a.ndim > 0 and f"{n}_ndim" in body:
            out.append(("ndim", f"const __grid_constant__ int {n}_ndim", n))
    out += [("out", f"{CUDA_TYPES[d]}* {n}", n) for n, d in zip(output_names, output_dtypes)]
    return out


def full_source(name, input_names, inputs, output_names, output_dtypes, template, body, header="") -> str:
    """What MLX 0.32's `build_kernel` wraps a body in, with this module's runtime for a prelude and
    `titan_run(args, blocks, threads)`, which runs it."""
    ps = params(input_names, inputs, output_names, output_dtypes, header + body)
    consts = "".join(
        f"  constexpr bool {k} = {str(v).lower()};\n" if isinstance(v, bool) else f"  constexpr int {k} = {v};\n"
        for k, v in template or []
    )
    args = []
    for i, (kind, decl, _) in enumerate(ps):
        ctype = decl.rsplit(" ", 1)[0].replace("const __grid_constant__ ", "")
        args.append(f"*(const {ctype}*)a[{i}]" if kind in ("shape", "ndim") else f"({ctype})a[{i}]")
    run = f"""
extern "C" void titan_run(void** a, unsigned blocks, unsigned threads) {{
  gridDim = dim3{{blocks, 1, 1}};
  blockDim = dim3{{threads, 1, 1}};
  for (unsigned b = 0; b < blocks; ++b) {{
    EmuBlock blk(threads);
    emu_block = &blk;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([=] {{ threadIdx = dim3{{t, 0, 0}}; blockIdx = dim3{{b, 0, 0}}; {name}({", ".join(args)}); }});
    for (auto& t : ts) t.join();
  }}
}}
"""
    decls = ",\n    ".join(d for _, d, _ in ps)
    return f"{PRELUDE}\n{header}\n__global__ void {name}(\n    {decls}) {{\n{consts}\n{body}\n}}\n{run}"


def compile_source(text: str, out: Path, syntax_only: bool) -> subprocess.CompletedProcess:
    src = out.with_suffix(".cpp")
    src.write_text(text)
    flags = ["-fsyntax-only"] if syntax_only else ["-O1", "-shared", "-fPIC", "-pthread", "-o", str(out)]
    return subprocess.run([CXX, "-std=c++20", "-Wno-unused", *flags, str(src)], capture_output=True, text=True)


def compiles_alone(name, input_names, inputs, output_names, output_dtypes, body) -> bool:
    """Whether a kernel body compiles (syntax only), for a test that the check can fail."""
    text = full_source(name, input_names, inputs, output_names, output_dtypes, None, body)
    return compile_source(text, _DIR / "alone.so", syntax_only=True).returncode == 0


def address(a: mx.array) -> int:
    """The address of an evaluated, row-contiguous MLX array's first element (0 if it is empty)."""
    if a.size == 0:
        return 0
    view = memoryview(a)
    if not view.c_contiguous:
        raise ValueError("the emulator takes row-contiguous inputs (MLX would copy this one)")
    return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))


_BUILT = {}  # (source digest, run) -> the library (None: checked only), for the whole test process
_DIR = Path(tempfile.mkdtemp(prefix="titan-emu-"))
atexit.register(shutil.rmtree, _DIR, True)


def library(text: str, run: bool):
    """`text` checked (run=False) or built into a library (once a process: a build takes seconds)."""
    key = (hashlib.sha256(text.encode()).hexdigest()[:20], run)
    if key not in _BUILT:
        out = _DIR / f"k{key[0]}.so"
        r = compile_source(text, out, syntax_only=not run)
        if r.returncode != 0:
            raise AssertionError(f"the kernel does not compile:\n{r.stderr[:3000]}\n{text}")
        _BUILT[key] = ctypes.CDLL(str(out)) if run else None
    return _BUILT[key]


class Emulator:
    """Stands in for mx.fast.cuda_kernel (module docstring). `sources`: every launch's full source,
    by (kernel name, output dtypes, template)."""

    def __init__(self, run: bool = True, blocks: int = 3, threads: int = 1024):
        self.run, self.blocks, self.threads = run, blocks, threads
        self.sources, self.launches = {}, 0

    def __call__(self, name, input_names, output_names, source, header="", **kw):
        def launch(inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, stream=None, **kw2):
            assert len(inputs) == len(input_names) and len(output_shapes) == len(output_names) == len(output_dtypes)
            assert all(isinstance(a, mx.array) for a in inputs)
            assert all(g >= 1 for g in grid) and all(t >= 1 for t in threadgroup)
            text = full_source(name, input_names, inputs, output_names, output_dtypes, template, source, header)
            self.sources[(name, tuple(str(d) for d in output_dtypes), str(template))] = text
            outputs = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
            lib = library(text, self.run)
            if not self.run:
                return outputs
            mx.eval(inputs, outputs)
            keep, ptrs = [], []
            for kind, _, n in params(input_names, inputs, output_names, output_dtypes, header + source):
                if kind == "out":
                    ptrs.append(address(outputs[output_names.index(n)]))
                    continue
                a = inputs[input_names.index(n)]
                if kind == "in":
                    ptrs.append(address(a))
                    continue
                val = np.zeros(MAX_NDIM, np.int32)
                val[: a.ndim] = a.shape
                if kind == "ndim":
                    val = np.array([a.ndim], np.int32)
                keep.append(val)
                ptrs.append(val.ctypes.data)
            threads = min(threadgroup[0], grid[0], self.threads)
            assert threads % 32 == 0, "the emulator runs whole warps"
            blocks = min(self.blocks, -(-grid[0] // threadgroup[0]))
            lib.titan_run((ctypes.c_void_p * len(ptrs))(*ptrs), blocks, threads)
            self.launches += 1
            return outputs

        return launch
