#!/usr/bin/env bash
# slurm_local_cluster.sh - run a real two-node Slurm cluster on this single host (for tests).
#
# Usage (as root, Debian 12):
#   bash scripts/slurm_local_cluster.sh start  [DIR]   # install if needed, (re)start, wait until ready
#   bash scripts/slurm_local_cluster.sh stop   [DIR]   # stop the slurmctld/slurmd started for DIR
#   bash scripts/slurm_local_cluster.sh status [DIR]   # print sinfo; exit 0 iff both nodes are up
#
#   DIR defaults to /tmp/imagenet_elastic_slurm. It holds slurm.conf, gres.conf, the saved controller
#   state (DIR/state), the slurmd spool dirs (DIR/spool/n1, DIR/spool/n2), pid files, logs
#   (DIR/slurmctld.log, DIR/slurmd-n1.log, DIR/slurmd-n2.log) and the fake GPU devices (DIR/gpu).
#
#   The last line `start` prints on stdout is exactly `export SLURM_CONF=DIR/slurm.conf`; everything
#   else goes to stderr, so a caller can do:
#       eval "$(bash scripts/slurm_local_cluster.sh start)"
#       srun -N2 --ntasks-per-node=1 --gres=gpu:2 env
#
# Layout: one controller (slurmctld on localhost:6817) and two slurmd daemons of one host
# (MULTIPLE_SLURMD), nodes n1 and n2 on ports 17001-17002, each with CPUs=2 and Gres=gpu:2. The GPUs are
# fake: character devices DIR/gpu/gpu0, DIR/gpu/gpu1 (same major/minor as /dev/null), so
# `srun --gres=gpu:2` sets CUDA_VISIBLE_DEVICES=0,1 without any real GPU. One partition `debug`
# (default, OverSubscribe=YES). No cgroups: proctrack/linuxproc, task/none. `127.0.0.1 n1 n2` is added to
# /etc/hosts so the node names resolve (e.g. for MASTER_ADDR).
#
# `start` is idempotent: it kills the daemons of a previous `start` for the same DIR and starts fresh ones
# with an empty queue (slurmctld -c): a job recovered from the saved state of a machine that was stopped
# mid-test stays RUNNING with no process behind it and holds its nodes and GPUs, so every later job of the
# tests would wait for them until its time-out.
# Packages slurm-wlm, munge and openmpi-bin are installed with apt-get only when srun, slurmctld, munged
# or mpirun is missing. munged is started if `munge -n` fails; `stop` leaves munged running (shared).
#
# Environment knobs:
#   SLURM_LOCAL_START_TIMEOUT   seconds `start` waits for both nodes to be up (default 30)
#
# Exit status: 0 on success; non-zero with a one-line message `slurm_local_cluster.sh: error: ...` on
# stderr on any failure (for a cluster that never became ready, the log tails follow on stderr).

set -Eeuo pipefail

PROG=slurm_local_cluster.sh
DEFAULT_DIR=/tmp/imagenet_elastic_slurm
NODES=(n1 n2)
START_TIMEOUT=${SLURM_LOCAL_START_TIMEOUT:-30}
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: error: $*" >&2; exit 1; }
on_err() {
    local rc=$?
    echo "$PROG: error: command failed (exit $rc) at line $1: $2" >&2
    exit "$rc"
}
trap 'on_err "$LINENO" "$BASH_COMMAND"' ERR

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# ----------------------------------------------------------------------------------------------- helpers

# Sets DIR to the absolute, physical path of $1 (default DEFAULT_DIR). With $2 = create the folder is
# created; otherwise DIR is set to the path as given and returns 1 when the folder does not exist.
resolve_dir() {
    local d=${1:-$DEFAULT_DIR}
    case $d in
        *[[:space:]]*) die "DIR must not contain whitespace: '$d'" ;;
    esac
    if [[ ${2:-} == create ]]; then
        mkdir -p "$d" 2>/dev/null || die "cannot create directory $d"
    elif [[ ! -d $d ]]; then
        DIR=$d
        return 1
    fi
    DIR=$(cd "$d" && pwd -P) || die "cannot enter directory $d"
}

require_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages, starts daemons, edits /etc/hosts)"
}

# State letter of a pid (R, S, Z, ...), empty if it does not exist.
proc_state() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    stat=${stat##*) }
    echo "${stat%% *}"
}

