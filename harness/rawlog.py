"""Raw logs: one immutable JSON-lines file per run under results/raw/<gate>/<experiment>/.

A run writes a temporary file, then links it into place under a fresh run id: an existing file
is never opened for writing, renamed over, or deleted. The records' format and their reader,
which refuses a malformed line with its file and line number, are records.py's.
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
