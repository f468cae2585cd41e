"""Provenance stamped on every raw record: what ran, where, with what, and when."""

import datetime
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

from .registry import REPO_ROOT

SCHEMA_VERSION = 1


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def git_state(root=REPO_ROOT) -> dict:
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
        return None


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
