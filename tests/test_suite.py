"""The test suite as a recorded gate (harness/suite.py): the engine/ tree a run names is git's own,
a sharded run keeps files whole (but the independent ones) and reports every failure by name, CI's
line says whether the landed tree has a passing GPU record, and the README's sentence on it is
generated from the records (harness/report/docblocks.py)."""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, needs_git

from harness import rawlog, records, suite
from harness.report import aggregate, docblocks
from harness.report.tables import suite as suite_tables

# A full run of `all` names its raw files <commit>[-dirty]-<host alias>...
FULL_RUN_FILE = re.compile(r"[0-9a-f]{12}(-dirty)?-host-")


@needs_git
def test_the_tree_hash_is_gits_own(tmp_path):
    """Computed from the files (a copy of the tree without .git names it too), it is what
    `git rev-parse HEAD:engine` says when engine/ is committed unchanged, and it changes with a byte."""
    repo = tmp_path / "repo"
    (repo / "engine" / "sub").mkdir(parents=True)
    (repo / "engine" / "a.py").write_text("x = 1\n")
    (repo / "engine" / "sub" / "b.yaml").write_text("b: 2\n")
    (repo / "engine" / "run.sh").write_text("#!/bin/sh\n")
    (repo / "engine" / "run.sh").chmod(0o755)
    (repo / "engine" / "__pycache__").mkdir()
    (repo / "engine" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")  # ignored, as git ignores it
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / ".gitignore").write_text("__pycache__/\n")
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    want = subprocess.run(git + ["rev-parse", "HEAD:engine"], capture_output=True, text=True).stdout.strip()
    assert suite.tree_hash(repo / "engine") == want
    (repo / "engine" / "a.py").write_text("x = 2\n")
    assert suite.tree_hash(repo / "engine") != want


def test_shards_keep_files_whole_but_the_independent_ones():
    ids = [f"tests/test_architectures.py::t[{i}]" for i in range(6)]
    ids += [f"tests/test_slots.py::u{i}" for i in range(3)]
    ids += ["tests/test_workflow.py::w", "tests/test_harness.py::h", "tests/test_cli.py::c"]
    groups = suite.shards(ids, 4)
    assert sorted(t for g in groups for t in g) == sorted(ids)  # each test once
    assert len(groups) == 4
    home = {
        t.split("::")[0]: {i for i, g in enumerate(groups) if any(x.startswith(t.split("::")[0]) for x in g)}
        for t in ids
    }
    assert len(home["tests/test_slots.py"]) == 1
    together = {i for i, g in enumerate(groups) for t in g if t.split("::")[0] in suite.TOGETHER}
    assert len(together) == 1  # Snakemake locks the checkout: one process for the workflow's tests
    assert len(home["tests/test_architectures.py"]) > 1
    # with a former run's seconds, a slow file gets a shard to itself and the rest share the others
    slow = {t: (300.0 if t.startswith("tests/test_slots.py") else 1.0) for t in ids}
    weighted = suite.shards(ids, 3, slow)
    assert sorted(t for g in weighted for t in g) == sorted(ids)
    assert any(g == [t for t in ids if t.startswith("tests/test_slots.py")] for g in weighted)


def test_a_run_records_every_failure_by_name_and_the_tree(tmp_path):
    """A real (tiny) pytest run in two shards: the record counts what passed, failed and was
    skipped, names each failure with its message and each skip with its reason; each shard's
    report and log are where TITAN_SUITE_REPORTS says as it ends (a run cut short keeps them)."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'one is not two'\n"
    )
    (tests / "test_b.py").write_text(
        "import pytest\n\n@pytest.mark.skip(reason='needs a GPU')\ndef test_gpu():\n    pass\n\n"
        "@pytest.mark.xfail(strict=True)\ndef test_known():\n    assert False\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from harness import suite; r, p = suite.run(sys.argv[2:], 2, root=sys.argv[1]); print(p)",
            str(tmp_path / "raw"),
            "tests",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "TITAN_SUITE_REPORTS": str(tmp_path / "reports"),
        },  # fmt: skip
    )
    assert out.returncode == 0, out.stderr
    (reports,) = (tmp_path / "reports").iterdir()
    assert sorted(p.name for p in reports.iterdir()) == ["shard-0.log", "shard-0.xml", "shard-1.log", "shard-1.xml"]
    assert sorted(line.split(":")[0] for line in out.stdout.splitlines() if line.startswith("[suite] shard")) == [
        "[suite] shard 0", "[suite] shard 1"]  # fmt: skip
    (rec,) = records.read([tmp_path / "raw"])
    r = rec["result"]
    assert (rec["gate"], rec["experiment"]) == ("tests", "suite")
    assert (r["passed"], r["failed"], r["skipped"], r["xfailed"], r["errors"]) == (1, 1, 1, 1, 0)
    assert [f["test"] for f in r["failures"]] == ["tests/test_a.py::test_bad"]
    assert "one is not two" in r["failures"][0]["message"]
    assert r["skips"] == [dict(test="tests/test_b.py::test_gpu", reason="needs a GPU")]
    assert r["engine_tree"] == suite.tree_hash(ROOT / "engine") and r["shards"] == 2
    assert set(r["durations"]) == {"tests/test_a.py::test_ok", "tests/test_a.py::test_bad", "tests/test_b.py::test_gpu",
                                   "tests/test_b.py::test_known"}  # fmt: skip
    # the failed shard's whole log is kept beside the records (the passing one's is not)
    (kept,) = (tmp_path / "logs" / "suite").iterdir()
    assert kept.name == Path(out.stdout.split()[-1]).stem
    (log,) = kept.iterdir()
    assert "one is not two" in log.read_text() and "assert 1 == 2" in log.read_text()


def _record(raw, tree, device="gpu", failed=0, args=("tests",)):
    res = dict(passed=10, failed=failed, errors=0, skipped=1, xfailed=0, tests=11, seconds=1.0, shards=1)
    res.update(failures=[dict(test="tests/test_x.py::test_y", message="boom")] * failed, skips=[], engine_tree=tree)
    res.update(engine_tree_committed=tree, exit_codes=[int(bool(failed))])
    config = dict(pytest_args=list(args), shards=1)
    return rawlog.write_run("tests", "suite", [res], config=config, seed=None, started="2026-12-02T00:00:00.000Z",
                            root=raw)  # fmt: skip


def test_shards_start_from_the_callers_kernel_cache_and_add_what_they_compiled_to_it(tmp_path):
    """Each shard keeps a kernel cache of its own (MLX writes one without a lock), made as a copy of
    the one the caller names, so that an earlier run's compiled kernels are not compiled again in
    every shard; once the shards end, the caller's cache has every kernel one of them compiled."""
    tests = tmp_path / "tests"
    tests.mkdir()
    compiles = (
        "import os, pathlib\n\ndef test_compiles():\n    cache = pathlib.Path(os.environ['MLX_PTX_CACHE_DIR'])\n"
        "    assert (cache / 'primed.ptx').read_text() == 'earlier'\n"
        "    (cache / f'{pathlib.Path(__file__).stem}.ptx').write_text('new')\n"
    )
    for name in ("test_a.py", "test_b.py"):
        (tests / name).write_text(compiles)
    primer = tmp_path / "kernels"
    primer.mkdir()
    (primer / "primed.ptx").write_text("earlier")
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from harness import suite; print(suite.run(['tests'], 2, False)[0])"],
        cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLX_PTX_CACHE_DIR": str(primer),
             "TITAN_SUITE_REPORTS": str(tmp_path / "reports")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "'passed': 2" in out.stdout and "'failed': 0" in out.stdout, out.stdout
    assert sorted(p.name for p in primer.iterdir()) == ["primed.ptx", "test_a.ptx", "test_b.ptx"]


