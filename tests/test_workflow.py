"""The workflow's plan: run ids are configuration, a run resumes, `figures` measures nothing,
and bad configuration is refused by name. Dry runs only (the smoke run itself is in .ci/run)."""

import os
import re
import shutil

import pytest
import yaml
from conftest import ROOT, job_stats, snakemake, workflow_dir


def planned_outputs(stdout: str) -> list:
    return [l.split("output:", 1)[1].strip() for l in stdout.splitlines() if l.strip().startswith("output:")]


def test_the_run_id_names_every_raw_file_of_the_run():
    r = snakemake("-n", "gate_b", "gate_c", "--config", "run=my-run.1")
    assert r.returncode == 0, r.stderr
    raw = [o for out in planned_outputs(r.stdout) for o in out.split(", ") if "/raw/" in o]
    assert raw and all(os.path.basename(o).startswith("my-run.1") for o in raw), raw


def test_a_spawned_job_takes_the_planners_run_id():
    """An executor's job parses the workflow again; the run id it sees is the planner's."""
    r = snakemake("-n", "gate_b", env={"TITAN_RUN": "planned-elsewhere"})
    assert r.returncode == 0, r.stderr
    assert "results/raw/B/design/planned-elsewhere.jsonl" in r.stdout


def test_auto_is_commit_and_host():
    r = snakemake("-n", "gate_b")
    out = next(o for o in planned_outputs(r.stdout) if "/raw/B/design/" in o)
    name = os.path.basename(out)[: -len(".jsonl")]
    commit, _, rest = name.partition("-")
    assert len(commit) == 12 and int(commit, 16) >= 0
    assert rest.removeprefix("dirty-").startswith("host-")


@pytest.mark.parametrize("bad", ["has/slash", "-leading-dash", "x" * 65])
def test_a_bad_run_id_is_refused_by_name(bad):
    r = snakemake("-n", "gate_b", "--config", f"run={bad}")
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "run" in text and "does not match" in text, text


def test_figures_plans_only_tables_and_plots():
    r = snakemake("-n", "figures", "--forcerun", "tables")
    assert r.returncode == 0, r.stderr
    assert set(job_stats(r.stdout)) <= {"tables", "plots", "figures"}
    assert "/raw/" not in " ".join(planned_outputs(r.stdout))


def test_a_complete_run_says_so_and_only_remakes_its_figures():
    run = "test-complete-run"
    first = snakemake("-n", "all", "--config", f"run={run}")
    assert first.returncode == 0, first.stderr
    raw = [o for out in planned_outputs(first.stdout) for o in out.split(", ") if "/raw/" in o and run in o]
    assert len(raw) > 10
    made = []
    try:
        for f in raw:  # stand-ins for a finished run's files
            path = workflow_dir() / f
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
            made.append(path)
        again = snakemake("-n", "all", "--config", f"run={run}")
        assert again.returncode == 0, again.stderr
        assert f"run {run}: every measurement of this run id is already under results/raw/" in again.stderr
        assert set(job_stats(again.stdout)) <= {"tables", "plots", "all"}
        assert f"results/runs/{run}/figures" in again.stdout
    finally:
        for path in made:
            path.unlink()


def test_a_models_own_sweep_reaches_its_jobs_only():
    """gpu.yaml sweeps olmoe-wide-trained at depths 1 to 3 and more fit tokens (by_model); the
    full-size model keeps the common sweep, and the trained models are trained by their own jobs."""
    r = snakemake("-n", "--forceall", "--profile", "profiles/gpu", "gate_c", "--config", "run=sweep")
    assert r.returncode == 0, r.stderr
    outs = " ".join(planned_outputs(r.stdout))
    assert "resources/predictors/olmoe-wide-trained/general-probe-d3-m8-t32.npz" in outs
    assert "resources/predictors/olmoe-1b-7b-shape/general-probe-d1-m8-t16.npz" in outs
    assert "olmoe-1b-7b-shape/general-probe-d2" not in outs
    assert "resources/models/olmoe-wide-trained/titan-build.json" in outs
    assert "resources/models/olmoe-trained/titan-build.json" in outs
    assert "olmoe-trained-f32/titan-build.json" not in outs  # written by olmoe-trained's run


def test_the_expert_store_is_its_own_job_that_the_timed_jobs_wait_for():
    """Written at real expert sizes it takes minutes: inside a sweep it would be timed with it, and
    a sweep cut short would write it again."""
    r = snakemake("-n", "--forceall", "--profile", "profiles/gpu", "gate_c", "--config", "run=store")
    assert r.returncode == 0, r.stderr
    jobs = re.split(r"^(?=(?:local)?rule )", r.stdout, flags=re.M)
    store = "resources/stores/olmoe-wide-trained/index.json"
    assert any(re.match(r"(local)?rule store:", j) and f"output: {store}" in j for j in jobs)
    sweeps = [j for j in jobs if re.match(r"(local)?rule (prefetch_online|sync_ablation):", j)]
    assert sweeps and all("resources/stores/" in j.split("output:")[0] for j in sweeps)
    assert any(store in j.split("output:")[0] for j in sweeps)


def test_a_sweep_for_a_model_not_swept_is_refused_by_name(tmp_path):
    cfg = tmp_path / "c.yaml"
    merged = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    merged["prefetch_online"]["by_model"] = {"olmoe-tiny-typo": {"slots": [8]}}
    cfg.write_text(yaml.safe_dump(merged))
    r = snakemake("-n", "gate_c", "--configfile", str(cfg))
    assert r.returncode != 0
    assert "prefetch_online.by_model: 'olmoe-tiny-typo' is not one of prefetch_online.models" in r.stdout + r.stderr


def test_the_smoke_run_is_the_whole_workflow_in_a_directory_of_its_own(tmp_path):
    """As the Snakemake template runs its tests: `snakemake --directory .test` plans every gate
    with .test's own configuration, and everything it makes (raw files, the expert store, the
    run's figures) lies inside that directory."""
    shutil.copytree(ROOT / ".test" / "configs", tmp_path / "configs")
    r = snakemake("-n", "--directory", str(tmp_path), "--config", "run=smoke-plan")
    assert r.returncode == 0, r.stderr
    jobs = job_stats(r.stdout)
    for rule in ("design", "prefetch_online", "placement_sim", "multinode", "sync_ablation", "wire_ablation",
                 "store", "tables", "plots"):  # fmt: skip
        assert jobs.get(rule), (rule, jobs)
    outputs = [o for out in planned_outputs(r.stdout) for o in out.split(", ")]
    assert all(not os.path.isabs(o) and not o.startswith("..") for o in outputs), outputs
    assert "results/raw/B/design/smoke-plan.jsonl" in outputs
    assert "resources/stores/qwen3moe-tiny/index.json" in outputs  # .test's own store, not the checkout's
    smoke = yaml.safe_load((ROOT / ".test" / "configs" / "default.yaml").read_text())
    assert smoke["profile"] == "smoke" and jobs["prefetch_online"] == len(smoke["prefetch_online"]["tiers"])
