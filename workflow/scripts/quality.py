"""Predictor quality on held-out traces: precision, recall and replayed hit rate beside LRU
and Belady at every S; one raw file per model and prompt set."""

import sys

sys.path.insert(0, snakemake.scriptdir)
from _common import run_gate  # noqa: E402

from harness import online  # noqa: E402

s, wc = snakemake.params.settings, snakemake.wildcards
run_gate(
    snakemake,
    "C",
    "predictor_quality",
    lambda: online.quality(
        wc.model, wc.pset, s["predictors"], s["depths"], s["slots"], s["fit_tokens"], s["predict_size"]
    ),
)
