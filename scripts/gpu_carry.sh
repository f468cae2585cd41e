#!/usr/bin/env bash
# Prepares what the development `device` tool's GPU machine needs for scripts/device_gpu.sh, as
# three carries (its image has Python 3.12 and CUDA 13 but no registry; docs/gpu.md, "Next on a GPU"):
#   .gpu1  the first part of MLX's CUDA wheel          call 1: cp .gpu1/part.aa /root/part.aa
#   .gpu3  Snakemake and the engine's other imports,   call 2: mkdir -p /root/gpu3 && cp .gpu3/* /root/gpu3/
#          the CUDA wheel's last part
#          (with resources/ptx-cache.tgz where an earlier run's OUTDIR/ptx.tgz was kept: MLX's compiled
#          kernels, which scripts/device_gpu.sh primes its cache with)
#   .gpu2  the wheel's second part, mlx, mlx-lm        call 3: bash .gpu2/install.sh && python3 -m pip install -q \
#            --no-index --no-deps --no-compile --target /tmp/site2 /root/gpu3/*.whl && export PYTHONPATH=/tmp/site:/tmp/site2 && ...
# A call carries at most 64 MiB together with the working tree, so everything but MLX's own wheels
# goes in .gpu3; this script says what each call will carry and fails when one is over.
#
# Usage, from the repository root: scripts/gpu_carry.sh   (about 3 minutes; needs the registry)
#   WHEELS: the wheel script (default ../shared/tools/mlx-cuda-wheels.sh, the development machine's)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
wheels=${WHEELS:-../shared/tools/mlx-cuda-wheels.sh}
[[ -f $wheels ]] || { echo "no wheel script at $wheels (set WHEELS)" >&2; exit 2; }
# The server tests' client (openai and what it imports) and the property tests' hypothesis.
EXTRA="openai httpx httpx2 httpcore httpcore2 h11 anyio sniffio idna certifi distro jiter pydantic pydantic-core
  annotated-types typing-extensions typing-inspection truststore hypothesis sortedcontainers ${EXTRA:-}" bash "$wheels"
# The call that waits on detached steps (scripts/device_gpu.sh, DETACH=1) is call 3 again: its
# install.sh must leave an installed site alone, or the running tests lose MLX under them (SIGBUS).
grep -q '^rm -rf /tmp/site$' .gpu2/install.sh || { echo ".gpu2/install.sh: no 'rm -rf /tmp/site' to guard" >&2; exit 1; }
sed -i 's|^rm -rf /tmp/site$|[ -f /tmp/site/.installed ] \&\& { echo "mlx already in /tmp/site"; exit 0; }\n&|' .gpu2/install.sh
echo 'touch /tmp/site/.installed' >>.gpu2/install.sh
scripts/snakemake_wheels.sh .gpu3
for w in .gpu2/*.whl; do
  case $(basename "$w") in
    mlx-* | mlx_lm-*) ;;  # .gpu2/install.sh installs these beside the CUDA part
    *) mv "$w" .gpu3/ ;;
  esac
done
# The wheel script splits MLX's CUDA part in two of 38 MiB, which with the tree (26 MiB and
# growing with results/raw) left call 1 at the limit; three parts of at most 30 MiB, the last
# in .gpu3, which call 2 puts in /root/gpu3.
cat .gpu1/part.aa .gpu2/part.ab > .gpu1/cuda.tar.xz && rm .gpu1/part.aa .gpu2/part.ab
(cd .gpu1 && split -b 30m cuda.tar.xz part. && rm cuda.tar.xz)
mv .gpu1/part.ab .gpu2/ && mv .gpu1/part.a[c-z] .gpu3/
grep -q '^cat /root/part.aa "$here"/part.ab |' .gpu2/install.sh || { echo ".gpu2/install.sh: no join of two parts" >&2; exit 1; }
sed -i 's|^cat /root/part.aa "$here"/part.ab |cat /root/part.aa "$here"/part.ab /root/gpu3/part.a[c-z] |' .gpu2/install.sh
mib() { echo $((($1 + 1048575) / 1048576)); }
# What a call takes along besides its carry: tracked files and untracked ones git does not ignore.
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
over=0
for d in .gpu1 .gpu3 .gpu2; do
  size=$(($(du -sb "$d" | cut -f1) + tree))
  [[ $d == .gpu3 && -f resources/ptx-cache.tgz ]] && size=$((size + $(du -sb resources/ptx-cache.tgz | cut -f1)))
  echo "call with $d: $(mib "$size") MiB of 62 (the tree $(mib "$tree") MiB)"
  # 62, not the limit's 64: the device tool counts what travels its own way, and refused a call
  # this sum put at 63.7 MiB (2026-12-08)
  ((size <= 62 * 1048576)) || over=1
done
((over == 0)) || { echo "a call is over 62 MiB: move wheels from .gpu2 to .gpu3, or carry less" >&2; exit 1; }
echo "ready: the three calls above, in that order, within 30 s of each other (the machine goes cold)"
