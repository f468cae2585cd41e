# Titan's experiment harness: gates B (design) and C (prefetch_online) on the engine, raw logs
# under results/raw/, tables and figures regenerated from them. See README.md for the targets.


configfile: "workflow/config/default.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/design.smk"
include: "workflow/rules/prefetch_online.smk"
include: "workflow/rules/placement.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/figures.smk"


rule all:
    default_target: True
    input:
        tables("figures"),
        plots("figures"),


rule smoke:
    input:
        tables("results/smoke/figures"),
        plots("results/smoke/figures"),


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
