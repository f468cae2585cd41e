"""The registry: every bad input gets a clear error naming the file, line or field."""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from mlx_lm.models import olmoe, qwen3_moe
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from engine.models import embedded, registry
from engine.models.registry import RegistryError
from engine.runtime import store as store_mod

REAL = "olmoe-1b-7b-4bit"
HASH = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def models_file(tmp_path, monkeypatch):
    """A private copy of configs/models.yaml, used by the registry for this test."""
    p = tmp_path / "models.yaml"
    p.write_text(registry.config_path().read_text())
    monkeypatch.setenv("TITAN_MODELS", str(p))
    return p


def edit(path, fn):
    data = yaml.safe_load(path.read_text())
    fn(data["models"])
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_shipped_config_is_valid():
    models = registry.load_registry()
    assert {"olmoe-tiny", "qwen3moe-tiny", "olmoe-1b-7b-shape", REAL, "qwen3-30b-a3b-4bit"} <= set(models)
    assert models["olmoe-1b-7b-shape"]["hidden"] == 2048 and models["olmoe-1b-7b-shape"]["vocab"] == 50304


def test_a_models_file_is_read_again_once_it_changes_and_each_caller_gets_its_own_copy(models_file):
    """The registry keeps a parsed file while it is unchanged (a workflow asks for specs dozens of
    times as it builds its DAG), so an edit must show at the next read, and one caller's change
    to a spec must not reach the next."""
    first = registry.get_spec("olmoe-tiny")
    first["experts"] = -1
    first.setdefault("training", {})["steps"] = -1
    again = registry.get_spec("olmoe-tiny")
    assert again["experts"] != -1 and again.get("training", {}).get("steps") != -1
    edit(models_file, lambda m: m["olmoe-tiny"].update(experts=48))
    assert registry.get_spec("olmoe-tiny")["experts"] == 48
    edit(models_file, lambda m: m["olmoe-tiny"].update(experts="many"))
    with pytest.raises(RegistryError, match=r"models\.olmoe-tiny\.experts"):
        registry.get_spec("olmoe-tiny")


def test_unknown_model_lists_known():
    with pytest.raises(RegistryError, match=r"unknown model 'mixtral'.*olmoe-tiny"):
        registry.get_spec("mixtral")


def test_malformed_yaml_names_line(models_file):
    models_file.write_text("models:\n  a:\n    kind: real\n   repo: x\n")
    with pytest.raises(RegistryError, match=r"models\.yaml: line \d+: not valid YAML"):
        registry.load_registry()


def test_bad_field_is_named(models_file):
    edit(models_file, lambda m: m["olmoe-tiny"].update(experts="many"))
    with pytest.raises(RegistryError, match=r"field models\.olmoe-tiny\.experts: 'many' is not of type 'integer'"):
        registry.load_registry()


def test_top_k_above_experts(models_file):
    edit(models_file, lambda m: m["olmoe-tiny"].update(top_k=65))
    with pytest.raises(RegistryError, match=r"models\.olmoe-tiny\.top_k: 65 exceeds experts"):
        registry.load_registry()


def test_malformed_revision_is_refused(models_file):
    edit(models_file, lambda m: m[REAL].update(revision="main"))
    with pytest.raises(RegistryError, match=r"field models\.olmoe-1b-7b-4bit\.revision: 'main' does not match"):
        registry.load_registry()


def test_unpinned_real_model_says_how_to_get_it(models_file):
    with pytest.raises(RegistryError, match=r"no pinned revision.*hf download mlx-community/.*python -m engine pin"):
        registry.model_dir(REAL)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setattr(registry, "_hf_cache", lambda: cache)
    return cache


def fake_snapshot(cache, repo, rev, weights=True):
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    if weights:
        (snap / "model.safetensors").write_bytes(b"")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    return snap


def test_pinned_but_not_cached(models_file, hf_cache):
    edit(models_file, lambda m: m[REAL].update(revision=HASH))
    with pytest.raises(RegistryError, match=rf"at revision {HASH}\) is not in the local Hugging Face cache"):
        registry.model_dir(REAL)


