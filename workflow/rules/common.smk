import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")

from harness import models
from harness import provenance

# The interpreter running Snakemake runs the engine too (the project's virtual environment).
PYTHON = sys.executable
# The rules declare what the engine builds under the working directory's resources/ (the
# checkout's, or .test's in `snakemake --directory .test`): the engine must build there, whatever
# the caller's environment says.
os.environ["TITAN_RESOURCES"] = str(Path("resources").resolve())


def run_id(value):
    """This invocation's run id. `auto` is decided once, by the process that plans the run, and
    handed to every job it spawns through the environment (an executor such as SLURM's or
    cluster-generic's parses this file again in each job's own Snakemake)."""
    if value != "auto":
        return value
    if os.environ.get("TITAN_RUN"):
        return os.environ["TITAN_RUN"]
    state = provenance.git_state()
    commit = (state["commit"] or "nocommit")[:12] + ("-dirty" if state["dirty"] else "")
    return f"{commit}-{provenance.host_alias()}"


SPAWNED = "TITAN_RUN" in os.environ  # a job of a run planned by another process (or a user's choice)
RUN = run_id(config.get("run", "auto"))
os.environ["TITAN_RUN"] = RUN


# Snakemake passes these on to the jobs an executor runs elsewhere.
envvars:
    "TITAN_RUN",
    "TITAN_RESOURCES",


TABLES = ["design", "prefetch_online", "miss_breakdown", "predictor_quality", "routing", "train_loss",
          "placement_sim", "multinode", "sync_ablation", "wire_ablation", "bench", "suite", "determinism", "claims"]
FIGURES = ["design", "throughput_vs_slots", "stall_vs_slots", "miss_breakdown", "predictor_recall",
           "routing", "train_loss", "placement", "throughput_vs_memory", "prediction_pays", "many_rows",
           "families"]
FITTED = ["popularity", "transition", "probe"]


wildcard_constraints:
    out="results|results/claims_check",
    figdir="figures|results/runs/[A-Za-z0-9][A-Za-z0-9._-]*/figures",
    tier="page_cache|cold",
    pset="general|code",
    split="fit|eval",
    model="[a-z0-9][a-z0-9._-]*",


CHECK = "results/claims_check"  # the claims check's output tree (rule claims_check)


def settings(out):
    """The configuration an output tree is made with (the claims check's: the default's, with its
    own, smaller ablation)."""
    if out == CHECK:
        if "claims_check" not in config:
            raise WorkflowError(f"profile {config['profile']}: no `claims_check` section in the configuration")
        return {**config, "ablations": {**config["ablations"], "sync": config["claims_check"]["sync"]}}
    return config


def existing_raw(out):
    """Every raw file already under an output tree (what `figures` tables)."""
    return sorted(str(p) for p in Path(out, "raw").rglob("*.jsonl"))


def raw_inputs(figdir):
    """What a figure folder's tables are made from: `figures/` from the raw logs already there;
    a run's folder (results/runs/RUN/figures) from those and this run's."""
    if figdir == "figures":
        return existing_raw("results")
    return sorted(set(existing_raw("results")) | set(raw_outputs("results")))


def spec(model):
    try:
        return models.get_spec(model)
    except models.RegistryError as e:
        raise WorkflowError(str(e))


def config_models(section):
    """Every model a configuration names."""
    return (section["prefetch_online"]["models"] + section["design"]["parity_models"]
            + section["routing"]["models"] + section["placement"]["models"]
            + section["ablations"]["sync"]["models"] + section["ablations"]["wire"]["models"])


def trained_base(model):
    """The model whose training run writes `model`: itself, or the model it is the float32 variant of."""
    base = model.removesuffix("-f32")
    return base if base != model and "training" in models.load_registry().get(base, {}) else model


# The models a training run makes (olmoe-trained also writes olmoe-trained-f32).
TRAINED = sorted({trained_base(m) for m, s in models.load_registry().items() if "training" in s})


