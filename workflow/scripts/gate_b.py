"""Gate B (design): slot writes, kernel sequences and activation parity; one raw file."""

from harness import design
from harness.report.jobs import run_gate

s = snakemake.params.settings


def measure():
    shape, timing = (s["hidden"], s["width"], s["dtype"]), dict(repeats=s["repeats"], sample_ms=s["sample_ms"])
    results = design.slot_write(*shape, s["slots"], s["experts"], **timing)
    results += design.kernels(*shape, s["experts"], s["top_k"], **timing)
    for m in s["parity_models"]:
        results += design.parity(m, design.PARITY_PROMPT, s["parity_steps"])
    return results


run_gate(snakemake, "B", "design", measure)
