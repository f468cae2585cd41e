"""Where the `device` install's extra host time a token goes on a CUDA GPU: the pipelined decode
(the bench's loop) of the full-size model, resident and at S = 16, with the layer's step taken
apart piece by piece. Each variant is a real decode; those marked `timing only` compute other
logits (the slots they read are not the experts routed to) and exist to split the time:

- resident: every expert in its slot (S = E), no step at all;
- device: the install as it is (one step kernel a layer: map step and fill);
- map only: the step kernel without its fill (no table or host tier among its inputs);
- header file: the device install with the step kernel's header read by NVRTC from a file, so
  that MLX's per-launch source is the body alone (exact: a candidate);
- tiny kernel (timing only): a launch with the step's arrays in and out and a one-line body (its slots are
  the router's indices modulo S), so that what is left is the step kernel's source and map step;
- no launch: the step replaced by one MLX operation (the router's indices modulo S), so what is
  left is the engine's Python around it;
- no step: the layer's SwitchGLU called on those indices directly, the engine's wrapper bypassed;
- no counters: the device install as it is, its counters never captured, so that the loop reads
  nothing back between one token and the next call (does that read wait for the next token's
  kernels? The families records show up to 25 ms a token outside graph, queue and eval).

The differences (device - map only, map only - no launch, no launch - no step, no step -
resident) are the fill's inputs, the launch itself, the engine's Python, and what the wrapper's
call costs; device - tiny kernel is what the step kernel's own source and work cost the host.
`MLX_USE_CUDA_GRAPHS=0` in the environment splits the queueing further (device_gpu.sh's `layer`
step runs both). Rounds interleave the variants; medians over rounds of the host's ms per token
(building the graph, queueing it, waiting for the token). Prints a table; no record (a probe).

    python scripts/probe_layer_cost.py [MODEL] [TOKENS] [ROUNDS] [SLOTS]
"""

import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a copy of the tree, not installed
from engine import EngineConfig, device, load  # noqa: E402
from engine.runtime import moe  # noqa: E402
from engine.runtime.device import cache as devicecache  # noqa: E402
from engine.runtime.device import kernel_source, kernels  # noqa: E402
from engine.runtime.device.stats import DeviceStats  # noqa: E402
from engine.runtime.loop import call_split, decode, totals  # noqa: E402
from engine.runtime.moe import StepStats  # noqa: E402

MODEL = sys.argv[1] if len(sys.argv) > 1 else "olmoe-1b-7b-shape"
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 5
S = int(sys.argv[4]) if len(sys.argv) > 4 else 16  # a family of 8 experts (Mixtral's) takes fewer


@contextlib.contextmanager
def patched(obj, name, value):
    real = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, real)


def map_only(jobs, tier=None, tensors=(), after=(), stream=None, real=kernels.step_kernel):
    return real(jobs, None, (), after, stream)


TINY = (
    "for (int j = threadIdx.x; j < N; j += blockDim.x) remapped[j] = (unsigned int)inds[j] % S;\n"
    "for (int j = threadIdx.x; j < M; j += blockDim.x) state_o[j] = state[j];"
)


def tiny_kernel(self, layer, inds, ahead=None):
    """The step's launch with the same arrays in and out, and a one-line body."""
    tabs = self.tables[layer]
    names = ("base", "inds", "state", "layer", *(f"t{i}" for i in range(len(tabs))), "after")
    k = kernels.cuda_kernel("probe_tiny", names, ("state_o", "remapped"), TINY)
    block = self.states[layer].block
    after = self.after[layer] if self.after[layer] is not None else block
    state, remapped = k(
        inputs=[self.tier.base, inds, block, self.layer_ids[layer], *tabs, after],
        output_shapes=[block.shape, inds.shape], output_dtypes=[mx.int32, mx.uint32], grid=(32, 1, 1),
        threadgroup=(32, 1, 1), template=[("N", inds.size), ("M", block.size), ("S", self.slots[layer])],
    )  # fmt: skip
    self.states[layer] = state.MapState(state, self.states[layer].E, self.slots[layer])
    return remapped


# The step kernel's header from a file NVRTC reads (an absolute #include), so that each launch's
# source (which MLX builds and hashes at every launch) is its body alone: exact, a candidate.
HEADER_FILE = Path(tempfile.mkdtemp(prefix="titan-probe-")) / "titan_step.cuh"
HEADER_FILE.write_text(kernel_source.STEP_HEADER)


def no_launch(self, layer, inds, ahead=None):
    return inds % self.slots[layer]


def no_step(self, x, indices):
    if self._cache.full(self._layer):
        return self.glu(x, indices)
    return self.glu(x, indices % self._cache.slots[self._layer])


VARIANTS = {
    "resident": (None, contextlib.nullcontext),
    "device": (S, contextlib.nullcontext),
    "map only": (S, lambda: patched(devicecache, "step_kernel", map_only)),
    "tiny kernel": (S, lambda: patched(devicecache.DeviceCache, "map_step", tiny_kernel)),
    "header file": (S, lambda: patched(kernels, "STEP_HEADER", f'#include "{HEADER_FILE}"\n')),
    "no launch": (S, lambda: patched(devicecache.DeviceCache, "map_step", no_launch)),
    "no step": (S, lambda: patched(moe.SlotSwitchGLU, "__call__", no_step)),
    "no counters": (S, lambda: patched(DeviceStats, "capture", StepStats.capture)),
}

if device.kind() != "gpu":
    raise SystemExit("probe_layer_cost: needs MLX's CUDA backend (a GPU)")
engines = {k: load(MODEL, EngineConfig(slots=s, install="device" if s else "auto")) for k, (s, _) in VARIANTS.items()}
ids = engines["resident"].tokenizer.encode("The history of the printing press begins")
per = {k: [] for k in VARIANTS}
failed = {}
for r in range(ROUNDS + 1):  # the first round warms up (kernel compilation) and is dropped
    for k, (_, ctx) in VARIANTS.items():
        if k in failed:
            continue
        try:
            with ctx():
                _, recs, _ = decode(engines[k].model, ids, TOKENS, pipelined=True)
        except RuntimeError as e:  # a candidate that does not compile is told, and the rest still run
            failed[k] = str(e).splitlines()[0][:300]
            per.pop(k)
            continue
        if r:
            per[k].append(dict(call_split(recs), total=1e3 * totals(recs)["seconds"] / totals(recs)["tokens"]))
graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "default")
print(f"{MODEL}, S = {S}, {TOKENS} tokens pipelined, median of {ROUNDS} interleaved rounds (ms per token); "
      f"MLX_USE_CUDA_GRAPHS={graphs}")  # fmt: skip
print(f"{'variant':12s} {'graph':>7s} {'queue':>7s} {'eval':>7s} {'total':>7s}  tok/s")
for k, runs in per.items():
    m = {f: statistics.median(x[f] for x in runs) for f in runs[0]}
    print(f"{k:12s} {m['graph']:7.2f} {m['queue']:7.2f} {m['eval']:7.2f} {m['total']:7.2f}  {1e3 / m['total']:.1f}")
for k, why in failed.items():
    print(f"{k:12s} FAILED: {why}")
sys.stdout.flush()
for eng in engines.values():  # after the table: a fault a variant left behind surfaces here
    eng.close()
mx.synchronize()
