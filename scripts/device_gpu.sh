#!/usr/bin/env bash
# How the committed GPU results are made: on a Linux machine with one NVIDIA GPU whose Python has
# MLX's CUDA backend importable (here the H200 of the development `device` tool, where mlx[cuda13]
# and mlx-lm were carried into /tmp/site). On your own GPU machine, install as docs/gpu.md says and
# run the same steps.
#
# Usage: TITAN_COMMIT=$(git rev-parse HEAD) scripts/device_gpu.sh OUTDIR STEP...
#   FULL=ID: the model of `build` and of the steps that say "needs build" (default olmoe-1b-7b-shape)
#   steps: tests (the GPU files of the test suite, harness/suite_scope.py's GPU_FILES, in SHARDS processes,
#   default 8, or the TESTS named, recorded as
#   results/raw/tests/suite/RUN.jsonl with the engine/ tree it ran on), tests2 (the test files TESTS2
#   names, a second record: a suite split in two where device time is short), build (the full-size model and its
#   store), miss, throughput, prefetch, fitted (prefetch with the fitted predictors and the
#   confidence floor), install, memory (peak memory at S = 16 and 32 against resident decoding),
#   syncfree (the device install beside the pinned one: throughput at S = 8, 16, 32 through
#   mlx-lm's generate_step and through the engine's loop, and the oracle's prefetch), decode16 (the
#   first of those at S = 16 alone: a change's check against the run before; needs build), oracle (that
#   prefetch alone, on a stream of its own and on the decode stream, 5 prompts; needs build),
#   batch16 (bench batch at S = 16 with the default install and the bus's limit; needs build),
#   manyrows (bench prefill and bench batch: the device install at S = 8, 16, 32 with and without the
#   next layer's area copied ahead, and pinned at S = 16, each beside resident; needs build),
#   families (bench families --record --clean --exactness: issue 49's shapes, FAMILIES picks and
#   orders them, FAMILY_REPEATS sets their repeats),
#   serve (bench serve: the engine's server batched and one at a time beside mlx_lm.server),
#   launch (scripts/probe_launch_cost.py: the host cost of one kernel launch; no record),
#   split (scripts/probe_split_calls.py on SPLIT_MODELS: whether a batched step's expert compute may
#   be split into two calls and keep mlx-lm's bits; nothing built; no record),
#   batchslots (scripts/probe_batch_slots.py on FULL: a batched decode step's misses a layer beside
#   the fewest any cache of the same slots allows; needs build; no record),
#   probe (scripts/probe_exactness.py on FULL, with MLX's CUDA graphs and without; needs build; no record),
#   peak (scripts/probe_peak.py on FULL: resident's peak memory by prompt and prefill chunk, as is and with a
#   prompt's layers in flight bounded to two; needs build; no record),
#   layer (scripts/probe_layer_cost.py: the device install's layer step taken apart, pipelined
#   decodes of FULL at LAYER_SLOTS (default 16), with MLX's CUDA graphs and without; needs build; no record),
#   design (the gpu profile's gate B, DESIGN_RUNS runs, default 3, under the run ids gpu-<commit>-rN;
#   needs Snakemake), gate_c (the gpu profile's gate C on the full-size model, both prompt sets; needs Snakemake; the
#   run id is $RUN, default gpu-<commit>; rerunning resumes it), wide (the same for olmoe-wide-trained:
#   its training on the GPU, routing, predictor quality and gate C sweep; about 3 minutes of training;
#   PSETS="general" limits it to one prompt set), variants (TESTS in one pytest process a variant of
#   the environment, side by side: VARIANTS="name:VAR=value;name2:"; no record)
# Every step writes OUTDIR/logs.tgz too: the new job logs and benchmark files, for where time went;
# and OUTDIR/ptx.tgz, MLX's compiled CUDA kernels, to prime the next machine's (PTX_CACHE, below).
# Writes OUTDIR/raw.tgz with every new raw file after each step (the development device drops
# untracked files between calls) and OUTDIR/log.txt. BUDGET=SECONDS stops a step in time for the
# collection to run before a caller's own time limit does (a step cut short is resumed by the
# next call: Snakemake keeps what finished; a sweep resumes at its first unfinished repetition).
#
# DETACH=1: the steps run in a process of their own session (setsid) in a copy of this tree at
# WORK (default /root/titan-work/tree), made at the first call, so they outlive the call on a
# machine that stays warm between calls, and the call's own limit stops no step part way. The call
# prints their log as it grows and, once they end or BUDGET is spent, brings back what they have
# made so far (OUTDIR/raw.tgz, logs.tgz, log.txt). The same command again waits on the same
# process; once it has ended, it runs the steps again in the same copy, where Snakemake resumes.
# The development device goes cold 30 s after a call returns, and takes the detached steps with it:
# call again at once (a session lost a suite run half way to a two-minute pause).
# `wide:code` and `wide:code,general` are the wide step for those prompt sets (PSETS), so that
# one detached run can do one set and then both.
set -uo pipefail
out=${1:?usage: scripts/device_gpu.sh OUTDIR STEP...}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
collect() {
  find results/raw -type f -newer "$marker" | sort > "$out/new-raw.txt"
  tar czf "$out/raw.tgz" -T "$out/new-raw.txt" 2>/dev/null
  # The jobs' logs and benchmark files say where a step's time went (not committed).
  find results/logs results/benchmarks .snakemake/log -type f -newer "$marker" 2>/dev/null | sort > "$out/new-logs.txt"
  tar czf "$out/logs.tgz" -T "$out/new-logs.txt" 2>/dev/null
  # (after a step's processes have ended, so no kernel is half written; renamed, so a reader
  # never sees half an archive)
  [[ ${DETACH:-} != 1 ]] && tar czf "$out/.ptx.tgz" -C "$MLX_PTX_CACHE_DIR" . 2>/dev/null &&
    mv "$out/.ptx.tgz" "$out/ptx.tgz"
  log "collected $(wc -l < "$out/new-raw.txt") raw files, $(wc -l < "$out/new-logs.txt") logs"
}
# MLX compiles its CUDA kernels at their first use (NVRTC) into MLX_PTX_CACHE_DIR. On a fresh
# machine every suite shard compiled the same ones at once (a shard's first decoding test took 150
# to 290 s). PTX_CACHE (default resources/ptx-cache.tgz: an earlier run's OUTDIR/ptx.tgz, which
# every collection brings back) primes an empty cache; one cache per MLX version and GPU. The
# suite's shards start from copies of it and add what they compiled (harness/suite.py).
if [[ -z ${MLX_PTX_CACHE_DIR:-} ]]; then
  mlx_version=$($py -c 'import mlx.core as mx; print(mx.__version__)' 2>/dev/null)
  gpu_arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
  MLX_PTX_CACHE_DIR=/tmp/titan-ptx/${mlx_version:-unknown}-sm${gpu_arch:-none}
