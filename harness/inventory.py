"""The machine inventory: full raw probes kept out of version control, and the sanitised
`artifacts/environment.json` generated from them, one entry per host alias.

A probe holds what identifies a machine (host and user names, addresses, machine id, GPU
serials and UUIDs) because the alias is derived from it and a person debugging a cluster needs
it; the inventory copies only an allow-list of fields, then checks that no identifying value
of any probe appears anywhere in its text. Machines that wrote raw records but were never
probed here (a borrowed GPU, say) enter from their records' provenance, which is sanitised
at the source.
"""

import getpass
import json
import os
import re
import socket
import subprocess
from pathlib import Path

from engine.config import resources_dir

from . import provenance, records

SCHEMA_VERSION = 1
KEEP = (
    "chip",
    "cores",
    "memory_bytes",
    "os",
    "os_version",
    "python",
    "versions",
    "device",
    "gpu",
    "driver",
    "cuda",
    "gpu_memory",
)
IDENTIFYING = ("hostname", "fqdn", "user", "machine_id", "addresses", "macs", "gpu_serials", "gpu_uuids")


class InventoryError(ValueError):
    """An inventory that would leak an identifying value, or a probe that cannot be read."""


def probes_dir() -> Path:
    return resources_dir() / "probes"


def _addresses():
    addrs, macs = set(), set()
    try:
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        addrs.update(re.findall(r"inet6? ([0-9a-fA-F:.]+)/", out))
        out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
        macs.update(m for m in re.findall(r"link/\w+ ([0-9a-f:]{17})", out) if m != "00:00:00:00:00:00")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        addrs.update(i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return sorted(addrs), sorted(macs)


def _gpu_ids():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=serial,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [], []
    rows = [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if "," in line]
    return [r[0] for r in rows if r[0] not in ("", "[N/A]")], [r[1] for r in rows]


def probe() -> dict:
    """Everything about this machine, identifying fields included (never committed)."""
    addrs, macs = _addresses()
    serials, uuids = _gpu_ids()
    try:
        machine_id = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine_id = None
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = None
    return dict(
        schema_version=SCHEMA_VERSION,
        probed_utc=provenance.utc_now(),
        alias=provenance.host_alias(),
        hostname=socket.gethostname(),
        fqdn=socket.getfqdn(),
        user=user,
        machine_id=machine_id,
        addresses=addrs,
        macs=macs,
        gpu_serials=serials,
        gpu_uuids=uuids,
        **provenance.environment(),
    )


def write_probe(out=None) -> Path:
    p = probe()
    path = Path(out) if out else probes_dir() / f"{p['alias']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(p, indent=2, sort_keys=True))
    os.replace(tmp, path)  # a probe is a snapshot of now, not an append-only record
    return path


def _secrets(probe_rec) -> set:
    vals = set()
    for k in IDENTIFYING:
        v = probe_rec.get(k)
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, str) and len(x) >= 3 and x not in ("127.0.0.1", "::1", "localhost"):
                vals.add(x)
    return vals


def entry(rec, source) -> dict:
    out = {k: rec[k] for k in KEEP if rec.get(k) is not None}
    out["source"] = source
    return out


def build(probes, records, existing=None) -> dict:
    """The inventory {alias: entry}: earlier entries kept, probed machines refreshed, and any
    alias that only raw records name added from their provenance."""
    machines = dict((existing or {}).get("machines", {}))
    for rec in records:
        alias = rec.get("host")
        if alias and alias not in machines:
            machines[alias] = entry(rec, "raw records")
    for p in probes:
        machines[p["alias"]] = entry(p, "probe")
    inv = dict(schema_version=SCHEMA_VERSION, machines=dict(sorted(machines.items())))
    text = json.dumps(inv, sort_keys=True)
    for p in probes:
        for secret in _secrets(p):
            if secret in text:
                raise InventoryError(f"probe of {p['alias']}: an identifying value would enter the inventory")
    return inv


def load_probes(folder=None) -> list:
    folder = Path(folder) if folder else probes_dir()
    out = []
    for f in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            out.append(json.loads(f.read_text()))
        except json.JSONDecodeError as e:
            raise InventoryError(f"{f}: line {e.lineno}: not a probe ({e.msg})") from None
    return out


def update(path, raw_root, probes_folder=None) -> dict:
    """Regenerate `path` (artifacts/environment.json) from the probes and the raw logs."""
    path = Path(path)
    existing = json.loads(path.read_text()) if path.exists() else None
    recs = records.read([Path(raw_root)]) if Path(raw_root).exists() else []
    inv = build(load_probes(probes_folder), recs, existing)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(inv, indent=2, sort_keys=True) + "\n")
    return inv
