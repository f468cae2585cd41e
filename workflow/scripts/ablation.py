"""The paper's implementation ablations: per-miss synchronisation (gate C) and the wire dtype
between nodes (gate F)."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import run_gate  # noqa: E402

from harness import gate_f, online  # noqa: E402

s, wc = snakemake.params.settings, snakemake.wildcards

if snakemake.rule == "sync_ablation":
    run_gate(
        snakemake,
        "C",
        "sync_ablation",
        lambda: online.sync_ablation(
            wc.model,
            s["tier"],
            wc.pset,
            s["slots"],
            s["prompts"],
            s["tokens"],
            installs=s["installs"],
            repeats=s.get("repeats", 3),
        ),
    )
else:
    run_gate(
        snakemake, "F", "wire_ablation", lambda: gate_f.wire_ablation(wc.model, s["nodes"], s["tokens"], s["wires"])
    )
