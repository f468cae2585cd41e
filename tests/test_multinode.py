"""Multi-node expert execution over mx.distributed (ring backend, local processes as nodes):
bit-identical logits with 2 and 3 nodes on both architectures; a dead or absent node fails the
run in bounded time, by name."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from engine import registry

from conftest import PROMPT
from test_exactness import max_abs_diff

ROOT = registry.REPO_ROOT
LAUNCH = [sys.executable, "-m", "mlx._distributed_utils.launch"]


def launch(n, *args, timeout=300):
    cmd = [os.path.join(os.path.dirname(sys.executable), "mlx.launch"), "--backend", "ring", "-n", str(n),
           "--", sys.executable, str(ROOT / "engine" / "dist_run.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("model_id", ["olmoe-tiny", "qwen3moe-tiny"])
def test_bit_identical_to_one_node(reference, tmp_path, model_id, nodes):
    ref = reference(model_id, steps=8)
    forced = tmp_path / "forced.npy"
    np.save(forced, np.array(ref["tokens"]))
    out = tmp_path / "run.npz"
    r = launch(nodes, "--model", model_id, "--prompt", PROMPT, "--tokens", "8", "--forced", str(forced),
               "--out", str(out), "--timeout", "120")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    z = np.load(out)
    assert [int(t) for t in z["prompt"]] == ref["ids"]
    logits = [z[f"logits_{i}"] for i in range(len(ref["logits"]))]
    assert max_abs_diff(ref["logits"], logits) == 0.0
    import json

    figures = json.loads(str(z["figures"]))
    assert figures["nodes"] == nodes and figures["bytes_sent"] > 0 and figures["rtt_ms_median"] > 0
    assert figures["remote_share"] == pytest.approx((nodes - 1) / nodes, abs=0.02)


@pytest.mark.timeout(240)
def test_a_node_that_never_joins_fails_the_run_by_name(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[{"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]')
    env = dict(os.environ, MLX_RANK="0", MLX_WORLD_SIZE="2", MLX_HOSTFILE=str(hostfile))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "engine" / "dist_run.py"), "--model", "qwen3moe-tiny",
                        "--timeout", "8"], cwd=ROOT, capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 120
    assert "did not answer" in r.stderr or "node" in r.stderr


@pytest.mark.timeout(300)
def test_a_node_that_dies_mid_run_fails_the_run_by_name(tmp_path):
    cmd = [os.path.join(os.path.dirname(sys.executable), "mlx.launch"), "--backend", "ring", "-n", "2", "--",
           sys.executable, str(ROOT / "engine" / "dist_run.py"), "--model", "olmoe-tiny", "--tokens", "400",
           "--timeout", "20"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    time.sleep(25)  # both ranks up and decoding
    out = subprocess.run(["pgrep", "-f", "dist_run.py"], capture_output=True, text=True).stdout.split()
    victims = [int(pid) for pid in out if int(pid) != p.pid]
    # the rank-1 process: the one that is not the launcher nor rank 0 (rank 0 is the elder)
    assert len(victims) >= 2
    os.kill(max(victims), signal.SIGKILL)
    t0 = time.monotonic()
    stdout, stderr = p.communicate(timeout=200)
    assert time.monotonic() - t0 < 120
    assert p.returncode != 0
    assert "node 1" in stderr or "rank 1" in stderr or "Node with rank 1" in stderr
