import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")

sys.path.insert(0, workflow.basedir)
from engine.models import registry  # noqa: E402
from harness import rawlog  # noqa: E402

# The interpreter running Snakemake runs the engine too (the project's virtual environment).
PYTHON = sys.executable
# Every benchmark output of this invocation carries this run id: a rerun adds new raw files.
RUN = rawlog.new_run_id()
# `snakemake figures` regenerates tables and figures from the raw logs already there.
FIGURES_ONLY = bool({"figures", "environment"} & set(sys.argv[1:]))

TABLES = ["design", "prefetch_online", "miss_breakdown", "predictor_quality", "routing", "train_loss",
          "placement_sim", "multinode", "sync_ablation", "wire_ablation", "bench", "claims"]
FIGURES = ["design", "throughput_vs_slots", "stall_vs_slots", "miss_breakdown", "predictor_recall",
           "routing", "train_loss", "placement"]
FITTED = ["popularity", "transition", "probe"]


wildcard_constraints:
    out="results|results/smoke",
    figdir="figures|results/smoke/figures",
    tier="page_cache|cold",
    pset="general|code",
    split="fit|eval",
    model="[a-z0-9][a-z0-9._-]*",


def settings(out):
    """The configuration section an output tree is made with."""
    return config if out == "results" else config["smoke"]


def out_of(figdir):
    return "results" if figdir == "figures" else "results/smoke"


def spec(model):
    try:
        return registry.get_spec(model)
    except registry.RegistryError as e:
        raise WorkflowError(str(e))


def check_models():
    """Refuse unknown models and absent real weights before any job runs."""
    for section in (config, config["smoke"]):
        for m in (section["prefetch_online"]["models"] + section["design"]["parity_models"]
                  + section["routing"]["models"] + section["placement"]["models"]
                  + section["ablations"]["sync"]["models"] + section["ablations"]["wire"]["models"]):
            s = spec(m)
            if s["kind"] == "real":
                try:
                    registry.real_model_dir(s)
                except registry.RegistryError as e:
                    raise WorkflowError(f"profile {config['profile']}: {e}")


if not FIGURES_ONLY:
    check_models()


def model_input(model):
    """A trained model is made by the `train` rule; the others are built by the engine."""
    s = spec(model)
    if "training" in s:
        return [f"resources/models/{model}/titan-build.json"]
    return []


def trace_file(model, pset, split, tokens):
    return f"resources/traces/{model}/{pset}-{split}-t{tokens}.npz"


def raw_outputs(out):
    s = settings(out)
    po = s["prefetch_online"]
    files = [f"{out}/raw/B/design/{RUN}.jsonl"]
    files += expand(f"{out}/raw/C/prefetch_online/{RUN}-{{model}}-{{tier}}-{{pset}}.jsonl",
                    model=po["models"], tier=po["tiers"], pset=po["prompt_sets"])
    files += expand(f"{out}/raw/C/predictor_quality/{RUN}-{{model}}-{{pset}}.jsonl",
                    model=po["models"], pset=po["prompt_sets"])
    files += expand(f"{out}/raw/C/routing/{RUN}-{{model}}.jsonl", model=s["routing"]["models"])
    files += expand(f"{out}/raw/F/placement_sim/{RUN}-{{model}}.jsonl", model=s["placement"]["models"])
    if s["placement"]["measured_nodes"]:
        files += expand(f"{out}/raw/F/multinode/{RUN}-{{model}}.jsonl", model=s["placement"]["models"])
    ab = s["ablations"]
    files += expand(f"{out}/raw/C/sync_ablation/{RUN}-{{model}}-{{pset}}.jsonl",
                    model=ab["sync"]["models"], pset=ab["sync"]["prompt_sets"])
    files += expand(f"{out}/raw/F/wire_ablation/{RUN}-{{model}}.jsonl", model=ab["wire"]["models"])
    return files


def tables(figdir):
    return expand(f"{figdir}/tables/{{t}}.{{ext}}", t=TABLES, ext=["csv", "md"])


def plots(figdir):
    return expand(f"{figdir}/{{f}}.{{ext}}", f=FIGURES, ext=["png", "pdf"])


# Routing statistics compare the fitted predictors at these depths, whatever the sweep runs.
ROUTING_DEPTHS = [1, 2, 3]


def fitted_files(model, psets, names, depths, po):
    """The fitted predictors (made once by the `fit` rule) that a job reads."""
    return expand(
        "resources/predictors/{model}/{pset}-{predictor}-d{depth}-m{size}-t{tokens}.npz",
        model=model, pset=psets, predictor=[p for p in names if p in FITTED], depth=depths,
        size=po["predict_size"], tokens=po["fit_tokens"],
    )


def fitted_inputs(wc):
    po = settings(wc.out)["prefetch_online"]
    return fitted_files(wc.model, [wc.pset], po["predictors"], po["depths"], po) + model_input(wc.model)
