"""Predictor quality on held-out traces: precision, recall and replayed hit rate beside LRU
and Belady at every S; one raw file per model and prompt set."""

from harness import online
from harness.report.jobs import run_gate

s, wc = snakemake.params.settings, snakemake.wildcards
run_gate(
    snakemake,
    "C",
    "predictor_quality",
    lambda: online.quality(
        wc.model, wc.pset, s["predictors"], s["depths"], s["slots"], s["fit_tokens"], s["predict_size"]
    ),
)
