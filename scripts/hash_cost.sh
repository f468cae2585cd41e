#!/usr/bin/env bash
# What a process's first load pays to hash a model's files (engine/models/embedded.py,
# verify_files), cold (page cache dropped: needs root) and warm, interleaved, 3 repeats; then the
# bare cold read and sha256's rate in memory, to split the time between the disk and the hash.
#   scripts/hash_cost.sh [MODEL]     (default olmoe-1b-7b-shape, built first if needed)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-olmoe-1b-7b-shape}
py=${PYTHON:-.venv/bin/python}
dir=$("$py" -c "from engine.models import registry; print(registry.model_dir('$model'))")
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
for r in 1 2 3; do
  for mode in cold warm; do
    [ "$mode" = cold ] && drop
    "$py" -c "
import time
from engine.models import registry
t = time.perf_counter(); registry.model_dir('$model'); a = time.perf_counter() - t
t = time.perf_counter(); registry.model_dir('$model'); b = time.perf_counter() - t
print('$mode: first load %.2f s, second %.2f ms' % (a, b * 1e3))"
  done
done
drop
TIMEFORMAT="cold read of $(du -sh "$dir" | cut -f1) (cat): %R s"
time cat "$dir"/* > /dev/null
"$py" -c "
import hashlib, time
b = bytes(1 << 30); t = time.perf_counter(); hashlib.sha256(b).hexdigest()
print('sha256 of 1 GiB in memory: %.2f s' % (time.perf_counter() - t))"