# True if the pid exists and is not a zombie (daemonised parents linger as zombies on some hosts).
alive() {
    local s
    s=$(proc_state "$1")
    [[ -n $s && $s != Z && $s != X ]]
}

# Pids of live slurmctld/slurmd/slurmstepd processes that belong to the cluster in DIR: those named in its
# pid files, those whose command line names DIR/slurm.conf, and slurmstepd processes holding files in DIR.
cluster_pids() {
    local dir=$1 conf=$1/slurm.conf f pid comm cmd
    local -A seen=()
    for f in "$dir/slurmctld.pid" "$dir"/slurmd-*.pid; do
        [[ -f $f ]] || continue
        pid=$(tr -dc '0-9' <"$f" 2>/dev/null || true)
        [[ -n $pid ]] || continue
        comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
        [[ $comm == slurmctld || $comm == slurmd ]] && seen[$pid]=1
    done
    for f in /proc/[0-9]*; do
        pid=${f#/proc/}
        comm=$(cat "$f/comm" 2>/dev/null || true)
        case $comm in
            slurmctld | slurmd)
                cmd=$(tr '\0' ' ' <"$f/cmdline" 2>/dev/null || true)
                [[ " $cmd " == *" $conf "* ]] && seen[$pid]=1
                ;;
            slurmstepd)
                local fd
                for fd in "$f"/fd/*; do
                    if [[ $(readlink "$fd" 2>/dev/null || true) == "$dir/"* ]]; then
                        seen[$pid]=1
                        break
                    fi
                done
                ;;
        esac
    done
    for pid in "${!seen[@]}"; do
        if alive "$pid"; then echo "$pid"; fi
    done
}

# SIGTERM the cluster's daemons, wait up to 10 s, then SIGKILL what is left.
kill_cluster() {
    local dir=$1 pids pid i
    pids=$(cluster_pids "$dir")
    [[ -n $pids ]] || return 0
    log "stopping old daemons of $dir (pids ${pids//$'\n'/ })"
    for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
    for ((i = 0; i < 100; i++)); do
        local left=""
        for pid in $pids; do if alive "$pid"; then left+=" $pid"; fi; done
        [[ -z $left ]] && break
        sleep 0.1
    done
    for pid in $pids; do
        if alive "$pid"; then
            log "pid $pid ignored SIGTERM, sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    for ((i = 0; i < 50; i++)); do
        local left=""
        for pid in $pids; do if alive "$pid"; then left+=" $pid"; fi; done
        [[ -z $left ]] && break
        sleep 0.1
    done
    rm -f "$dir/slurmctld.pid" "$dir"/slurmd-*.pid
}

# Refuse to start when slurmctld/slurmd of another cluster (another DIR or a system service) run on this
# host: they hold the ports 6817 and 17001-17002 that this cluster needs.
check_no_foreign_cluster() {
    local conf=$1/slurm.conf f pid comm cmd other
    for f in /proc/[0-9]*; do
        pid=${f#/proc/}
        comm=$(cat "$f/comm" 2>/dev/null || true)
        [[ $comm == slurmctld || $comm == slurmd ]] || continue
        alive "$pid" || continue
        cmd=$(tr '\0' ' ' <"$f/cmdline" 2>/dev/null || true)
        [[ " $cmd " == *" $conf "* ]] && continue
        other=$(sed -n 's/.* -f \([^ ]*\)\/slurm\.conf .*/\1/p' <<<" $cmd ")
        die "another Slurm daemon runs on this host (pid $pid: ${cmd% }); stop it first${other:+ (bash $0 stop $other)}"
    done
}

log_tails() {
    local dir=$1 f
    for f in "$dir/slurmctld.log" "$dir/slurmctld.stdout" "$dir"/slurmd-*.log "$dir"/slurmd-*.stdout; do
        [[ -s $f ]] || continue
        echo "----- tail of $f -----" >&2
        # The PMIx plugin errors are harmless noise (MpiDefault=none): leave them out.
        grep -v -e 'pmix' -e 'MPI: Cannot create context' "$f" | tail -n 25 >&2 || true
    done
}

# "n1 idle" lines, one per node; empty if the controller does not answer.
node_states() {
    timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true
}

