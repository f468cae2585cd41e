"""Where a family's logits part from mlx-lm's on a GPU, taken apart by install and setting: the
full-size exactness test's prompt (tests/conftest.py's PROMPT) through the unmodified mlx-lm model
twice (is resident itself stable?), then teacher-forced through the engine in each variant below,
one at a time, each step's max |Δlogit| against the first resident run. Step 0 is the prefill
(the many-rows area path), later steps decode through the slots.

- device S = E: every expert resident, filled once (no fill during decode, no area);
- device at 25 % and 50 %: the default install, as the exactness test runs it;
- ... with overlap: each layer's compute started at once (the install's default is without);
- ... ops: the device install's steps as MLX operations instead of its CUDA kernels;
- pinned at 25 %: the staging install (a copy kernel into a staging pool).

Run it once with MLX's CUDA graphs and once without (`MLX_USE_CUDA_GRAPHS=0`) to tell an
ordering that the graphs lose from a kernel's arithmetic. Prints a table; no record (a probe).

    python scripts/probe_exactness.py [MODEL] [STEPS] [full,quarter,half,overlap,ops,pinned]

PROMPT_TOKENS=N: instead of the test's prompt, N tokens of the general set's eval prompts (as
`bench families` prompts: 2048 there); RESIDENT_RUNS=R: resident R times, each against the first
(`bench families` saw Mixtral's resident tokens vary between runs over 2048 tokens: does it with
and without the graphs, and from which step?).
"""

import contextlib
import gc
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a copy of the tree, not installed
from engine import EngineConfig, load, max_abs_diff  # noqa: E402
from engine.models import registry  # noqa: E402
from engine.runtime.device import cache as devicecache  # noqa: E402
from engine.runtime.loop import decode  # noqa: E402
from harness import manyrows  # noqa: E402

MODEL = sys.argv[1] if len(sys.argv) > 1 else "mixtral-8x7b-shape"
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
ONLY = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # the variants' first words, e.g. device,ops
PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"


@contextlib.contextmanager
def ops_mode():
    real = devicecache.DeviceCache.__init__

    def init(self, *a, **k):
        real(self, *a, **{**k, "mode": "ops"})

    devicecache.DeviceCache.__init__ = init
    try:
        yield
    finally:
        devicecache.DeviceCache.__init__ = real


def steps_apart(want, got) -> list:
    return [max_abs_diff([a], [b]) for a, b in zip(want, got)]


def free():
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def main():
    shape = registry.shape(MODEL)
    E, k = shape["experts"], shape["top_k"]
    quarter, half = max(k, E // 4), max(k, E // 2)
    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "1")
    print(f"{MODEL}: E = {E}, top {k}; MLX_USE_CUDA_GRAPHS={graphs}", flush=True)
    t0 = time.perf_counter()
    model, tok, _ = registry.load_reference(MODEL)
    n = int(os.environ.get("PROMPT_TOKENS", "0"))
    ids = manyrows.long_ids(tok, n, "general") if n else tok.encode(PROMPT)
    tokens, _, want = decode(model, ids, STEPS, keep_logits=True)
    for run in range(1, int(os.environ.get("RESIDENT_RUNS", "2"))):
        _, _, again = decode(model, ids, STEPS, keep_logits=True)
        print(f"resident run {run + 1} against run 1 ({len(ids)} prompt tokens, {time.perf_counter() - t0:.0f} s): "
              f"max |Δ| a step {steps_apart(want, again)}", flush=True)  # fmt: skip
    del model
    free()
    variants = [
        ("device S = E", dict(slots=E, install="device"), None),
        (f"device S = {quarter}", dict(slots=quarter, install="device"), None),
        (f"device S = {half}", dict(slots=half, install="device"), None),
        (f"device S = {quarter}, overlap", dict(slots=quarter, install="device", overlap=True), None),
        (f"device S = {quarter}, ops", dict(slots=quarter, install="device"), ops_mode),
        (f"pinned S = {quarter}", dict(slots=quarter, install="pinned"), None),
    ]
    keys = ["full", "quarter", "half", "overlap", "ops", "pinned"]
    for key, (name, cfg, ctx) in zip(keys, variants):
        if ONLY is not None and key not in ONLY:
            continue
        t0 = time.perf_counter()
        try:
            with ctx() if ctx else contextlib.nullcontext():
                eng = load(MODEL, EngineConfig(**cfg))
                try:
                    _, _, got = decode(eng.model, ids, STEPS, forced=tokens, keep_logits=True)
                    counters = eng.counters()
                finally:
                    eng.close()
            d = steps_apart(want, got)
            first = next((i for i, x in enumerate(d) if x != 0), None)
            said = "exact" if first is None else f"parts at step {first}"
            print(f"{name}: {said}; max |Δ| a step {[round(x, 4) for x in d]}; misses {counters.get('misses')}; "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        except Exception as e:  # a variant that cannot run here says why, the others still run
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
        free()


if __name__ == "__main__":
    main()
