"""The test suite as a recorded gate: `python -m harness suite` runs pytest and writes what it found
as one raw record (results/raw/tests/suite/), naming the `engine/` tree it ran on.

CI has no GPU, so the engine's exactness on a CUDA GPU is known only from a run there; the record
says which `engine/` tree that run checked (its git tree hash, computed from the files themselves,
so a copy of the tree without `.git` names it too), on what device, and every failure by name and
every skip with its reason. `.ci/run` prints whether the landed tree has a passing GPU record
(`python -m harness suite --check`), and the README's exactness sentence is made from the latest one.

With `--shards N` the test files run in N pytest processes at once (a file's tests stay in one
process, but for `SPLIT` files, whose tests are independent), each with its own MLX kernel cache
(`MLX_PTX_CACHE_DIR`: MLX's CUDA backend writes compiled kernels without a lock). Where the caller
names a cache in `MLX_PTX_CACHE_DIR`, each shard's starts as a copy of it, and what the shards
compiled is added to it once they end: a fresh machine primed with an earlier run's kernels need
not compile them in every shard (scripts/device_gpu.sh, PTX_CACHE). The files that
plan or run the workflow in the checkout stay in one process (`TOGETHER`): Snakemake locks it.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import provenance, rawlog, records
from .suite_scope import GPU_FILES, covers_gpu_files, files_of, split_run  # noqa: F401 (asked as suite.X)

GATE, EXPERIMENT = "tests", "suite"
# Independent tests, spread over the shards one by one (on a GPU each compiles its own kernels).
SPLIT = (
    "tests/test_architectures.py",
    "tests/test_exactness.py",
    "tests/test_staging.py",
    "tests/test_prefetch.py",
    "tests/test_use.py",  # 870 s in one shard on the H200 (2026-12-03); its tests share no fixture
    # 1092 s in one shard on the H100 (2026-12-06), the suite's last by 7 minutes: most of its tests
    # start a server of their own; those that share the module's get one server a shard
    "tests/test_serve.py",
)
TOGETHER = ("tests/test_workflow.py", "tests/test_harness.py", "tests/test_cli.py")
IGNORED_PARTS = ("__pycache__",)


def tree_hash(folder: Path) -> str:
    """Git's tree hash of `folder` as its files are now (what `git rev-parse HEAD:engine` names when
    they are committed unchanged), computed without git: blobs and trees as git hashes them,
    `__pycache__` and `*.pyc` left out as `.gitignore` leaves them out."""

    def obj(kind: bytes, data: bytes) -> bytes:
        return hashlib.sha1(kind + b" " + str(len(data)).encode() + b"\0" + data).digest()

    def tree(d: Path) -> bytes | None:
        entries = []
        for p in d.iterdir():
            if p.name in IGNORED_PARTS or p.suffix == ".pyc":
                continue
            if p.is_symlink():
                entries.append((p.name, b"120000", obj(b"blob", os.readlink(p).encode())))
            elif p.is_dir():
                sub = tree(p)
                if sub is not None:  # git keeps no empty folder
                    entries.append((p.name + "/", b"40000", sub))
            else:
                mode = b"100755" if os.access(p, os.X_OK) else b"100644"
                entries.append((p.name, mode, obj(b"blob", p.read_bytes())))
        if not entries:
            return None
        entries.sort(key=lambda e: e[0].encode())  # git orders a folder as its name plus "/"
        body = b"".join(mode + b" " + name.rstrip("/").encode() + b"\0" + h for name, mode, h in entries)
        return obj(b"tree", body)

    h = tree(Path(folder))
    return h.hex() if h else ""


def committed_tree(root=provenance.REPO_ROOT) -> str | None:
    """`git rev-parse HEAD:engine` of the checkout, or None without git."""
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD:engine"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def shards(nodeids: list, n: int, seconds: dict | None = None) -> list:
    """Test ids in `n` groups of about equal cost: whole files (TOGETHER ones in one group), but
    SPLIT files' tests one by one; a test's cost is its seconds in `seconds` (a former run's), else
    the median of those, else 1."""
    units = {}
    for t in nodeids:
        f = t.split("::", 1)[0]
        key = "together" if f in TOGETHER else (t if f in SPLIT else f)
        units.setdefault(key, []).append(t)
    seconds = seconds or {}
    typical = sorted(seconds.values())[len(seconds) // 2] if seconds else 1.0

    def cost(tests):
        return sum(seconds.get(t, typical) for t in tests)

    groups = [[] for _ in range(max(1, n))]
    for unit in sorted(units.values(), key=cost, reverse=True):  # the costliest first, to the cheapest
        min(groups, key=cost).extend(unit)
    return [g for g in groups if g]


def former_seconds(device: str, raw=None) -> dict:
    """Each test's seconds in the latest recorded run of the suite on `device`."""
    folder = Path(raw or rawlog.RAW) / GATE / EXPERIMENT
    recs = [r for r in (records.read([folder]) if folder.exists() else []) if r["device"] == device]
    return max(recs, key=lambda r: r["finished_utc"])["result"].get("durations", {}) if recs else {}


def collect(args: list) -> list:
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
    )
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line]
    if not ids:
        raise RuntimeError(f"pytest collected no test:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return ids


def parse_junit(paths) -> dict:
    """Counts and names from pytest's JUnit XML files."""
    out = dict(passed=0, failed=0, errors=0, skipped=0, xfailed=0, tests=0, failures=[], skips=[], durations={})
    for p in paths:
        for case in ET.parse(p).getroot().iter("testcase"):
            name = f"{case.get('file') or case.get('classname', '').replace('.', '/') + '.py'}::{case.get('name')}"
            out["tests"] += 1
            out["durations"][name] = round(float(case.get("time") or 0.0), 2)
            failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
            if failure is not None:
                out["failed"] += 1
                out["failures"].append(dict(test=name, message=(failure.get("message") or "")[:500]))
            elif error is not None:
                out["errors"] += 1
                out["failures"].append(dict(test=name, message=("error: " + (error.get("message") or ""))[:500]))
            elif skipped is not None and skipped.get("type") == "pytest.xfail":
                out["xfailed"] += 1
            elif skipped is not None:
                out["skipped"] += 1
                out["skips"].append(dict(test=name, reason=(skipped.get("message") or "")[:300]))
            else:
                out["passed"] += 1
    out["failures"].sort(key=lambda f: f["test"])
    out["skips"].sort(key=lambda s: s["test"])
    return out


def gather_kernels(into: Path, caches: list):
    """Add to the kernel cache `into` what the shards' caches compiled that it lacks. MLX names a
    cached module's files (`.ptx`, `.txt`, `.cu`) after the module, so a name is one kernel's."""
    for cache in caches:
        for f in sorted(cache.iterdir()) if cache.is_dir() else []:
            if f.is_file() and not (into / f.name).exists():
                shutil.copy2(f, into / f".{f.name}.tmp")
                os.replace(into / f".{f.name}.tmp", into / f.name)  # no reader sees half a file


def run(pytest_args: list, n_shards: int = 1, record: bool = True, root=None) -> tuple[dict, Path | None]:
    """Run the suite (in `n_shards` processes) and write its record; returns the result and the path."""
    started = provenance.utc_now()
    t0 = time.time()
    cache = Path(tempfile.mkdtemp(prefix="titan-suite-"))
    work = reports_dir(started) or cache
    device = "gpu" if provenance.device()["device"] == "gpu" else "cpu"
    groups = shards(collect(pytest_args), n_shards, former_seconds(device)) if n_shards > 1 else [None]
    primer = os.environ.get("MLX_PTX_CACHE_DIR")
    primer = Path(primer) if primer and n_shards > 1 and Path(primer).is_dir() else None
    procs = []
    for i, group in enumerate(groups):
        env = dict(os.environ)
        if n_shards > 1:
            env["MLX_PTX_CACHE_DIR"] = str(cache / f"ptx-{i}")
            if primer is not None:
                shutil.copytree(primer, cache / f"ptx-{i}")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={work / f'shard-{i}.xml'}"]
        cmd += pytest_args if group is None else [a for a in pytest_args if a.startswith("-")] + group
        log = open(work / f"shard-{i}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, i))
    running = list(procs)
    while running:  # each shard said as it ends: a run cut short still shows which ended how
        for p, log, i in [r for r in running if r[0].poll() is not None]:
            running.remove((p, log, i))
            log.close()
            tail = (work / f"shard-{i}.log").read_text().splitlines()[-3:]
            print(f"[suite] shard {i}: exit {p.returncode}: {' | '.join(tail)}", flush=True)
        time.sleep(0.5 if running else 0)
    if primer is not None:  # from shards that ended as pytest ends: one that died may have half-written a kernel
        gather_kernels(primer, [cache / f"ptx-{i}" for p, _, i in procs if p.returncode in range(6)])
    xmls = [work / f"shard-{i}.xml" for i in range(len(groups)) if (work / f"shard-{i}.xml").exists()]
    result = parse_junit(xmls)
    result.update(
        seconds=round(time.time() - t0, 1),
        shards=len(groups),
        engine_tree=tree_hash(Path(provenance.REPO_ROOT) / "engine"),
        engine_tree_committed=committed_tree(),
        exit_codes=[p.returncode for p, _, _ in procs],
    )
    if len(xmls) < len(groups):
        missing = sorted(set(range(len(groups))) - {int(x.stem.split("-")[1]) for x in xmls})
        result["errors"] += len(missing)
        for i in missing:
            tail = (work / f"shard-{i}.log").read_text()[-500:]
            result["failures"].append(dict(test=f"shard {i}", message=f"pytest wrote no report: {tail}"))
    path = None
    if record:
        path = rawlog.write_run(
            GATE,
            EXPERIMENT,
            [result],
            config=dict(pytest_args=pytest_args, shards=n_shards),
            seed=None,
            started=started,
            root=root,
        )
    keep_failed_logs(work, [i for p, _, i in procs if p.returncode != 0], root, path.stem if path else started)
    return result, path


def reports_dir(started: str) -> Path | None:
    """Where the shards write their JUnit XML and logs as each ends: `$TITAN_SUITE_REPORTS/STARTED/`
    where that is set (scripts/device_gpu.sh sets it under results/logs/, which it brings back
    after every call, so that a run the device's time limit cuts short still names what the shards
    that ended found), else None (a temporary folder, with the kernel caches)."""
    root = os.environ.get("TITAN_SUITE_REPORTS")
    if not root:
        return None
    folder = Path(root) / started.replace(":", "")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def keep_failed_logs(work: Path, failed: list, root, name: str) -> Path | None:
    """A failed shard's whole log (every traceback, what the process printed before it died) into
    results/logs/suite/NAME/ beside the raw records: the record keeps 500 characters a failure,
    and a process a device fault poisoned needs its first error, which may be another test's."""
    if not failed:
        return None
    keep = Path(root or rawlog.RAW).parent / "logs" / "suite" / name.replace(":", "")
    keep.mkdir(parents=True, exist_ok=True)
    for i in failed:
        shutil.copy(work / f"shard-{i}.log", keep / f"shard-{i}.log")
    print(f"[suite] the failed shards' logs: {keep}", flush=True)
    return keep


def passing_record(tree: str, raw=None, device="gpu") -> dict | None:
    """The latest record of a suite run on `device` over engine tree `tree` with no failure that
    ran every GPU file (a check of one fix, one test file or one family is not the tree's record),
    or the latest passing runs of that tree that ran them between them (a split run), as one."""
    folder = Path(raw or rawlog.RAW) / GATE / EXPERIMENT
    recs = [
        r
        for r in (records.read([folder]) if folder.exists() else [])
        if r["device"] == device
        and r["result"]["engine_tree"] == tree
        and not r["result"]["failed"]
        and not r["result"]["errors"]
        and r["result"]["passed"]
    ]
    recs.sort(key=lambda r: r["finished_utc"])
    ran = [(tree, files_of(r["config"].get("pytest_args") or ["tests"])) for r in recs]
    for end in range(len(recs), 0, -1):
        idx = split_run(ran[:end])
        parts = [recs[i] for i in idx]
        if set(GPU_FILES) <= set().union(*(ran[i][1] for i in idx)):
            if len(parts) == 1:
                return parts[0]
            result = dict(parts[-1]["result"])
            result.update(
                {k: sum(p["result"].get(k, 0) for p in parts) for k in ("passed", "skipped", "xfailed", "tests")}
            )
            return dict(parts[-1], result=result, _file=" + ".join(p["_file"] for p in parts))
    return None


def check_line(root=provenance.REPO_ROOT, raw=None) -> str:
    """One line for CI: whether the landed `engine/` tree has a passing GPU record (never a failure)."""
    tree = committed_tree(root) or tree_hash(Path(root) / "engine")
    rec = passing_record(tree, raw)
    if rec:
        r = rec["result"]
        return (
            f"GPU tests: engine/ tree {tree[:12]} passed on {rec.get('gpu') or 'a GPU'} "
            f"({r['passed']} passed, {r['skipped']} skipped; {rec['_file']})"
        )
    return (
        f"WARNING: engine/ tree {tree[:12]} has no passing GPU test record of every GPU file: run "
        "`scripts/device_gpu.sh OUT tests` "
        "on a CUDA GPU and commit its record (docs/gpu.md, 'The test suite on a GPU')"
    )


def add_args(p):
    p.add_argument("--shards", type=int, default=1, help="pytest processes at once (default 1)")
    p.add_argument("--no-record", action="store_true", help="run and print, write no raw record")
    p.add_argument(
        "--check", action="store_true", help="print whether the landed engine/ tree has a passing GPU record"
    )
    p.add_argument(
        "--gpu-files", action="store_true", help="run the test files that exercise the engine on a device (GPU_FILES)"
    )
    p.add_argument("pytest_args", nargs="*", help="what pytest is given (default: the whole suite)")


def main(a):
    if a.check:
        print(check_line())
        return
    if a.shards < 1:
        raise ValueError(f"--shards must be at least 1, not {a.shards}")
    if a.gpu_files and a.pytest_args:
        raise ValueError("--gpu-files names the test files itself: give it no test paths")
    args = list(GPU_FILES) if a.gpu_files else (a.pytest_args or ["tests"])
    result, path = run(args, a.shards, record=not a.no_record)
    print(
        f"[suite] {result['passed']} passed, {result['failed']} failed, {result['errors']} errors, "
        f"{result['skipped']} skipped, {result['xfailed']} xfailed in {result['seconds']} s; engine/ tree "
        f"{result['engine_tree'][:12]}" + (f"; record {path}" if path else "")
    )
    for f in result["failures"]:
        print(f"  FAILED {f['test']}: {f['message'][:200]}")
    if result["failed"] or result["errors"]:
        sys.exit(1)