# True if every node of NODES is in one of the given states (exact match: `idle*` is not `idle`).
nodes_in_states() {
    local states=$1 lines n st
    lines=$(node_states)
    for n in "${NODES[@]}"; do
        st=$(awk -v n="$n" '$1 == n { print $2; exit }' <<<"$lines")
        [[ -n $st && " $states " == *" $st "* ]] || return 1
    done
}

# ------------------------------------------------------------------------------------------------ start

ensure_packages() {
    local missing=() c
    for c in srun slurmctld munged mpirun; do
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    log "missing ${missing[*]}: installing slurm-wlm munge openmpi-bin with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update >&2 || die "apt-get update failed"
    apt-get install -y --no-install-recommends slurm-wlm munge openmpi-bin >&2 \
        || die "apt-get install slurm-wlm munge openmpi-bin failed"
    for c in srun slurmctld munged mpirun; do
        command -v "$c" >/dev/null 2>&1 || die "$c still missing after installing the packages"
    done
}

ensure_munge() {
    local key=/etc/munge/munge.key i
    id munge >/dev/null 2>&1 || die "user munge does not exist (is the munge package installed?)"
    if [[ ! -s $key ]]; then
        log "creating munge key $key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$key" >&2 || die "mungekey --create failed"
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none || die "cannot write $key"
        fi
    fi
    chown munge:munge /etc/munge "$key"
    chmod 0700 /etc/munge
    chmod 0400 "$key"
    if munge -n >/dev/null 2>&1; then return 0; fi
    log "starting munged"
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    # A dead munged can leave its socket/pid behind; munged refuses to start over a live one only.
    runuser -u munge -- /usr/sbin/munged --force </dev/null >/dev/null 2>&1 \
        || runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1 \
        || die "munged failed to start (see /var/log/munge/munged.log)"
    for ((i = 0; i < 50; i++)); do
        munge -n >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged started but 'munge -n' still fails after 5 s (see /var/log/munge/munged.log)"
}

ensure_hosts() {
    local n add=0
    for n in "${NODES[@]}"; do
        awk -v n="$n" '/^[[:space:]]*#/ { next } $1 ~ /^127\./ { for (i = 2; i <= NF; i++) if ($i == n) f = 1 }
                       END { exit !f }' /etc/hosts || add=1
    done
    if [[ $add -eq 1 ]]; then
        log "adding '127.0.0.1 ${NODES[*]}' to /etc/hosts"
        echo "127.0.0.1 ${NODES[*]}" >>/etc/hosts || die "cannot append to /etc/hosts"
    fi
}

make_fake_gpus() {
    local dir=$1 i f
    mkdir -p "$dir/gpu"
    for i in 0 1; do
        f=$dir/gpu/gpu$i
        [[ -c $f ]] && continue
        rm -f "$f"
        mknod "$f" c 1 3 || die "mknod $f failed (fake GPUs must be character devices)"
    done
}

write_config() {
    local dir=$1
    mkdir -p "$dir/state" "$dir/spool/n1" "$dir/spool/n2"
    cat >"$dir/slurm.conf.tmp" <<EOF
# Written by scripts/slurm_local_cluster.sh - a two-node test cluster on one host. Do not edit.
ClusterName=imagenet-elastic-ci
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only once its credential has expired (default 120 s); 10 s keeps the
# requeue test short. Past that, it waits for a scheduler pass: the main loop's every 60 s and the
# backfill's every 30 s by default, so a requeued job restarted ~20 s late; here they run every 2 s.
AuthInfo=cred_expire=10
CredType=cred/munge
GresTypes=gpu
SchedulerParameters=sched_interval=2,bf_interval=2

StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true

# Nodes come back by themselves after restarts (even if they were DOWN for a reason).
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
# Seconds between SIGTERM and SIGKILL when a job/step is cancelled or times out.
KillWait=5
InactiveLimit=0
# Finished jobs stay visible to scontrol/squeue for 300 s (no accounting database here). Note that
# sbatch --wait polls after 2 s, then 8 s more, then every 32 s (it backs off while the wait is
# < MinJobAge/2), so a short batch job returns after ~10 s; poll squeue yourself for quicker results.
MinJobAge=300

NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    cat >"$dir/gres.conf.tmp" <<EOF
# Written by scripts/slurm_local_cluster.sh - fake GPUs (character devices), no autodetection.
AutoDetect=off
NodeName=n[1-2] Name=gpu File=$dir/gpu/gpu[0-1]
EOF
    mv -f "$dir/slurm.conf.tmp" "$dir/slurm.conf"
    mv -f "$dir/gres.conf.tmp" "$dir/gres.conf"
}

