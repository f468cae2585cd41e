#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (Debian's slurm-wlm and munge, as root), for running
# the workflow's SLURM profile for real: `snakemake --profile profiles/slurm smoke`.
# Usage: sudo scripts/slurm_local.sh [start|stop]   (start installs the packages if missing)
# What it sets up (seen working with slurm-wlm 22.05): a munge key, slurm.conf naming this host
# as controller and only node (its CPUs and most of its memory), one partition `compute`, no
# accounting database (so Snakemake's SLURM plugin asks squeue, not sacct, for job states).
set -euo pipefail
action=${1:-start}
host=$(hostname)
conf=/etc/slurm
if [ "$action" = stop ]; then
  pkill -x slurmd || true
  pkill -x slurmctld || true
  exit 0
fi
if ! command -v slurmctld > /dev/null; then
  apt-get install -y -q slurm-wlm munge > /dev/null
fi
mkdir -p /etc/munge /var/log/munge /run/munge /var/lib/munge "$conf" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
if [ ! -s /etc/munge/munge.key ]; then
  head -c 1024 /dev/urandom > /etc/munge/munge.key
fi
chown -R munge: /etc/munge /var/log/munge /run/munge /var/lib/munge
chmod 400 /etc/munge/munge.key
pgrep -x munged > /dev/null || runuser -u munge -- munged
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
cat > "$conf/slurm.conf" <<CONF
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
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=compute Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
cat > "$conf/cgroup.conf" <<CONF
CgroupPlugin=autodetect
IgnoreSystemd=yes
CONF
pgrep -x slurmctld > /dev/null || slurmctld
pgrep -x slurmd > /dev/null || slurmd
for _ in $(seq 30); do
  if sinfo -h -o %T 2> /dev/null | grep -qE 'idle|mixed'; then
    sinfo
    exit 0
  fi
  sleep 1
done
echo "the SLURM node did not come up; see /var/log/slurm/" >&2
exit 1
