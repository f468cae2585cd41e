#!/usr/bin/env bash
# The library as a user installs it: a wheel (not editable) in a fresh virtual environment, used
# from a directory that is not this checkout, from the command line and from Python.
# Usage: scripts/check_install.sh   (about a minute with a package index at hand)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip wheel -q --no-deps -w "$tmp/wheel" "$root"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$tmp"/wheel/*.whl
cd "$tmp"
export TITAN_RESOURCES="$tmp/resources"
"$tmp/venv/bin/python" -m engine list > "$tmp/models.txt"
grep -q '^qwen3moe-tiny ' "$tmp/models.txt"
grep -q '^tiny-mixtral ' "$tmp/models.txt"  # the packaged architectures file travels with the wheel
"$tmp/venv/bin/python" -m engine decode --model qwen3moe-tiny --slots 16 --tokens 4 --prompt "def main():" | tail -2
"$tmp/venv/bin/python" - <<'PY'
import pathlib

import engine

assert "site-packages" in engine.__file__, engine.__file__  # the installed copy, not the checkout
eng = engine.load("qwen3moe-tiny", slots=16, predictor="previous")
try:
    ids = eng.tokenizer.encode("def fibonacci(n):")
    tokens, steps, _ = engine.decode(eng.model, ids, 4)
    s = engine.summarize(steps)
    assert len(tokens) == 5 and s["misses"] > 0, s
finally:
    eng.close()
assert (pathlib.Path.cwd() / "resources" / "models" / "qwen3moe-tiny").is_dir()
print(f"installed engine {engine.__version__} decodes from {pathlib.Path.cwd()}: {s['tok_s']:.1f} tok/s")
PY