def trained_models():
    return sorted({trained_base(m) for m in config_models(config) if "training" in spec(m)})


def check_models():
    """Refuse unknown models and absent real weights before any job runs."""
    po = config["prefetch_online"]
    for m in po.get("by_model", {}):
        if m not in po["models"]:
            raise WorkflowError(f"prefetch_online.by_model: '{m}' is not one of prefetch_online.models {po['models']}")
    for m in config_models(config):
        s = spec(m)
        if s["kind"] == "real":
            try:
                models.real_model_dir(s)
            except models.RegistryError as e:
                raise WorkflowError(f"profile {config['profile']}: {e}")


check_models()


def check_values():
    """Values the schema allows but a model cannot take, refused at planning time naming the
    config key (a job would otherwise fail in the middle of a run)."""
    def within(key, values, low, high, what):
        for v in values if isinstance(values, list) else [values]:
            if not low <= v <= high:
                raise WorkflowError(f"profile {config['profile']}: {key}: {v} is outside {low}..{high} ({what})")

    d = config["design"]
    within("design.top_k", d["top_k"], 1, d["experts"], "design.experts")
    within("design.slots", d["slots"], d["top_k"], d["experts"], "design.top_k..design.experts")
    po = config["prefetch_online"]
    for m in po["models"]:
        shape = models.shape(m)
        E, K, L = shape["experts"] or 1 << 30, shape["top_k"] or 1, shape["layers"] or 1 << 30
        own = po.get("by_model", {}).get(m, {})

        def at(field):  # the value a model's sweep takes, and the key that set it
            return (f"prefetch_online.by_model.{m}.{field}", own[field]) if field in own else (
                f"prefetch_online.{field}", po[field])

        within(*at("slots"), K, E, f"{m}'s top_k..experts")
        within(*at("depths"), 1, L, f"{m}'s layers")
        within(*at("predict_size"), 1, E, f"{m}'s experts")
    sync = config["ablations"]["sync"]
    for m in sync["models"]:
        shape = models.shape(m)
        within("ablations.sync.slots", sync["slots"], shape["top_k"] or 1, shape["experts"] or 1 << 30,
               f"{m}'s top_k..experts")
    if "claims_check" in config:
        cc = config["claims_check"]["sync"]
        for m in cc["models"]:
            shape = models.shape(m)
            within("claims_check.sync.slots", cc["slots"], shape["top_k"] or 1, shape["experts"] or 1 << 30,
                   f"{m}'s top_k..experts")


check_values()


def model_input(model):
    """A trained model is made by the `train_model` rule; the others are built by the engine."""
    s = spec(model)
    if "training" in s:
        return [f"resources/models/{trained_base(model)}/titan-build.json"]
    return []


def store_input(model):
    """The expert store an offloaded engine reads (the `store` rule)."""
    return [f"resources/stores/{model}/index.json"]


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


def online(out, model):
    """Gate C's settings for one model: the sweep, with the model's own `by_model` entries."""
    po = settings(out)["prefetch_online"]
    return {**{k: v for k, v in po.items() if k != "by_model"}, **po.get("by_model", {}).get(model, {})}


def fitted_inputs(wc):
    po = online(wc.out, wc.model)
    return fitted_files(wc.model, [wc.pset], po["predictors"], po["depths"], po) + model_input(wc.model)


def online_inputs(wc):
    return fitted_inputs(wc) + store_input(wc.model)


# Say plainly when this run id has nothing left to measure (the planning process only: a job
# spawned by an executor inherits TITAN_RUN and stays quiet).
if not SPAWNED and all(os.path.exists(f) for f in raw_outputs("results")):
    print(f"[titan] run {RUN}: every measurement of this run id is already under results/raw/; `all` only "
          f"makes its tables and figures. To measure anew: snakemake --cores 2 all --config run=NEW_NAME",
          file=sys.stderr)
