#!/usr/bin/env bash
# Benchmark: the same workloads on a native directory, on awcpfs (through a real loopback
# Delegator export) and on sshfs (over a private loopback sshd), with a table of medians and
# ratios. See docs/BENCHMARKS.md for the method and the latest results.
#
#   bash scripts/bench.sh --quick          # small sizes, a few minutes
#   bash scripts/bench.sh                  # default: 20,000 files, 512 MiB, 300 C units
#   bash scripts/bench.sh --files 100000   # the large case
#
# Needs root (mounts, drop_caches), /dev/fuse, and Debian's apt-get to install missing tools
# (fio, sshfs, openssh-server, make, gcc, git, python3).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bash scripts/bench.sh [options]

  --quick             small sizes for a sanity run: 2,000 files, 64 MiB file, 30 C units,
                      3 runs, 2 s fio jobs (explicit flags still win)
  --files N           files in the synthetic repository (default 20000; 100000 = large case)
  --runs N            timed runs per cell; each figure is their median (default 5)
  --only LIST         comma-separated workloads: delegate,git,stat,read,seq,fio,make,visible
  --big-mib N         size of the sequential-read file in MiB (default 512)
  --c-units N         C compilation units (default 300)
  --fio-secs N        length of each fio job in seconds (default 5)
  --samples N         close->visible samples (default 20)
  --ttl-sleep S       sleep before the "after the TTL" git status (default 1.5)
  --bin-dir DIR       directory holding awcpfs and awcp-ctl (env AWCP_BENCH_BIN_DIR);
                      default: build them with cargo into the workspace's target/release
  --work-dir DIR      where the dataset, mounts and logs live (env AWCP_BENCH_WORK_DIR;
                      default a new directory under /var/tmp, removed at exit);
                      an existing dataset of the same parameters there is reused
  --out-dir DIR       where results-<time>.md and .tsv go
                      (env AWCP_BENCH_OUT_DIR; default /var/tmp/awcpfs-bench-results)
  --keep              keep the work directory (dataset, logs) at exit
  --step-timeout S    upper bound on any single timed command (default 900)
  --cell-budget S     stop repeating a cell once its runs took this long, keeping the
                      samples so far (default 300; 60 with --quick); the table marks
                      cells with fewer than --runs samples
  -h, --help          this text
EOF
}

T_START=$SECONDS
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HELPERS=$REPO_DIR/scripts/bench

FILES= BIG_MIB= C_UNITS= RUNS= FIO_SECS= QUICK=0 ONLY= KEEP=0
SAMPLES=20 TTL_SLEEP=1.5 STEP_TIMEOUT=900 CELL_BUDGET=
BIN_DIR=${AWCP_BENCH_BIN_DIR:-}
WORK=${AWCP_BENCH_WORK_DIR:-}
OUT_DIR=${AWCP_BENCH_OUT_DIR:-/var/tmp/awcpfs-bench-results}

need_arg() { [[ $# -ge 2 && -n $2 ]] || { echo "bench: $1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --quick) QUICK=1 ;;
        --files) need_arg "$@"; FILES=$2; shift ;;
        --runs) need_arg "$@"; RUNS=$2; shift ;;
        --only) need_arg "$@"; ONLY=$2; shift ;;
        --big-mib) need_arg "$@"; BIG_MIB=$2; shift ;;
        --c-units) need_arg "$@"; C_UNITS=$2; shift ;;
        --fio-secs) need_arg "$@"; FIO_SECS=$2; shift ;;
        --samples) need_arg "$@"; SAMPLES=$2; shift ;;
        --ttl-sleep) need_arg "$@"; TTL_SLEEP=$2; shift ;;
        --bin-dir) need_arg "$@"; BIN_DIR=$2; shift ;;
        --work-dir) need_arg "$@"; WORK=$2; shift ;;
        --out-dir) need_arg "$@"; OUT_DIR=$2; shift ;;
        --keep) KEEP=1 ;;
        --step-timeout) need_arg "$@"; STEP_TIMEOUT=$2; shift ;;
        --cell-budget) need_arg "$@"; CELL_BUDGET=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [[ $QUICK == 1 ]]; then
    : "${FILES:=2000}" "${BIG_MIB:=64}" "${C_UNITS:=30}" "${RUNS:=3}" "${FIO_SECS:=2}" "${CELL_BUDGET:=60}"
else
    : "${FILES:=20000}" "${BIG_MIB:=512}" "${C_UNITS:=300}" "${RUNS:=5}" "${FIO_SECS:=5}" "${CELL_BUDGET:=300}"
