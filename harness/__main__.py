"""Command line of the experiments: python -m harness {bench,train,probe} ...

python -m harness bench throughput|miss|install|prefetch [--record]
python -m harness train olmoe-trained        # trains, and writes the loss curve as a raw record
python -m harness probe                      # this machine's full environment probe (never committed)
python -m harness suite [--shards N] [ARGS]  # the test suite as a raw record naming the engine/ tree
python -m harness suite --check              # whether the landed engine/ tree has a passing GPU record
"""

import argparse
import sys

from engine.arguments import ERRORS
from engine.models import registry, train

from . import bench, inventory, provenance, rawlog, suite


def cmd_bench(a):
    bench.main(a)


def cmd_train(a):
    started = provenance.utc_now()
    spec = registry.get_spec(a.model)
    if "training" not in spec:
        raise registry.RegistryError(f"model '{a.model}' has no training block in {spec['source']}")
    out = train.train(a.model)
    cfg = dict(
        model=a.model, training=spec["training"], data_digest=out["data_digest"], tokens_per_step=out["tokens_per_step"]
    )
    path = rawlog.write_run(
        "train",
        a.model.replace("-", "_"),
        out["curve"],
        config=cfg,
        seed=spec["training"]["seed"],
        started=started,
        model=a.model,
        revision=None,
        command=["python", "-m", "harness", "train", a.model],
    )
    print(path)


def cmd_probe(a):
    print(inventory.write_probe(a.out))


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("bench", help="engine-core benchmarks: throughput, per-miss cost, install cost, prefetch")
    bench.add_args(p)
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("train", help="train a model with a training block and log its loss curve as a raw record")
    p.add_argument("model", nargs="?", default="olmoe-trained")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("probe", help="write this machine's full environment probe (kept out of version control)")
    p.add_argument("--out", default=None, help="file to write (default: <resources>/probes/<host alias>.json)")
    p.set_defaults(fn=cmd_probe)
    p = sub.add_parser("suite", help="run the test suite and record it (tests/suite), naming the engine/ tree")
    suite.add_args(p)
    p.set_defaults(fn=suite.main)
    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
