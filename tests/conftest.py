"""Shared by the suite: the embedded models it runs, the mlx-lm reference it compares with, and
helpers to decode through the engine. GPU-only and CPU-only tests carry `gpu_only`/`cpu_only`."""

import atexit
import functools
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import EngineConfig, device, load  # noqa: E402
from engine.models.registry import load_reference  # noqa: E402
from engine.predict import predictors, prompts  # noqa: E402
from engine.runtime import installs, staging  # noqa: E402
from engine.runtime.loop import decode  # noqa: E402
from engine.runtime.prefetch import Prefetcher  # noqa: E402
from engine.tracing import trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the repository
PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
MODELS = {"olmoe-tiny": dict(experts=64, top_k=8), "qwen3moe-tiny": dict(experts=128, top_k=8)}
ON_GPU = device.kind() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="GPU-only: needs MLX computing on a GPU")
cpu_only = pytest.mark.skipif(ON_GPU, reason="CPU-only: checks what the CPU backend does")
# Algorithm 1's host path on this backend (`auto` is the device install on a CUDA GPU): for the
# tests of its own parts (slot tables, the host prefetcher).
HOST_INSTALL = "pinned" if ON_GPU else "inplace"
# A copy of the tree without its history (the GPU machine's) cannot run what needs git.
needs_git = pytest.mark.skipif(
    not (ROOT / ".git").exists(), reason="needs the repository's git history; this copy of the tree has no .git"
)


# What a test's workflow may not see: what runs of the workflow (the main job, a smoke run) and
# the suite itself leave in the checkout.
STATE = {"results", "resources", "figures", ".snakemake", ".git", ".venv", ".pytest_cache"}


@functools.cache
def workflow_dir() -> Path:
    """A checkout of its own for the tests that plan the workflow: the code linked from this one,
    and only the committed records and figures (copied), so that what they plan is the same in a
    clean clone and in one where `snakemake all` has just run. Removed when the suite ends."""
    view = Path(tempfile.mkdtemp(prefix="titan-workflow-"))
    atexit.register(shutil.rmtree, view, True)
    for entry in ROOT.iterdir():
        if entry.name not in STATE and not entry.name.startswith(".gpu") and not entry.name.endswith(".egg-info"):
            (view / entry.name).symlink_to(entry)
    try:
        tracked = subprocess.run(["git", "ls-files", "-z", "results", "figures"], cwd=ROOT, capture_output=True,
                                 check=True).stdout.decode().split("\0")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):  # a copy of the tree without git: take its records
        tracked = [str(p.relative_to(ROOT)) for d in ("results/raw", "figures") for p in (ROOT / d).rglob("*")]
    for name in filter(None, tracked):
        src, dst = ROOT / name, view / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return view


@functools.cache
def answered_scontrol() -> str:
    """A folder holding an `scontrol` that fails at once. Snakemake's SLURM executor plugin asks
    `scontrol show config` whenever Snakemake starts (waiting up to 10 s); where slurm is installed
    without a controller to answer (this project's machines after CI's SLURM step) every planning
    test would wait for it. These tests plan with the local executor: nothing of SLURM's is used."""
    folder = Path(tempfile.mkdtemp(prefix="titan-scontrol-"))
    atexit.register(shutil.rmtree, folder, True)
    stub = folder / "scontrol"
    stub.write_text("#!/bin/sh\nexit 1\n")
    stub.chmod(0o755)
    return str(folder)


def snakemake(*args, env=None, timeout=300):
    """`snakemake ARGS` in `workflow_dir()` (without TITAN_RUN unless `env` gives it)."""
    env = dict(os.environ, **(env or {}))
    env["PATH"] = answered_scontrol() + os.pathsep + env.get("PATH", "")
    env.pop("TITAN_RUN", None) if env.get("TITAN_RUN") is None else None
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workflow_dir(), capture_output=True,
                          text=True, timeout=timeout, env=env)  # fmt: skip


@pytest.fixture(scope="session")
def reference():
    """Per model: the unmodified mlx-lm model's greedy tokens and logits over PROMPT."""
    cache = {}

    def get(model_id, steps=32):
        key = (model_id, steps)
        if key not in cache:
            model, tok, spec = load_reference(model_id)
            ids = tok.encode(PROMPT)
            tokens, _, logits = decode(model, ids, steps, keep_logits=True)
            cache[key] = dict(ids=ids, tokens=tokens, logits=logits, spec=spec)
        return cache[key]

    return get


