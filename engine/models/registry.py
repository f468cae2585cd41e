"""The model registry: the models Titan knows, each resolved to a local directory in mlx-lm's
format and loaded with `mlx_lm.load`.

The registry ships with the package (`engine/data/models.yaml`, validated against
`engine/data/models.schema.yaml`). A user's own models file extends or overrides it, entry by
entry: `--models FILE` on the command line or `$TITAN_MODELS`, else `configs/models.yaml` in the
current directory if there is one. Real models are pinned by a 40-hex commit and looked up in a
local directory or the local Hugging Face cache; nothing is ever downloaded. Embedded models are
built on demand, deterministically, into the resources folder (`engine.config`).
"""

import copy
import json
import os
import re
from pathlib import Path

import jsonschema
import mlx_lm
import mlx_lm.utils
import yaml
from huggingface_hub import constants

from ..config import DATA, checkout, resources_dir
from . import embedded
from .anatomy import TOP_K_NAMES

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML was built with it

PACKAGED = DATA / "models.yaml"
ARCHITECTURES = DATA / "architectures.yaml"  # one tiny model per MoE architecture of mlx-lm
SCHEMA = DATA / "models.schema.yaml"
HEX40 = re.compile(r"^[0-9a-f]{40}$")


class RegistryError(ValueError):
    """A model that cannot be resolved, with what to do about it."""


def user_path() -> Path | None:
    """The user's models file that extends the packaged registry, if any."""
    if os.environ.get("TITAN_MODELS"):
        return Path(os.environ["TITAN_MODELS"])
    local = Path("configs") / "models.yaml"
    if local.exists() and local.resolve() != PACKAGED.resolve():
        return local
    return None


def config_path() -> Path:
    """The file a model's entry is read from last: the user's file, else the packaged one."""
    return user_path() or PACKAGED


