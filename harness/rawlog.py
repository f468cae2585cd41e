"""Raw logs: one immutable JSON-lines file per run under results/raw/<gate>/<experiment>/.

A run writes a temporary file, then links it into place under a fresh run id: an existing file
is never opened for writing, renamed over, or deleted. Readers refuse a malformed line with its
file and line number.
"""

import json
import os
import secrets
import sys
from pathlib import Path

from . import provenance

# Where raw logs go unless a caller names the place: results/raw of the current directory (the
# workflow runs from the repository's root), or $TITAN_RAW.
RAW = Path(os.environ.get("TITAN_RAW", "results/raw"))
REQUIRED = (
    "schema_version",
    "gate",
    "experiment",
    "run_id",
    "command",
    "commit",
    "dirty",
    "host",
    "chip",
    "memory_bytes",
    "os",
    "os_version",
    "python",
    "versions",
    "device",
    "seed",
    "config",
    "started_utc",
    "finished_utc",
    "result",
)


class RawLogError(ValueError):
    """A raw log line that is not a valid record."""


def new_run_id() -> str:
    stamp = provenance.utc_now().replace("-", "").replace(":", "").replace(".", "")
    return f"{stamp}-{secrets.token_hex(3)}"


def write_run(
    gate: str,
    experiment: str,
    results,
    *,
    config: dict,
    seed,
    started: str,
    root=None,
    command=None,
    path=None,
    **extra,
) -> Path:
    """Stamp every result with provenance and write them as one new file; returns its path.
    With `path` (a workflow's declared output), the file goes there, and its stem is the run id."""
    if path is not None:
        final = Path(path)
        run_id = final.stem
    else:
        run_id = new_run_id()
        final = Path(root or RAW) / gate / experiment / f"{run_id}.jsonl"
    folder = final.parent
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for r in results:
        rec = provenance.stamp(r, command=command or sys.argv, seed=seed, config=config, started=started, **extra)
        rec = {"gate": gate, "experiment": experiment, "run_id": run_id, **rec}
        lines.append(json.dumps(rec, sort_keys=True))
    tmp = folder / f".{run_id}.tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.link(tmp, final)  # fails rather than replace an existing file
    os.unlink(tmp)
    os.chmod(final, 0o444)
    return final


def read(paths) -> list:
    """Every record of the given files (or folders, searched for *.jsonl), validated."""
    files = []
    for p in paths:
        p = Path(p)
        files += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    out, cwd = [], Path.cwd()
    for f in files:
        full = f.resolve()
        name = str(full.relative_to(cwd)) if full.is_relative_to(cwd) else str(f)
        with open(f) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise RawLogError(f"{f}: line {n}: not JSON ({e})") from None
                if not isinstance(rec, dict):
                    raise RawLogError(f"{f}: line {n}: not a JSON object")
                missing = [k for k in REQUIRED if k not in rec]
                if missing:
                    raise RawLogError(f"{f}: line {n}: missing field(s) {', '.join(missing)}")
                if rec["schema_version"] != provenance.SCHEMA_VERSION:
                    raise RawLogError(
                        f"{f}: line {n}: schema_version {rec['schema_version']!r} is not {provenance.SCHEMA_VERSION}"
                    )
                if not isinstance(rec["result"], dict):
                    raise RawLogError(f"{f}: line {n}: field result is not an object")
                rec["_file"] = name
                out.append(rec)
    return out
