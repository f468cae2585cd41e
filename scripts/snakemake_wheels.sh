#!/usr/bin/env bash
# Snakemake and what it needs, as wheels for a Python 3.12 x86-64 machine that has no registry
# (the GPU machine of the development `device` tool, whose image lacks Snakemake): into DIR
# (default .gpu3, ignored by git), to be carried and installed there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .gpu3/*.whl
# and PYTHONPATH=/tmp/site:/tmp/site2. Builds the pure-Python wheels here (some of Snakemake's
# needs are published only as source) and takes the compiled ones for CPython 3.12. PuLP (16 MB)
# is left out: only Snakemake's ILP scheduler imports it, and scripts/device_gpu.sh uses the
# greedy one. About 12 MB.
set -euo pipefail
dir=${1:-.gpu3}
root=$(git rev-parse --show-toplevel)
cd "$root"
version=$(sed -n 's/^snakemake==//p' requirements.lock)
[[ $dir == /* ]] || grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel -q -w "$work/all" "snakemake==$version"
rm -rf "$dir" && mkdir -p "$dir"
compiled=()
for w in "$work"/all/*.whl; do
  name=$(basename "$w")
  case $name in
    pulp-* | jsonschema-* | jsonschema_specifications-* | referencing-* | rpds_py-*) ;;  # see above; the rest come with mlx's
    *-none-any.whl | *-abi3-*.whl) cp "$w" "$dir/" ;;
    *) compiled+=("$(echo "$name" | cut -d- -f1)==$(echo "$name" | cut -d- -f2)") ;;
  esac
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$dir" "${compiled[@]}"
du -sh "$dir"
echo "ready: carry $dir with the second setup call (docs/gpu.md, 'What is next')"
