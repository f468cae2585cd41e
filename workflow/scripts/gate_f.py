"""Gate F (placement): the simulated grid or the measured multi-node runs of one model."""

from harness import gate_f
from harness.report.jobs import run_gate

s, wc = snakemake.params.settings, snakemake.wildcards
fit_tokens = snakemake.params.fit_tokens


def measured():
    results = gate_f.measure(
        wc.model,
        s["measured_nodes"],
        s["strategies"],
        s["tokens"],
        fit_tokens,
        s["measured_capacity"],
        s["measured_link"],
        s["ssd"],
    )
    bad = [r for r in results if r.get("max_abs_logit_diff", 0.0) != 0.0]
    if bad:  # a run that is not bit-identical to one node is a failure, not a figure
        raise SystemExit(f"multi-node logits differ from one node: {bad}")
    return results


if snakemake.rule == "placement_sim":
    run_gate(
        snakemake,
        "F",
        "placement_sim",
        lambda: gate_f.simulate(
            wc.model, fit_tokens, s["nodes"], s["links"], s["capacities"], s["ssd"], s["hot"], s["every"]
        ),
    )
else:
    run_gate(snakemake, "F", "multinode", measured)