def test_cached_at_another_revision_is_not_used(models_file, hf_cache):
    repo = registry.get_spec(REAL)["repo"]
    fake_snapshot(hf_cache, repo, "f" * 40)
    edit(models_file, lambda m: m[REAL].update(revision=HASH))
    with pytest.raises(RegistryError, match="not in the local Hugging Face cache"):
        registry.model_dir(REAL)


def test_pin_writes_the_cached_commit(models_file, hf_cache):
    repo = registry.get_spec(REAL)["repo"]
    snap = fake_snapshot(hf_cache, repo, HASH)
    before = models_file.read_text()
    assert registry.pin(REAL) == HASH
    after = models_file.read_text()
    assert f"revision: {HASH}" in after
    # only that one line changed: comments and the other models are kept
    assert [l for l in before.splitlines() if "revision" not in l] == [
        l for l in after.splitlines() if "revision" not in l
    ]
    assert registry.model_dir(REAL) == snap


def test_pin_without_cache(models_file, hf_cache):
    with pytest.raises(RegistryError, match="not in the local Hugging Face cache"):
        registry.pin(REAL)


def test_cached_without_weights(models_file, hf_cache):
    repo = registry.get_spec(REAL)["repo"]
    fake_snapshot(hf_cache, repo, HASH, weights=False)
    edit(models_file, lambda m: m[REAL].update(revision=HASH))
    with pytest.raises(RegistryError, match="no model\\*.safetensors"):
        registry.model_dir(REAL)


def test_embedded_builds_are_byte_identical(tmp_path):
    spec = registry.get_spec("qwen3moe-tiny")
    a, b = embedded.build(spec, tmp_path / "a"), embedded.build(spec, tmp_path / "b")
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) and "model.safetensors" in names and "tokenizer.json" in names
    for n in names:
        assert hashlib.sha256((a / n).read_bytes()).digest() == hashlib.sha256((b / n).read_bytes()).digest(), n