def force_pinned(monkeypatch):
    """`install="pinned"` runs the pinned install where there is no CUDA: its staging pool over
    HostMemory (a lazy gather standing in for the copy kernel)."""
    real = installs.choose
    monkeypatch.setattr(
        installs, "choose", lambda asked, *a, **k: installs.PinnedInstall if asked == "pinned" else real(asked, *a, **k)
    )
    monkeypatch.setattr(staging, "make_memory", staging.HostMemory)


def run_cli(*args, stdin=None):
    """`python -m engine ARGS` in the repository, its output captured."""
    return subprocess.run([sys.executable, "-m", "engine", *args], input=stdin, capture_output=True, text=True,
                          cwd=ROOT, timeout=600)  # fmt: skip


def run_engine(model_id, ref, **cfg):
    """Decode the reference's tokens through the engine (teacher-forced): records, logits, counters."""
    eng = load(model_id, EngineConfig(**cfg))
    try:
        _, records, logits = decode(
            eng.model, ref["ids"], len(ref["tokens"]) - 1, forced=ref["tokens"], keep_logits=True
        )
        return records, logits, eng.counters()
    finally:
        eng.close()


@pytest.fixture(scope="session")
def fit_traces():
    """Per model, a small in-memory trace of three fit prompts (8 decode tokens each)."""
    cache = {}

    def get(model_id):
        if model_id not in cache:
            model, tok, _ = load_reference(model_id)
            parts = []
            for i, p in enumerate(prompts.load("code", "fit")[:3]):
                r = trace.record(model, tok.encode(p["text"]), 8)
                r["prompt"] = np.full(len(r["tokens"]), i, np.int32)
                parts.append(r)
            cat = {
                k: np.concatenate([p[k] for p in parts])
                for k in ("experts", "probs", "hidden", "tokens", "prompt", "decode")
            }
            cache[model_id] = trace.Trace(meta={"model": model_id}, **cat)
        return cache[model_id]

    return get


def run_with(
    model_id, ref, name, depth, fit, eviction="lru", slots=None, install="inplace", overlap=None, pipelined=False
):
    """Decode the reference's tokens with predictor `name` fitted on `fit`, prefetching at `depth`
    (in the decode loop's order `pipelined`, or one token at a time)."""
    spec = MODELS[model_id]
    pred = predictors.make(name, depth, spec["top_k"]).fit(fit)
    eng = load(
        model_id,
        EngineConfig(slots=slots or spec["experts"] // 4, eviction=eviction, install=install, overlap=overlap),
        prefetcher=Prefetcher(pred, depth) if name != "none" else None,
    )
    try:
        if name == "oracle":
            model, _, _ = load_reference(model_id)
            eng.bind_oracle(trace.record(model, ref["ids"], len(ref["tokens"]) - 1)["experts"])
        _, records, logits = decode(
            eng.model, ref["ids"], len(ref["tokens"]) - 1, forced=ref["tokens"], keep_logits=True, pipelined=pipelined
        )
        return records, logits
    finally:
        eng.close()


def job_stats(stdout: str) -> dict:
    """{rule: jobs} from the "Job stats" table of a Snakemake dry run."""
    lines = stdout.split("Job stats:", 1)[1].splitlines()
    rows = [l.split() for l in lines[3:]]
    return {r[0]: int(r[1]) for r in rows[: next(i for i, r in enumerate(rows) if r and r[0] == "total")]}


class DeviceWatch:
    """On a CUDA GPU, a kernel's illegal access poisons the process: every later CUDA call fails
    with the same error, far from its cause. So after each test (and its garbage, whose finalizers
    unregister host memory) the device is synchronised: the first test after which it reports an
    error gets that error at its teardown, and each later test of the process fails at its setup
    naming it, instead of failing somewhere inside with an error that is not its own."""

    def __init__(self, sync):
        self.sync = sync  # raises the device's error, if it has one
        self.fault = None  # (test, error) of the first fault seen

    def after(self, test: str):
        if self.fault is None:
            try:
                self.sync()
            except Exception as e:
                self.fault = (test, f"{type(e).__name__}: {e}")
                pytest.fail(f"the device reported an error after this test: {self.fault[1]}", pytrace=False)

    def before(self, test: str):
        if self.fault is not None:
            pytest.fail(f"not run: the device faulted after {self.fault[0]} ({self.fault[1]})", pytrace=False)


def _device_sync():
    gc.collect()
    mx.synchronize()
    device.cuda_runtime().synchronize()


WATCH = DeviceWatch(_device_sync) if ON_GPU and device.pinned_unavailable() is None else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if WATCH is not None:
        WATCH.before(item.nodeid)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield  # the test's fixtures are torn down first
    if WATCH is not None:
        WATCH.after(item.nodeid)
    return result
