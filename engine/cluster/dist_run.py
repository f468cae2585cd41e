"""One multi-node decode, run under `mlx.launch` (every rank runs this module):

    mlx.launch --backend ring -n 3 python -m engine.cluster.dist_run --model qwen3moe-tiny \\
        --placement round_robin --tokens 16 --out /tmp/run.npz

Every rank builds the same placement from the same inputs; rank 0 decodes and writes its
logits and figures to `--out`, the others serve their experts until node 0 says stop.
"""

import argparse
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

from ..api import load
from ..config import EngineConfig
from ..models import registry
from ..models.anatomy import moe_blocks
from ..runtime.loop import decode
from ..runtime.moe import SlotSwitchGLU
from . import multinode
from . import placement as pl


def placement_for(args, num_layers, num_experts, world):
    """(executes_on (L, E), placement meta), identical on every rank."""
    if args.placement == "round_robin":
        where = (np.arange(num_layers)[:, None] * num_experts + np.arange(num_experts)[None, :]) % world
        return where, {"strategy": "round_robin"}
    nodes = [
        pl.Node(cost=c, capacity=m, link=r)
        for c, m, r in zip(args.node_cost[:world], args.node_capacity[:world], args.node_link[:world])
    ]
    if args.popularity:
        pi = np.load(args.popularity)
    else:
        pi = np.ones((num_layers, num_experts)) / num_experts
    p = pl.STRATEGIES[args.placement](pi, nodes, 1.0, args.hot)
    return p.executes_on(), {"strategy": args.placement}


