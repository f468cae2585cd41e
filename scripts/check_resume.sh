#!/usr/bin/env bash
# Resuming under a per-job executor: the smoke run through cluster-generic (every job in a fresh
# Snakemake, as on SLURM) is killed once its first raw file exists, then run again. The second
# invocation must keep that file as it was, measure only what is missing, and finish.
# Usage: scripts/check_resume.sh [RUN]   (from the repository root, in its virtual environment)
set -euo pipefail
run=${1:-resume-$(date -u +%Y%m%dT%H%M%S)}
smk=(.venv/bin/snakemake --executor cluster-generic --cluster-generic-submit-cmd bash --jobs 1 smoke
     --config "run=$run")
raw=results/smoke/raw
mkdir -p results/logs
setsid "${smk[@]}" > results/logs/resume-first.log 2>&1 &
pid=$!
first=""
for _ in $(seq 900); do
  first=$(find "$raw" -name "$run*.jsonl" 2> /dev/null | head -1)
  [ -n "$first" ] && break
  sleep 1
done
[ -n "$first" ] || { echo "no raw file of run $run appeared" >&2; kill -- -"$pid"; exit 1; }
kill -- -"$pid"  # the whole process group: Snakemake and the job it was running
wait "$pid" 2> /dev/null || true
before=$(stat -c '%i %Y %s' "$first"; sha256sum < "$first")
n_before=$(find "$raw" -name "$run*.jsonl" | wc -l)
echo "killed run $run with $n_before raw file(s) written, first $first"
"${smk[@]}" > results/logs/resume-second.log 2>&1
after=$(stat -c '%i %Y %s' "$first"; sha256sum < "$first")
[ "$before" = "$after" ] || { echo "resuming rewrote $first" >&2; exit 1; }
grep -q "Missing output files: $first" results/logs/resume-second.log && { echo "$first measured again" >&2; exit 1; }
n_after=$(find "$raw" -name "$run*.jsonl" | wc -l)
echo "resumed run $run: $first kept as it was; $n_after raw files now (was $n_before)"