def test_tests_not_run_after_a_device_fault_are_told_from_failures(tmp_path):
    """A device fault poisons its pytest process (conftest's DeviceWatch): the tests after it there
    are reported not run, naming the test after which the device faulted. The suite table keeps
    them apart, and the README's sentence names the fault, counts them, and lists only real failures."""
    from harness.report.tables.suite import suite_table

    fault = "tests/test_p.py::test_y[previous]"
    seen = "RuntimeError: cudaStreamSynchronize(stream_) failed: an illegal memory access was encountered"
    teardown = f'error: failed on teardown with "Failed: the device reported an error after this test: {seen}'
    setup = f'error: failed on setup with "Failed: not run: the device faulted after {fault} ({seen}'
    failures = [
        dict(test=fault, message=f"RuntimeError: {seen}"),
        dict(test=fault, message=teardown),
        dict(test="tests/test_a.py::test_b", message=setup),
        dict(test="tests/test_c.py::test_d", message="AssertionError: assert 1.0 == 0.0"),
    ]
    res = dict(passed=10, failed=2, errors=2, skipped=0, xfailed=0, tests=14, seconds=1.0, shards=2, skips=[])
    res.update(failures=failures, engine_tree="a" * 40, engine_tree_committed=None, exit_codes=[1, 1])
    rawlog.write_run("tests", "suite", [res], config={}, seed=None, started="2026-12-02T00:00:00.000Z", root=tmp_path)
    row = suite_table(records.read([tmp_path / "tests" / "suite"])).iloc[-1]
    assert row["faulted_after"] == fault and row["not_run"] == "tests/test_a.py::test_b"
    said = docblocks.gpu_exactness(pd.DataFrame([row.to_dict() | {"device": "gpu"}]))
    assert said.endswith(
        "10 passed, 4 failed, 0 skipped. Failed: `test_d`. The device faulted in `test_y[previous]`, and its "
        "process ran none of the one test after it ([docs/gpu.md](docs/gpu.md#the-test-suite-on-a-gpu))."
    )


def test_ci_says_whether_the_landed_tree_has_a_passing_gpu_record(tmp_path, monkeypatch):
    tree = suite.tree_hash(ROOT / "engine")
    monkeypatch.setattr(suite, "committed_tree", lambda *a: tree)
    assert suite.check_line(raw=tmp_path).startswith("WARNING: engine/ tree")
    _record(tmp_path, tree, failed=1)  # a failing run does not count
    _record(tmp_path, "0" * 40)  # nor a passing run of another tree
    _record(tmp_path, tree, args=suite.GPU_FILES[:3])  # nor a check of a few files
    _record(tmp_path, tree, args=[*suite.GPU_FILES, "-k", "slots"])  # nor of some tests of each
    line = suite.check_line(raw=tmp_path)
    assert line.startswith("WARNING") and "scripts/device_gpu.sh" in line
    path = _record(tmp_path, tree)
    rec = json.loads(path.read_text())
    if rec["device"] != "gpu":  # records made here are the CPU's: the line wants a GPU's
        assert suite.check_line(raw=tmp_path).startswith("WARNING")
        monkeypatch.setattr(suite, "passing_record", lambda t, raw=None, device="gpu": dict(rec, _file=str(path)))
    assert suite.check_line(raw=tmp_path).startswith(f"GPU tests: engine/ tree {tree[:12]} passed")


def test_a_suite_split_in_parts_counts_once_its_parts_ran_every_gpu_file_of_one_tree(tmp_path):
    """Where device time is short, scripts/device_gpu.sh runs the GPU files in two parts (tests,
    tests2): passing parts of one engine/ tree that ran every GPU file between them are its record."""
    tree, first, rest = "b" * 40, suite.GPU_FILES[:13], suite.GPU_FILES[13:]

    def record(t=tree, **kw):
        time.sleep(0.002)  # records are ordered by when they finished
        return _record(tmp_path, t, **kw)

    a = record(args=first)
    assert suite.passing_record(tree, tmp_path, device="cpu") is None  # a part alone is not
    record(args=rest, failed=1)  # nor with a failing part
    record(t="0" * 40, args=rest)  # nor with another tree's part
    assert suite.passing_record(tree, tmp_path, device="cpu") is None
    b = record(args=rest)
    rec = suite.passing_record(tree, tmp_path, device="cpu")
    assert [Path(f).name for f in rec["_file"].split(" + ")] == [a.name, b.name]
    assert rec["result"]["passed"] == 20 and rec["result"]["skipped"] == 2
    assert suite.split_run([("t", {"x"}), ("t", {"y"}), ("u", {"z"}), ("u", {"w"})]) == [2, 3]
    assert suite.split_run([("t", {"x"}), ("t", {"x", "y"})]) == [1]  # a run of a file again starts anew


def test_a_run_counts_for_its_tree_only_where_it_ran_every_gpu_file():
    assert suite.covers_gpu_files(["tests"]) and suite.covers_gpu_files(["tests/", "-x"])
    assert suite.covers_gpu_files(list(suite.GPU_FILES)) and suite.covers_gpu_files([*suite.GPU_FILES, "-v"])
    assert not suite.covers_gpu_files(list(suite.GPU_FILES[1:]))
    assert not suite.covers_gpu_files([*suite.GPU_FILES, "-k", "not slow"])
    assert not suite.covers_gpu_files(["tests/test_exactness.py::test_cold_tier_bit_identical", *suite.GPU_FILES])
    for f in suite.GPU_FILES:  # each names a file of the suite
        assert (ROOT / f).is_file(), f