fi
for v in FILES BIG_MIB C_UNITS RUNS FIO_SECS SAMPLES STEP_TIMEOUT CELL_BUDGET; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { o=${v,,}; echo "bench: --${o//_/-} must be a positive integer" >&2; exit 2; }
done
[[ $TTL_SLEEP =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "bench: --ttl-sleep must be a number" >&2; exit 2; }
ALL_WORKLOADS=(delegate git stat read seq fio make visible)
if [[ -n $ONLY ]]; then
    IFS=, read -r -a WORKLOADS <<<"$ONLY"
    for w in "${WORKLOADS[@]}"; do
        [[ " ${ALL_WORKLOADS[*]} " == *" $w "* ]] ||
            { echo "bench: unknown workload '$w' (one of: ${ALL_WORKLOADS[*]})" >&2; exit 2; }
    done
else
    WORKLOADS=("${ALL_WORKLOADS[@]}")
fi
wants() { [[ " ${WORKLOADS[*]} " == *" $1 "* ]]; }

# ---------------------------------------------------------------------------------------------
# logging and process bookkeeping

log() { printf '[bench %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

declare -A EXPORT_PID=() MOUNT_PID=() STATE_OF=()
CTL_PIDS=()
SSHD_PID=
SSHFS_MNT=
WORK_CREATED=0
CLEANED=0

is_alive() {
    local s
    s=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ -n $s && $s != Z* ]]
}

# stop_pid PID SECONDS [SIGNAL]: send SIGNAL (default INT), wait up to SECONDS, then SIGKILL.
stop_pid() {
    local pid=$1 t=${2:-30} sig=${3:-INT} end
    [[ -n $pid ]] || return 0
    if is_alive "$pid"; then
        kill -"$sig" "$pid" 2>/dev/null || true
        end=$((SECONDS + t))
        while is_alive "$pid" && ((SECONDS < end)); do sleep 0.1; done
        if is_alive "$pid"; then
            log "process $pid did not stop within ${t}s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.2
        fi
    fi
    wait "$pid" 2>/dev/null || true
}

force_unmount() {
    local m=$1
    [[ -n $m ]] || return 0
    if mountpoint -q "$m" 2>/dev/null; then
        timeout 30 fusermount3 -u "$m" 2>/dev/null || timeout 30 fusermount3 -uz "$m" 2>/dev/null ||
            timeout 30 umount -l "$m" 2>/dev/null || log "could not unmount $m"
    fi
}

