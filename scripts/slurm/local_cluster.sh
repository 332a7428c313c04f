#!/bin/bash
# A throwaway single-node SLURM cluster on this machine (Debian's slurm-wlm, run as root),
# for tests and trying the sbatch scripts:
#   scripts/slurm/local_cluster.sh start DIR   # then: export SLURM_CONF=DIR/slurm.conf
#   scripts/slurm/local_cluster.sh stop DIR
# Everything (munge socket and key, state, logs) lives under DIR; non-default ports
# (16817/16818) keep it apart from a system SLURM.
set -euo pipefail
cmd=${1:?start|stop}; dir=$(realpath -m "${2:?DIR}")
case "$cmd" in
start)
    mkdir -p "$dir"/{state,spool,log}
    mungekey -c -k "$dir/munge.key" -f
    munged -f -S "$dir/munge.sock" --key-file="$dir/munge.key" --log-file="$dir/log/munged.log" \
           --pid-file="$dir/munged.pid" --seed-file="$dir/munged.seed"
    host=$(hostname -s)
    mem=$(awk '/MemTotal/{print int($2 / 1024 * 0.8)}' /proc/meminfo)
    # the machine's processors: GNU nproc alone honours OMP_NUM_THREADS (torchrun sets it to 1), which
    # would give the node 1 CPU and leave a job that asks for 2 pending for ever
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    cat > "$dir/slurm.conf" <<CONF
ClusterName=refitlocal
SlurmctldHost=$host
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld
    slurmd
    for _ in $(seq 60); do
        sinfo -h -o %t 2>/dev/null | grep -qx idle && { echo "SLURM_CONF=$SLURM_CONF"; exit 0; }
        sleep 0.5
    done
    echo "local SLURM did not come up; see $dir/log" >&2
    exit 1
    ;;
stop)
    for daemon in slurmd slurmctld munged; do
        if [[ -f "$dir/$daemon.pid" ]]; then kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true; fi
    done
    ;;
*) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
