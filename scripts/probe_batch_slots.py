"""How many experts a batched decode step brings across the bus, a layer, beside the fewest any
cache of the same slots could (issue 48: `batch_generate` at B = 4 reaches about the speed of its
misses copied and then computed, docs/gpu.md, "Where the time goes"; whether a better choice of
what the slots keep can lower them is this probe's question).

MODEL's `device` install (S slots a layer) decodes a batch of B prompts (the eval prompts, cut to
64 tokens, as `bench batch` makes them) through mlx-lm's `batch_generate`; before each decode
step's layer call the probe reads the layer's slot map back (a host wait; nothing is timed) and
counts the experts the step's rows name that no slot holds: those the step's many-rows area brings
from the host tier. Beside them, over the same steps:
- `named`: the distinct experts the rows named, a layer's mean a step;
- `beyond`: max(0, named - S), what even slots holding just this step's experts would bring in;
- `most-named`: a cache that after each step keeps the S experts the most of its rows named
  (ties to the later rows), as a candidate rule;
- `latest`: one that keeps the experts of the step's latest `S // top-k` rows (the install's rule
  before `engine.runtime.moe.kept_after_many_rows`);
- `decayed`: one that keeps the S named by the most rows over the steps so far, each earlier
  step's count weighed 0.6 times the next's (the install's rule now; on `olmoe-tiny-f32`'s
  128-token batches at B = 4, S = 16 it brings in about a third fewer than `latest`: two of the
  four sequences there name nearly the same experts step after step, and the latest rows are
  not theirs);
- `fewest`: Belady's rule (`harness.manyrows.fewest_misses`), the least any cache of S brings in;
- of `decayed`'s, those the step before named at the layer, and what an area copied ahead from
  the step before's experts would read (`decayed_ahead`: whether such a copy, overlapping the
  layer before's compute, could take a batched step's misses off its path).
The install's own rule is `kept_after_many_rows`, read here from its slot maps. A probe:
no record; the printed table is its result. `--trace DIR` also writes each batch's routing,
DIR/MODEL-B{B}.npz (a layer's decode steps end to end, `layer0`..., and each step's rows,
`rows0`...: finished sequences leave a batch): what the experts a step names are does not depend
on the slots (the logits are mlx-lm's at every S), so any other rule can be counted against it
later without the model (`python scripts/probe_batch_slots.py --replay DIR/MODEL-B4.npz --slots 16`).

    python scripts/probe_batch_slots.py MODEL [--batches 4 16] [--slots 16] [--tokens 64] [--trace DIR]
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import batch_generate  # noqa: E402

from engine import EngineConfig, load  # noqa: E402
from engine.models.anatomy import moe_blocks  # noqa: E402
from engine.predict import prompts  # noqa: E402
from engine.runtime.moe import SlotSwitchGLU, engine_layers  # noqa: E402
from harness.manyrows import fewest_misses  # noqa: E402


def _walk(steps: list, keep):
    """Each step's named experts and those a cache held before it, the cache holding after each
    step what `keep(inds, on_device)` returns of the experts then on the device (those it held
    and those the step brought)."""
    held = set()
    for inds in steps:
        named = set(inds.reshape(-1).tolist())
        yield named, held
        held = keep(inds, held | named)


def _brought(steps: list, slots: int, keep) -> int:
    """Experts brought in over `steps` (each step's (rows, top-k) indices) by a cache that keeps
    what `keep` returns (`_walk`); the first step brings in only what it names beyond `slots` (as
    warm a start as `fewest_misses` gives itself)."""
    return sum(len(named - held) if t else max(0, len(named) - slots)
               for t, (named, held) in enumerate(_walk(steps, keep)))  # fmt: skip


def latest(steps: list, slots: int) -> int:
    """Experts brought in by a cache that keeps, after each step, the experts of its latest
    `slots // top-k` rows (the device install's rule before `kept_after_many_rows`: a batch's rows
    reach the switch flattened, so these are its last sequences')."""
    return _brought(steps, slots, lambda inds, _: set(inds[-max(1, slots // inds.shape[-1]) :].reshape(-1).tolist()))


def most_named(steps: list, slots: int) -> int:
    """Experts brought in by a cache that keeps, after each step, the `slots` experts most of that
    step's rows named (ties: the later row's)."""

    def keep(inds, _):
        votes = Counter()
        for r, row in enumerate(inds):
            for e in row.tolist():
                votes[e] += 1 + r / (len(inds) + 1)  # a later row breaks a tie
        return {e for e, _ in votes.most_common(slots)}

    return _brought(steps, slots, keep)


def _decayed_keep(slots: int, decay: float):
    """`decayed`'s keep: the `slots` experts on the device with the most rows naming them over the
    steps so far, each earlier step's count weighed `decay` times less."""
    score = Counter()

    def keep(inds, on_device):
        for e in score:
            score[e] *= decay
        score.update(inds.reshape(-1).tolist())
        return set(sorted(on_device, key=lambda e: (-score[e], e))[:slots])

    return keep


def decayed(steps: list, slots: int, decay: float = 0.6) -> int:
    """Experts brought in by a cache that keeps, after each step, the `slots` experts on the device
    with the most rows naming them over the steps so far, each earlier step's count weighed `decay`
    times less (a least-frequently-used rule that forgets)."""
    return _brought(steps, slots, _decayed_keep(slots, decay))


def decayed_ahead(steps: list, slots: int, decay: float = 0.6) -> tuple:
    """Of `decayed`'s experts brought in, those the step before named at this layer, and what an
    area copied ahead from the step before's experts would read: (named the step before, read
    ahead). Such an area, copied during the layer before's compute from what the step before named
    here and no slot holds (all that is known of this step's rows then), would bring the first
    off the step's own path, at the cost of reading all of the second, named again or not
    (no other figure: nothing is timed)."""
    before, read, last = 0, 0, None
    for named, held in _walk(steps, _decayed_keep(slots, decay)):
        if last is not None:
            ahead = last - held
            before += len((named - held) & ahead)
            read += len(ahead)
        last = named
    return before, read


def run(model_id: str, batch: int, slots: int, tokens: int, trace: Path | None = None) -> dict:
    engine = load(model_id, EngineConfig(slots=slots, install="device"))
    try:
        cache = engine.cache
        seen = [[] for _ in engine_layers(engine.model)]  # per layer: (the step's indices, the experts its slots held)

        class Counted(nn.Module):
            def __init__(self, switch):
                super().__init__()
                self.switch = switch

            def __call__(self, x, indices):
                inds = np.array(indices).reshape(-1, indices.shape[-1])
                if len(inds) <= batch:  # a decode step's rows (a prompt's are more)
                    held = set(cache.resident(self.switch._layer).tolist()) - {-1}
                    seen[self.switch._layer].append((inds, held))
                return self.switch(x, indices)

        blocks = moe_blocks(engine.model, kinds=(SlotSwitchGLU,))
        for b in blocks:
            setattr(b.parent, b.attr, Counted(b.switch))
        try:
            texts = [p["text"] for p in prompts.load("general", "eval")]
            ids = [engine.tokenizer.encode(texts[i % len(texts)])[:64] for i in range(batch)]
            batch_generate(engine.model, engine.tokenizer, ids, max_tokens=tokens)
        finally:
            for b in blocks:
                setattr(b.parent, b.attr, b.switch)
    finally:
        engine.close()
    if trace is not None:  # a layer's steps end to end, and each step's rows (finished sequences leave a batch)
        trace.mkdir(parents=True, exist_ok=True)
        arrays = {f"layer{i}": np.concatenate([x for x, _ in s]) for i, s in enumerate(seen)}
        arrays |= {f"rows{i}": np.array([len(x) for x, _ in s]) for i, s in enumerate(seen)}
        np.savez(trace / f"{model_id}-B{batch}.npz", **arrays)
    return count([[i for i, _ in s] for s in seen], batch, slots, [[h for _, h in s] for s in seen])


def count(steps: list, batch: int, slots: int, held: list | None = None) -> dict:
    """The table's row from each layer's steps (their (rows, top-k) indices) and, where the install
    ran, the experts its slots held before each step."""
    pairs = sum(len(s) for s in steps)
    named = [[set(i.reshape(-1).tolist()) for i in s] for s in steps]
    row = dict(B=batch, S=slots, steps=len(steps[0]))
    row["named"] = sum(len(u) for layer in named for u in layer) / pairs
    row["beyond"] = sum(max(0, len(u) - slots) for layer in named for u in layer) / pairs
    row["install"] = (float("nan") if held is None else
                      sum(len(u - h) for layer, hs in zip(named, held) for u, h in zip(layer, hs)) / pairs)  # fmt: skip
    row["latest"] = sum(latest(s, slots) for s in steps) / pairs
    row["most_named"] = sum(most_named(s, slots) for s in steps) / pairs
    row["decayed"] = sum(decayed(s, slots) for s in steps) / pairs
    row["fewest"] = sum(fewest_misses(layer, slots) for layer in named) / pairs
    row["ahead_named"], row["ahead_read"] = np.array([decayed_ahead(s, slots) for s in steps]).sum(axis=0) / pairs
    return row


def replay(path: Path, slots: int) -> dict:
    """`count` over a trace `--trace` wrote (no install: its column is nan)."""
    with np.load(path) as z:
        layers = len([f for f in z.files if f.startswith("layer")])
        steps = [np.split(z[f"layer{i}"], np.cumsum(z[f"rows{i}"])[:-1]) for i in range(layers)]
    return count(steps, max(len(s) for s in steps[0]), slots)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a model id (or none, with --replay)")
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--slots", type=int, nargs="+", default=[16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trace", type=Path, help="write each batch's routing here (MODEL-B{B}.npz)")
    ap.add_argument("--replay", type=Path, nargs="+", help="count traces --trace wrote, instead of a model")
    a = ap.parse_args()
    if (a.model is None) == (a.replay is None):
        ap.error("give a MODEL or --replay TRACE..., not both")
    print(f"{a.model or 'replayed'}: experts brought in a layer a decode step (means over the steps and layers)")
    print(
        "B S steps named beyond install latest most-named decayed fewest | decayed's named the step before, read ahead"
    )
    for source in a.batches if a.replay is None else a.replay:  # a batch size to decode, or a trace
        for s in a.slots:
            r = run(a.model, source, s, a.tokens, a.trace) if a.replay is None else replay(source, s)
            print(f"{r['B']} {r['S']} {r['steps']} " + " ".join(f"{r[k]:.2f}" for k in
                  ("named", "beyond", "install", "latest", "most_named", "decayed", "fewest")) +
                  f" | {r['ahead_named']:.2f} {r['ahead_read']:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