def test_gpu_files_runs_them_and_takes_no_paths(monkeypatch):
    seen = []
    ran = dict(passed=1, failed=0, errors=0, skipped=0, xfailed=0, seconds=0.1, engine_tree="a" * 40, failures=[])
    monkeypatch.setattr(suite, "run", lambda args, n, record: (seen.append(args), (ran, None))[1])
    a = argparse.Namespace(check=False, shards=1, no_record=True, gpu_files=True, pytest_args=[])
    suite.main(a)
    assert seen == [list(suite.GPU_FILES)]
    with pytest.raises(ValueError, match="--gpu-files"):
        suite.main(argparse.Namespace(**{**vars(a), "pytest_args": ["tests/test_use.py"]}))


def test_a_pages_generated_block_is_rewritten_and_nothing_else(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("# T\nhand text\n<!-- generated:gpu-exactness -->\nold\n<!-- /generated:gpu-exactness -->\nmore\n")
    suite_df = pd.DataFrame(
        [dict(device="gpu", chip="NVIDIA H200", engine_tree="abc", commit="def", scope="14 test files", passed=400,
              failed=1, errors=0, skipped=3, failures="tests/test_e.py::test_x[8]", run_id="r1")]
    )  # fmt: skip
    assert docblocks.build({"suite": suite_df}, tmp_path) == [page]
    text = page.read_text()
    assert text.startswith(
        "# T\nhand text\n<!-- generated:gpu-exactness -->\nThe suite's latest run on a GPU (NVIDIA H200"
    )
    said = "commit `def`, 14 test files, [record](results/raw/tests/suite/r1.jsonl)): 400 passed, 1 failed, 3 skipped."
    assert said + " Failed: `test_x[8]`." in text and text.endswith("-->\nmore\n")
    assert docblocks.build({"suite": suite_df}, tmp_path) == []  # the same records: the same bytes
    # a device fault: the tests its process did not run after it are said as such, not as failures
    fault = "tests/test_p.py::test_y[previous]"
    cut = ["tests/test_a.py::test_b", "tests/test_c.py::test_d"]
    faulted = suite_df.assign(failed=1, errors=3, failures="; ".join([fault, fault, *cut]), faulted_after=fault,
                              not_run="; ".join(cut))  # fmt: skip
    said = docblocks.gpu_exactness(faulted)
    assert said.endswith(
        "400 passed, 4 failed, 3 skipped. The device faulted in `test_y[previous]`, and its process ran none of "
        "the 2 tests after it ([docs/gpu.md](docs/gpu.md#the-test-suite-on-a-gpu))."
    )
    none = docblocks.gpu_exactness(suite_df.iloc[:0])
    assert none.startswith("No run of the test suite on a CUDA GPU is recorded yet")
    page.write_text("<!-- generated:gpu-exactness -->\nunclosed\n")
    with pytest.raises(docblocks.BlockError, match="README.md: block 'gpu-exactness' must be opened and closed once"):
        docblocks.build({"suite": suite_df}, tmp_path)


def test_a_narrower_latest_run_is_said_beside_the_widest_one():
    """A check of a fix runs a few tests on the GPU: the README says so, and still says what the
    latest of the widest runs found."""
    assert suite_tables.scope_of(["tests"]) == "the whole suite"
    assert suite_tables.scope_of(["tests/test_a.py", "tests/test_b.py"]) == "2 test files"
    assert suite_tables.scope_of(["tests/test_a.py::test_x", "tests/test_b.py"]) == "1 test file and 1 single test"
    base = dict(device="gpu", chip="NVIDIA H200", commit="c", errors=0, skipped=0, faulted_after="", not_run="")
    df = pd.DataFrame(
        [dict(base, engine_tree="t1", scope="16 test files", paths=16, passed=370, failed=1,
              failures="tests/test_e.py::test_x[8]", run_id="wide"),
         dict(base, engine_tree="t2", scope="1 test file and 1 single test", paths=2, passed=6, failed=0,
              failures="", run_id="narrow")]
    )  # fmt: skip
    said = docblocks.gpu_exactness(df)
    assert said.startswith("The suite's latest run on a GPU (NVIDIA H200, `engine/` tree `t2`")
    narrow = "1 test file and 1 single test, [record](results/raw/tests/suite/narrow.jsonl)): 6 passed, no failure"
    assert narrow in said
    assert said.endswith(
        "The latest of its widest runs (NVIDIA H200, `engine/` tree `t1` at commit `c`, 16 test files, "
        "[record](results/raw/tests/suite/wide.jsonl)): 370 passed, 1 failed, 0 skipped. Failed: `test_x[8]`."
    )
    assert "widest" not in docblocks.gpu_exactness(df.iloc[:1])  # the latest run is the widest: one sentence


def test_a_suite_split_in_parts_is_said_as_one_run():
    """Parts of one engine/ tree's run that ran other files (scripts/device_gpu.sh's tests and tests2)
    are said as one run: their counts summed, each part's record linked."""
    base = dict(device="gpu", chip="NVIDIA H100", commit="c", errors=0, failed=0, skipped=1, faulted_after="",
                not_run="", failures="")  # fmt: skip
    df = pd.DataFrame(
        [dict(base, engine_tree="t1", scope="16 test files", paths=16, files=" ".join(suite.GPU_FILES), passed=400,
              run_id="old"),
         dict(base, engine_tree="t2", scope="13 test files", paths=13, files=" ".join(suite.GPU_FILES[:13]),
              passed=283, run_id="a"),
         dict(base, engine_tree="t2", scope="3 test files", paths=3, files=" ".join(suite.GPU_FILES[13:]),
              passed=162, run_id="b")]
    )  # fmt: skip
    said = docblocks.gpu_exactness(df)
    assert said == (
        "The suite's latest run on a GPU (NVIDIA H100, `engine/` tree `t2` at commit `c`, 13 + 3 test files in 2 "
        "runs, records [1](results/raw/tests/suite/a.jsonl), [2](results/raw/tests/suite/b.jsonl)): 445 passed, "
        "no failure, 2 skipped."
    )  # as wide as the widest run: one sentence
    df.loc[1, "engine_tree"] = "t0"  # parts of two trees are two runs
    assert docblocks.gpu_exactness(df).startswith("The suite's latest run on a GPU (NVIDIA H100, `engine/` tree `t2` "
                                                   "at commit `c`, 3 test files, [record]")  # fmt: skip


def test_a_table_cell_with_quotes_commas_and_line_breaks_reads_back(tmp_path):
    """A failed test's id can hold a JSON body (quotes and commas): the suite's table still reads back."""
    ids = ['tests/test_serve.py::test_x[completions-{"prompt": "x", "n": 2}]', "two\nlines", "plain"]
    aggregate.write(pd.DataFrame({"failures": ids, "n": [1, 2, 3]}), tmp_path / "t.csv", tmp_path / "t.md")
    assert pd.read_csv(tmp_path / "t.csv")["failures"].tolist() == ids


def test_the_readme_carries_the_generated_gpu_sentence():
    """What `snakemake figures` writes into the README from the committed records, byte for byte."""
    table = ROOT / "figures" / "tables" / "suite.csv"
    df = pd.read_csv(table, dtype={"engine_tree": str, "commit": str, "failures": str}).fillna("")
    text = (ROOT / "README.md").read_text()
    assert docblocks.fill(text, "gpu-exactness", docblocks.gpu_exactness(df)) == text


def test_the_run_agreement_sentence_names_a_reversal_and_only_it(tmp_path):
    """docs/workflow.md's generated sentence compares the two latest full runs on one machine: a
    copy of a committed run (a day later) with one stall made ten times worse reports that claim
    going from yes to no, and no other."""
    first, copy = "c8af1fee9518-host-443118812e", "bbbbbbbbbbbb-host-443118812e"
    raw = tmp_path / "raw"
    for f in (ROOT / "results" / "raw").rglob("*.jsonl"):
        if FULL_RUN_FILE.match(f.name) and not f.name.startswith(first):  # every other full run: this one is the last
            continue
        dst = raw / f.relative_to(ROOT / "results" / "raw")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(f)
        if f.name.startswith(first):
            lines = []
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                rec["run_id"] = rec["run_id"].replace(first, copy)
                for k in ("started_utc", "finished_utc"):
                    rec[k] = rec[k].replace("2026-11-", "2026-12-")
                res = rec["result"]
                if "tiny-f32-code" in f.name and res.get("sync") == "batched" and res.get("install") == "copy":
                    for k in ("stall_ms_per_token", "stall_ms_per_token_min", "stall_ms_per_token_max"):
                        res[k] *= 10
                lines.append(json.dumps(rec))
            (dst.parent / f.name.replace(first, copy)).write_text("\n".join(lines) + "\n")
    text = docblocks.run_agreement(raw)
    assert f"`{first}` and `{copy}`" in text
    assert text.endswith(
        "1 went from yes to no or back: stall halved by batching (code; olmoe-tiny-f32, copy; batched / per-miss) "
        "(yes -> no)."
    )
    assert docblocks.run_agreement(tmp_path / "nothing") == "No two full runs of `all` on one machine are recorded yet."


def bench_rows(rows, run_id="20261202T000000000Z-aaaaaa"):
    cols = ["device", "chip", "host", "bench", "model", "tier", "slots", "prompt_set", "tokens", "figure", "value"]
    return pd.DataFrame([dict(zip(cols, r), run_id=run_id) for r in rows], columns=cols + ["run_id"])


def test_the_device_install_sentence_says_which_targets_were_met_and_by_how_much_one_was_missed():
    """Each S's ratio is the median of the repeats' ratios to resident decoding with their range: a
    target below the range is met, above it missed (by how much), inside it met or missed within
    the spread."""
    rows = [("gpu", "H200", "h", "throughput", "olmoe-1b-7b-shape", None, None, None, 32, "repeats[S=E@mlx-lm]", 5)]
    cases = ((8, 0.70, 0.60, 0.80, 0.15), (16, 0.58, 0.50, 0.70, 0.22), (32, 0.66, 0.60, 0.70, 0.28))
    for s, dev, lo, hi, pin in cases:
        k = f"S={s}/device@mlx-lm"
        figs = {f"x resident paired[{k}]": dev, f"x resident paired_min[{k}]": lo, f"x resident paired_max[{k}]": hi,
                f"tok_s[{k}]": 118.0, f"x resident paired[S={s}/pinned@mlx-lm]": pin}  # fmt: skip
        rows += [("gpu", "H200", "h", "throughput", "olmoe-1b-7b-shape", None, None, None, 32, f, v)
                 for f, v in figs.items()]  # fmt: skip
    text = docblocks.device_install(bench_rows(rows))
    assert "median of 5 interleaved repeats of 32 tokens, each against resident" in text
    assert "S = 8 0.70× [0.60, 0.80], 118 tok/s, target 0.4 met, `pinned` 0.15×" in text
    assert "S = 16 0.58× [0.50, 0.70], 118 tok/s, target 0.6 missed within the spread" in text
    assert "S = 32 0.66× [0.60, 0.70], 118 tok/s, target 0.75 missed by 0.09" in text
    assert "oracle" not in text  # no prefetch bench on the device: not said
    assert text.startswith("On an H200, `olmoe-1b-7b-shape`") and "The latest check" not in text
    assert "no throughput record" in docblocks.device_install(bench_rows([]))
    # a later run of S = 16 alone (a change's check, here on another card) leaves the sentence on the
    # run of every S, and is said after it with its own card
    k = "S=16/device@mlx-lm"
    figs = {f"x resident paired[{k}]": 0.82, f"x resident paired_min[{k}]": 0.64, f"x resident paired_max[{k}]": 0.83,
            f"tok_s[{k}]": 182.0, "repeats[S=E@mlx-lm]": 5}  # fmt: skip
    check = bench_rows([("gpu", "H100", "h", "throughput", "olmoe-1b-7b-shape", None, None, None, 128, f, v)
                        for f, v in figs.items()], run_id="20261206T000000000Z-cccccc")  # fmt: skip
    later = docblocks.device_install(pd.concat([bench_rows(rows), check]))
    assert later.startswith(text.removesuffix(" (`scripts/device_gpu.sh OUT syncfree`; `decode16`)."))
    assert ". The latest check, on an H100: S = 16 0.82× [0.64, 0.83], 182 tok/s, target 0.6 met (" in later
    # the oracle's prefetch, from one run of `bench prefetch` (another run's figures never mixed in)
    pf = ("gpu", "H200", "h", "prefetch", "olmoe-1b-7b-shape", "page_cache", 16, "general", 32)
    figs = {"tok_s[resident/d0/device]": 200.0, "tok_s[none/d0/device]": 160.0, "tok_s[oracle/d1/device]": 150.0,
            "tok_s[oracle/d1/serial/device]": 80.0, "tok_s[oracle/d2/serial/device]": 100.0}  # fmt: skip
    # (`/serial`: a prefetch on the decode stream, the engine's default; without it, on a stream of its own)
    older = bench_rows([(*pf, "tok_s[oracle/d1/serial/device]", 190.0)], run_id="20261201T000000000Z-bbbbbb")
    newer = bench_rows([(*pf, k, v) for k, v in figs.items()])
    text = docblocks.device_install(pd.concat([bench_rows(rows), newer, older]))
    assert (
        "the oracle's prefetch at S = 16 0.50× (100 [100, 100] tok/s over prompts against resident's 200) at its "
        "best depth (d = 2), on the decode stream (the default), target 0.8 missed by 0.30, "
        "on a stream of its own (`--overlap on`) 0.75× (d = 1), "
        "demand loading 0.80× in the same run (the default prefetch slower than a stream of its own and demand "
        "loading)"
    ) in text
    # the target missed: where the time goes, each configuration's token against demand loading's
    assert "; a token 10.00 ms against demand loading's 6.25 and resident's 5.00" in text
    assert "neither waiting" not in text  # a run without stall figures says no more than that
    stalls = {"stall_ms_per_token[oracle/d2/serial/device]": 0.0, "stall_ms_per_token[none/d0/device]": 0.0}
    text = docblocks.device_install(bench_rows(rows + [(*pf, k, v) for k, v in {**figs, **stalls}.items()]))
    assert "6.25 and resident's 5.00, neither waiting for a read: the rest is the prefetch's own launches" in text
    assert "builds its graph" not in text  # a run without the host's split says nothing of it
    graph = {
        "graph_ms[oracle/d2/serial/device]": 4.0,
        "graph_ms[none/d0/device]": 3.0,
        "graph_ms[resident/d0/device]": 2.0,
    }
    text = docblocks.device_install(bench_rows(rows + [(*pf, k, v) for k, v in {**figs, **graph}.items()]))
    assert "resident's 5.00; the host builds its graph in 4.00 ms against 3.00 and 2.00" in text
    # a pipelined run: the host builds a token while the device runs the last, hands it to MLX, and
    # waits for it; where no token waited, the token is all the host's
    piped = {k.replace("graph_ms", "eval_ms"): v + 1 for k, v in graph.items()}
    piped.update({k.replace("graph_ms", "pipelined"): 1.0 for k in graph})
    piped.update({k.replace("graph_ms", "queue_ms"): v / 2 for k, v in graph.items()})
    text = docblocks.device_install(bench_rows(rows + [(*pf, k, v) for k, v in {**figs, **graph, **piped}.items()]))
    assert (
        "resident's 5.00, of which waiting for its token 5.00 ms against 4.00 and 3.00: building its graph 4.00 "
        "against 3.00 and 2.00, MLX taking it 2.00 against 1.50 and 1.00 (`scripts"
    ) in text
    piped.update({k.replace("graph_ms", "eval_ms"): 0.01 for k in graph})
    text = docblocks.device_install(bench_rows(rows + [(*pf, k, v) for k, v in {**figs, **graph, **piped}.items()]))
    assert "resident's 5.00, all of it the host's (none waited over 0.01 ms for its token): building its" in text
    # a default faster than both says nothing of the kind
    quick = {**figs, "tok_s[oracle/d2/serial/device]": 170.0}
    text = docblocks.device_install(pd.concat([bench_rows(rows), bench_rows([(*pf, k, v) for k, v in quick.items()])]))
    assert (
        "0.85× (170 [170, 170] tok/s over prompts against resident's 200) at its best depth (d = 2), on the "
        "decode stream (the default), target 0.8 met, on a stream" in text
    )
    assert "slower than" not in text and "a token" not in text  # the target met: nothing to explain
    # the prompts' range: a target the median meets and the slowest prompt misses is met within it
    spread = {**quick, "tok_s_min[oracle/d2/serial/device]": 150.0, "tok_s_max[oracle/d2/serial/device]": 180.0}
    text = docblocks.device_install(pd.concat([bench_rows(rows), bench_rows([(*pf, k, v) for k, v in spread.items()])]))
    assert "0.85× (170 [150, 180] tok/s over prompts against resident's 200)" in text
    assert "target 0.8 met within the spread" in text
    # a run that pairs each prompt with resident decoding of it: those ratios, and their range
    pairs = {"x resident paired[oracle/d2/serial/device]": 0.83, "x resident paired_min[oracle/d2/serial/device]": 0.81,
             "x resident paired_max[oracle/d2/serial/device]": 0.9}  # fmt: skip
    text = docblocks.device_install(
        pd.concat([bench_rows(rows), bench_rows([(*pf, k, v) for k, v in {**spread, **pairs}.items()])])
    )
    assert "0.83× ([0.81, 0.90], each prompt against resident decoding of it) at its best depth (d = 2)" in text
    assert "target 0.8 met, on a stream" in text  # every prompt's ratio above it: met outright
    # where the run pairs every configuration, the rivals are its paired ratios too, not tok/s
    # against resident's median (a 3-prompt run on the H200 gave demand 0.86 paired, 0.71 unpaired)
    rivals = {"x resident paired[oracle/d1/device]": 0.86, "x resident paired[none/d0/device]": 0.9}
    text = docblocks.device_install(
        pd.concat([bench_rows(rows), bench_rows([(*pf, k, v) for k, v in {**spread, **pairs, **rivals}.items()])])
    )
    assert "on a stream of its own (`--overlap on`) 0.86× (d = 1), demand loading 0.90× in the same run" in text
    # both inside the default's own range [0.81, 0.90]: slower, but not outside the noise
    assert "(the default prefetch slower than a stream of its own and demand loading, within the spread)" in text
    rivals["x resident paired[none/d0/device]"] = 0.95
    text = docblocks.device_install(
        pd.concat([bench_rows(rows), bench_rows([(*pf, k, v) for k, v in {**spread, **pairs, **rivals}.items()])])
    )
    assert "slower than a stream of its own and demand loading, a stream of its own within the spread)" in text
    # a run with only the other stream's figure names that stream, not the default
    own = {k: v for k, v in figs.items() if "serial" not in k}
    text = docblocks.device_install(pd.concat([bench_rows(rows), bench_rows([(*pf, k, v) for k, v in own.items()])]))
    assert "at its best depth (d = 1), on a stream of its own (`--overlap on`), target 0.8 missed by 0.05" in text
    assert "0.75× (150 [150, 150] tok/s" in text
    assert "(this prefetch slower than demand loading)" in text


def test_the_readme_names_the_engines_default_stream_for_a_device_prefetch():
    """The report layer imports no engine: its idea of the default stream is a constant that must
    agree with the engine's own choice."""
    from engine.runtime.installs import DeviceInstall

    assert docblocks.DEVICE_PREFETCH_ON_DECODE_STREAM is (not DeviceInstall.overlap_default)


def test_the_prediction_pays_sentence_sets_each_install_against_its_own_demand_loading():
    """Gate C's answer on the GPU: per install path (its own run's rows), the oracle's best depth
    and the fastest fitted predictor at each S as multiples of demand loading, above or below
    only outside both spreads; the docs' form gives the figures with their ranges."""

    def row(install, slots, predictor, tok_s, spread=5.0, depth=1, commit="aaaaaaaaaaaa"):
        return dict(device="gpu", chip="NVIDIA H200", model="olmoe-wide-trained", tier="page_cache",
                    prompt_set="general", slots=slots, predictor=predictor, depth=depth, min_prob=0.0,
                    install=install, experts=64, tok_s=tok_s, tok_s_min=tok_s - spread,
                    tok_s_max=tok_s + spread, commit=commit)  # fmt: skip

    rows = [row("pinned", 8, "none", 80.0, depth=0), row("pinned", 8, "oracle", 130.0, depth=2),
            row("pinned", 8, "probe", 84.0), row("device", 8, "none", 240.0, depth=0, commit="b"),
            row("device", 8, "oracle", 210.0, commit="b"), row("device", 8, "probe", 238.0, spread=12, commit="b"),
            row("device", 8, "transition", 200.0, commit="b"), row("pinned", 64, "none", 370.0, depth=0, commit="b"),
            row("cpu-only", 8, "none", 1.0, depth=0) | {"device": "cpu"}]  # fmt: skip
    text = docblocks.prediction_pays(pd.DataFrame(rows), full=False)
    assert (
        "`device` install, general prompts (NVIDIA H200): S = 8: "
        "oracle 0.88× below, best fitted (probe d1) 0.99× within"
    ) in text
    assert (
        "`pinned` install, general prompts (NVIDIA H200): S = 8: "
        "oracle 1.62× above, best fitted (probe d1) 1.05× within"
    ) in text
    assert "cpu-only" not in text and "S = 64" not in text  # another device; every expert resident: no question
    # another fitted predictor faster than the probe: the probe's own best is said beside it,
    # since the question (and the target) is asked of the probe
    faster = rows + [row("device", 8, "previous", 241.0, spread=2, depth=3, commit="b")]
    text = docblocks.prediction_pays(pd.DataFrame(faster), full=False)
    assert "S = 8: oracle 0.88× below, best fitted (previous d3) 1.00× within, probe (d1) 0.99× within" in text
    assert "probe (d1) 1.05×" not in text  # where the probe is the best fitted, it is said once
    full = docblocks.prediction_pays(pd.DataFrame(rows), full=True)
    assert "S = 8 (demand 240.0 [235.0, 245.0] tok/s): oracle 210.0 [205.0, 215.0], 0.88× below" in full
    assert "No gate C run of `olmoe-wide-trained` on a GPU" in docblocks.prediction_pays(pd.DataFrame(rows[-1:]), False)


def test_the_serve_sentence_names_each_server_with_its_latency_and_memory():
    base = ("cpu", "EPYC", "h", "serve", "olmoe-tiny-f32", None, 16, None, 16)
    figs = {"clients": 8, "latency_p50_s[engine S=16]": 1.5, "latency_p99_s[engine S=16]": 2.25,
            "tok_s[engine S=16]": 40.0, "tok_s_min[engine S=16]": 38.0, "tok_s_max[engine S=16]": 41.0,
            "peak_rss_bytes[engine S=16]": 120e6, "latency_p50_s[mlx_lm.server]": 0.5,
            "latency_p99_s[mlx_lm.server]": 0.75, "tok_s[mlx_lm.server]": 90.0, "tok_s_min[mlx_lm.server]": 80.0,
            "tok_s_max[mlx_lm.server]": 95.0}  # fmt: skip
    text = docblocks.serve_bench(bench_rows([(*base, k, v) for k, v in figs.items()]))
    assert text.startswith("On EPYC (cpu), `olmoe-tiny-f32`, 8 clients at once: ")
    assert "engine S=16: latency p50 1.50 s, p99 2.25 s, 40.0 tok/s [38.0, 41.0], peak RSS 120 MB" in text
    assert "mlx_lm.server: latency p50 0.50 s, p99 0.75 s, 90.0 tok/s [80.0, 95.0]." in text
    # against mlx_lm.server repetition by repetition, issue 48's target on the GPU's full-size model,
    # the untimed first round (a fresh server compiling), and how many requests each was sent
    more = {**figs, "x reference[engine S=16]": 0.33, "x reference_min[engine S=16]": 0.03,
            "x reference_max[engine S=16]": 0.42, "warmup_s[engine S=16]": 45.25, "requests": 48}  # fmt: skip
    gpu = ("gpu", "H100", "h", "serve", "olmoe-1b-7b-shape", None, 16, None, 16)
    text = docblocks.serve_bench(bench_rows([(*gpu, k, v) for k, v in more.items()]))
    assert "8 clients at once, 48 requests to each, every one answered: " in text
    assert ("peak RSS 120 MB, 0.33× of mlx_lm.server [0.03, 0.42] (target 0.3 met within the spread), "
            "first round (untimed) 45.2 s; mlx_lm.server") in text  # fmt: skip
    text = docblocks.serve_bench(bench_rows([(*base, k, v) for k, v in more.items()]))
    assert "0.33× of mlx_lm.server [0.03, 0.42], first round" in text and "target" not in text


def test_the_readmes_many_rows_table_reads_each_target_from_the_latest_gpu_run_that_measured_it():
    """One row per issue 48 target: the default path against resident (mlx_lm.server for serve),
    met or missed by how much, the bus's limit beside a batch bound by it, and the card and run it
    comes from; a CPU run alone gives the sentence instead."""
    m, gpu = "olmoe-1b-7b-shape", ("gpu", "NVIDIA H200", "h")
    pre = {"repeats": 3, "tokens_match[resident]": 1.0, "tokens_match[S=16/device]": 1.0,
           "x resident[S=16/device@2048]": 0.9, "x resident_min[S=16/device@2048]": 0.88,
           "x resident_max[S=16/device@2048]": 0.95, "x resident[S=8/device@2048]": 0.7,
           "decode x resident[S=16/device]": 0.75, "memory x resident[S=16/device]": 0.5}  # fmt: skip
    bat = {"repeats": 3, "tokens_match[S=16/device]": 0.0, "x resident[S=16/device@B16]": 0.22,
           "x resident_min[S=16/device@B16]": 0.2, "x resident_max[S=16/device@B16]": 0.23,
           "bus limit x resident[S=16/device@B16]": 0.24}  # fmt: skip
    srv = {"clients": 8, "x reference[engine S=16]": 0.4, "x reference[engine S=16 one at a time]": 0.2,
           "latency_p99_s[engine S=16]": 2.5, "latency_p99_s[mlx_lm.server]": 0.8}  # fmt: skip
    runs = (("prefill", pre, "p1"), ("batch", bat, "b1"), ("serve", srv, "s1"))
    frame = pd.concat([bench_rows([(*gpu, kind, m, None, None, None, 64, f, v) for f, v in figs.items()], rid)
                       for kind, figs, rid in runs])  # fmt: skip
    table = docblocks.many_rows_targets(frame)
    assert "| time to first token, 2048-token prompt, S = 16 | 0.90× [0.88, 0.95] (target 0.85 met) |" in table
    assert "| time to first token, 2048-token prompt, S = 8 | 0.70× (target 0.8 missed by 0.10) |" in table
    assert "| peak memory over the prompts, S = 16 (at most) | 0.50× (target 0.45 missed by 0.05) |" in table
    assert ("| `batch_generate`, B = 16, S = 16 | 0.22× [0.20, 0.23] (target 0.3 missed by 0.08); the bus's "
            "limit 0.24× |") in table  # fmt: skip
    assert ("| 8 clients through `serve`, × mlx_lm.server | 0.40× (target 0.3 met); p99 2.50 s (mlx_lm.server "
            "0.80 s) |") in table  # fmt: skip
    assert "one at a time" not in table and "B = 4" not in table  # a target not measured has no row
    # a run that counted the fewest misses any 16 slots allow says the limit with them too
    fewest = {"bus cache limit x resident[S=16/device@B16]": 0.23, "bus serial x resident[S=16/device@B16]": 0.2}
    more = pd.concat([frame, bench_rows([(*gpu, "batch", m, None, None, None, 64, f, v)
                                         for f, v in fewest.items()], "b1")])  # fmt: skip
    assert ("| `batch_generate`, B = 16, S = 16 | 0.22× [0.20, 0.23] (target 0.3 missed by 0.08); the bus's "
            "limit 0.24× (0.20× copying, then computing), 0.23× with the fewest misses any 16 slots allow |"
            ) in docblocks.many_rows_targets(more)  # fmt: skip
    assert table.endswith("Greedy tokens equal resident's in 2 of 3 configurations of these. Runs: `bench prefill` "
                          "`p1` on H200; `bench batch` `b1` on H200; `bench serve` `s1` on H200.")  # fmt: skip
    # a later run of another install alone (an ablation: `--installs pinned`) is no target's run
    pinned = {"x resident[S=16/pinned@B16]": 0.04, "default[S=16/pinned]": 0.0, "repeats": 1}
    later = pd.concat([frame, bench_rows([(*gpu, "batch", m, None, None, None, 64, f, v) for f, v in pinned.items()],
                                         "b2")])  # fmt: skip
    assert docblocks.many_rows_targets(later) == table
    assert "| S = 16 (pinned) |" in docblocks.many_rows_tables(later)  # its own table, after the default's
    cpu = [("cpu", "EPYC", "h", "prefill", "olmoe-tiny-f32", None, None, None, 8, f, v) for f, v in pre.items()]
    assert docblocks.many_rows_targets(bench_rows(cpu)).startswith("On EPYC (cpu)")


def test_the_many_rows_sentence_sets_the_default_path_against_its_targets_and_its_ablation():
    """The README's many-rows sentence, from the latest prefill and batch runs of a machine and model:
    the device install's default (the rows' own area, not the next layer's copied ahead) at each S
    and prompt length against issue 48's targets on a GPU's full-size model, the option beside it, the decode after
    the longest prompt, the memory, batch_generate, and whether the tokens were resident's."""
    base = ("gpu", "H200", "h")
    m = "olmoe-1b-7b-shape"
    pre = {"repeats": 3, "tokens_match[resident]": 1.0, "tokens_match[S=16/device/union]": 1.0,
           "tokens_match[S=16/device/ahead]": 0.0, "decode x resident[S=16/device/union]": 0.75,
           "decode x resident_min[S=16/device/union]": 0.72, "decode x resident_max[S=16/device/union]": 0.8,
           "memory x resident[S=16/device/union]": 0.41}  # fmt: skip
    for n, x, lo, hi in ((128, 0.45, 0.40, 0.52), (512, 0.8, 0.75, 0.85), (2048, 0.9, 0.86, 0.95)):
        k = f"S=16/device/union@{n}"
        pre.update({f"x resident[{k}]": x, f"x resident_min[{k}]": lo, f"x resident_max[{k}]": hi})
        pre[f"x resident[S=16/device/ahead@{n}]"] = x - 0.2
    bat = {"repeats": 3, "x resident[S=16/device/union@B4]": 0.3, "x resident_min[S=16/device/union@B4]": 0.25,
           "x resident_max[S=16/device/union@B4]": 0.35, "x resident[S=16/device/union@B16]": 0.33,
           "bus_gb_s": 50.0, "bus limit x resident[B4]": 0.8, "rows name every expert[B4]": 0.0,
           "bus limit x resident[B16]": 0.44, "rows name every expert[B16]": 1.0}  # fmt: skip
    rows = [(*base, "prefill", m, None, None, None, 64, f, v) for f, v in pre.items()]
    rows += [(*base, "batch", m, None, None, None, 64, f, v) for f, v in bat.items()]
    text = docblocks.many_rows(bench_rows(rows))
    assert text.startswith("On H200 (gpu), `olmoe-1b-7b-shape` (3 interleaved repeats")
    assert "S = 16 (device): 128 0.45× [0.40, 0.52] (target 0.5 missed within the spread)" in text
    assert "512 0.80× [0.75, 0.85] (target 0.7 met), 2048 0.90× [0.86, 0.95] (target 0.85 met)" in text
    assert "copied ahead (`area_ahead`), S = 16 at 2048 tokens 0.70× against the default's 0.90×" in text
    assert "decode after the 2048-token prompt, S = 16: 0.75× [0.72, 0.80] (target 0.7 met)" in text
    assert "held 0.41× of resident's memory (target at most 0.45: met)" in text
    assert ("`batch_generate` at S = 16 (device): B = 4 0.30× [0.25, 0.35] (target 0.45 missed by 0.15), "
            "B = 16 0.33× (target 0.3 met)") in text  # fmt: skip
    assert "greedy tokens equal resident's in 2 of 3 configurations" in text
    # where the batch's time goes: the bus's limit where the rows name every expert (B = 16, not 4)
    assert ("the bus's limit where a step's rows name every expert, each read once a step at the 50.0 GB/s "
            "the run measured: B = 16 0.44× (reached 0.75 of it)") in text  # fmt: skip
    assert "B = 4 0.80×" not in text
    # a run that counts the slots: the bus carries every expert but the S a layer's slots hold
    slot = {**bat, "bus limit x resident[S=16/device/union@B16]": 0.55}
    both_b = rows + [(*base, "batch", m, None, None, None, 64, f, v) for f, v in slot.items()]
    text = docblocks.many_rows(bench_rows([r for r in both_b if r[3] == "prefill" or r[-2] in slot]))
    assert ("the bus's limit where a step's rows name every expert, all but the slots' 16 read "
            "once a step at the 50.0 GB/s the run measured: B = 16 0.55× (reached 0.60 of it)") in text  # fmt: skip
    table = docblocks.many_rows_tables(bench_rows([(*base, "batch", m, None, None, None, 64, f, v)
                                                   for f, v in slot.items()]))  # fmt: skip
    assert "| the bus's limit at S = 16, every other expert read once a step |  | 0.55× |" in table
    # a run that counted the experts its decode steps' rows named: a limit at every B, said so
    named = {**slot, "named experts a layer[B4]": 26.5, "named experts a layer[B16]": 64.0, "experts": 64.0,
             "bus limit x resident[S=16/device/union@B4]": 0.9,
             "bus serial x resident[S=16/device/union@B4]": 0.6}  # fmt: skip
    counted = [(*base, "batch", m, None, None, None, 64, f, v) for f, v in named.items()]
    text = docblocks.many_rows(bench_rows([r for r in rows if r[3] == "prefill"] + counted))
    assert ("the bus's limit from the experts a step's rows named a layer (26.5 at B = 4, 64.0 at B = 16, of 64), "
            "all but the slots' 16 read once a step at the 50.0 GB/s the run measured: B = 4 0.90× (0.60× copying, "
            "then computing; reached 0.33 of it), B = 16 0.55× (reached 0.60 of it)") in text  # fmt: skip
    table = docblocks.many_rows_tables(bench_rows(counted))
    assert "| experts a step's rows named, a layer's mean | 26.5 | 64.0 |" in table
    assert (
        "| the bus's limit at S = 16, each expert the rows named beyond the slots read once a step | 0.90× | 0.55× |"
        in table
    )
    assert "| the same, each step's copies before its compute | 0.60× |  |" in table
    # and the fewest experts any S slots bring in over the run's steps (Belady's rule), the limit with them
    least = {**named, "fewest misses a layer[S=16/device/union@B4]": 12.25,
             "bus cache limit x resident[S=16/device/union@B4]": 0.7}  # fmt: skip
    counted = [(*base, "batch", m, None, None, None, 64, f, v) for f, v in least.items()]
    text = docblocks.many_rows(bench_rows([r for r in rows if r[3] == "prefill"] + counted))
    assert ("reached 0.60 of it); as no S slots hold just what each step's rows name, the fewest experts any 16 "
            "slots bring in (Belady's rule) make it B = 4 0.70× (12.2 a layer a step)") in text  # fmt: skip
    table = docblocks.many_rows_tables(bench_rows(counted))
    assert "| the fewest experts any 16 slots bring in, a layer a step | 12.2 |  |" in table
    assert "| the bus's limit with those read once a step | 0.70× |  |" in table
    cpu = [("cpu", "EPYC", "h", "prefill", "olmoe-tiny-f32", None, None, None, 8, f, v) for f, v in pre.items()]
    assert "(target" not in docblocks.many_rows(bench_rows(cpu))  # targets are the GPU's full-size model's
    assert "No `bench prefill`" in docblocks.many_rows(bench_rows([]))
    # the README's reads the GPU's full-size model alone where it has runs; docs/gpu.md every machine's
    both = bench_rows(rows + cpu)
    assert "EPYC" in docblocks.many_rows(both) and "EPYC" not in docblocks.many_rows(both, only_targets=True)
    assert "On EPYC (cpu)" in docblocks.many_rows(bench_rows(cpu), only_targets=True)
    # a batch-only check on another card comes after the wide run, and speaks of no time to first token
    check = [("gpu", "A100", "h", "batch", m, None, None, None, 64, f, v) for f, v in bat.items()]
    text = docblocks.many_rows(bench_rows(rows + check), only_targets=True)
    assert text.startswith("On H200 (gpu)") and text.index("On A100 (gpu)") > text.index("On H200 (gpu)")
    assert text.count("time to first token") == 1
    assert "On A100 (gpu), `olmoe-1b-7b-shape` (3 interleaved repeats, each against resident in the same repeat, " \
        "[min, max]): `batch_generate`" in text  # fmt: skip
    # a run of two installs is read by the one `auto` gives on its machine, where it says which
    two = {"x resident[S=16/device@B4]": 0.5, "x resident[S=16/inplace@B4]": 0.8, "repeats": 3}
    said = {**two, "default[S=16/device]": 0.0, "default[S=16/inplace]": 1.0}
    text = docblocks.many_rows(bench_rows([("cpu", "EPYC", "h", "batch", "m", None, None, None, 8, f, v)
                                           for f, v in said.items()]))  # fmt: skip
    assert "`batch_generate` at S = 16 (inplace): B = 4 0.80×" in text
    text = docblocks.many_rows(bench_rows([("cpu", "EPYC", "h", "batch", "m", None, None, None, 8, f, v)
                                           for f, v in two.items()]))  # fmt: skip
    assert "`batch_generate` at S = 16 (device): B = 4 0.50×" in text  # older runs: the first by name
    # the tables: one per bench and machine, a row per configuration, resident left out (it is 1.0)
    tables = docblocks.many_rows_tables(both)
    assert "| | 128 tokens | 512 tokens | 2048 tokens | decode after 2048 | memory held |" in tables
    assert "| the bus's limit, every expert read once a step |  | 0.44× |" in tables
    assert "| S = 16 (device, the rows' area) | 0.45× [0.40, 0.52] | 0.80× [0.75, 0.85] | 0.90× [0.86, 0.95] | " \
        "0.75× [0.72, 0.80] | 0.41× |" in tables  # fmt: skip
    assert "| S = 16 (device, next layer ahead) | 0.25× |" in tables
    assert "| S = 16 (device, the rows' area) | 0.30× [0.25, 0.35] | 0.33× |" in tables
    assert "resident" not in tables.split("| --- ")[-1]
