"""The harness: raw logs are append-only and provenance-stamped, aggregation is deterministic
and refuses malformed lines, and a bad configuration fails before any job runs."""

import getpass
import json
import os
import re
import socket
import statistics
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from conftest import ROOT, job_stats, snakemake

from harness import provenance, rawlog, records, suite
from harness.__main__ import main as harness_main
from harness.report import aggregate, claims_check, compare_runs, plotting
from harness.report.tables import bench as bench_tables
from harness.report.tables import online as online_tables
from harness.report.tables import routing as routing_tables

# A full run of `all` names its raw files <commit>[-dirty]-<host alias>...
FULL_RUN_FILE = re.compile(r"[0-9a-f]{12}(-dirty)?-host-")


def fake_run(root, gate="C", experiment="prefetch_online", n=2, **result):
    rows = [
        dict(
            model="m",
            tier="cold",
            prompt_set="code",
            slots=16,
            experts=64,
            predictor="none",
            depth=0,
            tok_s=10.0 + i,
            stall_ms_per_token=1.5,
            late_stall_ms_per_token=0.0,
            hit_rate=0.5,
            issued=0,
            useful=0,
            wasted=0,
            late=0,
            tokens=8,
            per_miss_pread_ms=0.1,
            per_miss_array_ms=0.0,
            per_miss_install_ms=0.01,
            per_miss_stall_ms=0.2,
            misses=3,
            **result,
        )
        for i in range(n)
    ]
    for i, r in enumerate(rows):
        r["slots"] = 16 * (i + 1)
    return rawlog.write_run(
        gate,
        experiment,
        rows,
        config={"x": 1},
        seed=0,
        started=provenance.utc_now(),
        root=root,
        command="test",
        model="m",
        revision=None,
    )


def test_a_run_adds_a_read_only_file_and_never_replaces_one(tmp_path):
    a = fake_run(tmp_path)
    b = fake_run(tmp_path)
    assert a != b and a.exists() and b.exists()
    assert not os.access(a, os.W_OK) or os.geteuid() == 0  # root ignores modes; the mode is still 0444
    assert oct(a.stat().st_mode & 0o777) == "0o444"
    before = a.read_bytes()
    with pytest.raises(FileExistsError):
        rawlog.write_run(
            "C", "prefetch_online", [{"v": 1}], config={}, seed=0, started=provenance.utc_now(), path=a, command="test"
        )
    assert a.read_bytes() == before


def test_every_record_carries_provenance(tmp_path):
    recs = records.read([fake_run(tmp_path)])
    assert len(recs) == 2
    for r in recs:
        for k in records.REQUIRED:
            assert k in r, k
        assert r["versions"]["mlx"] and r["versions"]["mlx-lm"] and r["versions"]["numpy"]
        assert r["device"] in ("cpu", "gpu")
        assert r["host"].startswith("host-")
        assert r["started_utc"].endswith("Z") and r["finished_utc"] >= r["started_utc"]


def test_no_host_or_user_name_in_records(tmp_path):
    text = fake_run(tmp_path).read_text()
    values = set()

    def walk(o):
        if isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
        else:
            values.add(str(o))

    for line in text.splitlines():
        walk(json.loads(line))
    assert socket.gethostname() not in values
    assert getpass.getuser() not in values


def test_malformed_line_is_named(tmp_path):
    good = fake_run(tmp_path)
    bad = tmp_path / "C" / "prefetch_online" / "bad.jsonl"
    lines = good.read_text().splitlines()
    bad.write_text(lines[0] + "\n" + lines[1][:-10] + "\n")
    with pytest.raises(records.RawLogError, match=r"bad\.jsonl: line 2: not JSON"):
        records.read([tmp_path])
    rec = json.loads(lines[0])
    del rec["commit"]
    bad.write_text(json.dumps(rec) + "\n")
    with pytest.raises(records.RawLogError, match=r"bad\.jsonl: line 1: missing field\(s\) commit"):
        aggregate.build(tmp_path, tmp_path / "fig")


def test_tables_are_byte_identical_from_the_same_logs(tmp_path):
    raw = tmp_path / "raw"
    fake_run(raw)
    fake_run(raw)
    aggregate.build(raw, tmp_path / "a")
    aggregate.build(raw, tmp_path / "b")
    for f in sorted((tmp_path / "a" / "tables").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / "tables" / f.name).read_bytes(), f.name
    table = (tmp_path / "a" / "tables" / "prefetch_online.csv").read_text().splitlines()
    assert len(table) == 3  # header + two configurations, each from both runs (one commit: pooled)
    header = table[0].split(",")
    row = dict(zip(header, table[1].split(",")))
    assert row["runs"] == "2" and row["commit"] == (provenance.git_state()["commit"] or "")[:12]


def test_bad_config_fails_before_any_job_naming_the_field(tmp_path):

    cfg = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    cfg["prefetch_online"]["tiers"] = ["page_cache", "ssd"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    r = snakemake("-n", "all", "--configfile", str(bad))
    assert r.returncode != 0
    assert "ssd" in (r.stdout + r.stderr) and "tiers" in (r.stdout + r.stderr)


@pytest.mark.parametrize(
    "section,key,value,says",
    [
        ("design", "slots", [8, 999], "design.slots: 999 is outside 8..64"),
        ("design", "top_k", 99, "design.top_k: 99 is outside 1..64"),
        ("prefetch_online", "slots", [4], "prefetch_online.slots: 4 is outside 8..64"),
        ("prefetch_online", "depths", [1, 9], "prefetch_online.depths: 9 is outside 1..4"),
        ("prefetch_online", "predict_size", 65, "prefetch_online.predict_size: 65 is outside 1..64"),
    ],
)
def test_values_a_model_cannot_take_fail_at_planning_naming_the_key(tmp_path, section, key, value, says):
    """The schema allows them; the models do not (every model of the default profile has 64 experts,
    top-8 and 4 layers): refused before any job, by key."""
    cfg = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    cfg[section][key] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    r = snakemake("-n", "all", "--configfile", str(bad))
    assert r.returncode != 0 and says in r.stdout + r.stderr, r.stdout + r.stderr


def test_paper_profile_refuses_without_weights():
    r = snakemake("-n", "all", "--configfile", "configs/paper.yaml")
    assert r.returncode != 0
    assert "no pinned revision" in (r.stdout + r.stderr)


def test_dry_run_of_all_plans_every_gate():
    r = snakemake("-n", "all")
    assert r.returncode == 0, r.stderr
    jobs = job_stats(r.stdout)
    for rule in (
        "design",
        "prefetch_online",
        "predictor_quality",
        "routing",
        "sync_ablation",
        "placement_sim",
        "multinode",
        "wire_ablation",
        "tables",
        "plots",
    ):
        assert jobs.get(rule, 0) >= 1, (rule, jobs)


def _spread(v, spread):
    return (v, v * (1 - spread), v * (1 + spread)) if spread is not None else (v, None, None)


def sync_run(root, per_miss, batched, stall_per_miss, stall_batched, pset="general", spread=0.02):
    """A sync ablation record whose figures vary by +-`spread` over their repetitions (None: a
    single run, as records from before repetitions are)."""
    rows = []
    for s, t, st in (("per_miss", per_miss, stall_per_miss), ("batched", batched, stall_batched)):
        t, t_lo, t_hi = _spread(t, spread)
        st, st_lo, st_hi = _spread(st, spread)
        row = dict(model="m", tier="page_cache", prompt_set=pset, slots=16, experts=64, install="copy", sync=s,
                   tok_s=t, stall_ms_per_token=st, misses=100, tokens=32)  # fmt: skip
        if spread is not None:
            row.update(tok_s_min=t_lo, tok_s_max=t_hi, stall_ms_per_token_min=st_lo, stall_ms_per_token_max=st_hi,
                       repeats=3)  # fmt: skip
        rows.append(row)
    return rawlog.write_run(
        "C",
        "sync_ablation",
        rows,
        config={},
        seed=0,
        started=provenance.utc_now(),
        root=root,
        command="test",
        model="m",
        revision=None,
    )


def claims_of(raw, figdir):
    return aggregate.build(raw, figdir)["claims"].set_index("claim")


TOK = "batched reads vs per-miss sync, tok/s at 16 slots (general; m, copy)"
STALL = "stall halved by batching (general; m, copy; batched / per-miss)"


def test_claims_compare_ratios_with_a_stated_tolerance(tmp_path):
    sync_run(tmp_path / "raw", 28.0, 51.0, 4.0, 2.0)  # the paper's own figures: agree
    c = claims_of(tmp_path / "raw", tmp_path / "a")
    row = c.loc[TOK]
    assert row["ratio"] == pytest.approx(51 / 28) and row["direction"] == "yes" and row["within_tolerance"] == "yes"
    assert row["ratio_low"] == pytest.approx(51 * 0.98 / (28 * 1.02))
    assert row["ratio_high"] == pytest.approx(51 * 1.02 / (28 * 0.98))
    assert c.loc[STALL]["within_tolerance"] == "yes"
    text = (tmp_path / "a" / "claims.md").read_text()
    assert "within a factor of 1.5" in text and "28 -> 51 tok/s" in text


def test_claims_say_no_when_the_reproduction_disagrees(tmp_path):
    sync_run(tmp_path / "raw", 50.0, 40.0, 1.0, 1.2)  # batching made it slower: opposite direction
    row = claims_of(tmp_path / "raw", tmp_path / "a").loc[TOK]
    assert row["direction"] == "no" and row["within_tolerance"] == "no"
    sync_run(tmp_path / "raw2", 50.0, 55.0, 1.0, 0.9)  # right direction, far smaller gain
    row = claims_of(tmp_path / "raw2", tmp_path / "b").loc[TOK]
    assert row["direction"] == "yes" and row["within_tolerance"] == "no"


def test_a_claim_whose_spread_straddles_the_line_is_unresolved(tmp_path):
    sync_run(tmp_path / "raw", 50.0, 52.0, 1.0, 0.8, spread=0.1)  # x1.04, but +-10% on each side
    row = claims_of(tmp_path / "raw", tmp_path / "a").loc[TOK]
    assert row["ratio"] > 1 and row["ratio_low"] < 1 < row["ratio_high"]
    assert row["direction"] == "unresolved"
    sync_run(tmp_path / "raw2", 28.0, 51.0, 4.0, 2.0, spread=None)  # measured once: no spread
    row = claims_of(tmp_path / "raw2", tmp_path / "b").loc[TOK]
    assert row["direction"] == "unresolved (no spread)" and row["within_tolerance"] == "unresolved (no spread)"


def test_a_claim_rests_on_every_run_of_its_commit(tmp_path):
    """Two runs of one commit are pooled: the median of their figures and the widest range, so
    that a second run that disagrees makes the verdict unresolved instead of replacing the
    first; the claims table says how many runs and which commit. A run of another commit is not
    pooled with them."""
    raw = tmp_path / "raw"
    sync_run(raw, 28.0, 51.0, 4.0, 2.0)  # x1.82, +-2 %
    row = claims_of(raw, tmp_path / "a").loc[TOK]
    assert (row["direction"], row["runs"], row["commit"]) == ("yes", 1, (provenance.git_state()["commit"] or "")[:12])
    sync_run(raw, 50.0, 45.0, 4.0, 4.4)  # the same code again, now batching loses
    row = claims_of(raw, tmp_path / "b").loc[TOK]
    assert row["runs"] == 2 and row["direction"] == "unresolved"
    assert row["ratio_low"] == pytest.approx(45 * 0.98 / (50 * 1.02))
    assert row["ratio_high"] == pytest.approx(51 * 1.02 / (28 * 0.98))
    assert row["ratio"] == pytest.approx(((51 + 45) / 2) / ((28 + 50) / 2))
    assert "| runs | commit |" in (tmp_path / "b" / "claims.md").read_text()
    for code, f in zip("ab", sorted(raw.rglob("*.jsonl"))):  # each run of a commit of its own: the latest decides
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**r, "commit": code * 40}) + "\n" for r in recs))
    row = claims_of(raw, tmp_path / "c").loc[TOK]
    assert row["runs"] == 1 and row["direction"] == "no"


