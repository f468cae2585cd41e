"""The command lines, as a user runs them: `python -m engine` (the library) and `python -m
harness` (the experiments). Every bad option is refused by name before anything loads."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, needs_git


def run(*args, module="engine", cwd=ROOT):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_decode_prints_text_and_tok_s():
    r = run("decode", "--model", "olmoe-tiny", "--slots", "16", "--tokens", "8", "--prompt", "import os")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("import os")
    line = next(l for l in r.stdout.splitlines() if "tok/s" in l)
    assert "S=16/64" in line and "hit rate" in line
    assert "per miss: pread" in r.stdout


def test_decode_cold_tier():
    r = run("decode", "--model", "qwen3moe-tiny", "--slots", "32", "--tokens", "4", "--tier", "cold")
    assert r.returncode == 0, r.stderr
    assert "tier=cold" in r.stdout and "tok/s" in r.stdout


def test_decode_zero_tokens_is_a_prefill():
    r = run("decode", "--model", "qwen3moe-tiny", "--slots", "32", "--tokens", "0")
    assert r.returncode == 0, r.stderr
    assert "prefill only" in r.stdout


@pytest.mark.parametrize("sub", ["", "list", "build", "pin", "store", "decode", "trace", "fit", "train", "version"])
def test_help(sub):
    r = run(*([sub] if sub else []), "--help")
    assert r.returncode == 0 and "usage" in r.stdout


@pytest.mark.parametrize("sub", ["", "bench", "train", "probe"])
def test_harness_help(sub):
    r = run(*([sub] if sub else []), "--help", module="harness")
    assert r.returncode == 0 and "usage: python -m harness" in r.stdout


@pytest.mark.parametrize(
    "args,named",
    [
        (["decode", "--tokens", "-3"], "argument --tokens: must be at least 0, not -3"),
        (["decode", "--tokens", "many"], "argument --tokens: not an integer: 'many'"),
        (["decode", "--slots", "0"], "argument --slots: must be at least 1, not 0"),
        (["decode", "--readers", "0"], "argument --readers: must be at least 1, not 0"),
        (["decode", "--depth", "0"], "argument --depth: must be at least 1, not 0"),
        (["decode", "--predict-size", "-1"], "argument --predict-size: must be at least 1"),
        (["decode", "--min-prob", "1.5"], "argument --min-prob: must lie in [0, 1], not 1.5"),
        (["decode", "--install", "magic"], "argument --install: invalid choice"),
        (["decode", "--predictor", "psychic"], "argument --predictor: invalid choice"),
        (["trace", "--limit", "0"], "argument --limit: must be at least 1"),
        (["fit", "--depth", "-2"], "argument --depth: must be at least 1"),
        (["--models", "/nonexistent/models.yaml", "list"], "--models: /nonexistent/models.yaml: no such models file"),
    ],
)
def test_bad_options_are_named(args, named):
    r = run(*args)
    assert r.returncode == 2
    assert named in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_empty_prompt_is_named():
    r = run("decode", "--model", "qwen3moe-tiny", "--tokens", "2", "--prompt", "")
    assert r.returncode == 2 and "--prompt: the prompt encodes to no token" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args,named",
    [
        (["bench", "throughput", "--repeats", "0"], "argument --repeats: must be at least 1"),
        (["bench", "miss", "--batch", "0"], "argument --batch: must be at least 1"),
        (["bench", "prefetch", "--min-probs", "-0.1"], "argument --min-probs: must lie in [0, 1]"),
        (["bench", "nothing"], "invalid choice: 'nothing'"),
    ],
)
def test_harness_bad_options_are_named(args, named):
    r = run(*args, module="harness")
    assert r.returncode == 2 and named in r.stderr, r.stderr


def test_slots_below_top_k_are_refused():
    r = run("decode", "--model", "olmoe-tiny", "--slots", "4", "--tokens", "2")
    assert r.returncode == 2
    assert "--slots 4: below the model's top_k (8)" in r.stderr


def test_unknown_model():
    r = run("decode", "--model", "nope", "--tokens", "2")
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr


def test_real_model_without_weights():
    r = run("decode", "--model", "qwen3-30b-a3b-4bit", "--tokens", "2")
    assert r.returncode == 2 and "python -m engine pin qwen3-30b-a3b-4bit" in r.stderr


def test_a_users_models_file_extends_the_registry(tmp_path):
    extra = tmp_path / "mine.yaml"
    extra.write_text(
        (ROOT / "engine" / "data" / "models.yaml").read_text().split("models:")[0]
        + "models:\n  my-tiny:\n    kind: embedded\n    architecture: qwen3_moe\n    dtype: bfloat16\n"
        "    seed: 7\n    layers: 2\n    hidden: 128\n    expert_width: 64\n    heads: 4\n    kv_heads: 2\n"
        "    head_dim: 16\n    experts: 16\n    top_k: 4\n    vocab: 512\n"
    )
    r = run("--models", str(extra), "list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ids = {line.split()[0] for line in r.stdout.splitlines()}
    assert {"my-tiny", "olmoe-tiny", "qwen3moe-tiny"} <= ids  # the packaged models stay


@needs_git
def test_two_commits_run_side_by_side_alternating_and_keep_their_records(tmp_path):
    """scripts/ab_commits.sh: each run executes in its own commit's tree, the order alternates so
    that drift falls on both, and the raw records the runs write come back into this checkout.
    (Both sides are HEAD here: a CI clone may hold no other commit; the trees tell them apart.)"""
    tag = f"ab-test-{os.getpid()}"
    code = (
        "import pathlib, time; side = pathlib.Path.cwd().name; "
        f"p = pathlib.Path('results/raw/{tag}') / f'{{time.time_ns()}}.jsonl'; "
        "p.parent.mkdir(parents=True, exist_ok=True); p.write_text(side); print('ran', side)"
    )
    script = ROOT / "scripts" / "ab_commits.sh"
    out = subprocess.run(
        [script, "HEAD", "HEAD", "2", "--", "python", "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable},  # this environment's, whatever its folder is called
    )
    kept = ROOT / "results" / "raw" / tag
    try:
        assert out.returncode == 0, out.stderr
        ran = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ran ")]
        assert ran == ["a", "b", "b", "a"]
        assert sorted(f.read_text() for f in kept.iterdir()) == sorted(ran)
    finally:
        shutil.rmtree(kept, ignore_errors=True)


@needs_git
def test_side_by_side_needs_a_count():
    out = subprocess.run(
        [ROOT / "scripts" / "ab_commits.sh", "HEAD", "HEAD", "x", "--", "true"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "REPEATS must be a positive integer, not 'x'" in out.stderr


def test_side_by_side_records_are_summarised_per_commit(tmp_path):
    """scripts/ab_summary.py: each commit's runs of `bench prefetch --record`, every figure as the
    median [min, max] over runs, and tok/s over demand loading's taken within each run."""

    def record(commit, dirty, demand, probe, predict_ms):
        res = {
            "none/d0": {"tok_s": demand, "time_split_ms": {"predict": 0.0}},
            "probe/d1": {"tok_s": probe, "time_split_ms": {"predict": predict_ms}},
        }
        p = tmp_path / f"{commit}-{demand}.jsonl"
        p.write_text(json.dumps({"commit": commit * 40, "dirty": dirty, "result": {"results": res}}) + "\n")
        return p

    files = [
        record("a", False, 100.0, 50.0, 1.0),
        record("a", False, 200.0, 50.0, 3.0),
        record("b", True, 10.0, 20.0, 2.0),
    ]
    script = ROOT / "scripts" / "ab_summary.py"
    out = subprocess.run([sys.executable, script, *map(str, files)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "aaaaaaaaaaaa: 2 runs"
    rows = [re.match(r"  (\S+)\s+(.+?)\s+(\S+ \[\S+, \S+\])$", line).groups() for line in lines[1:7]]
    got = {f"{name} {fig}": value for name, fig, value in rows}
    assert got["probe/d1 x demand"] == "0.375 [0.250, 0.500]"  # 50/100 and 50/200: not 100/150
    assert got["probe/d1 predict ms"] == "2.000 [1.000, 3.000]"
    assert "bbbbbbbbbbbb-dirty: 1 runs" in lines
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"bench": "miss"}\n')
    out = subprocess.run([sys.executable, script, str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and f"{bad}: line 1 is not a `bench prefetch` raw record" in out.stderr


_FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for the GPU machine's python: a measurement takes a while, then writes a raw file
if [ "$1 $2" = "-m harness" ]; then
  sleep "$FAKE_SECONDS"
  mkdir -p results/raw/bench/fake
  n=$(ls results/raw/bench/fake | wc -l)
  echo '{}' > "results/raw/bench/fake/$n.jsonl"
  echo "measured $n with resources at $TITAN_RESOURCES"
fi
"""


def test_detached_gpu_steps_outlive_the_call_and_the_next_call_waits_on_them(tmp_path):
    """scripts/device_gpu.sh with DETACH=1, as on the GPU machine of the development device tool:
    the steps run in a session of their own in a copy of the tree, so a call whose BUDGET ends
    first returns while they go on; the same command again waits on the same process (not a
    second one) and brings back every raw file they wrote, in the copy and not in the tree; the
    models they build are the tree's resources."""
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    state = tmp_path / "state"
    primer = tmp_path / "primer"  # an earlier run's compiled kernels (OUTDIR/ptx.tgz)
    primer.mkdir()
    (primer / "gather_kernel.ptx").write_text("compiled")
    subprocess.run(["tar", "czf", tmp_path / "ptx.tgz", "-C", primer, "."], check=True)
    kernels = tmp_path / "kernels"
    env = dict(os.environ, DETACH="1", WORK=str(state / "tree"), PYTHON=str(fake), FAKE_SECONDS="3",
               PTX_CACHE=str(tmp_path / "ptx.tgz"), MLX_PTX_CACHE_DIR=str(kernels))  # fmt: skip
    env.pop("TITAN_RESOURCES", None)

    def call(out, budget):
        cmd = [ROOT / "scripts" / "device_gpu.sh", tmp_path / out, "miss", "install"]
        return subprocess.run(
            cmd, cwd=ROOT, env=dict(env, BUDGET=str(budget)), capture_output=True, text=True, timeout=120
        )

    first = call("out1", 12)
    pid = (state / "pid").read_text().strip()
    try:
        assert "started the steps in a session of their own" in first.stdout
        assert "still running" in first.stdout, first.stdout
        os.kill(int(pid), 0)  # alive after the call returned
        second = call("out2", 60)
        assert f"waiting on the detached steps (process {pid})" in second.stdout
        assert "the steps have ended" in second.stdout
    finally:
        subprocess.run(["kill", pid], capture_output=True)
    listed = subprocess.run(["tar", "tzf", tmp_path / "out2" / "raw.tgz"], capture_output=True, text=True)
    assert sorted(listed.stdout.split()) == ["results/raw/bench/fake/0.jsonl", "results/raw/bench/fake/1.jsonl"]
    log = (tmp_path / "out2" / "log.txt").read_text()
    assert "measured 0" in log and "measured 1" in log
    # the copy builds nothing of its own: a model `build` made in the tree is the steps' too
    assert f"with resources at {ROOT}/resources" in log
    assert not (ROOT / "results" / "raw" / "bench" / "fake").exists()
    # MLX's kernel cache, primed once from the earlier run's, comes back for the next machine
    assert (kernels / "gather_kernel.ptx").read_text() == "compiled"
    assert "primed from" in first.stdout and "primed from" not in second.stdout
    listed = subprocess.run(["tar", "tzf", tmp_path / "out2" / "ptx.tgz"], capture_output=True, text=True)
    assert "./gather_kernel.ptx" in listed.stdout.split()


def test_the_peak_probe_separates_a_prompts_prefill_by_its_chunk():
    """scripts/probe_peak.py (docs/gpu.md: why a plan is a lower bound for a long prompt), on the
    CPU: a row per prompt and prefill chunk, the peak over the weights beside what a plan counts;
    the larger chunk of one prompt holds more at once (here MLX's CPU attention materializes a
    chunk's scores)."""
    out = subprocess.run(
        [sys.executable, ROOT / "scripts" / "probe_peak.py", "olmoe-tiny-f32", "256", "--chunks", "64,256",
         "--tokens", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+\|\s+([\d.]+) (kB|MB|GB)", line)
        if m:
            rows[int(m.group(2))] = float(m.group(3)) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[m.group(4)]
    assert set(rows) == {64, 256} and rows[256] > rows[64], out.stdout


def test_the_batch_slots_probe_counts_a_steps_misses_between_the_least_any_cache_allows_and_all_it_names(tmp_path):
    """scripts/probe_batch_slots.py (docs/gpu.md: where a batched step's time goes), on the CPU:
    the device install's misses a layer a step, read from its slot maps, lie between the fewest
    any cache of S allows (Belady's rule) and every expert the rows named; no S slots bring in
    fewer than a step's experts beyond S; one row names its top-k. Of the decayed rule's, those the
    step before named are no more than it brings in, nor than an area copied ahead from the step
    before reads. The routing it traces, replayed without the model, counts every rule alike (the
    install's column aside, which needs the model)."""
    probe = [sys.executable, ROOT / "scripts" / "probe_batch_slots.py"]
    out = subprocess.run([*probe, "olmoe-tiny-f32", "--batches", "1", "4", "--tokens", "8", "--trace", tmp_path],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr

    def table(stdout):
        lines = [line.split("|") for line in stdout.splitlines()[2:]]
        return [([float(x) for x in left.split()], [float(x) for x in right.split()]) for left, right in lines]

    parsed = {int(left[0]): (left[3:], right) for left, right in table(out.stdout)}
    rows = {b: r for b, (r, _) in parsed.items()}
    assert set(rows) == {1, 4}
    for (named, beyond, install, latest, most, decayed, fewest), (before, ahead) in parsed.values():
        rules = (install, latest, most, decayed)
        assert beyond <= fewest <= min(rules) and max(rules) <= named
        assert before <= decayed and before <= ahead
    assert rows[1][:2] == [8.0, 0.0] and rows[4][0] > 8
    again = subprocess.run([*probe, "--replay", tmp_path / "olmoe-tiny-f32-B4.npz"], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr
    ((replayed, replayed_ahead),) = [(left[3:], right) for left, right in table(again.stdout)]
    assert replayed_ahead == parsed[4][1]
    assert replayed[2] != replayed[2]  # nan: no install ran
    assert rows[4][2] <= rows[4][3]  # the install's rule brings in no more than keeping the latest rows' experts
    assert replayed[:2] + replayed[3:] == rows[4][:2] + rows[4][3:]


def test_the_split_probe_compares_each_pair_of_a_split_step_with_mlx_lms_one_call():
    """scripts/probe_split_calls.py (docs/gpu.md: where a batched step's time goes), on the CPU: a
    row per batch and split, the two calls' pair counts adding up to the step's; the CPU computes
    a pair alike whatever else its call holds, so every split is mlx-lm's to the bit there (what
    the GPU does is the probe's question)."""
    out = subprocess.run([sys.executable, ROOT / "scripts" / "probe_split_calls.py", "olmoe-tiny-f32", "--batches",
                          "1", "4", "16"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert {(int(r[0]), r[1]) for r in rows} == {(1, "itself"), (1, "held"), (4, "itself"), (4, "rows"),
                                                 (4, "held"), (16, "itself"), (16, "rows"), (16, "held")}  # fmt: skip
    assert all(sum(map(int, r[2].split("+"))) == int(r[0]) * 8 for r in rows)  # top-8: every pair, once
    assert all(r[3] == "equal" for r in rows), out.stdout