def _field(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def validate(data, source) -> dict:
    """Validate a parsed models file against the schema; errors name the field."""
    schema = yaml.safe_load(SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        raise RegistryError(f"{source}: field {_field(err.absolute_path)}: {err.message}")
    for mid, spec in data["models"].items():
        if spec["kind"] != "embedded" or "config" in spec:
            continue
        if spec["top_k"] > spec["experts"]:
            raise RegistryError(
                f"{source}: field models.{mid}.top_k: {spec['top_k']} exceeds experts ({spec['experts']})"
            )
        head_dim = spec.get("head_dim") or spec["hidden"] // spec["heads"]
        if spec.get("head_dim") is None and spec["hidden"] % spec["heads"]:
            raise RegistryError(
                f"{source}: field models.{mid}.heads: hidden ({spec['hidden']}) is not a multiple of heads"
            )
        if spec["heads"] % spec.get("kv_heads", spec["heads"]):
            raise RegistryError(f"{source}: field models.{mid}.kv_heads: heads is not a multiple of kv_heads")
        if head_dim % 2:
            raise RegistryError(f"{source}: field models.{mid}.head_dim: must be even (rotary embedding)")
    return data["models"]


# (path, its text) -> its validated specs: a workflow asks for specs dozens of times while it builds
# its DAG, and parsing the files each time cost it 17 s of 20. Keyed on the text, so an edit shows
# at the next read however soon it comes.
_PARSED = {}


def read_models_file(path) -> dict:
    """Parse and validate one models file; returns {model id: spec} (a copy of its own)."""
    path = Path(path)
    try:
        key = (str(path.resolve()), path.read_bytes())
    except OSError:
        key = None  # _read_models_file names what is wrong
    if key is not None and key in _PARSED:
        return copy.deepcopy(_PARSED[key])
    models = _read_models_file(path)
    if key is not None:
        _PARSED[key] = copy.deepcopy(models)
    return models


def _read_models_file(path: Path) -> dict:
    if not path.exists():
        raise RegistryError(f"{path}: no such models file")
    if path.is_dir():
        raise RegistryError(f"{path}: a directory, not a models file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_LOADER)
    except UnicodeDecodeError as e:
        raise RegistryError(f"{path}: not a models file (not UTF-8 text: byte {e.start})") from None
    except OSError as e:
        raise RegistryError(f"{path}: cannot read the models file: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise RegistryError(f"{path}: {where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    return validate(data, path)


def load_registry(path=None) -> dict:
    """{model id: spec}: the packaged registry extended by the user's models file (or by `path`);
    each spec's `source` names the file it came from."""
    models = {}
    for packaged in (PACKAGED, ARCHITECTURES):
        models.update({mid: dict(spec, source=str(packaged)) for mid, spec in read_models_file(packaged).items()})
    extra = Path(path) if path else user_path()
    if extra is not None and extra.resolve() != PACKAGED.resolve():
        models.update({mid: dict(spec, source=str(extra)) for mid, spec in read_models_file(extra).items()})
    for mid, spec in models.items():
        real = spec.get("mirrors")
        if real is not None and models.get(real, {}).get("kind") != "real":
            raise RegistryError(f"{spec['source']}: field models.{mid}.mirrors: '{real}' is not a real model "
                                "of the registry (the checkpoint whose dimensions it takes)")  # fmt: skip
    return models


def get_spec(model_id: str, path=None) -> dict:
    models = load_registry(path)
    if model_id not in models:
        extra = path or user_path()
        where = f"{PACKAGED}" + (f" or {extra}" if extra else "")
        raise RegistryError(f"unknown model '{model_id}' (not in {where}); known: {', '.join(sorted(models))}")
    return dict(models[model_id], id=model_id)


def _hf_cache() -> Path:

    return Path(constants.HF_HUB_CACHE)


def _how_to_get(spec) -> str:
    return (
        f"Titan never downloads. On a machine with internet run `hf download {spec['repo']}` "
        f"(or `huggingface-cli download {spec['repo']}`), bring its Hugging Face cache here "
        f"(HF_HUB_CACHE={_hf_cache()}) or set `path:` for {spec['id']} in {spec.get('source', config_path())}, "
        f"then run `python -m engine pin {spec['id']}`."
    )


def real_model_dir(spec) -> Path:
    rev = spec.get("revision")
    if rev is None:
        raise RegistryError(
            f"model '{spec['id']}' has no pinned revision in {spec.get('source', config_path())}. " + _how_to_get(spec)
        )
    if not HEX40.match(str(rev)):
        raise RegistryError(f"model '{spec['id']}': revision {rev!r} is not a 40-hex commit. " + _how_to_get(spec))
    if spec.get("path"):
        p = Path(spec["path"]).expanduser()
        if not (p / "config.json").exists():
            raise RegistryError(f"model '{spec['id']}': {p} holds no config.json. " + _how_to_get(spec))
        return p
    snap = _hf_cache() / ("models--" + spec["repo"].replace("/", "--")) / "snapshots" / rev
    if not (snap / "config.json").exists():
        raise RegistryError(
            f"model '{spec['id']}' ({spec['repo']} at revision {rev}) is not in the local Hugging Face cache. "
            + _how_to_get(spec)
        )
    if not list(snap.glob("model*.safetensors")):
        raise RegistryError(f"model '{spec['id']}': {snap} holds no model*.safetensors weights. " + _how_to_get(spec))
    verify_real(spec, snap)
    return snap


def cache_blobs(snap: Path) -> dict:
    """{file: its blob's name} of a Hugging Face cache snapshot: the sha256 of a large (LFS) file,
    git's blob id of a small one; what the download was checked against."""
    out = {}
    for p in sorted(snap.rglob("*")):
        if p.is_symlink():
            name = Path(os.readlink(p)).name
            if re.fullmatch(r"[0-9a-f]{64}|[0-9a-f]{40}", name):
                out[str(p.relative_to(snap))] = name
    return out


def verify_real(spec, snap: Path, force: bool = False):
    """A pinned model's files against their blob names (sha256 or git blob id), once per process."""
    want = cache_blobs(snap)
    if not want:
        return
    how = f"fetch it again (`hf download {spec['repo']} --revision {spec['revision']}`)"
    try:
        embedded.verify_files(snap, want, how, force=force)
    except embedded.BuildError as e:
        raise RegistryError(str(e)) from None


def verify(model_id: str) -> int:
    """Hash every file of a model (built, trained or pinned) against what its build or download
    recorded, whatever was checked before; returns how many files. Raises naming a damaged one."""
    spec = get_spec(model_id)
    if spec["kind"] == "real":
        snap = real_model_dir(spec)
        verify_real(spec, snap, force=True)
        return len(cache_blobs(snap))
    out = model_dir(model_id, build=False)
    files = json.loads((out / embedded.MANIFEST).read_text())["files"]
    try:
        embedded.verify_files(out, files, f"rebuild it with `python -m engine build {model_id} --force`", force=True)
    except embedded.BuildError as e:
        raise RegistryError(str(e)) from None
    return len(files)


def model_dir(model_id: str, build: bool = True) -> Path:
    """The local mlx-lm directory of a model; embedded models are built on demand."""
    spec = get_spec(model_id)
    if spec["kind"] == "real":
        return real_model_dir(spec)
    out = resources_dir() / "models" / model_id
    try:
        embedded.check_or_build(spec, out, allow_build=build)
    except embedded.BuildError as e:
        raise RegistryError(str(e)) from None
    return out


def load(model_id: str, lazy: bool = False):
    """Load a model with mlx-lm; returns (model, tokenizer, spec, path)."""
    path = model_dir(model_id)
    model, tokenizer = mlx_lm.load(str(path), lazy=lazy)
    return model, tokenizer, get_spec(model_id), path


def skeleton(model_id: str):
    """mlx-lm's model of a registered model with no weight computed or read: an embedded model's
    from its spec (built or not, any size), a real one's from its local files, lazily. Its
    parameters' shapes and dtypes are the loaded model's: what a memory plan needs."""
    spec = get_spec(model_id)
    if spec["kind"] == "real":
        return mlx_lm.utils.load_model(real_model_dir(spec), lazy=True)[0]
    return embedded.skeleton(spec)


def cached_revision(repo: str) -> str:
    """The commit of the locally cached copy of a Hugging Face repository."""
    root = _hf_cache() / ("models--" + repo.replace("/", "--"))
    snaps = sorted(p.name for p in (root / "snapshots").glob("*") if HEX40.match(p.name))
    ref = root / "refs" / "main"
    if ref.exists() and ref.read_text().strip() in snaps:
        return ref.read_text().strip()
    if len(snaps) == 1:
        return snaps[0]
    if not snaps:
        raise RegistryError(f"{repo} is not in the local Hugging Face cache ({root} has no snapshot)")
    raise RegistryError(f"{repo}: several cached snapshots and no refs/main; pin one by hand: {', '.join(snaps)}")


def pin(model_id: str, path=None) -> str:
    """Write the commit of the locally cached copy of a real model into the models file that
    defines it (the user's, or the packaged one in a source checkout)."""
    spec = get_spec(model_id, path)
    path = Path(spec["source"])
    if path.resolve() == PACKAGED.resolve() and checkout() is None:
        raise RegistryError(
            f"model '{model_id}' comes from the installed package ({path}); copy its entry into "
            f"your own models file (--models FILE or $TITAN_MODELS) and pin it there"
        )
    if spec["kind"] != "real":
        raise RegistryError(f"model '{model_id}' is embedded: it is built from its spec, there is nothing to pin")
    rev = cached_revision(spec["repo"])
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, l in enumerate(lines) if re.match(rf"^\s+{re.escape(model_id)}:\s*$", l))
    indent = len(lines[start]) - len(lines[start].lstrip())
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        m = re.match(r"^(\s+revision:\s*)(\S.*?)?(\s*#.*)?$", line.rstrip("\n"))
        if m:
            lines[i] = f"{m.group(1)}{rev}{m.group(3) or ''}\n"
            break
    else:
        raise RegistryError(f"{path}: model '{model_id}' has no revision line to pin")
    text = "".join(lines)
    validate(yaml.safe_load(text), path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return rev


def load_reference(model_id: str):
    """The unmodified mlx-lm model, every expert in memory: the bit-exactness reference."""
    model, tokenizer, spec, _ = load(model_id)
    return model, tokenizer, spec


EXPERT_NAMES = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
LAYER_NAMES = ("num_hidden_layers", "num_layers", "n_layers")


def shape_of(spec) -> dict:
    """Experts, experts per token and layers of an embedded spec, however its architecture
    names them (None where it does not say)."""
    if "config" not in spec:
        return dict(experts=spec["experts"], top_k=spec["top_k"], layers=spec["layers"])
    cfg = dict(spec["config"], **(spec["config"].get("text_config") or {}))

    def first(names):
        return next((cfg[n] for n in names if isinstance(cfg.get(n), int) and not isinstance(cfg.get(n), bool)), None)

    return dict(experts=first(EXPERT_NAMES), top_k=first(TOP_K_NAMES), layers=first(LAYER_NAMES))


def shape(model_id: str) -> dict:
    """`shape_of` for any registered model without building it: an embedded model's from its spec,
    a real one's from its pinned config.json (None where a field is unknown)."""
    spec = get_spec(model_id)
    if spec["kind"] == "real":
        return shape_of({"config": json.loads((real_model_dir(spec) / "config.json").read_text())})
    return shape_of(spec)


def limits_of(model_id: str) -> dict:
    """What a request's sampler fields are checked against (engine.sampling): the model's
    vocabulary (its config's `vocab_size`, None where it does not say) and context (context_of)."""
    cfg = json.loads((model_dir(model_id) / "config.json").read_text())
    vocab = next((c["vocab_size"] for c in (cfg, cfg.get("text_config") or {})
                  if isinstance(c.get("vocab_size"), int) and c["vocab_size"] > 0), None)  # fmt: skip
    return dict(vocab=vocab, context=context_of(model_id))


def context_of(model_id: str) -> int:
    """The positions the model was made for: its config's `max_position_embeddings` (a multimodal
    one's text config's); 4096 where the config does not say. Builds an embedded model if needed."""
    cfg = json.loads((model_dir(model_id) / "config.json").read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        n = c.get("max_position_embeddings")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return 4096