def test_readme_is_a_front_door_linking_every_guide_and_result():
    """The README stays short and links the guides and generated results; nothing rewrites it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15_000
    for target in ("docs/engine.md", "docs/gpu.md", "docs/cluster.md", "docs/results.md", "docs/workflow.md",
                   "docs/serve.md", "figures/claims.md"):  # fmt: skip
        assert f"]({target})" in readme and (ROOT / target).exists(), target
    results = (ROOT / "docs" / "results.md").read_text()
    for png in (
        "design",
        "throughput_vs_slots",
        "stall_vs_slots",
        "miss_breakdown",
        "predictor_recall",
        "routing",
        "train_loss",
        "placement",
    ):
        assert f"(../figures/{png}.png)" in results and (ROOT / "figures" / f"{png}.png").exists(), png


def test_provenance_names_no_path_of_the_machine(monkeypatch):
    """A record's command is what anyone would type again: no checkout path, no home folder."""
    main = str(ROOT / "engine" / "__main__.py")
    assert provenance.portable_command([main, "train", "olmoe-trained"]) == "python -m engine train olmoe-trained"
    assert provenance.portable_command([sys.executable, "-m", "harness", "bench", "miss"]) == (
        "python -m harness bench miss"
    )
    assert provenance.portable_command(["python", str(ROOT / "results" / "raw")]) == "python results/raw"
    home = os.path.expanduser("~")
    assert provenance.portable_command(["cat", os.path.join(home, "notes.txt")]) == "cat ~/notes.txt"
    for k in [k for k in os.environ if k.startswith("MLX_") or k.startswith("CUDA_")]:
        monkeypatch.delenv(k)
    rec = provenance.stamp({"x": 1}, command=[main, "decode"], seed=0)
    assert str(ROOT) not in json.dumps(rec) and rec["command"] == "python -m engine decode"
    assert "settings" not in rec  # nothing set: the record is as it always was


def test_a_record_names_the_mlx_settings_it_ran_under(monkeypatch):
    """A run under MLX_USE_CUDA_GRAPHS=0 (or CUDA_LAUNCH_BLOCKING=1, ...) computes or schedules
    otherwise, so its record says so; where MLX keeps its kernel cache changes nothing."""
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/tmp/ptx")
    rec = provenance.stamp({"x": 1}, command=["python"], seed=0)
    assert rec["settings"] == {"CUDA_LAUNCH_BLOCKING": "1", "MLX_USE_CUDA_GRAPHS": "0"}


def test_gate_c_runs_fitted_predictors_at_every_floor_and_the_others_without():
    from harness import online

    c = online.configs(64, [8, 16, 64], ["none", "probe", "oracle"], [1, 2], [0.0, 0.25])
    assert c[:2] == [(64, "mlx-lm", 0, 0.0), (64, "none", 0, 0.0)]
    assert (8, "probe", 2, 0.25) in c and (16, "probe", 1, 0.0) in c
    assert (8, "oracle", 2, 0.0) in c and (8, "oracle", 2, 0.25) not in c
    assert len(c) == len(set(c)) == 2 + 2 * (1 + 2 * 2 + 2)  # S = E only as the ceiling


def test_configurations_take_turns_and_the_log_says_where_the_time_went(monkeypatch, capsys):
    """Each repetition starts one configuration later, so none always decodes first; each
    repetition is logged with the seconds since the sweep began, since a sweep cut short by a
    time limit writes no record."""
    from harness import online

    order = []
    monkeypatch.setattr(online, "decode", lambda model, ids, tokens: order.append((model, ids[0])) or (None, []))
    monkeypatch.setattr(online, "accumulate", lambda acc, records: acc)
    accs = online.run_interleaved({"a": "A", "b": "B"}, [[1], [2]], 4, 2, say=online.phase_log())
    assert order == [("A", 1), ("A", 2), ("B", 1), ("B", 2), ("B", 1), ("B", 2), ("A", 1), ("A", 2)]
    assert {k: len(v) for k, v in accs.items()} == {"a": 2, "b": 2}
    lines = capsys.readouterr().err.splitlines()
    assert [l.split(" s  ", 1)[1] for l in lines] == [
        "repetition 1 of 2: 2 configurations x 2 prompts",
        "repetition 2 of 2: 2 configurations x 2 prompts",
    ]
    assert all(l.startswith("[titan]") and float(l.split()[1]) >= 0 for l in lines)


class _Stopped(Exception):
    """What a time limit's kill is to a sweep: it stops between two decodes."""


def _counting_decode(order):
    def decode(model, ids, tokens):
        order.append((model, ids[0]))
        return None, [{"phase": "decode", "seconds": 0.5, "hits": len(order)}]

    return decode


def test_a_stopped_sweep_resumes_at_the_repetition_it_had_not_finished(monkeypatch, tmp_path):
    """The rerun of a sweep stopped in its second repetition takes the first from the checkpoint,
    measures the second and the third in the order the first process would have, and removes
    nothing it did not measure; another sweep's checkpoint is never read."""
    from harness import online
    from harness.checkpoint import Repetitions

    order = []
    monkeypatch.setattr(online, "decode", _counting_decode(order))
    models, inputs, key = {("a", 1): "A", ("b", 2): "B"}, [[1], [2]], {"sweep": 1}
    path = tmp_path / "partial" / "sweep.json"

    class StopInSecond(Repetitions):
        def save(self, reps):
            super().save(reps)
            monkeypatch.setattr(online, "decode", lambda *a: (_ for _ in ()).throw(_Stopped()))

    with pytest.raises(_Stopped):
        online.run_interleaved(models, inputs, 4, 3, checkpoint=StopInSecond(path, key))
    first = list(order)
    assert first == [("A", 1), ("A", 2), ("B", 1), ("B", 2)] and path.exists()

    order.clear()
    monkeypatch.setattr(online, "decode", _counting_decode(order))
    reps = Repetitions(path, key)
    accs = online.run_interleaved(models, inputs, 4, 3, checkpoint=reps)
    assert reps.loaded == 1
    # repetitions 2 and 3 in the turns the stopped process would have taken
    assert order == [("B", 1), ("B", 2), ("A", 1), ("A", 2), ("A", 1), ("A", 2), ("B", 1), ("B", 2)]
    # the first repetition is the stopped process's (its decodes were the 1st to 4th), the rest new
    assert [a["hits"] for a in accs[("b", 2)]] == [3 + 4, 1 + 2, 7 + 8]
    assert accs[("a", 1)][0]["hits"] == 1 + 2 and accs[("a", 1)][0]["seconds"] == 1.0

    order.clear()
    other = Repetitions(path, {"sweep": 2})  # other arguments, code or model files
    online.run_interleaved(models, inputs, 4, 3, checkpoint=other)
    assert other.loaded == 0 and len(order) == 3 * 4