def test_other_seed_other_weights(tmp_path):
    spec = registry.get_spec("qwen3moe-tiny")
    a = embedded.build(spec, tmp_path / "a")
    b = embedded.build(dict(spec, seed=1), tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_embedded_uses_mlx_lm_classes_and_quantization():

    for mid, cls, dtype in (("olmoe-tiny", olmoe.Model, "float16"), ("qwen3moe-tiny", qwen3_moe.Model, "bfloat16")):
        model, tok, spec, _ = registry.load(mid)
        assert type(model) is cls
        sw = model.layers[0].mlp.switch_mlp.gate_proj
        assert isinstance(sw, QuantizedSwitchLinear) and (sw.bits, sw.group_size, sw.mode) == (4, 64, "affine")
        assert str(sw.scales.dtype).endswith(dtype)
        assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"


# (layers, hidden, experts, top_k, shared experts, vocabulary) of each real checkpoint's config.json,
# and the GB its mlx-community form holds: what each family's shape must have
FAMILIES = {
    "qwen3-30b-a3b-shape": ("qwen3-30b-a3b-4bit", 48, 2048, 128, 8, 0, 151936, 17.2),
    "mixtral-8x7b-shape": ("mixtral-8x7b-4bit", 32, 4096, 8, 2, 0, 32000, 26.3),
    "gpt-oss-20b-shape": ("gpt-oss-20b-mxfp4", 24, 2880, 32, 4, 0, 201088, 11.1),
    "deepseek-v2-lite-shape": ("deepseek-v2-lite-4bit", 27, 2048, 64, 6, 2, 102400, 8.8),
}


@pytest.mark.parametrize("model_id", sorted(FAMILIES))
def test_each_family_shape_has_its_real_checkpoints_dimensions(model_id):
    """Planned, not built (17-26 GB): the spec's model, as mlx-lm's class makes it, has the real
    checkpoint's dimensions, and a build would write about as many bytes as its 4-bit form holds."""
    real, layers, hidden, experts, top_k, shared, vocab, gb = FAMILIES[model_id]
    spec = registry.get_spec(model_id)
    assert spec["mirrors"] == real and registry.get_spec(real)["kind"] == "real"
    assert registry.shape(model_id) == {"experts": experts, "top_k": top_k, "layers": layers}
    cfg = embedded.hf_config(spec)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (layers, hidden, vocab)
    assert cfg.get("n_shared_experts", 0) == shared
    assert embedded.planned_bytes(spec) / 1e9 == pytest.approx(gb, abs=0.1)


def test_a_shape_that_mirrors_no_real_model_is_refused_by_field(models_file):
    spec = {k: v for k, v in registry.get_spec("mixtral-8x7b-shape").items() if k not in ("id", "source")}
    edit(models_file, lambda m: m.update({"my-shape": dict(spec, mirrors="olmoe-tiny")}))
    with pytest.raises(RegistryError, match=r"field models\.my-shape\.mirrors: 'olmoe-tiny' is not a real model"):
        registry.load_registry()


def test_a_build_too_big_for_its_disk_is_refused_by_name_before_it_writes(tmp_path, monkeypatch):
    from engine import config

    monkeypatch.setattr(config.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    spec = registry.get_spec("qwen3-30b-a3b-shape")
    says = rf"{tmp_path}: 0.00 GB free, the build needs 17.59 GB to build 'qwen3-30b-a3b-shape' \(17.18 GB of weights"
    with pytest.raises(embedded.BuildError, match=says):
        embedded.build(spec, tmp_path / "m")
    assert os.listdir(tmp_path) == []  # nothing written, nothing left behind
    model, _, _, path = registry.load("olmoe-tiny", lazy=True)
    with pytest.raises(store_mod.StoreError, match=rf"{tmp_path}: 0.00 GB free, .* the expert store of 'olmoe-tiny'"):
        store_mod.build(model, path, tmp_path / "store", "olmoe-tiny")
    assert os.listdir(tmp_path) == []


def test_a_large_build_says_what_it_writes_as_it_goes(tmp_path, monkeypatch, capsys):
    from engine import config

    monkeypatch.setattr(config, "PROGRESS_BYTES", 0)  # olmoe-tiny as if it were large
    monkeypatch.setattr(embedded, "SHARD_BYTES", 4 << 20)
    embedded.build(registry.get_spec("olmoe-tiny"), tmp_path / "m")
    err = capsys.readouterr().err
    assert "[titan] olmoe-tiny: 0 of " in err, err  # before the first byte: how much it will write
    n = len(list((tmp_path / "m").glob("*.safetensors")))
    assert n > 1 and f"[titan] olmoe-tiny: {n} of {n} written (0.0 of 0.0 GB" in err, err
    model, _, _, path = registry.load("olmoe-tiny", lazy=True)
    store_mod.build(model, path, tmp_path / "store", "olmoe-tiny")
    assert "[titan] the expert store of olmoe-tiny: 4 of 4 written" in capsys.readouterr().err


def test_build_from_another_spec_is_refused(tmp_path):
    spec = registry.get_spec("qwen3moe-tiny")
    out = embedded.build(spec, tmp_path / "m")
    with pytest.raises(embedded.BuildError, match="built from another spec.*--force"):
        embedded.check_or_build(dict(spec, layers=4), out)


@pytest.mark.parametrize("model_id", sorted(m for m, s in registry.load_registry().items() if s["kind"] == "real"))
def test_every_real_model_pins_and_resolves_from_the_cache(models_file, hf_cache, model_id):
    """Each real checkpoint goes through `engine pin` as the first two did: the cached commit is
    written into the models file, and the model then resolves to that snapshot."""
    repo = registry.get_spec(model_id)["repo"]
    snap = fake_snapshot(hf_cache, repo, HASH)
    assert registry.pin(model_id) == HASH
    assert registry.get_spec(model_id)["revision"] == HASH
    assert registry.model_dir(model_id) == snap


def test_processes_that_start_at_once_build_a_model_and_its_store_once(tmp_path):
    """The nodes of a multi-node run (and parallel workflow jobs) start together on a fresh
    checkout: one builds the model and its store, the others wait for it and use what it built
    (a fresh `snakemake all` once failed here: one node replaced the folder the other read)."""
    code = (
        "from engine.models import registry\n"
        "from engine.runtime.engine import open_store\n"
        "model, _, _, path = registry.load('qwen3moe-tiny', lazy=True)\n"
        "with open_store('qwen3moe-tiny', model, path) as s:\n"
        "    s.verify_all()\n"
    )
    env = dict(os.environ, TITAN_RESOURCES=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True) for _ in range(3)
    ]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    text = "".join(errs)
    assert text.count("building embedded model qwen3moe-tiny") == 1, text
    assert text.count("building the expert store of qwen3moe-tiny") == 1, text


@pytest.fixture
def built_copy(tmp_path, monkeypatch):
    """olmoe-tiny as built, copied into resources of its own (its files may then be damaged)."""
    src = registry.model_dir("olmoe-tiny")
    res = tmp_path / "res"
    shutil.copytree(src, res / "models" / "olmoe-tiny", copy_function=shutil.copy2)
    monkeypatch.setenv("TITAN_RESOURCES", str(res))
    return res / "models" / "olmoe-tiny"


def test_a_damaged_model_file_is_named_at_load(built_copy, monkeypatch):
    """One flipped byte in model.safetensors (the 1 MiB of lm_head-side tensors at its end), a
    truncated file, a missing one: each is refused by name at load, before mlx-lm reads it."""
    weights = built_copy / "model.safetensors"
    good = weights.read_bytes()
    registry.load("olmoe-tiny", lazy=True)  # intact: loads
    data = bytearray(good)
    data[-100] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match=rf"{weights}: damaged: its sha256 is .* rebuild it with"):
        registry.load("olmoe-tiny", lazy=True)
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(RegistryError, match=rf"{weights}: damaged: .*\({len(good) // 2} bytes now\)"):
        registry.load("olmoe-tiny", lazy=True)
    weights.unlink()
    with pytest.raises(RegistryError, match=rf"{weights}: missing \(the build wrote it\)"):
        registry.load("olmoe-tiny", lazy=True)


