#!/usr/bin/env bash
# Resuming under a per-job executor: the smoke run (`snakemake --directory .test`, the workflow
# at its tiniest inside .test/) through cluster-generic (every job in a fresh Snakemake, as on
# SLURM) is killed once the job that wrote its first raw file has finished, then run again. The
# second invocation must keep that file as it was, measure only what is missing, and finish.
# Usage: scripts/check_resume.sh [RUN]   (from the repository root, in its virtual environment)
set -euo pipefail
run=${1:-resume-$(date -u +%Y%m%dT%H%M%S)}
smk=(.venv/bin/snakemake --directory .test --executor cluster-generic --cluster-generic-submit-cmd bash
     --jobs 1 --config "run=$run")
raw=.test/results/raw
mkdir -p results/logs
setsid "${smk[@]}" > results/logs/resume-first.log 2>&1 &
pid=$!
# The outer Snakemake's progress lines ("k of N steps"); each job's inner Snakemake prints "1 of 1".
outer_done() { grep -cE '^[0-9]+ of ([2-9]|[0-9]{2,}) steps' results/logs/resume-first.log || true; }
first=""
for _ in $(seq 900); do
  # find fails while $raw does not exist yet (a fresh clone); that is "not yet", not an error.
  first=$(find "$raw" -name "$run*.jsonl" 2> /dev/null | head -1 || true)
  [ -n "$first" ] && break
  sleep 1
done
[ -n "$first" ] || { echo "no raw file of run $run appeared" >&2; kill -- -"$pid"; exit 1; }
# The file exists once its job has written it, but the job is done only when the outer Snakemake
# says so; killed before that, Snakemake rightly removes it as possibly corrupt. With --jobs 1 the
# next progress line is that job's.
done0=$(outer_done)
for _ in $(seq 300); do
  [ "$(outer_done)" -gt "$done0" ] && break
  sleep 1
done
[ "$(outer_done)" -gt "$done0" ] || { echo "the job writing $first never finished" >&2; kill -- -"$pid"; exit 1; }
kill -- -"$pid"  # the whole process group: Snakemake and the job it was running
wait "$pid" 2> /dev/null || true
[ -f "$first" ] || { echo "Snakemake removed $first although its job had finished" >&2; exit 1; }
before=$(stat -c '%i %Y %s' "$first"; sha256sum < "$first")
n_before=$(find "$raw" -name "$run*.jsonl" | wc -l)
echo "killed run $run with $n_before raw file(s) written, first $first"
# A failing resume prints its own log's end: CI shows only what this script prints.
"${smk[@]}" > results/logs/resume-second.log 2>&1 || {
  echo "resuming run $run failed; the end of results/logs/resume-second.log:" >&2
  grep -nE -B2 -A12 "^(Error|.*Exception|WorkflowError)" results/logs/resume-second.log | tail -60 >&2
  tail -20 results/logs/resume-second.log >&2
  for log in $(grep -oE "log: \S+" results/logs/resume-second.log | awk '{print $2}' | sort -u); do
    log=.test/$log  # the jobs' paths are relative to the working directory
    [ -s "$log" ] && grep -qiE "error|traceback" "$log" && { echo "--- $log" >&2; tail -30 "$log" >&2; }
  done
  exit 1
}
after=$(stat -c '%i %Y %s' "$first"; sha256sum < "$first")
[ "$before" = "$after" ] || { echo "resuming rewrote $first" >&2; exit 1; }
grep -q "Missing output files: ${first#.test/}" results/logs/resume-second.log && { echo "$first measured again" >&2; exit 1; }
n_after=$(find "$raw" -name "$run*.jsonl" | wc -l)
echo "resumed run $run: $first kept as it was; $n_after raw files now (was $n_before)"
