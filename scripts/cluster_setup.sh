#!/usr/bin/env bash
# Prepare every host of an mlx.launch hostfile to run Titan, all hosts at once: sync this
# checkout, create the pinned virtual environment, and run an import check that prints the mlx,
# mlx-lm and engine versions and the device. Fails, naming the host, when a host cannot be reached, its setup
# fails, or its versions differ from the first host's.
#
# Usage: scripts/cluster_setup.sh HOSTFILE [--dest DIR] [--check-only]
#   HOSTFILE     mlx.launch's JSON hostfile: [{"ssh": "node1", "ips": ["10.0.0.1"]}, ...]
#   --dest DIR   where the code lives on each host (default: the same path as here); "{host}"
#                in DIR is replaced by the host's name (for several "hosts" on one machine)
#   --check-only skip sync and environment; only compare the hosts' versions
# Environment:
#   TITAN_REMOTE_SHELL  how to run a command on a host, "{host}" replaced (default:
#                       "ssh -o BatchMode=yes {host}"); e.g. "ip netns exec {host} bash -c"
#   TITAN_PIP_ARGS      extra pip arguments, e.g. "--no-index --find-links /shared/wheels" for
#                       hosts without a package index
# Versions are pinned by requirements.lock (pip constraints), the same set CI and the
# development machine run.
set -euo pipefail

usage() { sed -n '2,18p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
hostfile=$1; shift
here=$(cd "$(dirname "$0")/.." && pwd)
dest_tpl=$here
check_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --dest) dest_tpl=$2; shift 2 ;;
    --check-only) check_only=1; shift ;;
    *) usage ;;
  esac
done
[ -r "$hostfile" ] || { echo "error: cannot read hostfile $hostfile" >&2; exit 2; }
shell_tpl=${TITAN_REMOTE_SHELL:-"ssh -o BatchMode=yes {host}"}
pip_args=${TITAN_PIP_ARGS:-}
python=${PYTHON:-python3}

hosts=$($python - "$hostfile" <<'EOF'
import json, sys
try:
    hosts = json.load(open(sys.argv[1]))
    names = [h["ssh"] for h in hosts]
except (ValueError, KeyError, TypeError) as e:
    sys.exit(f"error: {sys.argv[1]}: not an mlx.launch hostfile (a JSON list of {{\"ssh\": ..., \"ips\": [...]}}): {e}")
if not names:
    sys.exit(f"error: {sys.argv[1]}: no hosts")
print("\n".join(names))
EOF
)

remote() {  # remote HOST COMMAND: run COMMAND in a shell on HOST
  local host=$1; shift
  local cmd=${shell_tpl//\{host\}/$host}
  $cmd "$*"
}

setup_host() {  # setup_host HOST: sync the code to it and create its environment
  local host=$1 dest q
  dest=${dest_tpl//\{host\}/$host}
  q=$(printf %q "$dest")
  echo "[$host] syncing the code to $dest"
  remote "$host" "mkdir -p $q" || { echo "error: host $host: cannot reach it or create $dest" >&2; return 1; }
  # tar over the remote shell: the tracked and untracked files git does not ignore, nothing built
  (cd "$here" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) \
    | remote "$host" "tar -xf - -C $q" || { echo "error: host $host: sync failed" >&2; return 1; }
  echo "[$host] creating the pinned environment $dest/.venv"
  remote "$host" "cd $q && $python -m venv .venv && .venv/bin/pip install -q $pip_args -c requirements.lock -e ." \
    || { echo "error: host $host: environment setup failed" >&2; return 1; }
}

if [ $check_only = 0 ]; then
  # Every host at once (a cluster's setup takes one host's time, not the sum); each host's lines
  # are kept apart and printed whole once it is done, so that a failure reads as its host's.
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  pids=()
  for host in $hosts; do
    setup_host "$host" > "$logs/${#pids[@]}.out" 2> "$logs/${#pids[@]}.err" &
    pids+=($!)
  done
  failed=0 i=0
  for host in $hosts; do
    wait "${pids[$i]}" || failed=1
    cat "$logs/$i.out"
    cat "$logs/$i.err" >&2
    i=$((i + 1))
  done
  [ $failed = 0 ] || exit 1
fi

first_report=""
first_host=""
for host in $hosts; do
  q=$(printf %q "${dest_tpl//\{host\}/$host}")
  report=$(remote "$host" "cd $q && .venv/bin/python -m engine version") \
    || { echo "error: host $host: import check failed" >&2; exit 1; }
  echo "[$host] $report"
  versions=$(printf '%s' "$report" | $python -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["versions"], sort_keys=True))')
  if [ -z "$first_report" ]; then
    first_report=$versions; first_host=$host
  elif [ "$versions" != "$first_report" ]; then
    echo "error: host $host differs from $first_host: $versions vs $first_report" >&2
    exit 1
  fi
done
echo "all hosts agree: $first_report"
