"""Gate F (`placement`): the expected per-step cost of placing experts on several nodes
(Algorithm 2 against its baselines and the adaptive scheduler), simulated on traces; and
measured multi-node runs on local processes, bit-exact against one node, with the per-layer
round trip beside a bare `mx.distributed` exchange of the same bytes."""

import itertools
import tempfile
import time
from pathlib import Path

import numpy as np

from engine import max_abs_diff
from engine.cluster import multinode
from engine.cluster import placement as pl
from engine.models.registry import load_reference
from engine.predict import prompts
from engine.runtime.loop import decode
from engine.tracing import trace


def node_config(n, link, capacity, cost=1.0):
    """Node 0 and n-1 remote nodes; capacity in experts per node; link in units of c."""
    return [pl.Node(cost=cost, capacity=capacity)] + [
        pl.Node(cost=cost, capacity=capacity, link=link) for _ in range(n - 1)
    ]


def simulate(model_id, tokens, nodes_list, links, capacities, ssd, hot, every):
    """Expected and trace-replayed cost per token of every strategy over a grid of node
    configurations; the adaptive scheduler is fitted on general prompts and replayed on code
    prompts (a popularity shift), beside the static Algorithm 2 from the same prior."""
    fit = trace.load(trace.trace_path(model_id, "general", "fit", tokens))
    ev = trace.load(trace.trace_path(model_id, "general", "eval", tokens))
    shift = trace.load(trace.trace_path(model_id, "code", "eval", tokens))
    E, L = fit.num_experts, fit.num_layers
    pi = pl.popularity_from(fit.experts, E)
    out = []
    for n, link, frac in itertools.product(nodes_list, links, capacities):
        cap = max(1, int(frac * L * E))
        nodes = node_config(n, link, cap)
        base = dict(model=model_id, nodes=n, link=link, capacity_share=frac, ssd=ssd, hot=hot)
        for name, fn in pl.STRATEGIES.items():
            p = fn(pi, nodes, 1.0, hot)
            out.append(
                dict(
                    base,
                    strategy=name,
                    expected=pl.expected_cost(p, pi, nodes, ssd),
                    replayed=pl.trace_cost(p, ev.experts, nodes, ssd),
                    shifted=pl.trace_cost(p, shift.experts, nodes, ssd),
                    remote_share=float((p.executes_on() > 0).mean()),
                    ssd_share=float((p.executes_on() == pl.SSD).mean()),
                )
            )
        ad = pl.adaptive(shift.experts, E, nodes, 1.0, ssd, pi, every=every, hot=hot, move_cost=0.0)
        out.append(
            dict(
                base, strategy="adaptive", expected=None, replayed=None, shifted=ad["cost_per_token"], moves=ad["moves"]
            )
        )
    return out


def spec_top_k(model) -> int:
    return next(layer.mlp.top_k for layer in model.layers if hasattr(layer.mlp, "switch_mlp"))


