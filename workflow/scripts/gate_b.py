"""Gate B (design): slot writes, kernel sequences and activation parity; one raw file."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import run_gate  # noqa: E402

from harness import design  # noqa: E402

s = snakemake.params.settings


def measure():
    results = design.slot_write(s["hidden"], s["width"], s["dtype"], s["slots"], s["experts"], s["repeats"])
    results += design.kernels(s["hidden"], s["width"], s["dtype"], s["experts"], s["top_k"], s["repeats"])
    for m in s["parity_models"]:
        results += design.parity(m, design.PARITY_PROMPT, s["parity_steps"])
    return results


run_gate(snakemake, "B", "design", measure)
