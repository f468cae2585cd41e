"""Whether a batched decode step's expert compute may be split into calls and keep mlx-lm's bits
(issue 48: a `device` step copies the experts its rows name, then computes; docs/gpu.md, "Where
the time goes"). Overlapping the copy with compute needs the layer's (row, expert) pairs computed
in more than one call: first the pairs whose expert a slot already holds, while the others cross
the bus, then those. That is exact only where the backend computes a pair to the same bits
whatever else its call holds; MLX's CUDA `gather_qmm` picks its kernel by the call's size
(docs/gpu.md, "The prefill on a small table"), so it has to be asked.

For MODEL's first MoE layer (mlx-lm's own switch module, built from the model's shapes and
quantized as a build quantizes it, random weights from SEED: nothing is read or built), at each
batch B: random rows and top-k choices, mlx-lm's call over all of them, then the same pairs in
two calls
- `rows`: the first half of the rows, then the rest (each in mlx-lm's shape for fewer sequences);
- `held`: the pairs whose expert is among S held experts (a random S of the layer's), then the
  others, each pair as a row of its own;
and whether each pair's output is mlx-lm's to the bit (with the calls' pair counts: a split that
crosses a kernel's size threshold may differ where one that does not is equal). Also whether
mlx-lm's call agrees with itself. A probe: no record.

    python scripts/probe_split_calls.py MODEL [--batches 4 16] [--slots 16] [--seed 0]
"""

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from engine.models import registry  # noqa: E402
from engine.models.anatomy import moe_blocks  # noqa: E402


def random_switch(model_id: str, seed: int):
    """The first MoE layer's switch module of `model_id`, as a build makes it, with random
    weights: packed codes uniform, microscaling scales between 2^-8 and 2^-4, affine scales and
    biases that centre the codes, other floats small."""
    model = registry.skeleton(model_id)
    switch = moe_blocks(model)[0].switch
    rng = np.random.default_rng(seed)
    flat = tree_flatten(switch.parameters())
    drawn = {}
    for name, p in flat:
        if p.dtype == mx.uint32:
            v = rng.integers(0, 1 << 32, size=p.shape, dtype=np.uint32)
        elif p.dtype == mx.uint8:
            v = rng.integers(119, 124, size=p.shape, dtype=np.uint8)
        elif name.endswith("scales"):
            v = rng.uniform(0.5, 1.5, size=p.shape) * 0.02
        elif name.endswith("biases"):
            continue  # from the scales, below
        else:
            v = rng.standard_normal(p.shape) * 0.02
        drawn[name] = v
    for name, _ in flat:
        if name.endswith("biases"):
            # the codes' middle at zero: Mixtral's widths overflow float16 otherwise
            owner = functools.reduce(getattr, name.split(".")[:-1], switch)
            scales = drawn[name.removesuffix("biases") + "scales"]
            drawn[name] = -((1 << owner.bits) - 1) / 2 * scales * rng.uniform(0.9, 1.1, size=scales.shape)
    params = [(name, mx.array(drawn[name]).astype(p.dtype)) for name, p in flat]
    switch.update(tree_unflatten(params))
    mx.eval(switch.parameters())
    dtype = next(p.dtype for _, p in params if p.dtype in (mx.float16, mx.bfloat16, mx.float32))
    return switch, dtype


def hidden_of(switch) -> int:
    """The width of the switch's input: its first projection's input dimension (a packed
    quantized weight holds 32 / bits inputs a word)."""
    proj = next(getattr(switch, n) for n in ("up_proj", "gate_proj", "fc1") if hasattr(switch, n))
    bits = getattr(proj, "bits", None)
    return proj["weight"].shape[-1] * 32 // bits if bits else proj["weight"].shape[-1]


def probe(model_id: str, batches=(4, 16), slots: int = 16, seed: int = 0) -> list[dict]:
    """One row per batch and split: whether every pair's output equals mlx-lm's call's."""
    switch, dtype = random_switch(model_id, seed)
    shape = registry.shape(model_id)
    E, k, D = shape["experts"], shape["top_k"], hidden_of(switch)
    rng = np.random.default_rng(seed + 1)
    out = []
    for B in batches:
        x = mx.array(rng.standard_normal((B, D))).astype(dtype)
        inds_np = np.argsort(rng.random((B, E)), axis=1)[:, :k].astype(np.uint32)
        inds = mx.array(inds_np)
        full = switch(x, inds)
        again = switch(x, inds)
        mx.eval(full, again)
        full_np = np.array(full.astype(mx.float32)).reshape(B, k, -1)
        if not np.isfinite(full_np).all() or not np.abs(full_np).max() > 0:
            raise SystemExit(f"{model_id}: mlx-lm's call gave no finite, nonzero output at B = {B}: nothing to compare")
        again_np = np.array(again.astype(mx.float32)).reshape(B, k, -1)
        out.append(dict(batch=B, split="itself", calls=[B * k], equal=bool((again_np == full_np).all()),
                        max_abs=float(np.abs(again_np - full_np).max())))  # fmt: skip
        h = B // 2
        if h:
            parts = [switch(x[:h], inds[:h]), switch(x[h:], inds[h:])]
            split = np.concatenate([np.array(p.astype(mx.float32)).reshape(-1, k, full_np.shape[-1]) for p in parts])
            out.append(dict(batch=B, split="rows", calls=[h * k, (B - h) * k], equal=bool((split == full_np).all()),
                            max_abs=float(np.abs(split - full_np).max())))  # fmt: skip
        held = set(rng.permutation(E)[: min(slots, E)].tolist())
        rows, cols = np.nonzero(np.isin(inds_np, list(held)))
        rest_r, rest_c = np.nonzero(~np.isin(inds_np, list(held)))
        got = np.empty_like(full_np)
        calls = []
        for r, c in ((rows, cols), (rest_r, rest_c)):
            if not len(r):
                continue
            y = switch(x[mx.array(r)], mx.array(inds_np[r, c][:, None]))
            got[r, c] = np.array(y.astype(mx.float32)).reshape(len(r), -1)
            calls.append(len(r))
        out.append(dict(batch=B, split="held", calls=calls, equal=bool((got == full_np).all()),
                        max_abs=float(np.abs(got - full_np).max())))  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--slots", type=int, default=16, help="the experts a layer holds (the `held` split)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(f"{a.model} on {mx.default_device()}: each pair's output against mlx-lm's one call of the step's rows")
    print(f"{'B':>4} {'split':>7} {'pairs a call':>14}  result")
    for row in probe(a.model, a.batches, a.slots, a.seed):
        said = "equal" if row["equal"] else f"DIFFER (max |d| {row['max_abs']:.3g})"
        print(f"{row['batch']:>4} {row['split']:>7} {'+'.join(map(str, row['calls'])):>14}  {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