cleanup() {
    local rc=$?
    [[ $CLEANED == 1 ]] && return
    CLEANED=1
    set +e
    cd / || true
    local n
    for n in "${!MOUNT_PID[@]}"; do stop_pid "${MOUNT_PID[$n]}" 60; done
    for n in "${!EXPORT_PID[@]}"; do stop_pid "${EXPORT_PID[$n]}" 10; done
    local p
    for p in "${CTL_PIDS[@]}"; do stop_pid "$p" 60; done
    if [[ -n ${WORK:-} && -d $WORK/mnt ]]; then
        for n in "$WORK"/mnt/* "$WORK"/ctl/executor/work/*; do force_unmount "$n"; done
    fi
    force_unmount "$SSHFS_MNT"
    stop_pid "$SSHD_PID" 10 TERM
    if [[ $WORK_CREATED == 1 && $KEEP == 0 && -n ${WORK:-} && -d $WORK ]]; then
        if grep -qs " ${WORK}/" /proc/mounts; then
            log "something is still mounted under $WORK; leaving it in place"
        else
            rm -rf "$WORK"
        fi
    elif [[ -n ${WORK:-} && -d $WORK ]]; then
        log "work directory kept: $WORK"
    fi
    ((rc == 0)) || log "exited with status $rc (logs were in ${LOGS:-?})"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# wait_for DESCRIPTION SECONDS PID COMMAND...: poll COMMAND until it succeeds; fail if PID
# (when not "-") dies or the time is up.
wait_for() {
    local desc=$1 t=$2 pid=$3 end
    shift 3
    end=$((SECONDS + t))
    until "$@" >/dev/null 2>&1; do
        if [[ $pid != - ]] && ! is_alive "$pid"; then
            log "$desc: the process exited"
            return 1
        fi
        if ((SECONDS >= end)); then
            log "$desc: not ready after ${t}s"
            return 1
        fi
        sleep 0.05
    done
}

# ---------------------------------------------------------------------------------------------
# prerequisites

[[ $(id -u) == 0 ]] || die "run as root: the benchmark mounts filesystems and drops the page cache"
[[ -c /dev/fuse ]] || die "/dev/fuse is missing (load the fuse module or run with --device /dev/fuse)"

ensure_tools() {
    local -A pkg_of=(
        [fio]=fio [sshfs]=sshfs [/usr/sbin/sshd]=openssh-server [ssh-keygen]=openssh-client
        [make]=make [gcc]=gcc [git]=git [python3]=python3 [fusermount3]=fuse3
        [mountpoint]=util-linux [timeout]=coreutils [ps]=procps
    )
    local missing=() c
    for c in "${!pkg_of[@]}"; do
        command -v "$c" >/dev/null 2>&1 || missing+=("${pkg_of[$c]}")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || die "missing tools (${missing[*]}) and no apt-get to install them"
    log "installing from Debian: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    timeout 900 apt-get update -qq >/dev/null || die "apt-get update failed"
    timeout 1800 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
        die "apt-get install ${missing[*]} failed"
}
ensure_tools

if [[ -z $BIN_DIR ]]; then
    command -v cargo >/dev/null || die "cargo not found; build awcpfs and awcp-ctl and pass --bin-dir"
    BIN_DIR=${CARGO_TARGET_DIR:-$REPO_DIR/target}/release
    log "building awcpfs and awcp-ctl (release) into $BIN_DIR"
    (cd "$REPO_DIR" && timeout 3600 cargo build --release -q -p awcpfs -p awcp-ctl) ||
        die "cargo build failed"
fi
BIN_DIR=$(cd "$BIN_DIR" && pwd) || die "--bin-dir $BIN_DIR does not exist"
AWCPFS=$BIN_DIR/awcpfs
AWCP_CTL=$BIN_DIR/awcp-ctl
[[ -x $AWCPFS && -x $AWCP_CTL ]] || die "no awcpfs / awcp-ctl in $BIN_DIR"

# ---------------------------------------------------------------------------------------------
# work directory, dataset

if [[ -z $WORK ]]; then
    WORK=$(mktemp -d /var/tmp/awcpfs-bench.XXXXXX)
    WORK_CREATED=1
else
    mkdir -p "$WORK"
    WORK=$(cd "$WORK" && pwd)
fi
SRC=$WORK/src
MNT=$WORK/mnt
RUN=$WORK/run
LOGS=$WORK/logs
mkdir -p "$MNT" "$RUN" "$LOGS" "$WORK/state" "$OUT_DIR"
STAMP="files=$FILES big=$BIG_MIB units=$C_UNITS v1"
RAW=$RUN/raw.tsv
: >"$RAW"
STEPLOG=$LOGS/steps.log
export GIT_CONFIG_GLOBAL=$RUN/gitconfig GIT_CONFIG_NOSYSTEM=1
printf '[safe]\n\tdirectory = *\n[user]\n\tname = bench\n\temail = bench@example.invalid\n' \
    >"$GIT_CONFIG_GLOBAL"

if [[ -f $SRC/.stamp && $(cat "$SRC/.stamp") == "$STAMP" ]]; then
    log "reusing the dataset in $SRC ($STAMP)"
else
    rm -rf "$SRC"
    log "generating the dataset: $FILES files, ${BIG_MIB} MiB file, $C_UNITS C units"
    timeout 3600 python3 "$HELPERS/gen.py" --root "$SRC" --files "$FILES" \
        --big-mib "$BIG_MIB" --c-units "$C_UNITS" || die "dataset generation failed"
    echo "$STAMP" >"$SRC/.stamp"
fi
# start from a known state even with a reused dataset
make -s -C "$SRC/cproj" clean >/dev/null
find "$SRC/scratch" -mindepth 1 -delete
git -C "$SRC/repo" status >/dev/null
BIG_BYTES=$(stat -c %s "$SRC/big/big.bin")

DROP_OK=1
drop_caches() {
    [[ $DROP_OK == 1 ]] || return 0
    sync
    if ! echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
        DROP_OK=0
        log "WARNING: cannot drop the page cache; 'cold' figures are not cold"
    fi
}

# ---------------------------------------------------------------------------------------------
# awcpfs: export + mount, by name (repo, big, cproj, scratch); the mount is $MNT/<name>

SEQ=0
awcpfs_up() {
    local name=$1 src=$2
    local h=$RUN/$name.handle st=$WORK/state/$name.$((++SEQ)) mnt=$MNT/$name
    rm -f "$h"
    mkdir -p "$mnt" "$st"
    STATE_OF[$name]=$st
    "$AWCPFS" export "$src" --listen 127.0.0.1:0 --handle-out "$h" --state-dir "$st/export" \
        >>"$LOGS/awcpfs-$name-export.log" 2>&1 &
    EXPORT_PID[$name]=$!
    wait_for "awcpfs export of $src" 900 "${EXPORT_PID[$name]}" \
        python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$h" || return 1
    "$AWCPFS" mount "$h" "$mnt" --state-dir "$st/mount" >>"$LOGS/awcpfs-$name-mount.log" 2>&1 &
    MOUNT_PID[$name]=$!
    wait_for "awcpfs mount at $mnt" 300 "${MOUNT_PID[$name]}" mount_ready "$mnt" "$src" || return 1
}
# mount_ready MOUNTPOINT SOURCE: mounted, and listing it shows files when the source has any
mount_ready() {
    mountpoint -q "$1" || return 1
    [[ -z $(ls -A "$2") ]] && { ls -A "$1" >/dev/null; return; }
    [[ -n $(ls -A "$1") ]]
}

awcpfs_down() {
    local name=$1 st=${STATE_OF[$1]:-}
    if [[ -n ${MOUNT_PID[$name]:-} ]]; then
        [[ -f $st/mount/status.json ]] && cp "$st/mount/status.json" "$LOGS/awcpfs-$name-status.$SEQ.json"
        stop_pid "${MOUNT_PID[$name]}" 300   # SIGINT: write back, unmount
        unset "MOUNT_PID[$name]"
    fi
    force_unmount "$MNT/$name"
    if [[ -n ${EXPORT_PID[$name]:-} ]]; then
        stop_pid "${EXPORT_PID[$name]}" 30
        unset "EXPORT_PID[$name]"
    fi
    [[ -n $st ]] && rm -rf "$st"
    unset "STATE_OF[$name]"
    return 0
}

# a fresh export (re-registered: the manifest is a snapshot) and a fresh mount with an
# empty state directory
awcpfs_fresh() { awcpfs_down "$1"; awcpfs_up "$1" "$2"; }

# ---------------------------------------------------------------------------------------------
# sshfs over a private loopback sshd

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

sshd_start() {
    local d=$WORK/sshd
    mkdir -p "$d" /run/sshd
    rm -f "$d"/host_key* "$d"/client_key*
    ssh-keygen -q -t ed25519 -N '' -f "$d/host_key"
    ssh-keygen -q -t ed25519 -N '' -f "$d/client_key"
    cp "$d/client_key.pub" "$d/authorized_keys"
    SSH_PORT=$(free_port)
    cat >"$d/sshd_config" <<EOF
Port $SSH_PORT
ListenAddress 127.0.0.1
HostKey $d/host_key
PidFile $d/sshd.pid
AuthorizedKeysFile $d/authorized_keys
PermitRootLogin yes
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
Subsystem sftp /usr/lib/openssh/sftp-server
EOF
    /usr/sbin/sshd -D -e -f "$d/sshd_config" 2>>"$LOGS/sshd.log" &
    SSHD_PID=$!
    wait_for "sshd on port $SSH_PORT" 30 "$SSHD_PID" \
        ssh -o BatchMode=yes -o ConnectTimeout=5 -o IdentityFile="$d/client_key" -o StrictHostKeyChecking=no \
        -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -p "$SSH_PORT" root@127.0.0.1 true ||
        die "sshd did not start (see $LOGS/sshd.log)"
    SSHFS_MNT=$MNT/sshfs
    mkdir -p "$SSHFS_MNT"
    log "sshd listening on 127.0.0.1:$SSH_PORT"
}

sshfs_up() {
    local d=$WORK/sshd
    timeout 60 sshfs -o "IdentityFile=$d/client_key,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,port=$SSH_PORT,BatchMode=yes,LogLevel=ERROR" \
        "root@127.0.0.1:$SRC" "$SSHFS_MNT" 2>>"$LOGS/sshfs.log" || return 1
    wait_for "sshfs mount" 30 - mount_ready "$SSHFS_MNT" "$SRC"
}
sshfs_down() { force_unmount "$SSHFS_MNT"; }
sshfs_fresh() { sshfs_down; sshfs_up; }

# ---------------------------------------------------------------------------------------------
# timing

record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RAW"; }
us_to_s() { printf -v "$1" '%d.%06d' $(($2 / 1000000)) $(($2 % 1000000)); }

# The fixed cost of one measured command (timeout + sh), subtracted from every sample.
OVERHEAD_US=0
measure_overhead() {
    local i t0 t1 samples=()
    for ((i = 0; i < 21; i++)); do
        t0=${EPOCHREALTIME/./}
        timeout -k 10 "$STEP_TIMEOUT" sh -c ':'
        t1=${EPOCHREALTIME/./}
        samples+=($((t1 - t0)))
    done
    OVERHEAD_US=$(printf '%s\n' "${samples[@]}" | sort -n | sed -n 11p)
    log "per-command overhead (timeout + sh): ${OVERHEAD_US} µs, subtracted from every sample"
}

# run_step DIR CMD: run CMD with sh in DIR, bounded by the step timeout; output to the step log.
run_step() {
    local dir=$1 cmd=$2 rc=0
    cd "$dir" || return 1
    timeout -k 10 "$STEP_TIMEOUT" sh -c "$cmd" >>"$STEPLOG" 2>&1 || rc=$?
    cd "$WORK"
    return $rc
}

# measure WORKLOAD VARIANT CONFIG DIR PREP CMD [CHECK]: RUNS times, eval PREP (untimed; "-"
# for nothing), time CMD in DIR, then eval CHECK (untimed; it must succeed for the sample to
# count). The first failure records "fail" and ends the cell; so does the cell budget.
measure() {
    local w=$1 v=$2 c=$3 dir=$4 prep=$5 cmd=$6 check=${7:-} i t0 t1 d s rc
    local cell_start=$SECONDS
    log "  $w/$v on $c: $cmd"
    for ((i = 1; i <= RUNS; i++)); do
        if [[ $prep != - ]] && ! eval "$prep" >>"$STEPLOG" 2>&1; then
            log "  FAILED to prepare $w/$v on $c (run $i): $prep"
            record "$w" "$v" "$c" s fail
            return 0
        fi
        echo "== $w/$v/$c run $i: $cmd" >>"$STEPLOG"
        rc=0
        t0=${EPOCHREALTIME/./}
        run_step "$dir" "$cmd" || rc=$?
        t1=${EPOCHREALTIME/./}
        if ((rc != 0)); then
            log "  FAILED: $w/$v on $c (run $i) exited $rc$( ((rc == 124)) && echo " (timed out after ${STEP_TIMEOUT}s)"); last output:"
            tail -n 5 "$STEPLOG" | sed 's/^/      /' >&2
            record "$w" "$v" "$c" s fail
            return 0
        fi
        if [[ -n $check ]] && ! eval "$check" >>"$STEPLOG" 2>&1; then
            log "  FAILED: $w/$v on $c (run $i): the result check failed: $check"
            tail -n 3 "$STEPLOG" | sed 's/^/      /' >&2
            record "$w" "$v" "$c" s fail
            return 0
        fi
        d=$((t1 - t0 - OVERHEAD_US))
        ((d > 0)) || d=1
        us_to_s s "$d"
        record "$w" "$v" "$c" s "$s"
        if ((i < RUNS && SECONDS - cell_start > CELL_BUDGET)); then
            log "  $w/$v on $c: $i run(s) took $((SECONDS - cell_start))s, over the cell budget (${CELL_BUDGET}s); keeping $i sample(s)"
            break
        fi
    done
}

# warmup CONFIG DIR CMD: one untimed run (fills caches / fetches content).
warmup() {
    echo "== warm-up on $1: $3" >>"$STEPLOG"
    run_step "$2" "$3" || { log "  warm-up on $1 failed: $3"; return 1; }
}

# fail_cells WORKLOAD CONFIG VARIANT...: record failures when a setup step broke.
fail_cells() {
    local w=$1 c=$2 v
    shift 2
    for v in "$@"; do record "$w" "$v" "$c" s fail; done
}

# ---------------------------------------------------------------------------------------------
# workloads

wl_delegate() {
    log "workload: delegate -> usable mount (awcp-ctl serve + executor on loopback)"
    local api_port export_port exec_port d=$WORK/ctl ts=$RUN/agent-ts
    rm -rf "$d"
    mkdir -p "$d/delegator" "$d/executor"
    api_port=$(free_port) export_port=$(free_port) exec_port=$(free_port)
    "$AWCP_CTL" serve --state-dir "$d/delegator" --listen "127.0.0.1:$api_port" \
        --export-listen "127.0.0.1:$export_port" >>"$LOGS/ctl-serve.log" 2>&1 &
    CTL_PIDS+=($!)
    local serve_pid=$!
    # The agent's first action is to print the time; it runs with cwd = the mount.
    "$AWCP_CTL" executor --dir "$d/executor" --listen "127.0.0.1:$exec_port" \
        --agent-cmd "date +%s%N > '$ts'; ls -A > /dev/null" >>"$LOGS/ctl-executor.log" 2>&1 &
    CTL_PIDS+=($!)
    local exec_pid=$!
    if ! wait_for "awcp-ctl serve" 60 "$serve_pid" \
            python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$api_port" ||
        ! wait_for "awcp-ctl executor" 60 "$exec_pid" \
            python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$exec_port"; then
        fail_cells delegate awcpfs 1k n
        return 0
    fi
    local variant dir i t0 t1 s rc
    for variant in 1k n; do
        [[ $variant == 1k ]] && dir=$SRC/repo-1k || dir=$SRC/repo
        log "  delegate/$variant: awcp-ctl delegate $dir --wait"
        for ((i = 0; i <= RUNS; i++)); do   # run 0 is the warm-up
            rm -f "$ts"
            rc=0
            t0=${EPOCHREALTIME/./}
            timeout -k 10 "$STEP_TIMEOUT" "$AWCP_CTL" --daemon "http://127.0.0.1:$api_port" \
                delegate "$dir" --to "http://127.0.0.1:$exec_port/awcp" --task bench --wait \
                >>"$LOGS/ctl-delegate.log" 2>&1 || rc=$?
            if ((rc != 0)) || [[ ! -s $ts ]]; then
                log "  FAILED: delegate/$variant (run $i) exited $rc; see $LOGS/ctl-delegate.log"
                tail -n 5 "$LOGS/ctl-delegate.log" | sed 's/^/      /' >&2
                record delegate "$variant" awcpfs s fail
                break
            fi
            ((i == 0)) && continue
            t1=$(($(cat "$ts") / 1000))
            us_to_s s $((t1 - t0))
            record delegate "$variant" awcpfs s "$s"
        done
    done
    stop_pid "$exec_pid" 60
    stop_pid "$serve_pid" 30
    CTL_PIDS=()
}

GIT_CMD='git status >/dev/null'
native_git_refresh() { git -C "$SRC/repo" status >/dev/null; }

wl_git() {
    log "workload: git status"
    local R=$SRC/repo
    warmup native "$R" "$GIT_CMD"
    measure git cold native "$R" drop_caches "$GIT_CMD"
    measure git warm native "$R" - "$GIT_CMD"
    measure git ttl native "$R" "sleep $TTL_SLEEP" "$GIT_CMD"
    # remote-cold: the index holds the Delegator's native stat data, as after local work
    measure git cold awcpfs "$MNT/repo" "native_git_refresh && awcpfs_fresh repo $R && drop_caches" "$GIT_CMD"
    awcpfs_down repo
    if awcpfs_up repo "$R" && warmup awcpfs "$MNT/repo" "$GIT_CMD"; then
        measure git warm awcpfs "$MNT/repo" - "$GIT_CMD"
        measure git ttl awcpfs "$MNT/repo" "sleep $TTL_SLEEP" "$GIT_CMD"
    else
        fail_cells git awcpfs warm ttl
    fi
    awcpfs_down repo
    measure git cold sshfs "$SSHFS_MNT/repo" "native_git_refresh && sshfs_fresh && drop_caches" "$GIT_CMD"
    if warmup sshfs "$SSHFS_MNT/repo" "$GIT_CMD"; then
        measure git warm sshfs "$SSHFS_MNT/repo" - "$GIT_CMD"
        measure git ttl sshfs "$SSHFS_MNT/repo" "sleep $TTL_SLEEP" "$GIT_CMD"
    else
        fail_cells git sshfs warm ttl
    fi
    native_git_refresh
}

STAT_CMD="find . -printf '%i %s %T@\n' >/dev/null"

wl_stat() {
    log "workload: stat walk"
    local R=$SRC/repo
    warmup native "$R" "$STAT_CMD"
    measure stat cold native "$R" drop_caches "$STAT_CMD"
    measure stat warm native "$R" - "$STAT_CMD"
    measure stat cold awcpfs "$MNT/repo" "awcpfs_fresh repo $R && drop_caches" "$STAT_CMD"
    awcpfs_down repo
    if awcpfs_up repo "$R" && warmup awcpfs "$MNT/repo" "$STAT_CMD"; then
        measure stat warm awcpfs "$MNT/repo" - "$STAT_CMD"
        local rss
        if rss=$(ps -o rss= -p "${MOUNT_PID[repo]}"); then
            record rss walk awcpfs mb "$(python3 -c "print(round(int('$rss') * 1024 / 1e6, 1))")"
            log "  awcpfs mount RSS after the walk: ${rss// /} KiB"
        fi
    else
        fail_cells stat awcpfs warm
    fi
    awcpfs_down repo
    measure stat cold sshfs "$SSHFS_MNT/repo" "sshfs_fresh && drop_caches" "$STAT_CMD"
    warmup sshfs "$SSHFS_MNT/repo" "$STAT_CMD" || true
    measure stat warm sshfs "$SSHFS_MNT/repo" - "$STAT_CMD"
}

READ_CMD='find . -type f -size -64k -exec cat {} + >/dev/null'

wl_read() {
    log "workload: read every small file"
    local R=$SRC/repo
    warmup native "$R" "$READ_CMD"
    measure read cold native "$R" drop_caches "$READ_CMD"
    measure read warm native "$R" - "$READ_CMD"
    measure read cold awcpfs "$MNT/repo" "awcpfs_fresh repo $R && drop_caches" "$READ_CMD"
    awcpfs_down repo
    if awcpfs_up repo "$R" && warmup awcpfs "$MNT/repo" "$READ_CMD"; then
        measure read warm awcpfs "$MNT/repo" - "$READ_CMD"
    else
        fail_cells read awcpfs warm
    fi
    awcpfs_down repo
    measure read cold sshfs "$SSHFS_MNT/repo" "sshfs_fresh && drop_caches" "$READ_CMD"
    warmup sshfs "$SSHFS_MNT/repo" "$READ_CMD" || true
    measure read warm sshfs "$SSHFS_MNT/repo" - "$READ_CMD"
}

SEQ_CMD='dd if=big.bin of=/dev/null bs=1M status=none'

wl_seq() {
    log "workload: sequential read of big.bin ($((BIG_BYTES >> 20)) MiB)"
    local B=$SRC/big
    warmup native "$B" "$SEQ_CMD"
    measure seq cold native "$B" drop_caches "$SEQ_CMD"
    measure seq warm native "$B" - "$SEQ_CMD"
    measure seq cold awcpfs "$MNT/big" "awcpfs_fresh big $B && drop_caches" "$SEQ_CMD"
    awcpfs_down big
    if awcpfs_up big "$B" && warmup awcpfs "$MNT/big" "$SEQ_CMD"; then
        measure seq warm awcpfs "$MNT/big" - "$SEQ_CMD"
    else
        fail_cells seq awcpfs warm
    fi
    awcpfs_down big
    measure seq cold sshfs "$SSHFS_MNT/big" "sshfs_fresh && drop_caches" "$SEQ_CMD"
    warmup sshfs "$SSHFS_MNT/big" "$SEQ_CMD" || true
    measure seq warm sshfs "$SSHFS_MNT/big" - "$SEQ_CMD"
}

# measure_fio CONFIG DIR VARIANT INVALIDATE: RUNS fio jobs of FIO_SECS each; records IOPS.
# INVALIDATE=0: the page cache is used as it is (warm); 1: fio drops the file's cached pages
# (fadvise DONTNEED) before the job, so the filesystem's own read path is measured.
measure_fio() {
    local c=$1 dir=$2 v=$3 inval=$4 i out=$RUN/fio.json iops
    local cmd="fio --name=randread --filename=big.bin --readonly --rw=randread --bs=4k \
--ioengine=psync --iodepth=1 --numjobs=1 --size=$BIG_BYTES --runtime=$FIO_SECS --time_based \
--invalidate=$inval --randrepeat=1 --output-format=json --output=$out"
    log "  fio/$v on $c: 4 KiB random reads, psync, 1 job, ${FIO_SECS}s, invalidate=$inval"
    for ((i = 1; i <= RUNS; i++)); do
        rm -f "$out"
        echo "== fio/$v/$c run $i" >>"$STEPLOG"
        if ! run_step "$dir" "$cmd" ||
            ! iops=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["jobs"][0]["read"]["iops"])' "$out"); then
            log "  FAILED: fio/$v on $c (run $i); see $STEPLOG"
            record fio "$v" "$c" iops fail
            return 0
        fi
        record fio "$v" "$c" iops "$iops"
    done
}

wl_fio() {
    log "workload: fio 4 KiB random reads on big.bin"
    local B=$SRC/big
    warmup native "$B" "$SEQ_CMD"
    measure_fio native "$B" warm 0
    measure_fio native "$B" uncached 1
    if awcpfs_up big "$B" && warmup awcpfs "$MNT/big" "$SEQ_CMD"; then
        measure_fio awcpfs "$MNT/big" warm 0
        measure_fio awcpfs "$MNT/big" uncached 1
    else
        record fio warm awcpfs iops fail
        record fio uncached awcpfs iops fail
    fi
    awcpfs_down big
    sshfs_fresh && warmup sshfs "$SSHFS_MNT/big" "$SEQ_CMD" || true
    measure_fio sshfs "$SSHFS_MNT/big" warm 0
    measure_fio sshfs "$SSHFS_MNT/big" uncached 1
}

MAKE_OUT=$RUN/make.out
MAKE_CMD="make -j2 >'$MAKE_OUT'"
EDIT_N=0
# edit 5 C files below DIR (append a line, so their content and mtime change). The sleep
# first keeps the edit out of the second the last build finished in: sshfs (SFTP v3) keeps
# mtimes in whole seconds, so make would otherwise see nothing to do.
edit5() {
    local dir=$1 u
    sleep 1.1
    EDIT_N=$((EDIT_N + 1))
    for u in 001 003 005 007 009; do
        printf '/* edit %d */\n' "$EDIT_N" >>"$dir/src/unit$u.c"
    done
}
make_clean_src() { make -s -C "$SRC/cproj" clean >/dev/null; }
# compiled N: the last make compiled exactly N units
compiled() {
    local n
    n=$(grep -c -- ' -c ' "$MAKE_OUT" || true)
    [[ $n == "$1" ]] || { echo "make compiled $n units, expected $1"; return 1; }
}