start_daemons() {
    local dir=$1 conf=$1/slurm.conf n
    log "starting slurmctld"
    : >"$dir/slurmctld.stdout"
    # -c: forget the jobs of the saved state (see the header); -i: ignore unreadable state files (e.g. left by
    # another Slurm version) instead of refusing to start.
    slurmctld -f "$conf" -c -i </dev/null >>"$dir/slurmctld.stdout" 2>&1 \
        || { log_tails "$dir"; die "slurmctld failed to start"; }
    for n in "${NODES[@]}"; do
        log "starting slurmd -N $n"
        : >"$dir/slurmd-$n.stdout"
        slurmd -f "$conf" -N "$n" </dev/null >>"$dir/slurmd-$n.stdout" 2>&1 \
            || { log_tails "$dir"; die "slurmd -N $n failed to start"; }
    done
}

wait_ready() {
    local dir=$1 deadline resumed=0
    deadline=$((SECONDS + START_TIMEOUT))
    while ((SECONDS < deadline)); do
        if nodes_in_states "idle mixed allocated"; then return 0; fi
        # Nodes kept DOWN/DRAINED in the saved state with a responding slurmd: resume them once.
        if ((resumed == 0)) && node_states | grep -Eq ' (down|drained|draining)$'; then
            resumed=1
            timeout 10 scontrol update NodeName=n[1-2] State=RESUME >/dev/null 2>&1 || true
        fi
        sleep 0.25
    done
    echo "--- sinfo ---" >&2
    timeout 10 sinfo -N -l >&2 || true
    log_tails "$dir"
    die "nodes ${NODES[*]} not idle after ${START_TIMEOUT} s (logs above, under $dir)"
}

cmd_start() {
    require_root
    resolve_dir "${1:-}" create
    local dir=$DIR
    export SLURM_CONF=$dir/slurm.conf
    ensure_packages
    ensure_munge
    ensure_hosts
    kill_cluster "$dir"
    check_no_foreign_cluster "$dir"
    make_fake_gpus "$dir"
    write_config "$dir"
    start_daemons "$dir"
    wait_ready "$dir"
    log "cluster ready: $(node_states | tr '\n' ' ')(dir $dir)"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

# ------------------------------------------------------------------------------------------------- stop

cmd_stop() {
    require_root
    if ! resolve_dir "${1:-}"; then
        log "nothing to stop: $DIR does not exist"
        return 0
    fi
    local dir=$DIR jobs
    export SLURM_CONF=$dir/slurm.conf
    # Cancel the jobs first so that their slurmstepd and tasks end cleanly (KillWait=5).
    jobs=$( { [[ -f $SLURM_CONF ]] && timeout 5 squeue -h -o %i 2>/dev/null; } || true)
    if [[ -n $jobs ]]; then
        log "cancelling the jobs of $dir: ${jobs//$'\n'/ }"
        # shellcheck disable=SC2086
        timeout 10 scancel --quiet --full $jobs >/dev/null 2>&1 || true
        local i
        for ((i = 0; i < 40; i++)); do
            timeout 5 squeue -h -t PD,R,CG,S -o %i 2>/dev/null | grep -q . || break
            sleep 0.25
        done
    fi
    kill_cluster "$dir"
    log "stopped (munged left running)"
}

# ----------------------------------------------------------------------------------------------- status

cmd_status() {
    local dir
    if resolve_dir "${1:-}"; then dir=$DIR; else dir=$DIR; fi
    export SLURM_CONF=$dir/slurm.conf
    [[ -f $SLURM_CONF ]] || { echo "$PROG: no cluster configured in $dir" >&2; return 1; }
    if ! timeout 10 sinfo -N -o '%N %P %T %C %G'; then
        echo "$PROG: slurmctld of $dir does not answer" >&2
        return 1
    fi
    if nodes_in_states "idle mixed allocated"; then return 0; fi
    echo "$PROG: not all of ${NODES[*]} are up" >&2
    return 1
}

# ------------------------------------------------------------------------------------------------- main

[[ $# -ge 1 && $# -le 2 ]] || usage
case $1 in
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" || exit $? ;;
    status) cmd_status "${2:-}" || exit $? ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
