"""Routing statistics of one model from its traces: popularity skew per layer, cross-layer
predictability by depth, and code-versus-general specialisation; one raw file."""

from harness import routing
from harness.report.jobs import run_gate

s, wc = snakemake.params.settings, snakemake.wildcards
run_gate(
    snakemake,
    "C",
    "routing",
    lambda: routing.stats(wc.model, s["fit_tokens"], s["predict_size"], snakemake.params.depths),
)
