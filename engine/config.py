"""What a user sets: the engine's options (`EngineConfig`) and where Titan keeps its files.

Built models, expert stores, traces and fitted predictors go under the *resources* folder:
`$TITAN_RESOURCES` if set; else `resources/` of the source checkout the engine runs from (as in
this repository); else `~/.cache/titan` (an installed wheel).
"""

import contextlib
import fcntl
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
DATA = PACKAGE / "data"


def checkout() -> Path | None:
    """The source checkout this package runs from (editable install or plain tree), if any."""
    root = PACKAGE.parent
    return root if (root / "pyproject.toml").exists() and (root / "engine" / "data").is_dir() else None


def resources_dir() -> Path:
    if os.environ.get("TITAN_RESOURCES"):
        return Path(os.environ["TITAN_RESOURCES"])
    root = checkout()
    return root / "resources" if root else Path.home() / ".cache" / "titan"


@contextlib.contextmanager
def build_lock(out: Path):
    """Held while `out` (a model or store folder) is built: processes that start at once (the
    nodes of a multi-node run, parallel jobs of a workflow) build it once, and the others wait
    and then find it built, instead of racing to replace the folder another is reading."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f".{out.name}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Builds of at least this many bytes say what they write as they go (a full-size family takes minutes)
PROGRESS_BYTES = 1 << 30


def disk_short(folder: Path, need: int) -> str | None:
    """Why `folder`'s file system cannot take `need` more bytes (with 2 % and 64 MiB to spare), or
    None where it can: a build checks before it writes, rather than failing half way."""
    folder = Path(folder)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    want = int(need * 1.02) + (64 << 20)
    if free >= want:
        return None
    return f"{folder}: {free / 1e9:.2f} GB free, the build needs {want / 1e9:.2f} GB"


def progress(what: str, done: int, total: int, bytes_done: int, bytes_total: int, seconds: float):
    """One line on stderr for a long build: `what` (e.g. the model), parts done, bytes, time."""
    if bytes_total >= PROGRESS_BYTES:
        print(f"[titan] {what}: {done} of {total} written ({bytes_done / 1e9:.1f} of {bytes_total / 1e9:.1f} GB, "
              f"{seconds:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip


@dataclass
class EngineConfig:
    slots: int | None = None  # None: every expert resident (S = E)
    tier: str = "page_cache"
    install: str = "auto"  # inplace on the CPU, device on a CUDA GPU (runtime.installs.choose says why)
    sync: str = "batched"  # or per_miss: the paper's first version, for its ablation
    readers: int = 4
    eviction: str = "lru"
    verify: str = "first"
    predictor: str = "none"
    depth: int = 1
    predict_size: int | None = None  # None: top_k
    min_prob: float = 0.0  # fitted predictors issue only experts at least this likely (0: all predicted)
    fit_set: str = "general"  # the prompt set whose fit traces fitted predictors learn from
    trace_tokens: int = 32  # decode tokens per prompt in those traces
    staging_records: int = 64  # pinned install: host records in the staging pool (8 to 256)
    # True: start each MoE layer's compute at once (async) rather than at the next sync, and with the
    # device install prefetch on a stream of its own rather than on the decode stream. None: what
    # measured faster for the install (installs.Install.overlap_default)
    overlap: bool | None = None
    # The device install: a many-rows call whose rows name at least E choices copies the next
    # layer's whole area during its compute (device.DeviceCache). None: the default (off)
    area_ahead: bool | None = None
    memory: int | None = None  # a memory budget in bytes instead of `slots` (engine.memory picks S)
    context: int = 4096  # tokens of KV cache the memory budget keeps room for
