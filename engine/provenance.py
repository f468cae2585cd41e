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
from importlib import metadata

from .registry import REPO_ROOT

SCHEMA_VERSION = 1


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def git_state(root=REPO_ROOT) -> dict:
    if os.environ.get("TITAN_COMMIT"):
        # A copy of the tree on another machine: the launcher says what it sent (a .git that
        # travelled with the copy may be stale; seen on the GPU machine).
        return {"commit": os.environ["TITAN_COMMIT"],
                "dirty": os.environ.get("TITAN_DIRTY", "").lower() in ("1", "true", "yes")}

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
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
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


def _version(pkg):
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        if pkg == "titan-engine":  # run from a source tree that was not pip-installed
            from . import __version__

            return __version__
        return None


def code_digest(root=REPO_ROOT) -> str:
    """A digest of the engine's source files: two nodes with the same version number but
    different code differ here."""
    h = hashlib.sha256()
    for f in sorted((root / "engine").glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def nvidia() -> dict:
    """GPU name, driver and CUDA version as `nvidia-smi` reports them (no serials or UUIDs)."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
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
    import mlx.core as mx

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
        "versions": {p: _version(p) for p in ("mlx", "mlx-lm", "numpy", "titan-engine")},
    }
    if _version("mlx-cuda-13"):
        env["versions"]["mlx-cuda-13"] = _version("mlx-cuda-13")
    env.update(device())
    return env


def stamp(result: dict, *, command, seed, config=None, started=None, **extra) -> dict:
    """One raw record: the measured `result` with full provenance."""
    rec = {
        "schema_version": SCHEMA_VERSION,
        "command": command if isinstance(command, str) else " ".join(command),
        **git_state(),
        **environment(),
        "seed": seed,
        "config": config or {},
        "started_utc": started or utc_now(),
        "finished_utc": utc_now(),
        **extra,
        "result": result,
    }
    json.dumps(rec)  # fail here, not in a reader, on anything unserialisable
    return rec
