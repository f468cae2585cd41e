"""The command line, as a user runs it."""

import subprocess
import sys

import pytest

from engine import registry


def run(*args):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          cwd=registry.REPO_ROOT, timeout=600)


def test_decode_prints_text_and_tok_s():
    r = run("decode", "--model", "olmoe-tiny", "--slots", "16", "--tokens", "8", "--prompt", "import os")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("import os")
    line = next(l for l in r.stdout.splitlines() if "tok/s" in l)
    assert "S=16/64" in line and "hit rate" in line
    assert "per miss: pread" in r.stdout


def test_decode_cold_tier():
    r = run("decode", "--model", "qwen3moe-tiny", "--slots", "32", "--tokens", "4", "--tier", "cold")
    assert r.returncode == 0, r.stderr
    assert "tier=cold" in r.stdout and "tok/s" in r.stdout


@pytest.mark.parametrize("sub", ["", "list", "build", "pin", "store", "decode", "bench"])
def test_help(sub):
    r = run(*([sub] if sub else []), "--help")
    assert r.returncode == 0 and "usage" in r.stdout


def test_slots_below_top_k_are_refused():
    r = run("decode", "--model", "olmoe-tiny", "--slots", "4", "--tokens", "2")
    assert r.returncode == 2
    assert "slots (4) < top_k (8)" in r.stderr


def test_unknown_model():
    r = run("decode", "--model", "nope", "--tokens", "2")
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr


def test_real_model_without_weights():
    r = run("decode", "--model", "qwen3-30b-a3b-4bit", "--tokens", "2")
    assert r.returncode == 2 and "python -m engine pin qwen3-30b-a3b-4bit" in r.stderr
