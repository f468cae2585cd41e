"""Gate C (prefetch_online): the sweep of one model, tier and prompt set; one raw file."""

from harness import online
from harness.checkpoint import scratch_for
from harness.report.jobs import run_gate

# Scratch for the repetitions a sweep stopped by a time limit had finished (harness.checkpoint):
# the rerun of this job resumes there. One per output file.
partial = scratch_for(snakemake.output[0])

s, wc = snakemake.params.settings, snakemake.wildcards
run_gate(
    snakemake,
    "C",
    "prefetch_online",
    lambda: online.sweep(
        wc.model,
        wc.tier,
        wc.pset,
        s["slots"],
        s["predictors"],
        s["depths"],
        s["prompts"],
        s["tokens"],
        readers=s["readers"],
        fit_tokens=s["fit_tokens"],
        size=s["predict_size"],
        repeats=s.get("repeats", 3),
        min_probs=s.get("min_probs", [0.0]),
        checkpoint=partial,
        progress=lambda r: print(r, flush=True),
    ),
)
