#!/usr/bin/env bash
# A throw-away Slurm cluster on this host for tests: munge, slurmctld and 4 virtual slurmd nodes
# (n1..n4, 127.0.0.1), all state under DIR. Needs root and the Debian packages
# slurmctld slurmd slurm-client munge (see docs/test-clusters.md).
#
#   launch/slurm_test_cluster.sh up DIR      # prints the SLURM_CONF to export; waits until nodes are idle
#   launch/slurm_test_cluster.sh down DIR    # cancels jobs, stops the daemons (munged if up started it), leaves DIR
set -euo pipefail

cmd=${1:?usage: $0 up|down DIR}
dir=$(realpath -m "${2:?usage: $0 up|down DIR}")
conf="$dir/slurm.conf"
nodes=4

die() { echo "slurm_test_cluster: $*" >&2; exit 1; }

up() {
    for bin in munged slurmctld slurmd sinfo; do
        command -v "$bin" >/dev/null || die "$bin not found (apt-get install slurmctld slurmd slurm-client munge)"
    done
    [ "$(id -u)" = 0 ] || die "must run as root (slurmd runs jobs as their users)"
    mkdir -p "$dir/ctld"
    for i in $(seq 1 $nodes); do mkdir -p "$dir/d-n$i"; done
    local host
    host=$(hostname -s)
    cat > "$conf" <<EOF
ClusterName=realcore-ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire (default 120 s) before it may start again: tests requeue.
AuthInfo=cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.log
SchedulerType=sched/backfill
# The main scheduling loop every second (default 60 s): a requeued job whose begin time has come
# otherwise waited for it, ~7 s more per requeue (Slurm 22.05, measured).
SchedulerParameters=bf_interval=1,bf_hetjob_immediate,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPort=6817
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=600
KillWait=5
Waittime=0
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/d-%n
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=127.0.0.1 Port=[6831-683$nodes] CPUs=4 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP
EOF
    # munge: the package made /etc/munge/munge.key; munged refuses a key it does not own.
    if ! pgrep -x munged >/dev/null; then
        [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (reinstall munge)"
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
        rm -f /run/munge/munged.pid  # a killed munged's leftover would pass for the new one's
        runuser -u munge -- /usr/sbin/munged
        # Ours to stop at `down` (a munged that was already running is left alone).
        local deadline=$((SECONDS + 10))
        until [ -s /run/munge/munged.pid ]; do
            [ $SECONDS -lt $deadline ] || die "munged wrote no pid file within 10 s"
            sleep 0.1
        done
        cp /run/munge/munged.pid "$dir/munged.pid"
    fi
    export SLURM_CONF="$conf"
    slurmctld -c -f "$conf"
    for i in $(seq 1 $nodes); do slurmd -N "n$i" -f "$conf"; done
    local deadline=$((SECONDS + 60))
    until [ "$(sinfo -h -o '%T' -N 2>/dev/null | grep -c '^idle')" = "$nodes" ]; do
        [ $SECONDS -lt $deadline ] || die "nodes not idle after 60 s: $(sinfo -N 2>&1 | tr '\n' ' ')"
        sleep 0.5
    done
    echo "$conf"
}

down() {
    export SLURM_CONF="$conf"
    [ -f "$conf" ] || exit 0
    scancel --full --quiet -p debug 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while [ -n "$(squeue -h 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
    scontrol shutdown 2>/dev/null || true
    for pidfile in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
    if [ -f "$dir/munged.pid" ]; then  # only the munged that `up` started
        pid=$(cat "$dir/munged.pid")
        if [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = munged ]; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$dir/munged.pid"
    fi
}

case "$cmd" in
    up) up ;;
    down) down ;;
    *) die "unknown command $cmd (up|down)" ;;
esac