wl_make() {
    log "workload: make -j2 ($C_UNITS units)"
    local C=$SRC/cproj M=$MNT/cproj S=$SSHFS_MNT/cproj all=$((C_UNITS + 1))
    # native
    measure make clean-cold native "$C" "make_clean_src && drop_caches" "$MAKE_CMD" "compiled $all"
    warmup native "$C" "make clean >/dev/null && $MAKE_CMD" || true
    measure make clean-warm native "$C" "make -s -C '$C' clean" "$MAKE_CMD" "compiled $all"
    measure make rebuild native "$C" "edit5 '$C'" "$MAKE_CMD" "compiled 5"
    make_clean_src
    # awcpfs: remote-cold = fresh export and mount of a clean tree, caches dropped
    measure make clean-cold awcpfs "$M" "awcpfs_down cproj && make_clean_src && awcpfs_up cproj $C && drop_caches" "$MAKE_CMD" "compiled $all"
    awcpfs_down cproj
    make_clean_src
    if awcpfs_up cproj "$C" && warmup awcpfs "$M" "$MAKE_CMD"; then
        measure make clean-warm awcpfs "$M" "make -s -C '$M' clean" "$MAKE_CMD" "compiled $all"
        measure make rebuild awcpfs "$M" "edit5 '$M'" "$MAKE_CMD" "compiled 5"
    else
        fail_cells make awcpfs clean-warm rebuild
    fi
    awcpfs_down cproj
    make_clean_src
    # sshfs
    measure make clean-cold sshfs "$S" "make_clean_src && sshfs_fresh && drop_caches" "$MAKE_CMD" "compiled $all"
    warmup sshfs "$S" "make clean >/dev/null && $MAKE_CMD" || true
    measure make clean-warm sshfs "$S" "make -s -C '$S' clean" "$MAKE_CMD" "compiled $all"
    measure make rebuild sshfs "$S" "edit5 '$S'" "$MAKE_CMD" "compiled 5"
    make_clean_src
}