def test_a_model_file_is_hashed_once_per_process(built_copy, monkeypatch):
    """A process hashes a file the first time it loads it, and again only once the file changes
    (size, modification time, inode); `store verify` (registry.verify) hashes every file whatever."""
    monkeypatch.setattr(embedded, "_HASHED", set())  # as a fresh process finds it
    hashed = []
    real = embedded.sha256_file
    monkeypatch.setattr(embedded, "sha256_file", lambda p: hashed.append(p) or real(p))
    registry.load("olmoe-tiny", lazy=True)
    first = len(hashed)
    assert first >= 2  # the weights and the tokenizer's files, by content
    registry.load("olmoe-tiny", lazy=True)
    assert len(hashed) == first
    n = registry.verify("olmoe-tiny")
    assert n >= 3 and len(hashed) >= 2 * first


def test_bit_rot_under_a_kept_modification_time_is_caught_by_the_next_process(built_copy):
    """A flipped byte whose file keeps its size and modification time (as bit rot keeps them) is
    named by the next process that loads the model, before it decodes anything."""
    weights = built_copy / "model.safetensors"
    registry.load("olmoe-tiny", lazy=True)  # found good once
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", "olmoe-tiny", "--slots", "16",
                        "--prompt", "x", "--max-tokens", "2"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and f"{weights}: damaged: its sha256 is" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_store_verify_names_a_damaged_model_file(built_copy):
    weights = built_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x80
    weights.write_bytes(bytes(data))
    r = subprocess.run(
        [sys.executable, "-m", "engine", "store", "verify", "olmoe-tiny"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 2 and f"{weights}: damaged" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_pinned_models_files_are_checked_against_their_blob_names(models_file, hf_cache):
    """The Hugging Face cache names a large file's blob by its sha256 and a small one's by its git
    blob id: a file that no longer matches its name is refused by name."""
    repo = registry.get_spec(REAL)["repo"]
    root = hf_cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / HASH
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    files = {"config.json": b"{}", "model.safetensors": b"weights" * 1000}
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else embedded.git_blob_sha1_of(data)
        (root / "blobs" / digest).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{digest}")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(HASH)
    edit(models_file, lambda m: m[REAL].update(revision=HASH))
    assert registry.model_dir(REAL) == snap
    blob = (snap / "model.safetensors").resolve()
    blob.write_bytes(b"weightz" * 1000)
    with pytest.raises(RegistryError, match=r"model\.safetensors: damaged: its sha256 is .* fetch it again"):
        registry.model_dir(REAL)
