#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (Debian's slurm-wlm and munge, as root), for running
# the workflow's SLURM profile for real: `snakemake --directory .test --profile profiles/slurm`.
# Usage: sudo scripts/slurm_local.sh [start|stop]   (start installs the packages if missing)
# What it sets up (seen working with slurm-wlm 22.05): a munge key, slurm.conf naming this host
# as controller and only node (its CPUs and most of its memory), one partition `compute`, no
# accounting database (so Snakemake's SLURM plugin asks squeue, not sacct, for job states).
# It owns only what it starts: the daemons' PIDs are kept in $TITAN_SLURM_STATE (default
# /run/titan-slurm) and `stop` ends those processes and no other; on a machine where a SLURM
# daemon or a slurm.conf it did not write already exists (a real cluster node), it refuses to start.
set -euo pipefail
action=${1:-start}
host=$(hostname)
conf=/etc/slurm
state=${TITAN_SLURM_STATE:-/run/titan-slurm}
mark="# written by titan's scripts/slurm_local.sh"
alive() {  # whether process $1 runs as daemon $2 (a zombie no longer does)
  [ "$(cat "/proc/$1/comm" 2> /dev/null)" = "$2" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2> /dev/null
}
running() {  # the live processes named $1
  local pid
  for pid in $(pgrep -x "$1"); do alive "$pid" "$1" && echo "$pid"; done
  return 0
}
ours() {  # the PID in pidfile $1 if that process is still the daemon named $2
  local pid
  pid=$(head -1 "$state/$1" 2> /dev/null) || return 1
  [ -n "$pid" ] && alive "$pid" "$2" && echo "$pid"
}
if [ "$action" = stop ]; then
  for d in slurmd slurmctld munged; do
    if pid=$(ours "$d.pid" "$d"); then
      kill "$pid"
      for _ in $(seq 100); do alive "$pid" "$d" || break; sleep 0.1; done
      echo "stopped $d ($pid)"
    fi
    rm -f "$state/$d.pid"
  done
  exit 0
fi
for d in slurmctld slurmd; do
  if [ -n "$(running "$d")" ] && ! ours "$d.pid" "$d" > /dev/null; then
    echo "a $d this script did not start runs here (pid $(running "$d" | head -1)): it makes a one-node" \
      "cluster only where there is no SLURM already" >&2
    exit 1
  fi
done
if [ -e "$conf/slurm.conf" ] && ! grep -qxF "$mark" "$conf/slurm.conf"; then
  echo "$conf/slurm.conf exists and this script did not write it: it leaves a real cluster's configuration alone" >&2
  exit 1
fi
mkdir -p "$state"
if ! command -v slurmctld > /dev/null; then
  apt-get install -y -q slurm-wlm munge > /dev/null
fi
mkdir -p /etc/munge /var/log/munge /run/munge /var/lib/munge "$conf" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
  head -c 1024 /dev/urandom > /etc/munge/munge.key
fi
chown -R munge: /etc/munge /var/log/munge /run/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
if [ -z "$(running munged)" ]; then  # a munged already running (a real node's) is used, not owned
  runuser -u munge -- munged  # returns once the daemon runs, its PID in munged's own pidfile
  cp /run/munge/munged.pid "$state/munged.pid"
fi
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
cat > "$conf/slurm.conf" <<CONF
$mark
ClusterName=titan
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MinJobAge=600
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=compute Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
cat > "$conf/cgroup.conf" <<CONF
CgroupPlugin=autodetect
IgnoreSystemd=yes
CONF
ours slurmctld.pid slurmctld > /dev/null || slurmctld
ours slurmd.pid slurmd > /dev/null || slurmd
for _ in $(seq 30); do
  if sinfo -h -o %T 2> /dev/null | grep -qE 'idle|mixed'; then
    sinfo
    exit 0
  fi
  sleep 1
done
echo "the SLURM node did not come up; see /var/log/slurm/" >&2
exit 1