fi
export MLX_PTX_CACHE_DIR
mkdir -p "$MLX_PTX_CACHE_DIR"
ptx_cache=${PTX_CACHE:-resources/ptx-cache.tgz}
if [[ -f $ptx_cache && -z $(ls -A "$MLX_PTX_CACHE_DIR") ]]; then
  tar xzf "$ptx_cache" -C "$MLX_PTX_CACHE_DIR" &&
    log "MLX's kernel cache $MLX_PTX_CACHE_DIR primed from $ptx_cache ($(ls "$MLX_PTX_CACHE_DIR" | wc -l) files)"
fi
deadline=$(($(date +%s) + ${BUDGET:-1000000}))
if [[ ${DETACH:-} == 1 ]]; then
  work=${WORK:-/root/titan-work/tree}
  state=$(dirname "$work")
  pid=$(cat "$state/pid" 2>/dev/null)
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    log "waiting on the detached steps (process $pid) in $work"
  else
    if [[ ! -d $work ]]; then  # what the steps build and measure stays in the copy between calls
      mkdir -p "$work" && touch "$state/marker"
      tar cf - --exclude=./.git --exclude=./.venv --exclude=./resources --exclude=./.snakemake \
        --exclude='./.gpu*' --exclude=./results/logs --exclude=./results/benchmarks . | tar xf - -C "$work"
    fi
    mkdir -p "$state/out"
    # Nothing of this call's (its output pipes included) stays open in the detached process.
    # The models and stores stay in this tree's resources (kept between calls while the machine is
    # warm), so that a `build` run in a call and the detached steps share one copy of a 26 GB model.
    (export TITAN_RESOURCES=${TITAN_RESOURCES:-$PWD/resources}
     cd "$work" && DETACH=child BUDGET='' MARKER="$state/marker" \
      exec setsid scripts/device_gpu.sh "$state/out" "$@") > /dev/null 2>&1 < /dev/null &
    for _ in $(seq 50); do [[ -s $state/pid ]] && [[ $(cat "$state/pid") != "$pid" ]] && break; sleep 0.1; done
    pid=$(cat "$state/pid")
    log "started the steps in a session of their own (process $pid) in $work: $*"
  fi
  touch "$state/out/log.txt"
  tail -n +1 -F "$state/out/log.txt" 2> /dev/null &
  tailer=$!
  while kill -0 "$pid" 2>/dev/null && (($(date +%s) < deadline - 10)); do sleep 2; done
  kill "$tailer" 2>/dev/null
  cp "$state/out/log.txt" "$out/log.txt"
  [[ -f $state/out/variants.tgz ]] && cp "$state/out/variants.tgz" "$out/"
  [[ -f $state/out/ptx.tgz ]] && cp "$state/out/ptx.tgz" "$out/"  # as the last ended step left it
  # what the steps have made so far, a step still running included (its finished jobs' files)
  marker=$state/marker
  (cd "$work" && collect)
  if kill -0 "$pid" 2>/dev/null; then
    log "the steps are still running (process $pid): the same command waits on them again"
  else
    log "the steps have ended"
  fi
  exit 0
