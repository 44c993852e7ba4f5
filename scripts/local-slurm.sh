#!/usr/bin/env bash
# A real Slurm cluster on this one host, for tests and demos:
#   scripts/local-slurm.sh up|down|status [STATE_DIR]      (STATE_DIR defaults to /tmp/areal-slurm)
#
# munged, slurmctld and two slurmd (`slurmd -N n1`, `slurmd -N n2`, each on its own port) with
# 4 fake GPUs per node, partition `debug`. Everything (config, state, logs, pid files, the munge
# key and socket) lives in STATE_DIR; the host's /etc/slurm and /etc/munge are never read.
# After `up`:  export SLURM_CONF=STATE_DIR/slurm.conf   and sinfo/sbatch/srun/squeue just work.
#
# Built against Debian 12: slurm-wlm 22.05.8, munge 0.5.15. Up in 0.3 s on an idle host (about
# 2 s under heavy load), down in 0.3 s; about 25 MB resident for munged, slurmctld (and its
# slurmscriptd) and the two slurmd.
# Quirks, each of which cost time once:
# - The daemons must be started under their own names (`slurmctld`, `slurmd`, the alternatives
#   symlinks): started as `slurmctld-wlm`, Gres is silently dropped from the nodes.
# - gres.conf `File=` must name character devices; empty files are refused. The fake GPUs are
#   `mknod c 195 N` (the NVIDIA major) under STATE_DIR/dev; nothing ever opens them. Slurm sets
#   CUDA_VISIBLE_DEVICES from the gres binding: indices 0..3 within the node, so two jobs on one
#   node see 0,1 and 2,3.
# - The nodes declare more CPUs than the host has; `SlurmdParameters=config_overrides` keeps them
#   from being drained for it. Both nodes are this host (NodeAddr 127.0.0.1, same hostname), so
#   `hostname` inside a step is the same on both: use SLURMD_NODENAME / SLURM_NODEID.
# - `scontrol listpids JOB` asks the slurmd named after this host's name: pass the node
#   (`scontrol listpids JOB n2`). `srun --overlap --jobid J -w n2` reaches a node of a running job.
# - `SchedulerParameters=bf_interval=1`: heterogeneous jobs are only started by the backfill
#   scheduler, which otherwise waits 30 s between passes.
# - No slurmdbd: `sacct` and `sreport` fail; ended jobs stay in `squeue -t all` for MinJobAge.
# - A batch job whose node fails is requeued (Slurm's default) unless submitted --no-requeue.
# - Job steps run as root (SlurmUser=root); proctrack/linuxproc, so `scontrol listpids` works
#   without cgroups. The daemons run with a clean environment (no AREAL_HOME) so that a test's
#   leak check never counts them. slurmstepd overwrites its environment with its process title
#   (psutil's environ() reads it as empty); its sockets in STATE_DIR/spool/NODE tell its node.
# - Killed daemons stay zombies for a while here (init reaps slowly): liveness checks skip them.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin

cmd=${1:-}
STATE=${2:-${AREAL_SLURM_STATE:-/tmp/areal-slurm}}
NODES=(n1 n2)
GPUS_PER_NODE=4
CPUS_PER_NODE=16
PARTITION=debug

usage() {
    echo "usage: $0 up|down|status [STATE_DIR]" >&2
    exit 2
}

# The pid in a pid file, if that process is alive and is still the daemon the file is named
# after (a pid reused by another process is left alone).
daemon_pid() {
    local f=$1 name pid
    name=$(basename "$f" .pid)
    name=${name%%-*}
    [[ -s $f ]] || return 1
    pid=$(cat "$f")
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] && alive "$pid" && echo "$pid"
}

# Running and not a zombie: a daemon's parent is init, which can take seconds to reap it.
alive() {
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [[ $state != Z ]]
}

pid_alive() { daemon_pid "$1" >/dev/null; }

pidfiles() {
    echo "$STATE/run/munged.pid" "$STATE/run/slurmctld.pid"
    for n in "${NODES[@]}"; do echo "$STATE/run/slurmd-$n.pid"; done
}

all_running() {
    [[ -f $STATE/slurm.conf ]] || return 1
    local f
    for f in $(pidfiles); do pid_alive "$f" || return 1; done
}

# Daemons and client calls get a clean environment: only what Slurm needs.
clean() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin SLURM_CONF="$STATE/slurm.conf" "$@"; }

ensure_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    ((${#missing[@]} == 0)) && return 0
    echo "installing ${missing[*]} with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; }
}

# N ports no socket on this host uses, below the ephemeral range (32768+) so that no outgoing
# connection takes one between now and the daemons binding it.
free_ports() {
    local p picked=" "
    while (($(wc -w <<<"$picked") < $1)); do
        p=$((20000 + RANDOM % 12000))
        [[ $picked == *" $p "* ]] && continue
        grep -q ":$(printf %04X "$p") " /proc/net/tcp /proc/net/tcp6 2>/dev/null && continue
        picked+="$p "
    done
    echo "$picked"
}

write_config() {
    local host ports ctld_port i
    host=$(hostname -s)
    read -r -a ports <<<"$(free_ports $((1 + ${#NODES[@]})))"
    ctld_port=${ports[0]}
    mkdir -p "$STATE"/{run,log,ctld,spool,dev,munge,tmp}
    chmod 700 "$STATE/munge"
    : >"$STATE/plugstack.conf"
    {
        cat <<EOF
# Written by scripts/local-slurm.sh; regenerated on every \`up\` from a stopped state.
ClusterName=areal-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
PlugStackConfig=$STATE/plugstack.conf
TmpFS=$STATE/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=2
MinJobAge=300
EOF
        i=1
        for n in "${NODES[@]}"; do
            echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[$i]}" \
                "CPUs=$CPUS_PER_NODE Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS_PER_NODE" \
                "ThreadsPerCore=1 RealMemory=8192 Gres=gpu:$GPUS_PER_NODE State=UNKNOWN"
            i=$((i + 1))
        done
        echo "PartitionName=$PARTITION Nodes=$(
            IFS=,
            echo "${NODES[*]}"
        ) Default=YES MaxTime=INFINITE State=UP"
    } >"$STATE/slurm.conf"

    echo "AutoDetect=off" >"$STATE/gres.conf"
    for n in "${NODES[@]}"; do
        mkdir -p "$STATE/dev/$n"
        for ((g = 0; g < GPUS_PER_NODE; g++)); do
            [[ -c $STATE/dev/$n/nvidia$g ]] || mknod "$STATE/dev/$n/nvidia$g" c 195 "$g"
        done
        echo "NodeName=$n Name=gpu File=$STATE/dev/$n/nvidia[0-$((GPUS_PER_NODE - 1))]" >>"$STATE/gres.conf"
    done
}

