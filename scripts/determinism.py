"""Is plain mlx-lm run-to-run deterministic here? For each model named (default: every tiny
architecture), the unmodified mlx-lm model decodes the tests' prompt greedily, then teacher-forced
on the same tokens RUNS - 1 more times in the same process; the record gives, per model, the
largest |Δlogit| between any run and the first (0.0: deterministic) and whether any run held NaN.

The engine's bit-exactness is only defined against a reference that agrees with itself, so this
is the first thing to measure on a new backend (issue 28). Run it with MLX_USE_CUDA_GRAPHS=0 as
well on a CUDA GPU: the record names the setting, so the two can be told apart.

Usage: python scripts/determinism.py [--runs 3] [--record] [--shard I/N] [MODEL ...]
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a copy of the tree, not installed

import numpy as np  # noqa: E402

from engine.models import registry  # noqa: E402
from engine.runtime.loop import decode, max_abs_diff  # noqa: E402
from harness import provenance, rawlog  # noqa: E402

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"


def check(model_id: str, runs: int, steps: int) -> dict:
    model, tok, _ = registry.load_reference(model_id)
    ids = tok.encode(PROMPT)
    tokens, _, first = decode(model, ids, steps, keep_logits=True)
    worst, nan = 0.0, any(np.isnan(x).any() for x in first)
    for _ in range(runs - 1):
        _, _, again = decode(model, ids, steps, forced=tokens, keep_logits=True)
        nan = nan or any(np.isnan(x).any() for x in again)
        worst = max(worst, max_abs_diff(first, again))
    return dict(model=model_id, runs=runs, steps=steps, max_abs_diff=worst, nan=bool(nan), deterministic=worst == 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--shard", default="0/1", help="I/N: every Nth model from the Ith (to run N processes at once)")
    a = ap.parse_args()
    started = provenance.utc_now()
    models = a.models or [m for m, s in registry.load_registry().items() if s["source"] == str(registry.ARCHITECTURES)]
    i, n = (int(x) for x in a.shard.split("/"))
    out = []
    for m in models[i::n]:
        try:
            r = check(m, a.runs, a.steps)
        except Exception as e:  # a model mlx-lm cannot run is reported, not fatal to the others
            r = dict(model=m, error=f"{type(e).__name__}: {e}"[:300])
        r["cuda_graphs"] = os.environ.get("MLX_USE_CUDA_GRAPHS", "1") != "0"
        print(r, flush=True)
        out.append(r)
    if a.record:
        cfg = dict(runs=a.runs, steps=a.steps, cuda_graphs=os.environ.get("MLX_USE_CUDA_GRAPHS", "1") != "0")
        print(rawlog.write_run("tests", "determinism", out, config=cfg, seed=None, started=started))


if __name__ == "__main__":
    main()
