"""Routing statistics of one model from its traces: popularity skew per layer, cross-layer
predictability by depth, and code-versus-general specialisation; one raw file."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import run_gate  # noqa: E402

from harness import routing  # noqa: E402

s, wc = snakemake.params.settings, snakemake.wildcards
run_gate(
    snakemake,
    "C",
    "routing",
    lambda: routing.stats(wc.model, s["fit_tokens"], s["predict_size"], snakemake.params.depths),
)
