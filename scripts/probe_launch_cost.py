"""Where a device-install layer's host time goes on a CUDA GPU: the host cost of building and of
evaluating one `mx.fast.cuda_kernel` launch as its inputs and outputs grow, beside a plain MLX
operation, and of the engine's step kernel with one job (demand) and two (a prefetch riding
along). Medians of 5 repeats of 400 launches each; prints a table (no record: a probe).

    python scripts/probe_launch_cost.py
"""

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a copy of the tree, not installed
from engine.runtime.device import kernels as devicemap  # noqa: E402
from engine.runtime.device.kernels import Job  # noqa: E402
from engine.runtime.device.state import MapState  # noqa: E402
from engine.runtime.staging import cuda_kernel  # noqa: E402

N = 400


def timed(build):
    """(µs to build N launches, µs to evaluate them), per launch; the chain is serial."""
    builds, evals = [], []
    for _ in range(5):
        mx.synchronize()
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        t2 = time.perf_counter()
        builds.append((t1 - t0) / N * 1e6)
        evals.append((t2 - t1) / N * 1e6)
    return statistics.median(builds), statistics.median(evals)


def plain():
    x = mx.zeros((8,), mx.int32)
    mx.eval(x)
    for _ in range(N):
        x = x + 1
    return x


def custom(ins: int, outs: int):
    names = tuple(f"i{k}" for k in range(ins))
    onames = tuple(f"o{k}" for k in range(outs))
    src = "if (threadIdx.x == 0) { " + " ".join(f"o{k}[0] = i0[0] + {k};" for k in range(outs)) + " }"
    k = cuda_kernel(f"probe{ins}_{outs}", names, onames, src)
    extra = [mx.zeros((16,), mx.int32) for _ in range(ins - 1)]
    mx.eval(extra)

    def build():
        x = mx.zeros((8,), mx.int32)
        for _ in range(N):
            x = k(inputs=[x, *extra], output_shapes=[(8,)] * outs, output_dtypes=[mx.int32] * outs,
                  grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]  # fmt: skip
        return x

    return build


def step(two: bool):
    E, S = 64, 16
    tabs = [[mx.zeros((S, 1024, 256), mx.uint32) for _ in range(9)] for _ in range(2)]
    mx.eval(tabs)

    def build():
        st = [MapState.empty(E, S) for _ in range(2)]
        inds = mx.array([[[1, 2, 3, 4, 5, 6, 7, 8]]], mx.uint32)
        for _ in range(N):
            # the map steps alone (no tier to copy from), the tables as inputs all the same
            jobs = [Job(st[0], inds, S)]
            if two:
                jobs.append(Job(st[1], inds.reshape(-1), S, False))
            out = devicemap.step_kernel(jobs, after=tabs[0] + (tabs[1] if two else []))
            st[0] = out[0][0]
            if two:
                st[1] = out[1][0]
            inds = out[0][1].remapped * 0 + inds
        return [inds, *st[0].arrays()]

    return build


try:
    cuda_kernel("probe", ("x",), ("o",), "o[0] = x[0];")(
        inputs=[mx.zeros((1,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1)
    )
except RuntimeError as e:
    raise SystemExit(f"probe_launch_cost: needs MLX's CUDA backend ({e})") from None
rows = [("x + 1 (a plain op)", plain)]
for ins, outs in ((1, 1), (8, 1), (24, 1), (1, 10), (24, 10), (40, 20)):
    rows.append((f"custom kernel, {ins} in, {outs} out", custom(ins, outs)))
rows += [("step kernel, map only, 1 job", step(False)), ("step kernel, map only, 2 jobs", step(True))]
print(f"{'launch':36s} {'build µs':>9s} {'eval µs':>9s}   (per launch, median of 5 x {N})")
for name, build in rows:
    timed(build)  # compile, warm up
    b, e = timed(build)
    print(f"{name:36s} {b:9.1f} {e:9.1f}", flush=True)
