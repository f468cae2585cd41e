"""The raw-record format and its reader: what every line of a raw log under results/raw/ holds
(`REQUIRED`, at `SCHEMA_VERSION`), read and validated. Apart from the writer (rawlog.py, which
stamps provenance and so imports the engine and MLX) so that tables are made without either."""

import json
from pathlib import Path

SCHEMA_VERSION = 1
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
                if rec["schema_version"] != SCHEMA_VERSION:
                    raise RawLogError(
                        f"{f}: line {n}: schema_version {rec['schema_version']!r} is not {SCHEMA_VERSION}"
                    )
                if not isinstance(rec["result"], dict):
                    raise RawLogError(f"{f}: line {n}: field result is not an object")
                rec["_file"] = name
                out.append(rec)
    return out
