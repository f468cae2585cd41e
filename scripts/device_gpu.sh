#!/usr/bin/env bash
# How the committed GPU results were made: on a Linux machine with one NVIDIA GPU whose Python
# has MLX's CUDA backend importable (here the H200 of the development `device` tool, where
# mlx[cuda13], mlx-lm and Snakemake's wheels were carried into /tmp/site). On your own GPU
# machine, install as README's "On an NVIDIA GPU" says and run the same commands.
#
# Usage: TITAN_COMMIT=$(git rev-parse HEAD) scripts/device_gpu.sh OUTDIR
#   writes OUTDIR/raw.tgz with every new raw file after each step. Measured on the H200: the
#   benches take ~4 min with the model and store builds, the exactness tests ~5.5 min, the gpu
#   profile's trained-model half of gate C ~3 min; of the full-size half, the general prompts
#   with their fits ~11 min and the sync ablation ~2.5 min (builds and traces ~5.5 min more).
set -uo pipefail
out=${1:?usage: scripts/device_gpu.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
marker=$(mktemp)
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
collect() {
  # Copied out after every step: the development device re-syncs the tree at each call and
  # drops untracked files, new raw logs included (lost once, 2026-11-30).
  find results/raw -type f -newer "$marker" | sort > "$out/new-raw.txt"
  tar czf "$out/raw.tgz" -T "$out/new-raw.txt" 2>/dev/null
  log "collected $(wc -l < "$out/new-raw.txt") raw files"
}
step() {  # a failed step is logged and the next one still runs
  log "$*"
  "$@" || log "FAILED ($?): $*"
  collect
}
log "device: $($py -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step $py -m engine bench install --record --repeats 3
step $py -m engine bench throughput --model olmoe-1b-7b-shape --tokens 32 --repeats 3 --slots 16 --record
step $py -m engine bench miss --repeats 2 --readers 1 4 --record
step $py -m engine bench prefetch --model olmoe-1b-7b-shape --slots 16 --predictors oracle probe transition \
  --depths 1 --prompts 2 --tokens 16 --record
step $py -m snakemake --profile profiles/gpu --scheduler greedy gate_b gate_c
step $py -m pytest -q -x tests/test_exactness.py -p no:cacheprovider
