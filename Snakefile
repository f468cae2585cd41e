# Titan's experiment harness: gates B (design), C (prefetch_online) and F (placement) on the
# engine, raw logs under results/raw/, tables and figures made from them (docs/workflow.md).
from snakemake.utils import min_version

min_version("9.0")


configfile: "configs/default.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/design.smk"
include: "workflow/rules/prefetch_online.smk"
include: "workflow/rules/placement.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/claims.smk"


rule all:
    # This run's measurements (run id: config `run`), then its tables and figures, made from
    # every raw log there is, under results/runs/RUN/figures/. A rerun resumes the run.
    default_target: True
    input:
        raw_outputs("results"),
        tables(f"results/runs/{RUN}/figures"),
        plots(f"results/runs/{RUN}/figures"),


rule figures:
    # The published tables and figures (figures/) from the raw logs already under results/raw/;
    # measures nothing.
    input:
        tables("figures"),
        plots("figures"),


rule gate_b:
    input:
        f"results/raw/B/design/{RUN}.jsonl",


rule gate_c:
    input:
        [f for f in raw_outputs("results") if "/raw/C/" in f],


rule ablations:
    input:
        [f for f in raw_outputs("results") if "_ablation/" in f],


rule gate_f:
    input:
        [f for f in raw_outputs("results") if "/raw/F/" in f],
