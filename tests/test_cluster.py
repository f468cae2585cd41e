"""Several machines: the node setup script on two loopback "hosts", the sanitised environment
inventory, and the SLURM profile's dry run (no scheduler exists here)."""

import json
import os
import subprocess

import pytest
from conftest import ROOT, needs_git, snakemake

from harness import inventory, provenance, records

SETUP = ROOT / "scripts" / "cluster_setup.sh"


def setup(hostfile, *args, env=None):
    env = {**os.environ, "TITAN_REMOTE_SHELL": "bash -c", **(env or {})}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        ["bash", str(SETUP), str(hostfile), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
        stdin=subprocess.DEVNULL,
    )


@needs_git  # the script syncs the committed code to each host
@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_setup_two_loopback_hosts_then_refuse_one_that_differs(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(
        json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}])
    )
    dest = tmp_path / "nodes" / "{host}"
    r = setup(hostfile, "--dest", str(dest))
    assert r.returncode == 0, r.stdout + r.stderr
    for host in ("127.0.0.1", "localhost"):
        node = tmp_path / "nodes" / host
        assert (node / "engine" / "runtime" / "engine.py").exists() and (node / ".venv" / "bin" / "python").exists()
        assert not (node / "resources").exists()  # code only, nothing built
    versions = [
        json.loads(line.split("] ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("[") and "{" in line
    ]
    assert len(versions) == 2 and versions[0]["versions"] == versions[1]["versions"]
    assert versions[0]["versions"]["mlx"] == "0.32.4" and versions[0]["device"] in ("cpu", "gpu")
    assert "all hosts agree" in r.stdout

    # A node whose engine code differs (same version number) is refused by name.
    runtime = tmp_path / "nodes" / "localhost" / "engine" / "runtime" / "engine.py"
    runtime.write_text(runtime.read_text() + "\n# edited on this node only\n")
    r = setup(hostfile, "--dest", str(dest), "--check-only")
    assert r.returncode != 0
    assert "host localhost differs from 127.0.0.1" in r.stderr and "engine-code" in r.stderr


@needs_git
def test_hosts_are_set_up_at_once_and_a_failing_one_is_named_while_the_others_finish(tmp_path):
    """Every host's setup runs at the same time; one that fails is named, and every other host's
    lines still come out whole, in the hostfile's order. (A remote shell stands in for ssh: `slow`
    takes a second a command, `bad` cannot be reached.)"""
    remote = tmp_path / "remote"
    remote.write_text(
        '#!/usr/bin/env bash\nhost=$1; shift\n[ "$host" = bad ] && exit 3\ncat > /dev/null\n'
        '[ "$host" = slow ] && sleep 1\nexit 0\n'
    )
    remote.chmod(0o755)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": h, "ips": ["127.0.0.1"]} for h in ("slow", "bad", "fast")]))
    r = setup(hostfile, "--dest", str(tmp_path / "{host}"), env={"TITAN_REMOTE_SHELL": f"{remote} {{host}}"})
    assert r.returncode != 0
    assert "error: host bad: cannot reach it" in r.stderr
    lines = [line.split("]")[0] for line in r.stdout.splitlines() if line.startswith("[")]
    assert lines == ["[slow", "[slow", "[bad", "[fast", "[fast"]  # each host's lines together, in order


def test_setup_refuses_a_malformed_hostfile(tmp_path):
    bad = tmp_path / "hosts.json"
    bad.write_text('{"ssh": "node1"}')
    r = setup(bad, "--check-only")
    assert r.returncode != 0 and f"{bad}: not an mlx.launch hostfile" in r.stderr


def test_setup_names_an_unreachable_host(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "nowhere", "ips": ["127.0.0.1"]}]))
    r = setup(hostfile, "--dest", str(tmp_path / "x"), env={"TITAN_REMOTE_SHELL": "false {host}"})
    assert r.returncode != 0 and "host nowhere" in r.stderr


SECRETS = dict(
    hostname="ws-alice-7f3a.corp.example",
    fqdn="ws-alice-7f3a.corp.example",
    user="alice.smith",
    machine_id="5f2d7c1e9a8b4c3d2e1f0a9b8c7d6e5f",
    addresses=["10.12.34.56", "fe80::1ff:fe23:4567:890a"],
    macs=["3c:22:fb:12:34:56"],
    gpu_serials=["1652621034567"],
    gpu_uuids=["GPU-8f2a4b6c-1d3e-4f5a-9b8c-7d6e5f4a3b2c"],
)


def fake_probe(alias="host-0123456789", **over):
    p = dict(
        schema_version=1,
        probed_utc="2026-11-30T00:00:00Z",
        alias=alias,
        **SECRETS,
        chip="AMD EPYC",
        cores=2,
        memory_bytes=1 << 34,
        os="Linux",
        os_version="6.18",
        python="3.11.7",
        versions={"mlx": "0.32.4", "mlx-lm": "0.32.2", "numpy": "2.4.6", "titan-engine": "0.1.0"},
        device="cpu",
    )
    p.update(over)
    return p


def test_nothing_identifying_survives_sanitising():
    inv = inventory.build([fake_probe()], [])
    text = json.dumps(inv)
    for v in SECRETS.values():
        for x in v if isinstance(v, list) else [v]:
            assert x not in text, f"{x} leaked into the inventory"
    assert inv["machines"]["host-0123456789"]["chip"] == "AMD EPYC"
    assert set(inv["machines"]["host-0123456789"]) <= set(inventory.KEEP) | {"source"}


def test_an_allowed_field_carrying_a_secret_is_refused():
    with pytest.raises(inventory.InventoryError, match="identifying value"):
        inventory.build([fake_probe(chip="AMD EPYC on ws-alice-7f3a.corp.example")], [])


def test_this_machines_probe_is_full_and_its_entry_sanitised(tmp_path):
    path = inventory.write_probe(tmp_path / "probe.json")
    p = json.loads(path.read_text())
    assert p["alias"] == provenance.host_alias() and p["hostname"]
    inv = inventory.build([p], [])
    assert p["hostname"] not in json.dumps(inv) and p["alias"] in inv["machines"]


def test_every_raw_records_host_resolves_in_the_committed_inventory():
    inv = json.loads((ROOT / "artifacts" / "environment.json").read_text())
    aliases = {r["host"] for r in records.read([ROOT / "results" / "raw"])}
    assert aliases and aliases <= set(inv["machines"]), aliases - set(inv["machines"])


def test_slurm_profile_dry_run():
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="needs Snakemake's SLURM executor plugin")
    r = snakemake("-n", "--profile", "profiles/slurm", "all")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "profiles/slurm" in out
    assert "slurm_partition=compute" in out and "slurm_extra=--exclusive" in out  # per-rule resources applied
