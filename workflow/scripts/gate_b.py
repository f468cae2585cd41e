"""Gate B (design): slot writes, kernel sequences and activation parity; one raw file."""

from harness import design
from harness.report.jobs import run_gate

s = snakemake.params.settings


def measure():
    results = design.slot_write(s["hidden"], s["width"], s["dtype"], s["slots"], s["experts"], s["repeats"])
    results += design.kernels(s["hidden"], s["width"], s["dtype"], s["experts"], s["top_k"], s["repeats"])
    for m in s["parity_models"]:
        results += design.parity(m, design.PARITY_PROMPT, s["parity_steps"])
    return results


run_gate(snakemake, "B", "design", measure)