wl_visible() {
    log "workload: close -> visible at the Delegator ($SAMPLES samples)"
    local out=$RUN/visible.txt c mdir v
    for c in awcpfs sshfs; do
        if [[ $c == awcpfs ]]; then
            if ! awcpfs_up scratch "$SRC/scratch"; then
                record visible close awcpfs s fail
                awcpfs_down scratch
                continue
            fi
            mdir=$MNT/scratch
        else
            sshfs_fresh || { record visible close sshfs s fail; continue; }
            mdir=$SSHFS_MNT/scratch
        fi
        log "  visible/close on $c"
        if timeout -k 10 "$STEP_TIMEOUT" python3 "$HELPERS/visible.py" --mount-dir "$mdir" \
            --source-dir "$SRC/scratch" --samples "$SAMPLES" >"$out" 2>>"$STEPLOG"; then
            while read -r v; do record visible close "$c" s "$v"; done <"$out"
        else
            log "  FAILED: close -> visible on $c; see $STEPLOG"
            while read -r v; do record visible close "$c" s "$v"; done <"$out"
            record visible close "$c" s fail
        fi
        [[ $c == awcpfs ]] && awcpfs_down scratch
    done
    find "$SRC/scratch" -mindepth 1 -delete
}

# ---------------------------------------------------------------------------------------------
# main