def _write(out, figures, **arrays):
    """Rank 0's output, written last and atomically: it exists only for a run that finished."""
    if out:
        tmp = out + ".tmp.npz"
        np.savez(tmp, figures=json.dumps(figures), **arrays)
        os.replace(tmp, out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m engine.cluster.dist_run", description=__doc__)
    ap.add_argument("--model", default="qwen3moe-tiny")
    ap.add_argument("--prompt", default="def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--slots", type=int, default=None, help="node 0's slots per layer (default: all)")
    ap.add_argument(
        "--placement", default="round_robin", choices=["round_robin", "algorithm2", "node0_only", "popularity_only"]
    )
    ap.add_argument("--popularity", default=None, help=".npy of pi[l, e] for the cost-aware placements")
    ap.add_argument("--node-cost", type=float, nargs="*", default=[1.0, 1.0, 1.0, 1.0])
    ap.add_argument(
        "--node-capacity",
        type=float,
        nargs="*",
        default=[1e9, 1e9, 1e9, 1e9],
        help="experts per node (the placement's unit size is one expert)",
    )
    ap.add_argument("--node-link", type=float, nargs="*", default=[0.0, 0.5, 0.5, 0.5])
    ap.add_argument("--hot", type=int, default=0)
    ap.add_argument(
        "--adaptive-every",
        type=int,
        default=0,
        help="adaptive scheduler: re-place and move experts every N decode tokens (0: static)",
    )
    ap.add_argument("--decay", type=float, default=0.9, help="adaptive scheduler: popularity moving-average decay")
    ap.add_argument(
        "--wire",
        choices=["model", "float16", "bfloat16", "float32"],
        default="model",
        help="dtype of activations and results on the wire (default: the model's)",
    )
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent node fails the run")
    ap.add_argument("--forced", default=None, help=".npy of tokens to feed (teacher forcing)")
    ap.add_argument("--out", default=None, help="rank 0 writes logits and figures here (.npz)")
    ap.add_argument(
        "--bare",
        action="store_true",
        help="no model run: time bare exchanges of one decode layer's bytes with every node",
    )
    ap.add_argument("--pid-dir", default=None, help="each rank writes rank<N>.pid here (for fault tests)")
    a = ap.parse_args(argv)
    group, dog = multinode.init(a.timeout)
    rank, world = group.rank(), group.size()
    if a.pid_dir:
        with open(os.path.join(a.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    cfg = json.loads((registry.model_dir(a.model) / "config.json").read_text())
    spec = dict(
        layers=cfg["num_hidden_layers"],
        experts=cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"],
        hidden=cfg["hidden_size"],
        dtype=cfg.get("torch_dtype", "float16"),
    )
    num_layers = spec["layers"]
    try:
        multinode.check_versions(group, dog, a.model)
    except multinode.NodeError as e:
        print(f"error: node {rank}: {e}", file=sys.stderr, flush=True)
        return 4
    where, meta = placement_for(a, num_layers, spec["experts"], world)
    model_dt = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}[spec["dtype"]]
    wire = model_dt if a.wire == "model" else multinode.DTYPES[a.wire]
    if a.bare:
        if rank != 0:
            multinode.serve_bare(group, dog, spec["hidden"], wire)
            return
        links = {n: multinode.Link(group, n, dog, wire) for n in range(1, world)}
        kmax = max(1, -(-spec["top_k"] // world))  # an even share of a token's experts per node
        rtts = multinode.bare_exchanges(links, spec["hidden"], kmax, num_layers * a.tokens, wire)
        multinode.stop_all(group, links)
        figures = dict(
            nodes=world,
            rtt_ms_median=1e3 * float(np.median(rtts)),
            wire=str(wire),
            bytes_per_exchange=sum(l.bytes_sent + l.bytes_received for l in links.values()) / len(rtts),
        )
        _write(a.out, figures)
        print(json.dumps(figures), flush=True)
        return
    if rank != 0:
        multinode.serve(group, dog, a.model, where, wire)
        return
    eng = load(a.model, EngineConfig(slots=a.slots))
    links = {n: multinode.Link(group, n, dog, wire) for n in range(1, world)}
    stats = {"rtt_s": []}
    layers = []
    for o, b in enumerate(moe_blocks(eng.model, kinds=SlotSwitchGLU)):
        sw = b.switch
        layers.append(multinode.DistributedSwitchGLU(sw.glu, sw._cache, o, where[o], links, stats))
        setattr(b.parent, b.attr, layers[-1])
    scheduler = None
    if a.adaptive_every:
        nodes = [
            pl.Node(cost=c, capacity=m, link=r)
            for c, m, r in zip(a.node_cost[:world], a.node_capacity[:world], a.node_link[:world])
        ]
        pi = np.load(a.popularity) if a.popularity else np.ones(where.shape) / where.shape[1]
        scheduler = multinode.AdaptiveScheduler(
            pi, nodes, links, layers, stats, every=a.adaptive_every, decay=a.decay, hot=a.hot
        )
        stats["scheduler"] = scheduler
    ids = eng.tokenizer.encode(a.prompt)
    forced = np.load(a.forced) if a.forced else None
    t0 = time.perf_counter()
    tokens, records, logits = decode(eng.model, ids, a.tokens, forced=forced, keep_logits=True)
    seconds = time.perf_counter() - t0
    multinode.stop_all(group, links)
    eng.close()
    figures = dict(
        nodes=world,
        tokens=a.tokens,
        seconds=seconds,
        tok_s=a.tokens / sum(r["seconds"] for r in records[1:]),
        bytes_sent=sum(l.bytes_sent for l in links.values()),
        bytes_received=sum(l.bytes_received for l in links.values()),
        bytes_per_token=sum(l.bytes_sent + l.bytes_received for l in links.values()) / (len(ids) + a.tokens),
        rtt_ms_median=1e3 * float(np.median(stats["rtt_s"])) if stats["rtt_s"] else None,
        remote_share=float((where != 0).mean()),
        wire=str(wire),
        **meta,
    )
    if scheduler is not None:
        figures.update(
            adaptive_every=a.adaptive_every,
            moves=scheduler.moves,
            replacements=scheduler.replacements,
            schedule=scheduler.history,
            final_remote_share=float(np.mean([(l._where != 0).mean() for l in layers])),
        )
    _write(
        a.out,
        figures,
        tokens=np.array(tokens),
        prompt=np.array(ids),
        **{f"logits_{i}": l for i, l in enumerate(logits)},
    )
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    sys.exit(main())
