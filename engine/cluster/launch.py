"""Start a multi-node decode and say plainly whether it worked:

    python -m engine.cluster.launch -n 3 -- --model qwen3moe-tiny --placement algorithm2 --tokens 16
    python -m engine.cluster.launch --hostfile hosts.json -- --model qwen3moe-tiny --tokens 16

It runs `mlx.launch` over `engine.cluster.dist_run` (the arguments after `--` go to every rank)
and exits 0 only when rank 0 wrote its result: `mlx.launch` itself can exit 0 after stopping the
other ranks when one of them died, so a failed run here exits 3 and names the node."""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .multinode import NodeError, launch


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m engine.cluster.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", "--nodes", type=int, help="local processes, one per node")
    where.add_argument("--hostfile", help="mlx.launch's hostfile: one entry per machine, node 0 first")
    ap.add_argument("--backend", default="ring", help="mx.distributed backend (default: ring)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the whole run is given up")
    ap.add_argument("--out", default=None, help="rank 0's result (.npz; default: a temporary file)")
    a = ap.parse_args(argv)
    if a.nodes is not None and a.nodes < 2:
        ap.error(f"argument -n/--nodes: at least 2 nodes, not {a.nodes}")
    if "--out" in rest:
        ap.error("give --out before `--`: it is where rank 0's result goes")
    nodes = a.nodes or len(json.loads(Path(a.hostfile).read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out) if a.out else Path(tmp) / "run.npz"
        try:
            figures, _ = launch(nodes, rest, out, timeout=a.timeout, backend=a.backend, hostfile=a.hostfile)
        except NodeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