cd "$WORK"
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
MEM=$(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)
FS_TYPE=$(stat -f -c %T "$WORK")
MACHINE="$(nproc) CPUs ($CPU), $MEM RAM, Linux $(uname -r), work dir on $FS_TYPE"
log "machine: $MACHINE"
log "binaries: $BIN_DIR; work dir: $WORK; runs per cell: $RUNS; workloads: ${WORKLOADS[*]}"
measure_overhead
if wants git || wants stat || wants read || wants seq || wants fio || wants make || wants visible; then
    sshd_start
    sshfs_up || die "sshfs mount failed (see $LOGS/sshfs.log)"
fi

for w in "${WORKLOADS[@]}"; do
    "wl_$w"
done
sshfs_down

STAMP_T=$(date +%Y%m%d-%H%M%S)
RESULT_MD=$OUT_DIR/results-$STAMP_T.md
RESULT_TSV=$OUT_DIR/results-$STAMP_T.tsv
cp "$RAW" "$RESULT_TSV"
printf '{"files": %d, "big_bytes": %d, "runs": %d, "samples": %d}\n' "$FILES" "$BIG_BYTES" "$RUNS" "$SAMPLES" >"$RUN/meta.json"
ELAPSED=$((SECONDS - T_START))
{
    echo "# awcpfs benchmark, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "* machine: $MACHINE"
    echo "* command: \`bash scripts/bench.sh$([[ $QUICK == 1 ]] && echo " --quick") --files $FILES --runs $RUNS --big-mib $BIG_MIB --c-units $C_UNITS --fio-secs $FIO_SECS${ONLY:+ --only $ONLY}\`"
    echo "* awcpfs: $("$AWCPFS" --version 2>/dev/null || echo '?')$(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null | sed 's/^/, commit /')"
    echo "* sshfs: $(sshfs --version 2>&1 | grep -m1 -i 'sshfs version' || echo '?'); $(ssh -V 2>&1)"
    echo "* dataset: $FILES files (log-normal, median 3 KiB) in git; $((BIG_BYTES >> 20)) MiB file; $C_UNITS C units x 30 headers"
    echo "* medians of $RUNS runs ($SAMPLES samples for close -> visible); wall time ${ELAPSED}s"
    [[ $DROP_OK == 1 ]] || echo "* WARNING: the page cache could not be dropped; cold figures are warm"
    echo
    python3 "$HELPERS/table.py" "$RAW" --meta "$RUN/meta.json"
} >"$RESULT_MD"
echo
cat "$RESULT_MD"
echo
log "results: $RESULT_MD (raw samples: $RESULT_TSV); took ${ELAPSED}s"