def measure(model_id, nodes_list, strategies, tokens, fit_tokens, capacity_share, link, ssd, timeout=600):
    """Measured runs on local processes for every strategy; each compared with one node."""
    fit = trace.load(trace.trace_path(model_id, "general", "fit", fit_tokens))
    E, L = fit.num_experts, fit.num_layers
    pi = pl.popularity_from(fit.experts, E)
    ref, tok, spec = load_reference(model_id)
    # The popularity comes from prose (the general fit traces); decoding code is the shift the
    # adaptive scheduler is for. Every strategy decodes the same prompt.
    prompt = prompts.load("code", "eval")[0]["text"]
    ids = tok.encode(prompt)
    ref_tokens, _, ref_logits = decode(ref, ids, tokens, keep_logits=True)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        np.save(tmp / "pi.npy", pi)
        np.save(tmp / "forced.npy", np.array(ref_tokens))
        cap = max(1, int(capacity_share * L * E))
        for n in nodes_list:
            nodes = node_config(n, link, cap)
            for strategy in strategies:
                # node 0 holds its share in its slot table; the rest of its experts are read on demand
                slots = max(spec_top_k(ref), min(E, int(capacity_share * E)))
                # adaptive: Algorithm 2 at the start, then live re-placement and moves during decode
                args = [
                    "--model",
                    model_id,
                    "--prompt",
                    prompt,
                    "--tokens",
                    tokens,
                    "--placement",
                    "algorithm2" if strategy == "adaptive" else strategy,
                    "--slots",
                    slots,
                    "--popularity",
                    tmp / "pi.npy",
                    "--forced",
                    tmp / "forced.npy",
                    "--timeout",
                    120,
                    "--node-cost",
                    *[x.cost for x in nodes],
                    "--node-capacity",
                    *[x.capacity for x in nodes],
                    "--node-link",
                    *[x.link for x in nodes],
                ]
                if strategy == "adaptive":
                    args += ["--adaptive-every", max(1, tokens // 4), "--decay", 0.5]
                t0 = time.perf_counter()
                figures, z = multinode.launch(n, args, tmp / f"{n}-{strategy}.npz", timeout=timeout)
                wall = time.perf_counter() - t0
                logits = [z[f"logits_{i}"] for i in range(len(ref_logits))]
                diff = max_abs_diff(ref_logits, logits)
                p = pl.STRATEGIES["algorithm2" if strategy == "adaptive" else strategy](pi, nodes, 1.0, 0)
                extra = {k: figures[k] for k in ("moves", "replacements", "final_remote_share") if k in figures}
                out.append(
                    dict(
                        model=model_id,
                        kind="measured",
                        nodes=n,
                        strategy=strategy,
                        link=link,
                        slots=slots,
                        capacity_share=capacity_share,
                        ssd=ssd,
                        expected=pl.expected_cost(p, pi, nodes, ssd),
                        ms_per_token=1e3 / figures["tok_s"],
                        max_abs_logit_diff=diff,
                        launch_seconds=wall,
                        **{k: figures[k] for k in ("bytes_per_token", "rtt_ms_median", "remote_share", "wire")},
                        **extra,
                    )
                )
            bare = multinode.launch(
                n,
                ["--model", model_id, "--bare", "--tokens", tokens, "--timeout", 120],
                tmp / f"{n}-bare.npz",
                timeout=timeout,
            )[0]
            out.append(
                dict(
                    model=model_id,
                    kind="bare_exchange",
                    nodes=n,
                    rtt_ms_median=bare["rtt_ms_median"],
                    bytes_per_exchange=bare["bytes_per_exchange"],
                )
            )
    return out


def wire_ablation(model_id, nodes, tokens, wires, timeout=600):
    """Max |logit difference| against one node with activations and results sent in each wire
    dtype (`model`: the model's own), round-robin placement so most experts are remote."""
    ref, tok, spec = load_reference(model_id)
    prompt = "The Python language reference describes the syntax and core semantics of the language."
    ids = tok.encode(prompt)
    ref_tokens, _, ref_logits = decode(ref, ids, tokens, keep_logits=True)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        np.save(tmp / "forced.npy", np.array(ref_tokens))
        for wire in wires:
            args = [
                "--model",
                model_id,
                "--prompt",
                prompt,
                "--tokens",
                tokens,
                "--placement",
                "round_robin",
                "--forced",
                tmp / "forced.npy",
                "--timeout",
                120,
                "--wire",
                wire,
            ]
            figures, z = multinode.launch(nodes, args, tmp / f"{wire}.npz", timeout=timeout)
            logits = [z[f"logits_{i}"] for i in range(len(ref_logits))]
            diff = max_abs_diff(ref_logits, logits)
            out.append(
                dict(
                    model=model_id,
                    dtype=spec["dtype"],
                    nodes=nodes,
                    wire=wire,
                    wire_dtype=figures["wire"],
                    tokens=tokens,
                    max_abs_logit_diff=diff,
                    remote_share=figures["remote_share"],
                    bytes_per_token=figures["bytes_per_token"],
                )
            )
    return out
