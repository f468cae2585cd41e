"""Provenance stamped on every raw record: what ran, where, with what, and when."""

import datetime
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from engine import versions

from .records import SCHEMA_VERSION

# The checkout the experiments run from: its git state is what every record names.
REPO_ROOT = Path(__file__).resolve().parent.parent


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def git_state(root=REPO_ROOT) -> dict:
    if os.environ.get("TITAN_COMMIT"):
        # A copy of the tree on another machine: the launcher says what it sent (a .git that
        # travelled with the copy may be stale; seen on the GPU machine).
        return {
            "commit": os.environ["TITAN_COMMIT"],
            "dirty": os.environ.get("TITAN_DIRTY", "").lower() in ("1", "true", "yes"),
        }

    def run(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

    try:
        commit = run("rev-parse", "HEAD").stdout.strip() or None
        dirty = bool(run("status", "--porcelain", "--untracked-files=no").stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"commit": commit, "dirty": dirty}


def host_alias() -> str:
    """A stable alias for this machine that names neither the host nor its user."""
    try:
        machine_id = open("/etc/machine-id").read().strip()
    except OSError:
        machine_id = ""
    digest = hashlib.sha256(f"titan-host:{machine_id}:{socket.gethostname()}".encode()).hexdigest()
    return f"host-{digest[:10]}"


def chip() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            pass
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def code_digest() -> str:
    return versions.code_digest()


def nvidia() -> dict:
    """GPU name, driver and CUDA version as `nvidia-smi` reports them (no serials or UUIDs)."""
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    line = q.stdout.strip().splitlines()[0] if q.stdout.strip() else ""
    if line:
        name, driver, mem = (x.strip() for x in line.split(",")[:3])
        out.update(gpu=name, driver=driver, gpu_memory=mem)
    m = re.search(r"CUDA Version:\s*([0-9.]+)", head)
    if m:
        out["cuda"] = m.group(1)
    return out


def device() -> dict:
    dev = mx.default_device()
    out = {"device": "gpu" if dev.type == mx.DeviceType.gpu else "cpu"}
    if out["device"] == "gpu":
        try:
            info = mx.device_info()
            out["gpu"] = info.get("device_name") or info.get("architecture")
        except Exception:
            pass
        out.update(nvidia())
    return out


def environment() -> dict:
    env = {
        "host": host_alias(),
        "chip": chip(),
        "cores": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "os": platform.system(),
        "os_version": platform.release() if sys.platform != "darwin" else platform.mac_ver()[0],
        "python": platform.python_version(),
        "versions": versions.versions(),
    }
    env.update(device())
    return env


def portable_command(command) -> str:
    """The command as anyone could type it again, naming no path of the machine that ran it:
    a package's `__main__.py` as `python -m PACKAGE`, the interpreter as `python`, a path inside
    this checkout relative to it, one under the home folder from `~`."""
    if isinstance(command, str):
        return command
    parts = [str(p) for p in command]
    if parts and parts[0].endswith("__main__.py"):
        parts[:1] = ["python", "-m", Path(parts[0]).parent.name]
    home = str(Path.home())
    out = []
    for p in parts:
        if p == sys.executable:
            p = "python"
        elif os.path.isabs(p) and Path(p).is_relative_to(REPO_ROOT):
            p = str(Path(p).relative_to(REPO_ROOT)) or "."
        elif os.path.isabs(p) and home not in ("", "/") and p.startswith(home + os.sep):
            p = "~" + p[len(home) :]
        out.append(p)
    return " ".join(out)


# Environment variables that change what MLX computes or how it schedules it (MLX_USE_CUDA_GRAPHS=0,
# MLX_MAX_OPS_PER_BUFFER, CUDA_LAUNCH_BLOCKING=1, ...): a run made under one says so in its record.
# Where MLX keeps its compiled kernels changes nothing it computes.
NOT_SETTINGS = ("MLX_PTX_CACHE_DIR",)


def settings() -> dict:
    """The MLX and CUDA environment variables set for this run (empty where none is)."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(("MLX_", "CUDA_LAUNCH_BLOCKING", "CUDA_VISIBLE_DEVICES")) and k not in NOT_SETTINGS
    }


def stamp(result: dict, *, command, seed, config=None, started=None, **extra) -> dict:
    """One raw record: the measured `result` with full provenance (and `settings`, the MLX and
    CUDA environment variables it ran under, where any was set)."""
    ran_under = settings()
    rec = {
        "schema_version": SCHEMA_VERSION,
        "command": portable_command(command),
        **git_state(),
        **environment(),
        "seed": seed,
        "config": config or {},
        "started_utc": started or utc_now(),
        "finished_utc": utc_now(),
        **({"settings": ran_under} if ran_under else {}),
        **extra,
        "result": result,
    }
    json.dumps(rec)  # fail here, not in a reader, on anything unserialisable
    return rec
