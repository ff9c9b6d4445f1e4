#!/usr/bin/env bash
# Start, stop or check a local two-node Slurm cluster on this machine (run as root).
#
#   scripts/local_slurm.sh start    # install packages if missing, start munge, slurmctld, slurmd n1 + n2
#   scripts/local_slurm.sh status   # exit 0 when both nodes are up
#   scripts/local_slurm.sh stop     # cancel all jobs, stop the daemons this script started
#
# Two emulated nodes share this host: partition "rollout" is node n1, partition "train"
# node n2 (slurm/local/slurm.conf.in). Each slurmd runs in its own mount namespace with
# its own /tmp, because Slurm's PMIx plugin wants a private /tmp per node; so anything
# both nodes must see (run directories, job output, the Python environment) has to live
# outside /tmp. Every command is idempotent.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TEMPLATE="$REPO_DIR/slurm/local/slurm.conf.in"
CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
STATE_DIR=${HPC_ASYNCPPO_SLURM_STATE:-/var/lib/hpc_asyncppo-slurm}
LOG_DIR=${HPC_ASYNCPPO_SLURM_LOGS:-/var/log/hpc_asyncppo-slurm}
MARKER=hpc_asyncppo-local-cluster
NODES=(n1 n2)
CTLD_PID=/run/slurmctld-hpcasyncppo.pid
READY_TIMEOUT_S=${HPC_ASYNCPPO_SLURM_READY_TIMEOUT:-60}

say() { echo "local_slurm: $*"; }
die() { echo "local_slurm: error: $*" >&2; exit 1; }

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

slurmd_pidfile() { echo "/run/slurmd-hpcasyncppo-$1.pid"; }

ensure_packages() {
    local missing=0 cmd
    for cmd in munged slurmctld slurmd sbatch srun mpirun; do
        command -v "$cmd" >/dev/null || missing=1
    done
    ls /usr/lib/*/slurm-wlm/mpi_pmix*.so >/dev/null 2>&1 || missing=1
    if (( missing )); then
        say "installing slurm-wlm, munge, openmpi (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            slurm-wlm munge openmpi-bin libopenmpi-dev >/dev/null
    fi
}

render_conf() {
    [[ -f "$TEMPLATE" ]] || die "missing $TEMPLATE"
    if [[ -f "$CONF" ]] && ! grep -q "$MARKER" "$CONF"; then
        die "$CONF exists and was not written by this script; move it away or set SLURM_CONF"
    fi
    local rendered
    rendered=$(sed -e "s|@HOST@|$(hostname -s)|g" -e "s|@STATE_DIR@|$STATE_DIR|g" \
        -e "s|@LOG_DIR@|$LOG_DIR|g" "$TEMPLATE")
    mkdir -p "$(dirname "$CONF")"
    if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$rendered" ]]; then
        if alive "$CTLD_PID"; then
            say "configuration changed: restarting the daemons"
            stop_daemons
        fi
        printf '%s\n' "$rendered" >"$CONF"
    fi
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    [[ -f /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (reinstall munge)"
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- munged --force
    touch "$STATE_DIR/started-munge"
}

start_slurmctld() {
    alive "$CTLD_PID" && return
    install -d -m 0755 "$STATE_DIR/ctld"
    slurmctld
}

start_slurmd() {
    local node=$1
    alive "$(slurmd_pidfile "$node")" && return
    local node_tmp="$STATE_DIR/nodes/$node/tmp"
    install -d -m 1777 "$node_tmp"
    install -d -m 0755 "$STATE_DIR/slurmd-$node"
    # A private mount namespace per node: its own /tmp (PMIx), nothing leaks to the host.
    unshare --mount --propagation private \
        sh -c "mount --bind '$node_tmp' /tmp && exec slurmd -N '$node'"
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT_S)) states
    while (( SECONDS < deadline )); do
        states=$(node_states || true)
        if [[ -n "$states" ]] && ! grep -qvE ' (idle|mixed|allocated|completing)$' <<<"$states"; then
            [[ $(wc -l <<<"$states") -ge ${#NODES[@]} ]] && return 0
        fi
        # Nodes left down or drained by an earlier unclean stop come back here.
        if grep -qE ' (down|drained|draining)' <<<"$states"; then
            scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume 2>/dev/null || true
        fi
        sleep 1
    done
    die "nodes not ready after ${READY_TIMEOUT_S}s: $(tr '\n' ' ' <<<"$states"); see $LOG_DIR"
}

stop_daemons() {
    local node pids=()
    for node in "${NODES[@]}"; do
        if alive "$(slurmd_pidfile "$node")"; then pids+=("$(cat "$(slurmd_pidfile "$node")")"); fi
    done
    if alive "$CTLD_PID"; then pids+=("$(cat "$CTLD_PID")"); fi
    (( ${#pids[@]} )) || return 0
    kill "${pids[@]}" 2>/dev/null || true
    local deadline=$((SECONDS + 15)) pid
    while (( SECONDS < deadline )); do
        local left=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
        (( left )) || return 0
        sleep 0.5
    done
    kill -9 "${pids[@]}" 2>/dev/null || true
}

cmd_start() {
    [[ $(id -u) -eq 0 ]] || die "run as root (it starts system daemons)"
    ensure_packages
    install -d -m 0755 "$STATE_DIR" "$LOG_DIR"
    render_conf
    start_munge
    start_slurmctld
    local node
    for node in "${NODES[@]}"; do start_slurmd "$node"; done
    wait_ready
    say "up: partitions $(sinfo -h -o '%P=%N' | tr '\n' ' ')(conf $CONF, logs $LOG_DIR)"
}

cmd_stop() {
    if alive "$CTLD_PID"; then
        local jobs
        jobs=$(squeue -h -o '%i' 2>/dev/null || true)
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            local deadline=$((SECONDS + 20))
            while (( SECONDS < deadline )) && [[ -n "$(squeue -h -o '%i' 2>/dev/null)" ]]; do
                sleep 0.5
            done
        fi
    fi
    stop_daemons
    if [[ -f "$STATE_DIR/started-munge" ]]; then
        [[ -f /run/munge/munged.pid ]] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$STATE_DIR/started-munge"
    fi
    say "stopped"
}

cmd_status() {
    local ok=0 node
    alive "$CTLD_PID" && say "slurmctld running" || { say "slurmctld not running"; ok=1; }
    for node in "${NODES[@]}"; do
        alive "$(slurmd_pidfile "$node")" && say "slurmd $node running" \
            || { say "slurmd $node not running"; ok=1; }
    done
    (( ok == 0 )) && sinfo -N -o '%N %P %T %c' 2>/dev/null
    return $ok
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    restart) cmd_stop; cmd_start ;;
    *) echo "usage: $0 start|stop|status|restart" >&2; exit 2 ;;
esac
