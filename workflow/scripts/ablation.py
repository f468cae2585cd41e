"""The paper's implementation ablations: per-miss synchronisation (gate C) and the wire dtype
between nodes (gate F)."""

from harness import gate_f, online
from harness.report.jobs import run_gate

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