fi
[[ ${DETACH:-} == child ]] && echo $$ > "$(dirname "$out")/pid"
exec > >(tee -a "$out/log.txt") 2>&1
marker=${MARKER:-$(mktemp)}
run() {  # a failed step is logged and the next one still runs
  local left=$((deadline - $(date +%s) - 20))
  if ((left <= 0)); then
    log "skipped, BUDGET spent: $*"
    return
  fi
  log "$*"
  timeout -k 10 "$left" "$@" || log "FAILED ($?): $*"
  collect
}
full=${FULL:-olmoe-1b-7b-shape}
# Scripts of packages installed with `pip --target DIR` (mlx.launch) land in DIR/bin.
IFS=: read -ra sites <<< "${PYTHONPATH:-}"
for site in "${sites[@]}"; do [[ -d $site/bin ]] && PATH="$site/bin:$PATH"; done
export PATH
# A step that BUDGET stopped leaves Snakemake's lock behind; nothing else runs here, so lift it.
$py -m snakemake --profile profiles/gpu --unlock > /dev/null 2>&1 || true
log "device: $($py -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# The suite's shards write their reports as each ends under results/logs/, which collect() brings
# back after every call: a suite the device's time cuts short still names what its shards found.
export TITAN_SUITE_REPORTS=${TITAN_SUITE_REPORTS:-results/logs/suite-reports}
for step in "$@"; do
  case $step in
    tests) run $py -m harness suite --shards "${SHARDS:-8}" ${TESTS:---gpu-files} ;;  # the record: results/raw/tests/suite
    tests2) run $py -m harness suite --shards "${SHARDS:-8}" $TESTS2 ;;  # the rest of TESTS, when a session's
            # device time may end mid-suite: the first record stands whether or not this one comes
    build) run $py -m engine store build $full ;;
    miss) run $py -m harness bench miss --repeats 2 --readers 4 --batch 1 8 --record ;;
    throughput) run $py -m harness bench throughput --model $full --tokens 32 --repeats 7 --slots 16 32 \
                  --installs pinned copy --overlap both --record ;;
    prefetch) run $py -m harness bench prefetch --model $full --slots 16 --install pinned --predictors oracle \
                --depths 1 2 3 --prompts 5 --tokens 32 --record ;;
    fitted) run $py -m harness bench prefetch --model $full --slots 16 --install pinned \
              --predictors probe transition popularity --depths 1 --min-probs 0 0.25 --prompts 3 --tokens 32 --record ;;
    install) run $py -m harness bench install --record --repeats 3 ;;
    syncfree)  # the device install (issue 29) beside the pinned path, resident and mlx-lm, one interleaved run each
          # 128 tokens a repeat: at 32 (0.15 s) the machine's own drift between repeats was larger
          # than the differences measured (docs/gpu.md)
          run $py -m harness bench throughput --model $full --tokens 128 --repeats 5 --slots 8 16 32 \
            --installs device pinned --loop mlx-lm --record
          run $py -m harness bench throughput --model $full --tokens 32 --repeats 3 --slots 16 \
            --installs device pinned --record  # the engine's loop: the per-token split (graph, eval)
          run $py -m harness bench prefetch --model $full --slots 16 --install device --predictors oracle \
            --depths 1 2 --prompts 3 --tokens 32 --overlap both --record ;;
    decode16)  # the syncfree step's first run at S = 16 alone: a change's check against the run before it
          run $py -m harness bench throughput --model $full --tokens 128 --repeats 5 --slots 16 \
            --installs device pinned --loop mlx-lm --record ;;
    batch16)  # the manyrows step's bench batch at S = 16 alone (the default install): B = 1, 4, 16 and the
              # bus's limit at each, measured in the same run; needs build
          run $py -m harness bench batch --model $full --slots 16 --repeats 3 --tokens 64 --record ;;
    oracle)  # the syncfree step's prefetch alone: the oracle's fills on their own stream and on the decode stream
          run $py -m harness bench prefetch --model $full --slots 16 --install device --predictors oracle \
            --depths 1 2 --prompts 5 --tokens 32 --overlap both --record ;;
    manyrows)  # many rows at once (issue 48), each configuration beside resident in the same repeat; needs build
          run $py -m harness bench prefill --model $full --slots 8 16 --installs device --area-ahead both \
            --repeats 3 --tokens 64 --record
          run $py -m harness bench batch --model $full --slots 16 --installs device --area-ahead both \
            --repeats 3 --tokens 64 --record
          run $py -m harness bench prefill --model $full --slots 16 --installs pinned --repeats 2 --tokens 64 --record
          run $py -m harness bench batch --model $full --slots 16 --installs pinned --batches 4 16 --repeats 1 \
            --tokens 32 --record ;;
    families)  # issue 49: each family's shape at its real size, one a process, built, measured, removed;
               # FAMILIES="id ..." picks them in that order (default: every family, fewest layers first),
               # FAMILY_REPEATS the repeats against resident (default the bench's); each family's
               # full-size exactness test runs on its model before it is removed
          run $py -m harness bench families --record --clean --exactness ${FAMILIES:+--families $FAMILIES} \
            ${FAMILY_REPEATS:+--repeats $FAMILY_REPEATS} ;;
    serve)  # issue 48: the engine's server batched and one at a time beside mlx_lm.server, 8 clients
          run $py -m harness bench serve --model $full --slots 16 --clients 8 --requests 2 --tokens 32 \
            --repeats 3 --record ;;
    launch) run $py scripts/probe_launch_cost.py ;;
    split)  # whether a batched step's pairs split into two calls keep mlx-lm's bits, for each family
            # (scripts/probe_split_calls.py; nothing built: one layer of random weights; no record)
          for m in ${SPLIT_MODELS:-olmoe-1b-7b-shape gpt-oss-20b-shape qwen3-30b-a3b-shape mixtral-8x7b-shape}; do
            run $py scripts/probe_split_calls.py $m --batches 1 2 4 8 16 64
          done ;;
    batchslots)  # the experts a batched step brings in a layer against the fewest any S slots allow
            # (scripts/probe_batch_slots.py; needs build; no record); the routing it traced comes back
            # in logs.tgz (results/logs/batchslots), so other rules can be counted without a GPU
          run $py scripts/probe_batch_slots.py $full --batches 4 16 --slots 8 16 32 --trace results/logs/batchslots ;;
    probe)  # where FULL's logits part from mlx-lm's, teacher-forced, with MLX's CUDA graphs and without
            # (scripts/probe_exactness.py; PROMPT_TOKENS, RESIDENT_RUNS; PROBE="STEPS VARIANTS"); needs build
          run $py scripts/probe_exactness.py $full ${PROBE:-4 quarter,full}
          run env MLX_USE_CUDA_GRAPHS=0 $py scripts/probe_exactness.py $full ${PROBE:-4 quarter,full} ;;
    peak)  # where resident's peak memory goes over a prompt, by prompt and prefill chunk
           # (scripts/probe_peak.py on FULL; PEAK="PROMPT_TOKENS ..."; needs build; no record)
          run $py scripts/probe_peak.py $full ${PEAK:-16 512 2048}
          run $py scripts/probe_peak.py $full ${PEAK:-16 512 2048} --bound-layers 2 ;;  # layers in flight bounded
    layer) args=("$full" "${LAYER_TOKENS:-64}" "${LAYER_ROUNDS:-5}" "${LAYER_SLOTS:-16}")  # needs build
           run $py scripts/probe_layer_cost.py "${args[@]}"
           run env MLX_USE_CUDA_GRAPHS=0 $py scripts/probe_layer_cost.py "${args[@]}" ;;  # MLX's CUDA graphs' share
    memory) run $py -m harness bench throughput --model $full --tokens 16 --repeats 3 --slots 16 32 \
              --installs pinned --overlap on --record ;;
    design)  # gate B's design, DESIGN_RUNS times (default 3), each a run id of its own (gpu-<commit>-rN):
             # its claims are decided from the spread over runs
          for i in $(seq "${DESIGN_RUNS:-3}"); do
            r=gpu-${TITAN_COMMIT:0:12}-r$i
            run $py -m snakemake --profile profiles/gpu --config run=$r -- results/raw/B/design/$r.jsonl
          done ;;
    gate_c) r=${RUN:-gpu-${TITAN_COMMIT:0:12}}
            run $py -m snakemake --profile profiles/gpu --scheduler greedy --config run=$r -- \
              results/raw/C/prefetch_online/$r-$full-page_cache-{general,code}.jsonl ;;
    wide | wide:*)
          [[ $step == wide:* ]] && PSETS=${step#wide:} && PSETS=${PSETS//,/ }
          r=${RUN:-gpu-${TITAN_COMMIT:0:12}} w=olmoe-wide-trained targets=()
          for s in ${PSETS:-general code}; do  # PSETS: the prompt sets, most wanted first
            targets+=(results/raw/C/{prefetch_online/$r-$w-page_cache,predictor_quality/$r-$w}-$s.jsonl)
          done
          case "${PSETS:-general code}" in  # routing compares the two prompt sets
            *general*code* | *code*general*) targets+=(results/raw/C/routing/$r-$w.jsonl) ;;
          esac
          # First what the measurements read (training, traces, fitted predictors, the store), the
          # fits side by side: they time nothing, and one at a time they took 5 of a session's 30
          # device minutes. Retried once: MLX writes its kernel cache without a lock, and processes
          # that start at once may read a kernel another is still writing.
          run $py -m snakemake --profile profiles/gpu --scheduler greedy --config run=$r \
            --set-resources fit:timing=0 --retries 1 --omit-from prefetch_online predictor_quality routing \
            -- "${targets[@]}"
          # Then the measurements, one at a time.
          run $py -m snakemake --profile profiles/gpu --scheduler greedy --config run=$r -- "${targets[@]}" ;;
    variants)  # a fault that depends on what ran before it in the process, narrowed down: one pytest
               # process a variant, side by side, each running TESTS in the order given (a shard's
               # order: the suite record's shard split), under that variant's environment.
               # VARIANTS="name:VAR=value VAR2=value;name2:" (default: one variant, as is). No record:
               # each variant's log is in OUTDIR/log.txt's summary and in OUTDIR/variants.tgz.
               # Words after a variant's VAR=value ones wrap pytest (VARIANTS="memcheck:compute-sanitizer
               # --tool memcheck"). Each variant has its own MLX kernel cache, so that no two write one.
          vdir=$(mktemp -d) pids=() && IFS=';' read -ra vs <<< "${VARIANTS:-as-is:}"
          for v in "${vs[@]}"; do
            (read -ra envs <<< "${v#*:}"
             timeout -k 10 $((deadline - $(date +%s) - 30)) env MLX_PTX_CACHE_DIR="$vdir/ptx-${v%%:*}" \
               "${envs[@]}" $py -m pytest -v -p no:cacheprovider $TESTS > "$vdir/${v%%:*}.log" 2>&1
             echo "${v%%:*}: exit $?" >> "$vdir/exits.txt") &
            pids+=($!)
          done
          wait "${pids[@]}"  # not a bare wait: that would wait on this script's own log tee too
          cat "$vdir/exits.txt"
          grep -H "PASSED\|FAILED\|ERROR\|device reported\|device faulted\|Invalid\|=====.*at 0x\|by thread\|Address" "$vdir"/*.log | sed "s|$vdir/||" | tail -80
          tar czf "$out/variants.tgz" -C "$vdir" . ;;
    *) log "unknown step $step" ;;
  esac
done
