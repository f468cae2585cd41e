"""The test suite's recorded runs (`python -m harness suite`) and mlx-lm's own determinism."""

import re

import pandas as pd

from .common import MACHINE, latest, machine_cols

# what tests/conftest.py's DeviceWatch says of a test its process did not run after a device fault
NOT_RUN = re.compile(r"not run: the device faulted after (\S+)")


def suite_table(recs):
    """Every recorded run of the test suite (python -m harness suite): where it ran, on which
    engine/ tree, and what it found."""
    cols = MACHINE + ["engine_tree", "commit", "dirty", "scope", "paths", "files"]
    cols += ["passed", "failed", "errors", "skipped", "xfailed", "seconds"]
    cols += ["failures", "faulted_after", "not_run", "started_utc", "run_id"]
    rows = []
    for r in recs:
        res = r["result"]
        args = [a for a in (r.get("config") or {}).get("pytest_args", ["tests"]) if not a.startswith("-")]
        rows.append(
            dict(
                **machine_cols(r),
                scope=scope_of(args),
                paths=0 if whole_suite(args) else len(args),  # 0: every test
                files=" ".join(args),
                engine_tree=res["engine_tree"][:12],
                dirty=r["dirty"],
                **{k: res[k] for k in ("passed", "failed", "errors", "skipped", "xfailed", "seconds")},
                failures="; ".join(f["test"] for f in res["failures"]),
                # a device fault poisons its process: the tests after it there are not run, not failed
                faulted_after="; ".join(sorted({m[1] for f in res["failures"] if (m := NOT_RUN.search(f["message"]))})),
                not_run="; ".join(f["test"] for f in res["failures"] if NOT_RUN.search(f["message"])),
                started_utc=r["started_utc"],
                run_id=r["run_id"],
            )
        )
    return pd.DataFrame(rows, columns=cols).sort_values(["started_utc", "run_id"], kind="mergesort")


def whole_suite(args: list) -> bool:
    return args in (["tests"], ["tests/"])


def scope_of(args: list) -> str:
    """What a run covered, in words: the whole suite, or its test files and single tests."""
    if whole_suite(args):
        return "the whole suite"
    tests = sum("::" in a for a in args)
    files = len(args) - tests
    parts = [f"{files} test file{'s' if files != 1 else ''}"] if files else []
    return " and ".join(parts + ([f"{tests} single test{'s' if tests != 1 else ''}"] if tests else []))


def determinism_table(recs):
    """Plain mlx-lm run again on the same tokens (scripts/determinism.py): per machine, model and
    CUDA-graph setting, the largest |Δlogit| over the latest run's repetitions."""
    keys = MACHINE + ["cuda_graphs", "model"]
    figs = ("cuda_graphs", "model", "deterministic", "max_abs_diff", "nan", "steps")
    rows = [
        dict(**machine_cols(r), **{k: r["result"][k] for k in figs}, repetitions=r["result"]["runs"])
        | dict(started_utc=r["started_utc"], run_id=r["run_id"])
        for r in recs
        if "error" not in r["result"]
    ]
    cols = keys + ["deterministic", "max_abs_diff", "nan", "repetitions", "steps", "commit", "runs"]
    return latest(rows, keys).reindex(columns=cols) if rows else pd.DataFrame(columns=cols)
