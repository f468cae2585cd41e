#!/usr/bin/env bash
# Side by side: one command run from two commits, alternating (A B, B A, A B, ...), REPEATS times
# each, so that drift on a noisy machine falls on both alike. Prints each run's output under a
# header naming its commit. Raw records a run writes (`--record`) land in its worktree's
# results/raw/ stamped with its commit, and are copied into this checkout's results/raw/.
#   scripts/ab_commits.sh A B REPEATS -- python -m harness bench prefetch --model olmoe-tiny-f32 ...
# Each commit runs from its own git worktree (under $TMPDIR), with this checkout's Python and
# resources folder ($TITAN_RESOURCES, else this checkout's resources/), so both read the same
# models, stores and fits. A command starting with `python` runs this checkout's .venv/bin/python.
# Records of `bench prefetch` are then summarised side by side (scripts/ab_summary.py).
set -euo pipefail
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
  echo "usage: $0 COMMIT_A COMMIT_B REPEATS -- COMMAND..." >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
a=$(git -C "$root" rev-parse --verify "$1^{commit}")
b=$(git -C "$root" rev-parse --verify "$2^{commit}")
repeats=$3
shift 4
case "$repeats" in '' | *[!0-9]* | 0) echo "REPEATS must be a positive integer, not '$repeats'" >&2; exit 2 ;; esac
# `python` is this environment's Python: $PYTHON, else the first python3 on the PATH (never a fixed .venv)
py=${PYTHON:-$(command -v python3 || command -v python)}
[ "$1" = python ] && set -- "$py" "${@:2}"
export TITAN_RESOURCES=${TITAN_RESOURCES:-$root/resources}
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/a" 2>/dev/null; git -C "$root" worktree remove --force "$work/b" 2>/dev/null; rm -rf "$work"' EXIT
git -C "$root" worktree add -q --detach "$work/a" "$a"
git -C "$root" worktree add -q --detach "$work/b" "$b"
touch "$work/started"
for i in $(seq 1 "$repeats"); do
  order="a b"
  [ $((i % 2)) -eq 0 ] && order="b a"
  for side in $order; do
    commit=$a
    [ "$side" = b ] && commit=$b
    echo "== run $i, ${side^^} ${commit:0:12}"
    (cd "$work/$side" && "$@")
    if [ -d "$work/$side/results/raw" ]; then  # new files only: results/raw is append-only
      (cd "$work/$side/results/raw" && find . -type f -newer "$work/started" -print -exec cp --parents -n {} "$root/results/raw/" \;) \
        >> "$work/copied"
    fi
  done
done
# Prefetch benches: their figures side by side, per commit, from the records just copied.
if grep -q '^\./bench/prefetch/' "$work/copied" 2>/dev/null; then
  echo "== side by side (scripts/ab_summary.py)"
  grep '^\./bench/prefetch/' "$work/copied" | sort -u | sed "s|^\./|$root/results/raw/|" | xargs "$py" "$root/scripts/ab_summary.py"
fi