_SWEEP = """
import sys, time
from harness import checkpoint, online
save = checkpoint.Repetitions.save
def slow_save(self, reps):  # the second repetition cannot finish before the kill
    save(self, reps)
    print("saved", len(reps), flush=True)
    if sys.argv[2] == "stop":
        time.sleep(600)
checkpoint.Repetitions.save = slow_save
rows = online.sweep("olmoe-tiny-f32", "page_cache", "general", [16], ["none"], [1], 1, 4, repeats=2,
                    checkpoint=sys.argv[1])
print("rows", [(r["slots"], r["predictor"], r["repeats"], r["repeats_resumed"]) for r in rows], flush=True)
"""


def test_a_sweep_killed_in_its_second_repetition_is_measured_again_from_there(tmp_path):
    """A real process killed (SIGKILL, as a time limit does) after its first repetition: the
    rerun loads that repetition, measures the second, says so in each result, and removes the
    checkpoint."""
    path = tmp_path / "partial.json"
    cmd = [sys.executable, "-c", _SWEEP, str(path)]
    p = subprocess.Popen(cmd + ["stop"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "saved 1"
    finally:
        p.kill()
        p.wait()
    assert path.exists()
    out = subprocess.run(cmd + ["go"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "1 repetitions already measured, resuming" in out.stderr
    assert "saved 2" in out.stdout and not path.exists()
    assert "rows [(64, 'mlx-lm', 2, 1), (64, 'none', 2, 1), (16, 'none', 2, 1)]" in out.stdout


@pytest.mark.parametrize("content", ["{not json", json.dumps({"key": {"sweep": 1}, "repetitions": [{'["a", 1]': {}}]})])
def test_a_checkpoint_that_is_cut_or_lacks_a_configuration_is_measured_again(tmp_path, content):
    from harness.checkpoint import Repetitions

    path = tmp_path / "sweep.json"
    path.write_text(content)
    said = []
    reps = Repetitions(path, {"sweep": 1}, say=said.append)
    assert reps.load([("a", 1), ("b", 2)]) == [] and reps.loaded == 0
    assert str(path) in said[0] and "afresh" in said[0]


def test_a_sweeps_checkpoint_key_changes_when_the_model_is_trained_again(tmp_path):
    """The key takes the store's model digest, whose build manifest holds the weights' sha256:
    a retraining with the same shapes (a GPU one of the same seed) is another model."""
    from engine.models import embedded
    from engine.runtime.store import model_digest

    (tmp_path / "config.json").write_text("{}")
    embedded.write_safetensors(tmp_path / "model.safetensors", {"w": ("F32", (1,), b"1234")})
    manifest = tmp_path / embedded.MANIFEST

    def train():
        manifest.write_text(
            json.dumps({"files": {"model.safetensors": embedded.sha256_file(tmp_path / "model.safetensors")}})
        )

    train()
    before = model_digest(tmp_path)
    assert model_digest(tmp_path) == before
    embedded.write_safetensors(tmp_path / "model.safetensors", {"w": ("F32", (1,), b"5678")})
    train()
    assert model_digest(tmp_path) != before


def test_a_run_without_a_floor_joins_the_rows_at_floor_zero(tmp_path):
    """Gate C records before confidence floors have no min_prob: they ran at 0, so a newer run
    of the same configuration replaces them in the table rather than standing beside them."""
    fake_run(tmp_path)
    fake_run(tmp_path, min_prob=0.0)
    fake_run(tmp_path, min_prob=0.25)
    df = online_tables.prefetch_table(records.read([tmp_path]))
    assert sorted(df["min_prob"].unique()) == [0.0, 0.25]
    assert list(df[df["min_prob"] == 0.0]["runs"]) == [2, 2]


def test_every_trained_model_has_its_latest_curve(tmp_path):
    for model, steps in (("a", 3), ("a", 2), ("b", 4)):
        rawlog.write_run(
            "train",
            model,
            [dict(step=i, loss=1.0, cross_entropy=1.0, seconds=float(i)) for i in range(steps)],
            config={"model": model},
            seed=0,
            started=provenance.utc_now(),
            root=tmp_path,
            command="test",
            model=model,
            revision=None,
        )
    df = routing_tables.train_table(records.read([tmp_path]))
    assert df.groupby("model").size().to_dict() == {"a": 2, "b": 4}


def test_gate_c_rows_keep_each_install_path_apart(tmp_path):
    """A run on the pinned path stands beside the copy path's earlier run of the same
    configuration; a record from before records named the path ran that device's default then."""
    fake_run(tmp_path)  # no install: a CPU's default then, inplace
    fake_run(tmp_path, install="inplace")
    fake_run(tmp_path, install="copy")
    df = online_tables.prefetch_table(records.read([tmp_path]))
    assert df.groupby("install")["runs"].max().to_dict() == {"copy": 1, "inplace": 2}


def test_two_runs_verdicts_are_compared_each_from_its_own_records(tmp_path):
    """compare_runs: run 1 as committed, and a 'second run' that is its copy with one stall made
    ten times worse: exactly the claim that stall decides changes, and nothing else."""

    first = "c8af1fee9518-host-443118812e"
    raw = tmp_path / "raw"
    for f in (ROOT / "results" / "raw").rglob("*.jsonl"):
        dst = raw / f.relative_to(ROOT / "results" / "raw")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(f)
        if compare_runs.of_run(f.name, first):
            lines = []
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                rec["run_id"] = rec["run_id"].replace(first, "second")
                res = rec["result"]
                if "tiny-f32-code" in f.name and res.get("sync") == "batched" and res.get("install") == "copy":
                    for k in ("stall_ms_per_token", "stall_ms_per_token_min", "stall_ms_per_token_max"):
                        res[k] *= 10
                lines.append(json.dumps(rec))
            (dst.parent / f.name.replace(first, "second")).write_text("\n".join(lines) + "\n")
    df = compare_runs.compare(raw, first, "second")
    assert len(df) > 10
    changed = df[~df["same"]]
    assert list(changed["claim"]) == ["stall halved by batching (code; olmoe-tiny-f32, copy; batched / per-miss)"]
    assert changed["direction_a"].iloc[0] == "yes" and changed["direction_b"].iloc[0] == "no"


def test_the_claims_check_reports_a_changed_verdict_and_only_it(tmp_path):
    """claims_check: a check run that is the last full run's sync ablation again, with one stall made
    ten times worse, reports exactly the claim that stall decides (yes -> no, a reversal), with
    the full run it was compared with."""

    first = "c8af1fee9518-host-443118812e"
    raw, check = tmp_path / "raw", tmp_path / "check"
    for f in (ROOT / "results" / "raw").rglob("*.jsonl"):
        if FULL_RUN_FILE.match(f.name) and not f.name.startswith(first):  # every other full run: this one is the last
            continue
        dst = raw / f.relative_to(ROOT / "results" / "raw")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(f)
        if compare_runs_of(f.name, first) and "/sync_ablation/" in str(f):
            lines = []
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                res = rec["result"]
                if "tiny-f32-code" in f.name and res.get("sync") == "batched" and res.get("install") == "copy":
                    for k in ("stall_ms_per_token", "stall_ms_per_token_min", "stall_ms_per_token_max"):
                        res[k] *= 10
                lines.append(json.dumps(rec))
            out = check / "C" / "sync_ablation" / f.name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("\n".join(lines) + "\n")
    full, df = claims_check.check(raw, check, "host-443118812e")
    assert full == first and len(df) >= 8
    changed = df[df["changed"]]
    assert list(changed["claim"]) == ["stall halved by batching (code; olmoe-tiny-f32, copy; batched / per-miss)"]
    assert changed["reversed"].all()
    text = claims_check.report(full, df, ["abc1234 a change"], check)
    assert "1 verdicts changed, 1 of them from yes to no or back" in text and "REVERSED stall halved" in text
    assert text.rstrip().endswith("abc1234 a change")
    assert claims_check.check(raw, check, "host-0000000000")[0] is None  # no full run on that machine


def compare_runs_of(name, run):

    return compare_runs.of_run(name, run)


def test_a_model_that_does_not_fit_is_measured_at_its_slots_only(capsys):
    """bench throughput on a model larger than memory (the f32 full-size shape on a 24 GiB
    machine) decodes at --slots and never resident; `auto` decides from weights and memory."""
    import argparse

    from harness import bench

    assert bench.resident_fits("olmoe-tiny-f32")[0] is True
    a = argparse.Namespace(
        model="olmoe-tiny-f32",
        slots=[16],
        installs=None,
        overlap="on",
        tier="page_cache",
        tokens=3,
        repeats=1,
        resident="no",
        prompt_tokens=40,
        set="code",
    )
    out = bench.throughput(a)
    assert set(out["tok_s"]) == {"S=16"} and out["resident"] is False
    # the prompt's prefill, measured beside the decode: 40 tokens route to more than 16 experts
    assert out["prompt_tokens"] == 40 and out["prefill_tok_s"]["S=16"] > 0
    assert out["prefill_bytes_read"]["S=16"] > 0
    assert out["ratio_vs_resident"] == {} and out["ratio_engine_full_vs_mlx_lm"] is None
    assert "no resident decoding: weights" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="nothing to measure"):
        bench.throughput(argparse.Namespace(**dict(vars(a), slots=[])))
    with pytest.raises(SystemExit, match="--prompt-tokens 100000: the code eval prompts make only"):
        bench.throughput(argparse.Namespace(**dict(vars(a), prompt_tokens=100_000)))


def _gate_c_row(slots, predictor, tok_s, depth=1, min_prob=0.0, **more):
    row = dict(
        device="gpu", chip="NVIDIA H200", host="host-x", model="olmoe-wide-trained", tier="page_cache",
        prompt_set="general", slots=slots, predictor=predictor, depth=depth, min_prob=min_prob,
        install="pinned", experts=64, tok_s=tok_s, tok_s_min=tok_s - 5, tok_s_max=tok_s + 5,
        sync_ms_per_token=2.0, stall_ms_per_token=1.0, commit="aaaaaaaaaaaa",
    )  # fmt: skip
    return {**row, **more}


def test_the_answer_figure_takes_the_best_fitted_predictor_at_each_s(tmp_path, monkeypatch):
    """prediction_pays: at every S below E, demand loading, whichever fitted predictor (any depth,
    any floor) decoded fastest at that S, and the best oracle depth; a token's time split into
    the parts its record measured and the rest."""

    rows = [
        _gate_c_row(8, "none", 80.0, depth=0),
        _gate_c_row(8, "probe", 70.0, predict_ms_per_token=3.0),
        _gate_c_row(8, "transition", 90.0, depth=3, min_prob=0.25),
        _gate_c_row(8, "oracle", 120.0),
        _gate_c_row(8, "oracle", 130.0, depth=2),
        _gate_c_row(16, "none", 140.0, depth=0),
        _gate_c_row(16, "popularity", 150.0),
        _gate_c_row(16, "probe", 145.0, depth=2),
        _gate_c_row(16, "oracle", 170.0, depth=3),
        _gate_c_row(64, "none", 500.0, depth=0),
        _gate_c_row(64, "mlx-lm", 400.0, depth=0),
    ]
    bars = plotting.answer_rows(pd.DataFrame(rows)).set_index(["slots", "kind"])
    assert sorted(bars.index.get_level_values("slots").unique()) == [8, 16]  # S = E is no question
    best = bars.loc[(8, "best fitted")]
    assert (best["predictor"], best["depth"], best["min_prob"], best["tok_s"]) == ("transition", 3, 0.25, 90.0)
    assert bars.loc[(16, "best fitted"), "predictor"] == "popularity"
    assert bars.loc[(8, "oracle"), "depth"] == 2 and bars.loc[(8, "demand"), "tok_s"] == 80.0
    assert bars.loc[(8, "demand"), "other"] == pytest.approx(1e3 / 80 - 2.0 - 1.0)

    figdir = tmp_path / "figures"
    (figdir / "tables").mkdir(parents=True)
    pd.DataFrame(rows).to_csv(figdir / "tables" / "prefetch_online.csv", index=False)
    with monkeypatch.context() as m:
        m.setattr(plotting, "_empty", lambda *a: pytest.fail(f"drew the no-results card: {a}"))
        plotting.prediction_pays(figdir, trained=["olmoe-wide-trained"])
    assert (figdir / "prediction_pays.png").exists()
    # a model whose routing was not learnt is no question for this figure
    cards = []
    monkeypatch.setattr(plotting, "_empty", lambda *a: cards.append(a))
    plotting.prediction_pays(figdir, trained=["olmoe-trained"])
    assert cards == [(figdir, "prediction_pays", "gate C results on a trained model")]


def test_each_install_path_of_gate_c_gets_its_own_answer_panel_and_the_device_one_leads():
    """Gate C run on the pinned path and later on the device install (one model, prompt set and
    machine): prediction_pays draws a panel for each, each with its own run's resident rows, never
    the best of both; the lines of gate C's other figures follow the device install (`auto` on a
    CUDA GPU), the pinned path's demand loading in grey beside it."""
    pinned = [_gate_c_row(8, "none", 80.0, depth=0), _gate_c_row(8, "oracle", 130.0),
              _gate_c_row(8, "probe", 90.0), _gate_c_row(64, "mlx-lm", 400.0, depth=0, install=None)]  # fmt: skip
    device = [_gate_c_row(8, "none", 240.0, depth=0, install="device", commit="bbbbbbbbbbbb"),
              _gate_c_row(8, "oracle", 210.0, install="device", commit="bbbbbbbbbbbb"),
              _gate_c_row(8, "probe", 195.0, install="device", commit="bbbbbbbbbbbb"),
              _gate_c_row(64, "none", 370.0, depth=0, commit="bbbbbbbbbbbb"),
              _gate_c_row(64, "mlx-lm", 360.0, depth=0, install=None, commit="bbbbbbbbbbbb")]  # fmt: skip
    df = pd.DataFrame(pinned + device)
    panels = dict(plotting.install_panels(df))
    assert sorted(panels) == ["device", "pinned"]
    assert sorted(panels["device"]["tok_s"]) == [195.0, 210.0, 240.0, 360.0, 370.0]
    assert sorted(panels["pinned"]["tok_s"]) == [80.0, 90.0, 130.0, 400.0]
    bars = plotting.answer_rows(panels["device"]).set_index("kind")
    assert bars.loc["demand", "tok_s"] == 240.0 and bars.loc["oracle", "tok_s"] == 210.0
    current, earlier = plotting._current_install(df[df["predictor"] != "mlx-lm"])
    assert set(current["install"]) == {"device", "pinned"}  # the device run's S = E row rides along
    assert set(current.loc[current["slots"] < 64, "install"]) == {"device"}
    assert set(earlier["install"]) == {"pinned"} and 370.0 in set(current["tok_s"])


def test_throughput_runs_of_different_install_paths_keep_their_own_rows():
    """A run on the copy path from before records named the install, and a pinned run that named
    it, both call their offloaded configuration `S=16`: the table keeps them apart (a shared row
    would count them as two runs of one figure and show only the newer); resident rows are shared."""

    def rec(started, result):
        machine = dict(device="gpu", gpu="NVIDIA H200", chip="x", host="h", gate="bench")
        return dict(machine, started_utc=started, run_id=started, result=dict(bench="throughput", model="m", **result))

    old = rec("2026-11-30T03", dict(tokens=32, tok_s={"S=16": 18.0, "S=E": 200.0, "mlx-lm": 198.0}))
    new = rec(
        "2026-11-30T21",
        dict(
            tokens=32,
            tok_s={"S=16": 42.0, "S=E": 259.0},
            tok_s_spread={"S=16": {"min": 38.0, "max": 44.0}},
            memory_bytes={"S=16": 1.24e9, "S=E": 3.96e9},
            install={"S=16": "pinned", "S=E": "pinned"},
            prefill_tok_s={"S=16": 610.0},
            prefill_bytes_read={"S=16": 7.9e6},
        ),
    )
    df = bench_tables.bench_table([old, new]).set_index("figure")
    # a prefill measured beside the decode (runs before it was measured have none)
    assert df.loc["prefill_tok_s[S=16/pinned]", "value"] == 610.0
    assert df.loc["prefill_bytes_read[S=16/pinned]", "value"] == 7.9e6 and "prefill_tok_s[S=16/copy]" not in df.index
    assert df.loc["tok_s[S=16/copy]", ["value", "runs"]].tolist() == [18.0, 1]
    assert df.loc["tok_s[S=16/pinned]", ["value", "runs"]].tolist() == [42.0, 1]
    assert df.loc["tok_s_min[S=16/pinned]", "value"] == 38.0 and df.loc["memory_bytes[S=16/pinned]", "value"] == 1.24e9
    assert df.loc["tok_s[S=E]", ["value", "runs"]].tolist() == [259.0, 2]
    assert "tok_s[S=16]" not in df.index
    # a run of shorter decodes is another figure, not a newer run of this one
    short = rec("2026-11-30T22", dict(tokens=16, tok_s={"S=16": 30.0}, install={"S=16": "pinned"}))
    df = bench_tables.bench_table([old, new, short]).set_index(["figure", "tokens"])
    assert df.loc[("tok_s[S=16/pinned]", 32), "value"] == 42.0 and df.loc[("tok_s[S=16/pinned]", 16), "value"] == 30.0


def test_a_many_rows_run_of_another_install_keeps_its_own_resident_beside_the_default_runs():
    """`manyrows` runs the default install, then `--installs pinned` alone, at one commit: each
    run's resident (measured in its own repeats) stays its own row, so the default run's table
    and sentence read its own resident's figures, not the ablation's."""
    from harness.report.docblocks import many_rows_tables

    def rec(run, install, res_ms, conf_ms):
        machine = dict(device="gpu", gpu="NVIDIA H100", chip="H100", host="h", gate="bench", commit="c")
        cfg = "S=16/union" if install == "device" else "S=16"
        sp = {k: {"128": dict(median=v / 1e3, min=v / 1e3, max=v / 1e3, n=2)} for k, v in
              (("resident", res_ms), (cfg, conf_ms))}  # fmt: skip
        x = {k: {"128": dict(median=res_ms / v, min=res_ms / v, max=res_ms / v)} for k, v in
             (("resident", res_ms), (cfg, conf_ms))}  # fmt: skip
        one = dict(median=1.0, min=1.0, max=1.0)
        result = dict(bench="prefill", model="m", lengths=[128], repeats=2, install={cfg: install},
                      default_install="device", ttft_s=sp, x_resident=x, decode_tok_s={k: one for k in sp},
                      decode_x_resident={k: one for k in sp}, memory_bytes={k: 1.0 for k in sp},
                      memory_x_resident={k: 1.0 for k in sp}, tokens_match={k: True for k in sp})  # fmt: skip
        return dict(machine, started_utc=run, run_id=run, result=result)

    df = bench_tables.bench_table(
        [rec("2026-12-07T1", "device", 50.0, 100.0), rec("2026-12-07T2", "pinned", 60.0, 300.0)]
    )
    resident = df[df["figure"] == "ttft_ms[resident@128]"].set_index("run_id")["value"]
    assert resident.to_dict() == {"2026-12-07T1": 50.0, "2026-12-07T2": 60.0}
    tables = many_rows_tables(df)
    assert "run `2026-12-07T1`" in tables and "resident's time to first token: 50 ms" in tables
    assert "| S = 16 (pinned) | 0.20× [0.20, 0.20] |" in tables and "resident's time to first token: 60 ms" in tables


def test_memory_runs_of_the_throughput_bench_are_read_per_configuration(tmp_path, monkeypatch):

    figdir = tmp_path / "figures"
    (figdir / "tables").mkdir(parents=True)
    fig = {"memory_bytes[S=16]": 1.2e9, "tok_s[S=16]": 40.0, "tok_s_min[S=16]": 38.0, "tok_s_max[S=16]": 44.0,
           "memory_bytes[mlx-lm]": 3.9e9, "tok_s[mlx-lm]": 250.0, "ratio engine S=E / mlx-lm": 1.0}  # fmt: skip
    row = dict(device="gpu", chip="NVIDIA H200", host="h", bench="throughput", model="m", runs=1)
    # a run of longer decodes without memory figures first: its tok/s is not paired with the other's memory
    rows = [dict(row, tokens=32, figure="tok_s[S=16]", value=60.0, run_id="20261130T000000000Z-cccccc")]
    rows += [dict(row, tokens=16, figure=k, value=v, run_id="20261130T000000000Z-bbbbbb") for k, v in fig.items()]
    # an older run that measured memory too, at configurations the wider one did not run: not drawn
    # beside it (the bench table keeps each figure's newest run, so a panel would mix unlike runs)
    older = {"memory_bytes[S=8/pinned@mlx-lm]": 0.8e9, "tok_s[S=8/pinned@mlx-lm]": 20.0}
    # and a later one of one configuration: the wider run stays the panel's
    later = {"memory_bytes[S=32/pinned@mlx-lm]": 2.1e9, "tok_s[S=32/pinned@mlx-lm]": 60.0}
    rows += [dict(row, tokens=128, figure=k, value=v, run_id="20261201T000000000Z-dddddd") for k, v in later.items()]
    rows += [dict(row, tokens=128, figure=k, value=v, run_id="20261129T000000000Z-aaaaaa") for k, v in older.items()]
    pd.DataFrame(rows).to_csv(figdir / "tables" / "bench.csv", index=False)
    pd.DataFrame({"empty": [True]}).to_csv(figdir / "tables" / "prefetch_online.csv", index=False)
    got = plotting._bench_memory(figdir).set_index("config")
    assert got.loc["S=16", ["memory_bytes", "tok_s", "tok_s_min", "tok_s_max"]].tolist() == [1.2e9, 40.0, 38.0, 44.0]
    assert got.loc["mlx-lm", "tok_s"] == 250.0 and len(got) == 2
    assert set(got["run_id"]) == {"20261130T000000000Z-bbbbbb"}
    monkeypatch.setattr(plotting, "_empty", lambda *a: pytest.fail(f"drew the no-results card: {a}"))
    plotting.memory(figdir)  # gate C has nothing yet: the bench's runs alone make the figure
    assert (figdir / "throughput_vs_memory.png").exists()


def test_a_throughput_runs_panel_draws_each_install_path_up_to_resident():
    """One bench run with two install paths through mlx-lm's loop: one line each, S ascending and
    ending at the run's S = E, mlx-lm's own resident decoding not among them."""
    import matplotlib.pyplot as plt

    rows = [("S=32/device@mlx-lm", 2.1e9, 220.0), ("S=8/device@mlx-lm", 0.8e9, 145.0),
            ("S=8/pinned@mlx-lm", 0.8e9, 24.0), ("S=E@mlx-lm", 3.9e9, 300.0),
            ("mlx-lm@mlx-lm", 3.9e9, 250.0)]  # fmt: skip
    b = pd.DataFrame(rows, columns=["config", "memory_bytes", "tok_s"])
    fig, ax = plt.subplots()
    plotting._bench_lines(ax, b)
    lines = {c.get_label(): c.lines[0].get_ydata().tolist() for c in ax.containers}
    plt.close(fig)
    assert lines == {
        "device through mlx-lm (bench throughput)": [145.0, 220.0, 300.0],
        "pinned through mlx-lm (bench throughput)": [24.0, 300.0],
    }


def test_a_prefetch_bench_row_says_which_stream_its_prefetches_ran_on(capsys, monkeypatch):
    """bench prefetch with the device install and `--overlap` left to the engine (auto): the
    oracle's row is the decode stream's (`/serial`, overlap false), the engine's default there; asked
    for both, each stream has its row, and demand loading and resident decoding keep theirs. Each
    engine decodes a few warm-up tokens before its measured decodes, every decode pipelined as
    mlx-lm's generate_step decodes (the record says so)."""
    import argparse

    from harness import bench

    a = argparse.Namespace(
        model="qwen3moe-tiny", slots=[8], tier="page_cache", install="device", predictors=["oracle"],
        depths=[1], min_probs=[0.0], set="general", prompts=1, tokens=3, overlap="auto",
    )  # fmt: skip
    decoded = []
    real_decode = bench.decode
    monkeypatch.setattr(
        bench, "decode", lambda m, ids, n, *x, **kw: decoded.append((m, n, kw)) or real_decode(m, ids, n, *x, **kw)
    )
    out = bench.prefetch_bench(a)
    rows = out["results"]
    assert out["loop"] == "pipelined" and all(kw == {"pipelined": True} for *_, kw in decoded)
    assert set(rows["oracle/d1/serial"]["call_split_ms"]) == {"graph", "queue", "eval"}
    assert set(rows) == {"resident/d0", "none/d0", "oracle/d1/serial"}
    # every engine first decodes a few warm-up tokens (first-use compilation), then the measured ones
    warm = [m for m, n, _ in decoded[:3] if n == bench.WARM_TOKENS]
    assert len({id(m) for m in warm}) == 3 and [n for _, n, _ in decoded[3:]] == [a.tokens] * 3
    assert rows["oracle/d1/serial"]["overlap"] is False and rows["oracle/d1/serial"]["install"] == "device"
    # each prompt is decoded by every configuration in turn: a row's ratio to resident decoding is
    # taken prompt by prompt, and the table carries it with its range
    runs = rows["oracle/d1/serial"]["tok_s_runs"]
    assert len(runs) == a.prompts and rows["resident/d0"]["x_resident_paired"] == dict(median=1.0, min=1.0, max=1.0)
    assert rows["oracle/d1/serial"]["x_resident_paired"]["min"] == runs[0] / rows["resident/d0"]["tok_s_runs"][0]
    machine = dict(device="gpu", gpu="NVIDIA H200", chip="x", host="h", gate="bench")
    df = bench_tables.bench_table([dict(machine, started_utc="t", run_id="r", result=out)]).set_index("figure")
    paired = rows["oracle/d1/serial"]["x_resident_paired"]
    assert df.loc["x resident paired[oracle/d1/serial/device]", "value"] == paired["median"]
    assert df.loc["x resident paired_max[oracle/d1/serial/device]", "value"] == paired["max"]
    a.overlap = "both"
    rows = bench.prefetch_bench(a)["results"]
    assert set(rows) == {"resident/d0", "none/d0", "oracle/d1", "oracle/d1/serial"}
    assert rows["oracle/d1"]["overlap"] is True


def test_the_many_rows_benches_run_each_configuration_beside_resident_and_compare_tokens(capsys):
    """`bench prefill` and `bench batch` on the CPU: every configuration (the device install with
    and without the next layer's area copied ahead, named so) against resident in the same repeat,
    its greedy tokens compared with resident's (an exact engine gives resident's), its table rows
    named with the install path."""
    import argparse

    from harness import manyrows
    from harness.report.tables.bench import many_rows_figures

    a = argparse.Namespace(model="olmoe-tiny-f32", slots=[16], installs=["device"], area_ahead="both",
                           tier="page_cache", tokens=3, repeats=2, lengths=[24, 80], set="code",
                           batches=[1, 4], prompt_tokens=12)  # fmt: skip
    pre = manyrows.prefill(a)
    assert set(pre["ttft_s"]) == {"resident", "S=16/ahead", "S=16/union"} and pre["lengths"] == [24, 80]
    assert all(pre["tokens_match"].values()) and pre["install"]["S=16/ahead"] == "device"
    from engine import device

    assert pre["default_install"] == ("inplace" if device.kind() == "cpu" else "device")  # what `auto` gives
    assert pre["x_resident"]["resident"]["80"] == dict(median=1.0, min=1.0, max=1.0)
    assert pre["ttft_s"]["S=16/union"]["24"]["n"] == 2 and pre["decode_tok_s"]["S=16/ahead"]["n"] == 2
    figs = many_rows_figures(pre)
    assert "x resident_min[S=16/device/ahead@80]" in figs and figs["tokens_match[S=16/device/union]"] == 1.0
    bat = manyrows.batch(a)
    assert set(bat["tok_s"]["S=16/ahead"]) == {"1", "4"} and all(bat["tokens_match"].values())
    assert "tok_s_max[S=16/device/union@B4]" in many_rows_figures(bat)
    # the bus, measured in the same run: 4 rows of top-8 name at most 32 of 64 experts a layer
    assert bat["bus"]["gb_s"] > 0 and bat["step_bytes"]["4"] == 4 * bat["step_bytes"]["1"]
    assert all(0 < x <= 1 for x in bat["bus_limit_x_resident"].values())
    assert many_rows_figures(bat)["rows name every expert[B4]"] == 0.0
    # what the decode steps' rows named, counted on resident's run: one row names its top-k; four
    # name at least that and at most 4 x top-k; every layer of every step counted once
    one, four = bat["named_experts"]["1"], bat["named_experts"]["4"]
    assert one["counts"] == {str(bat["top_k"]): one["steps"] * one["layers"]} and one["rows"] == one["steps"] > 0
    assert four["rows"] == 4 * four["steps"] and sum(four["counts"].values()) == four["steps"] * four["layers"]
    assert all(bat["top_k"] <= int(u) <= min(bat["experts"], 4 * bat["top_k"]) for u in four["counts"])
    # no cache of 16 brings in fewer than a step's experts beyond 16, nor more than all it names
    beyond = sum(max(0, int(u) - 16) * n for u, n in four["counts"].items())
    assert beyond <= four["fewest_misses"]["16"] <= sum(int(u) * n for u, n in four["counts"].items())
    figs = many_rows_figures(bat)
    assert bat["top_k"] <= figs["named experts a layer[B4]"] <= 4 * bat["top_k"]
    assert 0 < figs["bus limit x resident[S=16/device/union@B4]"] <= 1  # a limit at every B now
    assert "tokens DIFFER" not in capsys.readouterr().out


def test_the_bus_limit_of_a_batch_is_residents_step_over_the_bus_time_of_every_expert_its_rows_name():
    from harness.manyrows import bus_limit

    # 2 layers of 64 experts of 1 MB, top-8, at 0.4 GB/s; resident 100 tok/s at B = 16 (0.16 s a
    # step) and 50 tok/s at B = 1 (0.02 s): B = 16 names every expert, 128 MB, 0.32 s on the bus;
    # B = 1 names 8 a layer, 16 MB, 0.04 s
    out = bus_limit(dict(gb_s=0.4), [64, 64], 10**6, 8, {16: 100.0, 1: 50.0})
    assert out["step_bytes"] == {"16": 128 * 10**6, "1": 16 * 10**6}
    assert out["bus_limit_x_resident"] == pytest.approx({"16": 0.5, "1": 0.5})
    assert bus_limit(dict(gb_s=100.0), [64], 10**6, 8, {16: 100.0})["bus_limit_x_resident"]["16"] == 1.0


def test_where_a_batchs_rows_name_every_expert_the_bus_carries_all_but_the_slots_experts():
    from harness.report.tables.bench import many_rows_figures

    # the record above at B = 16 (128 MB a step, 0.32 s at 0.4 GB/s; resident 0.16 s a step): with
    # 16 of 64 experts a layer in the slots, 96 MB cross, 0.24 s (2/3); with 32, 64 MB, 0.16 s (1)
    tok = dict(median=100.0, min=90.0, max=110.0, n=3)
    res = dict(bench="batch", repeats=3, install={"S=16": "device", "S=32": "device"}, top_k=8, experts=64,
               bus=dict(gb_s=0.4), tok_s={k: {"16": tok, "4": tok} for k in ("resident", "S=16", "S=32")},
               x_resident={k: {"16": tok, "4": tok} for k in ("resident", "S=16", "S=32")},
               tokens_match={"resident": True, "S=16": True, "S=32": True},
               step_bytes={"16": 128 * 10**6, "4": 64 * 10**6}, bus_limit_x_resident={"16": 0.5, "4": 0.5})  # fmt: skip
    figs = many_rows_figures(res)
    assert figs["bus limit x resident[S=16/device@B16]"] == pytest.approx(2 / 3)
    assert figs["bus limit x resident[S=32/device@B16]"] == 1.0
    # 4 rows of top-8 need not name every expert: no limit of that kind there
    assert not any(f.startswith("bus limit x resident[S=") and f.endswith("@B4]") for f in figs)


def test_where_a_batch_counted_the_experts_its_rows_named_the_bus_carries_those_beyond_the_slots():
    """Rows that name fewer than every expert get a limit too, from the count: a layer whose step
    named u experts sends max(0, u - S) across the bus, whatever the path does."""
    from harness.report.tables.bench import many_rows_figures, named_limit

    # 2 decode steps of 4 rows (8 tokens) over 2 layers: the four (step, layer) pairs named 20, 20,
    # 30 and 30 experts of 1 MB; at S = 16, 4 + 4 + 14 + 14 = 36 MB cross, 4.5 MB a token, 45 ms at
    # 0.1 GB/s; resident's 40 tok/s is 25 ms a token: 25/45. At S = 32 nothing need cross: 1.
    named = dict(steps=2, rows=8, layers=2, counts={"20": 2, "30": 2})
    assert named_limit(named, 16, 10**6, 0.1, 40.0) == pytest.approx(25 / 45)
    assert named_limit(named, 32, 10**6, 0.1, 40.0) == 1.0
    tok = dict(median=40.0, min=30.0, max=50.0, n=3)
    res = dict(bench="batch", repeats=3, install={"S=16": "device", "S=32": "device"}, top_k=8, experts=64,
               bus=dict(gb_s=0.1), expert_bytes=10**6, tok_s={k: {"4": tok} for k in ("resident", "S=16", "S=32")},
               x_resident={k: {"4": tok} for k in ("resident", "S=16", "S=32")}, named_experts={"4": named},
               tokens_match={"resident": True, "S=16": True, "S=32": True},
               step_bytes={"4": 64 * 10**6}, bus_limit_x_resident={"4": 0.5})  # fmt: skip
    figs = many_rows_figures(res)
    assert figs["named experts a layer[B4]"] == 25.0 and figs["rows name every expert[B4]"] == 0.0
    assert figs["bus limit x resident[S=16/device@B4]"] == pytest.approx(25 / 45)
    assert figs["bus limit x resident[S=32/device@B4]"] == 1.0
    # a path that copies a step's experts and then computes: 25 ms over 25 + 45
    assert figs["bus serial x resident[S=16/device@B4]"] == pytest.approx(25 / 70)
    assert figs["bus serial x resident[S=32/device@B4]"] == 1.0


def test_bench_miss_where_no_inplace_install_runs_measures_the_others_under_their_own_names(monkeypatch, capsys):
    """On a GPU `--install inplace` is pinned (a slot table's host views cannot be shared with the
    device), so `bench miss` there measures no `inplace` path and reads no record into a slot
    table's host view: the GPU's run once failed on that. Here the CPU plays such a machine."""
    import argparse

    from engine.runtime import installs
    from harness import bench

    real = installs.choose

    def on_a_gpu(asked, *args, **kwargs):
        return real("copy" if asked == "inplace" else asked, *args, **kwargs)

    monkeypatch.setattr(installs, "choose", on_a_gpu)
    p = argparse.ArgumentParser()
    bench.add_args(p)
    a = p.parse_args(["miss", "--model", "olmoe-tiny", "--repeats", "1", "--readers", "2", "--batch", "1", "4"])
    out = bench.miss(a)
    assert set(out["per_miss_ms"]) >= {"raw_preadv/b1", "engine_copy/b4"}
    assert not any("inplace" in n or "into_slots" in n for n in out["per_miss_ms"])
    assert "no inplace install here" in capsys.readouterr().err


def test_the_fewest_misses_of_a_cache_are_those_of_every_choice_searched_and_bound_the_limit():
    """What each step's rows name differs from the step before's, so S slots cannot hold just what
    every step names: `fewest_misses` (Belady's rule) is the least any cache of S brings in,
    checked against every keeping choice searched; the report's cache limit reads it."""
    import itertools
    import random

    from harness.manyrows import fewest_misses
    from harness.report.tables.bench import many_rows_figures, named_limit

    def searched(steps, slots):
        experts = sorted(set().union(*steps))
        starts = [set(c) for c in itertools.combinations(experts, min(slots, len(experts)))]
        best = {frozenset(c): 0 for c in starts}  # what the cache holds -> fewest brought in so far
        for named in steps:
            after = {}
            for held, n in best.items():
                pool = sorted(held | named)
                for keep in itertools.combinations(pool, min(slots, len(pool))):
                    k = frozenset(keep)
                    after[k] = min(after.get(k, 10**9), n + len(named - held))
            best = after
        return min(best.values())

    rng = random.Random(0)
    for _ in range(40):
        steps = [set(rng.sample(range(6), rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        for slots in (1, 2, 3):
            assert fewest_misses(steps, slots) == searched(steps, slots), (steps, slots)
    # one layer, two steps of 3 experts at S = 2: {0, 1, 2} then {3, 4, 5} bring in 1 + 3
    assert fewest_misses([{0, 1, 2}, {3, 4, 5}], 2) == 4 and fewest_misses([{0, 1, 2}] * 3, 3) == 0
    # the record of the named-limit test, with 40 experts brought in over its 4 (step, layer)
    # pairs at S = 16 (the count's 36 at the least): 40 MB over 8 tokens at 0.1 GB/s is 50 ms
    named = dict(steps=2, rows=8, layers=2, counts={"20": 2, "30": 2}, fewest_misses={"16": 40})
    assert named_limit(named, 16, 10**6, 0.1, 40.0, fewest=True) == pytest.approx(25 / 50)
    tok = dict(median=40.0, min=30.0, max=50.0, n=3)
    res = dict(bench="batch", repeats=3, install={"S=16": "device"}, top_k=8, experts=64, bus=dict(gb_s=0.1),
               expert_bytes=10**6, tok_s={k: {"4": tok} for k in ("resident", "S=16")},
               x_resident={k: {"4": tok} for k in ("resident", "S=16")}, named_experts={"4": named},
               tokens_match={"resident": True, "S=16": True}, step_bytes={"4": 64 * 10**6},
               bus_limit_x_resident={"4": 0.5})  # fmt: skip
    figs = many_rows_figures(res)
    assert figs["bus cache limit x resident[S=16/device@B4]"] == pytest.approx(0.5)
    assert figs["fewest misses a layer[S=16/device@B4]"] == 10.0
    assert figs["bus cache limit x resident[S=16/device@B4]"] <= figs["bus limit x resident[S=16/device@B4]"]


def test_bench_plan_records_which_cards_hold_each_family_and_the_readme_reads_it(tmp_path):
    """`bench plan --record` plans families for CUDA cards from their shapes (nothing built, one
    record, a result a family), and the README's "will it fit your card" table is read from it:
    a card that cannot hold a family says no, one that holds every expert says all."""
    env = dict(os.environ, TITAN_RESOURCES=str(tmp_path / "res"), TITAN_RAW=str(tmp_path / "raw"))
    cmd = [sys.executable, "-m", "harness", "bench", "plan", "--families", "mixtral-8x7b-shape", "qwen3moe-tiny",
           "--budgets", "12MB", "16GB", "--record"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "res" / "models").exists()
    recs = records.read([tmp_path / "raw" / "bench" / "plan"])
    assert [rec["result"]["model"] for rec in recs] == ["mixtral-8x7b-shape", "qwen3moe-tiny"]
    mixtral = recs[0]["result"]["cards"]
    assert "refused" in mixtral["0.012 GB"] and 2 <= mixtral["16 GB"]["slots"] < 8

    from harness.report import docblocks

    bench = bench_tables.bench_table(recs)

    def rows(table):
        return {
            line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[2:]
        }

    table = docblocks.families_plan(bench)
    assert table.splitlines()[0].endswith("| 0.012 GB | 16 GB |")
    assert rows(table)["`mixtral-8x7b-shape`"][-2:] == ["no", f"{mixtral['16 GB']['slots']} of 8"]
    assert rows(table)["`qwen3moe-tiny`"][-1] == "all"
    readme = rows(docblocks.families_table(bench))  # nothing measured: the plan's columns, then "not yet"
    assert readme["`mixtral-8x7b-shape`"][-3:] == [f"{mixtral['16 GB']['slots']} of 8", "16 GB and up",
                                                  "not yet"]  # fmt: skip
    assert readme["`qwen3moe-tiny`"][-3:] == ["all", "16 GB and up", "not yet"]  # 12 MB: its KV cache


def test_a_family_whose_tokens_part_from_residents_says_where_first():
    """Where a configuration's greedy tokens differ from resident's, the record keeps, per repeat,
    the first token that differs: 0 is the prompt's own (its prefill, the many-rows path), a later
    one a decode step; the docs' table says which."""
    from harness.families import first_difference, tokens_said
    from harness.report import docblocks

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([9, 2, 3], [1, 2, 3]) == 0 and first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one ended early
    said = tokens_said(dict(tokens_match=False, first_difference=[None, 5, 0]))
    assert said.startswith("DIFFER") and "-, 5, 0" in said
    assert tokens_said(dict(tokens_match=True, first_difference=[None])) == "= resident"
    fig = {"tokens_match[25%]": 0.0, "first difference[25%]": 0.0, "tokens_match[50%]": 0.0,
           "first difference[50%]": 7.0, "tokens_match[8 GB]": 1.0}  # fmt: skip
    cells = [docblocks._tokens_cell(fig, c) for c in ("25%", "50%", "8 GB")]
    assert cells == ["DIFFER from the prompt's token", "DIFFER from decode token 7", "= resident"]
    assert docblocks._tokens_word(fig) == ", tokens DIFFER"


def test_where_residents_own_tokens_vary_a_difference_says_so_and_whether_the_engines_were_among_them():
    """mlx-lm's model alone can give other greedy tokens run to run (Mixtral's shape over a 2048-token
    prompt on an H100): then a configuration whose tokens are one of resident's own runs is said
    to be that, a difference says resident's vary too, and the README's row does not say DIFFER
    for tokens resident itself gave."""
    from harness.families import tokens_said
    from harness.report import docblocks

    among = dict(tokens_match=False, first_difference=[12], tokens_in_resident_runs=True)
    outside = dict(tokens_match=False, first_difference=[12], tokens_in_resident_runs=False)
    assert tokens_said(among, resident_stable=False) == "= one of resident's own runs (resident's tokens vary)"
    assert tokens_said(outside, resident_stable=False).endswith("; resident's own tokens vary too")
    assert tokens_said(among).startswith("DIFFER")  # resident stable: its own run is the one compared
    fig = {"resident tokens unstable": 1.0, "tokens_match[25%]": 0.0, "tokens in resident runs[25%]": 1.0,
           "first difference[25%]": 12.0, "tokens_match[50%]": 1.0}  # fmt: skip
    assert docblocks._tokens_cell(fig, "25%") == "= one of resident's own runs"
    assert docblocks._tokens_word(fig) == ", resident's tokens vary"
    fig["tokens in resident runs[25%]"] = 0.0
    assert docblocks._tokens_cell(fig, "25%") == "DIFFER from decode token 12 (resident's own vary too)"
    assert docblocks._tokens_word(fig) == ", tokens DIFFER (resident's vary too)"
    del fig["tokens in resident runs[25%]"]  # a record from before the bench kept the tokens
    assert docblocks._tokens_word(fig) == ", tokens DIFFER (resident's vary too)"
    # the run's full-size exactness test (teacher-forced logits against mlx-lm's) then decides
    exact = docblocks._tokens_word(dict(fig, exact_full_size=1.0))
    assert exact == ", tokens DIFFER (resident's vary too; logits exact)"
    assert docblocks._tokens_word(dict(fig, exact_full_size=0.0)).endswith("; logits DIFFER)")


def test_the_readme_finds_a_runs_16_gb_budget_however_its_label_is_written():
    from harness.report import docblocks

    assert [
        docblocks.card_name(c)
        for c in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GeForce RTX 4090", "Apple M2 Max")
    ] == ["H100", "H200", "GeForce RTX 4090", "Apple M2 Max"]

    fig = {f"tok_s[{c}]": 1.0 for c in ("resident", "25%", "pinned 25%", "1.60 GB", "160.00 GB", "16.00 GB")}
    assert docblocks._card(fig, 16) == "16.00 GB"  # the label `bench families` writes on a GPU
    assert docblocks._card({"tok_s[16 GB]": 1.0}, 16) == "16 GB"
    assert docblocks._card({k: v for k, v in fig.items() if k != "tok_s[16.00 GB]"}, 16) is None


def test_a_budget_whose_measured_peak_was_above_it_is_said_over_in_both_tables():
    """`--memory` plans from the model's sizes; a run's peak memory is measured. Where a budget's
    configuration held more than the budget, docs/gpu.md's row says OVER and the README's row says
    the plan's cards are a plan, naming those budgets; a peak within its budget, or a configuration
    that is not a budget, says nothing."""
    from harness.report import docblocks

    fig = {"memory_bytes[resident]": 20e9, "memory_bytes[25%]": 30e9, "memory_bytes[8.00 GB]": 8.9e9,
           "memory_bytes[16.00 GB]": 15.9e9, "memory_bytes[24.00 GB]": 25.1e9}  # fmt: skip
    assert docblocks.over_budget(fig) == {8.0: 8.9e9, 24.0: 25.1e9}
    assert docblocks._over_word([8.0, 24.0]) == " (plan; peak over at 8, 24 GB)"
    assert docblocks._over_word([]) == ""


def test_bench_families_measures_a_family_beside_resident_records_it_once_and_reads_it_into_the_tables(tmp_path):
    """`bench families` on the CPU, as a sweep of one family (each in its own process): built in
    resources of its own, every configuration against resident in the same repeat (a fraction, a
    budget that holds it, one that cannot: not measured, said why; the pinned install: not on a
    CPU), tokens equal resident's, the bus-bound limit from the bandwidth the run measured; its
    files removed once recorded (`--clean`); run again, the family is recorded already and skipped.
    The record then makes the README's table row, docs/gpu.md's table and the figure."""
    env = dict(os.environ, TITAN_RESOURCES=str(tmp_path / "res"), TITAN_RAW=str(tmp_path / "raw"))
    cmd = [sys.executable, "-m", "harness", "bench", "families", "--families", "qwen3moe-tiny", "--fractions",
           "0.25", "--budgets", "20MB", "1MB", "24MB", "--repeats", "2", "--tokens", "3", "--prompt-tokens", "24",
           "--record", "--clean"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens = resident" in r.stdout and "DIFFER" not in r.stdout
    assert not (tmp_path / "res" / "models" / "qwen3moe-tiny").exists()  # removed once recorded
    assert not (tmp_path / "res" / "stores" / "qwen3moe-tiny").exists()
    recs = records.read([tmp_path / "raw" / "bench" / "families"])
    assert len(recs) == 1
    res = recs[0]["result"]
    assert set(res["configurations"]) == {"25%", "20.0 MB", "24.0 MB"}
    # a budget planning the same engine as one before it (every expert) is that engine's measurement, said so
    assert res["configurations"]["24.0 MB"] == dict(res["configurations"]["20.0 MB"], same_as="20.0 MB")
    assert "cannot hold this model" in res["skipped"]["1.0 MB"] and "pinned 25%" in res["skipped"]
    quarter = res["configurations"]["25%"]
    assert quarter["slots"] == 32 and quarter["tokens_match"] and quarter["tok_s"]["n"] == 2
    assert quarter["first_difference"] == [None, None] and res["resident"]["tokens_stable"]
    # every repeat's tokens, and resident's distinct runs (one here) with how many runs gave each
    assert len(quarter["tokens_each_repeat"]) == 2 and quarter["tokens_in_resident_runs"]
    assert [t["tokens"] for t in res["resident"]["token_runs"]] == [quarter["tokens_each_repeat"][0]]
    assert res["resident"]["token_runs"][0]["runs"] == 2 * 2  # two configurations measured, two repeats each
    assert 0 < quarter["limit_x_resident"] <= 1 and res["bus"]["gb_s"] > 0 and res["least_budget_bytes"] > 1e6
    # the first decode token apart from the rest, in every repeat (what a prompt left queued waits there),
    # and the engine's loop's first decode step apart from its mean step
    assert quarter["first_decode_ms"]["n"] == 2 and res["resident"]["first_decode_ms"]["n"] == 2 * 2
    assert quarter["tok_s_after_first"]["min"] > 0 and quarter["x_resident_after_first"]["median"] > 0
    assert quarter["step_ms"]["first"] > 0 and quarter["step_ms"]["later"] > 0
    with pytest.raises(SystemExit, match="qwen3moe-tiny has no full-size exactness test"):  # before it builds
        harness_main(cmd[cmd.index("bench") :] + ["--exactness"])
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert again.returncode == 0 and "qwen3moe-tiny: recorded at this commit on this machine already" in again.stderr
    assert len(records.read([tmp_path / "raw" / "bench" / "families"])) == 1

    from harness.report import docblocks

    table = bench_tables.bench_table(recs)
    row = docblocks.families_table(table)  # measured, no plan: its budgets are not a 16 GB card's
    assert "| `qwen3moe-tiny` |" in row and "| least budget |" in row and "no 16 GB budget in its run" in row
    assert "DIFFER" not in row
    differ = table.copy()  # a configuration whose tokens were not resident's shows in the family's row
    differ.loc[differ["figure"] == "tokens_match[25%]", "value"] = 0.0
    assert "no 16 GB budget in its run, tokens DIFFER |" in docblocks.families_table(differ)
    assert docblocks.families_table(table.iloc[:0]).startswith("No `bench plan` or `bench families` is recorded yet")
    detail = docblocks.families_detail(table)
    assert "| 25% | 32 |" in detail and "= resident" in detail and "(target" not in detail  # targets: a GPU's
    assert "host tier at" not in detail  # the CPU's install reads its tier by no kernel: no rate recorded
    first = next(line for line in detail.splitlines() if line.startswith("The first decode token apart"))
    assert "resident " in first and "; 25% " in first and "× resident's after its own first" in first
    assert "The engine's loop over a 64-token prompt" in first and "25% " in first.split("64-token prompt")[1]
    timed = json.loads(json.dumps(recs[0]))  # a GPU's record: its install's kernel timed over the tier
    timed["result"]["bus"]["tier"] = dict(gb_s=47.5, bytes=1, layers=[0], how="the device install's area kernel")
    header = docblocks.families_detail(bench_tables.bench_table([timed])).splitlines()[0]
    assert header.endswith(" GB/s (the device install's kernel read its host tier at 47.5):")
    # a later run under MLX settings (a diagnosis) is a run of its own: the docs show it beside the
    # plain one, while the README's table and the figure keep the plain run
    diag = dict(recs[0], settings={"MLX_USE_CUDA_GRAPHS": "0"}, run_id="99999999T000000000Z-000000",
                started_utc="9999-01-01T00:00:00.000Z")  # fmt: skip
    diag["result"] = json.loads(json.dumps(recs[0]["result"]))
    diag["result"]["configurations"]["25%"]["tokens_match"] = False
    both = bench_tables.bench_table(recs + [diag])
    assert docblocks.families_table(both) == row
    # an older commit's run of the family, whose 25% differed: none of its figures stands in the
    # tables beside the latest run's, not even one the latest run has not got
    older = dict(recs[0], commit="0" * 40, run_id="00000000T000000000Z-000000", started_utc="2000-01-01T00:00:00.000Z")
    older["result"] = json.loads(json.dumps(recs[0]["result"]))
    older["result"]["configurations"]["25%"].update(tokens_match=False, first_difference=[3])
    assert "first difference[25%]" in set(bench_tables.bench_table([older])["figure"])
    mixed = bench_tables.bench_table(recs + [older])
    assert older["run_id"] not in set(mixed["run_id"]) and "first difference[25%]" not in set(mixed["figure"])
    two = docblocks.families_detail(both)
    assert two.count("`bench families` on") == 2 and "under `MLX_USE_CUDA_GRAPHS=0`" in two and "DIFFER" in two
    assert recs[0]["run_id"] in two
    figdir = tmp_path / "fig"
    (figdir / "tables").mkdir(parents=True)
    table.to_csv(figdir / "tables" / "bench.csv", index=False)
    plotting.families(figdir)
    assert (figdir / "families.png").stat().st_size > 10_000


def test_a_familys_exactness_outcome_is_pytests_for_that_one_test(tmp_path):
    """`bench families --exactness` records what pytest found for the family's own test: passed,
    failed with its message, or an error naming the test where pytest ran none; the docs' table
    says whether it passed."""
    from harness import families
    from harness.report import docblocks

    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text("")
    name = families.EXACTNESS_TEST.split("::")[1]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_exactness.py").write_text(
        "import pytest\n"
        f"@pytest.mark.parametrize('model_id', ['good', 'bad'])\ndef {name}(model_id):\n"
        "    assert model_id == 'good', 'logits differ'\n"
    )
    good, bad, none = (families.exactness(m, root=tmp_path) for m in ("good", "bad", "absent"))
    assert good["outcome"] == "passed" and good["engine_tree"] == suite.tree_hash(tmp_path / "engine")
    assert bad["outcome"] == "failed" and "logits differ" in bad["message"]
    assert none["outcome"] == "error" and "no such test" in none["message"]
    with pytest.raises(FileNotFoundError, match="tests/test_exactness.py"):
        families.exactness("good", root=tmp_path / "engine")
    fig = dict(layers=2, experts=8, repeats=1, bus_gb_s=1.0, exact_full_size=0.0, **{"memory_bytes[resident]": 1.0})
    fig["tok_s[resident]"] = 1.0
    table = pd.DataFrame([dict(bench="families", device="cpu", chip="c", model="m", run_id="r", commit="k",
                               figure=f, value=v) for f, v in fig.items()])  # fmt: skip
    assert "`[m]`, logits at 25 % of the experts against mlx-lm's) FAILED" in docblocks.families_detail(table)


def test_bench_serve_sets_each_engine_server_against_mlx_lms_after_an_untimed_round_at_the_same_load(tmp_path):
    """`bench serve` on the CPU: three servers (the engine's batched and one at a time, mlx_lm.server)
    each warmed by one untimed round of the measured load, whose wall time is recorded; every
    repetition's requests answered; the table sets each engine server against mlx_lm.server
    repetition by repetition, and the name it reads is the bench's."""
    from harness import servebench

    assert bench_tables.REFERENCE_SERVER == servebench.REFERENCE
    env = dict(os.environ, TITAN_RAW=str(tmp_path / "raw"))
    cmd = [sys.executable, "-m", "harness", "bench", "serve", "--model", "olmoe-tiny-f32", "--slots", "16",
           "--clients", "2", "--requests", "1", "--tokens", "3", "--repeats", "2", "--record"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records.read([tmp_path / "raw" / "bench" / "serve"])
    (rec,) = recs
    servers = rec["result"]["servers"]
    assert set(servers) == {"engine S=16", "engine S=16 one at a time", servebench.REFERENCE}
    for s in servers.values():
        assert s["warmup_s"] > 0 and len(s["tok_s"]) == 2 and all(t > 0 for t in s["tok_s"])
    table = bench_tables.bench_table(recs)
    fig = dict(zip(table["figure"], table["value"]))
    assert fig["requests"] == 2 * 1 * 2 and f"x reference[{servebench.REFERENCE}]" not in fig
    each = [a / b for a, b in zip(servers["engine S=16"]["tok_s"], servers[servebench.REFERENCE]["tok_s"])]
    assert fig["x reference[engine S=16]"] == pytest.approx(statistics.median(each))
    assert fig["x reference_min[engine S=16]"] == pytest.approx(min(each))


def test_bench_families_frees_one_configuration_before_reading_the_next_ones_memory():
    """A closed engine's arrays outlive `del` while its objects refer to each other, until the
    garbage collector runs; `bench families` collects before it reads a configuration's memory, so
    that no configuration's count depends on when the collector ran."""
    import gc

    import mlx.core as mx

    from engine import EngineConfig, load
    from harness import families

    was = gc.isenabled()
    gc.disable()  # the collector not running by chance between two configurations
    try:
        families.release()
        base = mx.get_active_memory()
        eng = load("olmoe-tiny-f32", EngineConfig(slots=16, install="device"))
        mx.eval(eng.model.parameters())
        assert mx.get_active_memory() > base
        eng.close()
        del eng
        families.release()
        assert mx.get_active_memory() == base
    finally:
        if was:
            gc.enable()


def test_the_many_rows_figure_marks_the_bus_limit_where_a_batch_names_every_expert():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from harness.report.plotting import _bus_limits

    # resident 1000 tok/s at B = 16; the limit at S = 16 is 0.25 of it: a bar at 250 tok/s there
    g = pd.DataFrame(dict(config=["resident", "resident"], x=[4.0, 16.0], value=[400.0, 1000.0]))
    limits = pd.DataFrame(dict(config=["S=16/device/union", "S=16/device/ahead"], x=[16.0, 16.0], value=[0.25, 0.25]))
    fig, ax = plt.subplots()
    _bus_limits(ax, g, limits)
    (bar,) = ax.collections  # one S, one bar
    assert bar.get_label() == "bus's limit, S = 16"
    (seg,) = bar.get_segments()
    assert seg[0][1] == seg[1][1] == 250.0 and seg[0][0] < 16 < seg[1][0]
    plt.close(fig)