# TERM to all at once, KILL what is left after ~1.5 s: they stop in milliseconds, except a
# slurmctld still trying to reach a killed node, which waits 3 s; the next `up` wipes the state.
stop_pidfiles() {
    local f pids=() p i
    for f in "$@"; do
        if p=$(daemon_pid "$f"); then
            kill -TERM "$p" 2>/dev/null && pids+=("$p")
        fi
        rm -f "$f"
    done
    for p in "${pids[@]}"; do
        for ((i = 0; i < 30; i++)); do
            alive "$p" || break
            sleep 0.05
        done
        kill -KILL "$p" 2>/dev/null || true
    done
}

# slurmstepd and job tasks outlive slurmd. slurmstepd inherits the daemons' environment, a task
# the submitter's; both carry this cluster's SLURM_CONF, which finds them by pid (a task also has
# SLURM_JOB_ID, which keeps the caller of this script, that may carry SLURM_CONF too, out of it).
stop_job_processes() {
    local e pid
    for e in $(grep -lzxF -- "SLURM_CONF=$STATE/slurm.conf" /proc/[0-9]*/environ 2>/dev/null); do
        pid=${e#/proc/}
        pid=${pid%/environ}
        [[ $pid == "$$" ]] && continue
        if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]] ||
            grep -qz '^SLURM_JOB_ID=' "$e" 2>/dev/null; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

do_down() {
    local deadline
    if [[ -f $STATE/slurm.conf ]] && pid_alive "$STATE/run/slurmctld.pid"; then
        # Cancel every job first so that slurmstepd ends its tasks itself.
        if [[ -n $(clean squeue -h -o %i 2>/dev/null || true) ]]; then
            clean scancel --quiet --partition="$PARTITION" 2>/dev/null || true
            deadline=$((SECONDS + 15))
            while [[ -n $(clean squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < deadline)); do
                sleep 0.1
            done
        fi
    fi
    # shellcheck disable=SC2046
    stop_pidfiles $(pidfiles)
    if [[ -d $STATE ]]; then stop_job_processes; fi
}

do_up() {
    if all_running; then
        print_usage
        return 0
    fi
    ensure_packages
    local t0 idle deadline
    t0=$EPOCHREALTIME
    do_down # whatever is left of a half-started cluster
    # The controller's saved state would resurrect old jobs and node states.
    rm -rf "$STATE/ctld" "$STATE/spool"
    write_config

    if [[ ! -s $STATE/munge/munge.key ]]; then
        dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 400 "$STATE/munge/munge.key"
    # --force: munged wants every directory above its socket open to all users; these are
    # private to root, its only client.
    clean munged --force --key-file="$STATE/munge/munge.key" \
        --socket="$STATE/munge/munge.socket" --pid-file="$STATE/run/munged.pid" \
        --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed" 2>>"$STATE/log/munged.log"
    deadline=$((SECONDS + 30))
    until [[ -S $STATE/munge/munge.socket ]] || ((SECONDS > deadline)); do sleep 0.02; done

    # Started through the `slurmctld`/`slurmd` names; see the quirks at the top.
    clean slurmctld -f "$STATE/slurm.conf" -i
    for n in "${NODES[@]}"; do clean slurmd -f "$STATE/slurm.conf" -N "$n"; done

    # Up means both nodes idle: a job submitted now starts at once.
    deadline=$((SECONDS + 60))
    while :; do
        idle=$(clean sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$' || true)
        if [[ $idle == "${#NODES[@]}" ]] || ((SECONDS > deadline)); then break; fi
        sleep 0.05
    done
    if [[ $idle != "${#NODES[@]}" ]]; then
        echo "local-slurm: the nodes did not come up; logs in $STATE/log:" >&2
        tail -n 5 "$STATE"/log/*.log >&2 || true
        do_down
        exit 1
    fi
    awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "local-slurm: up in %.2f s\n", b - a }' >&2
    print_usage
}

print_usage() {
    cat <<EOF
Slurm cluster up: nodes ${NODES[*]}, partition $PARTITION, $GPUS_PER_NODE GPUs per node (gres gpu).
  export SLURM_CONF=$STATE/slurm.conf
  sinfo; sbatch --nodes 2 --gres gpu:1 job.sh; squeue
Logs in $STATE/log. Stop with: $0 down $STATE
EOF
}

do_status() {
    if all_running; then
        echo "up: SLURM_CONF=$STATE/slurm.conf"
        clean sinfo -N -o '%N %P %t %G' || true
        return 0
    fi
    echo "down ($STATE)"
    return 1
}

case $cmd in
up) do_up ;;
down) do_down ;;
status) do_status ;;
*) usage ;;
esac
