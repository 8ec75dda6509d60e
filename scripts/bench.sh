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

# The whole script is one compound command ({ ... }), so bash reads all of it before running
# any of it: editing this file while a benchmark runs cannot change what that run executes.
{
usage() {
    cat <<'EOF'
usage: bash scripts/bench.sh [options]

  --quick             small sizes for a sanity run: 2,000 files, 64 MiB file, 30 C units,
                      3 runs, 2 s fio jobs (explicit flags still win)
  --files N           files in the synthetic repository (default 20000; 100000 = large case)
  --runs N            timed runs per cell; each figure is their median (default 5)
  --only LIST         comma-separated workloads:
                      replay,gitfsm,delegate,git,stat,read,seq,fio,make,loop,pyc,visible,
                      aecp,cold
                      (replay: an agent's session replayed (scripts/bench/replay.sh:
                      git status/log, grep searches, reading the hits, a test run, sed
                      edits, git diff, git status, the tests again, a commit) on native,
                      awcpfs as mounted by default, awcpfs with the other writeback-cache
                      setting (--replay-alt), awcpfs with git's fsmonitor as the Executor
                      hands it to agents, and sshfs - the headline figure;
                      gitfsm: git status warm, after the dentries were dropped, on a
                      fresh mount of the same export and on a fresh export's mount, with
                      git's fsmonitor served by the mount against without it and against
                      native ext4;
                      (loop: edit 5 C files -> make -j2 -> run the program -> git commit,
                      and append to 200 files -> git add -A -> git commit;
                      pyc: python3 -m compileall of ~1,800 modules, a write-heavy build;
                      aecp: git status and the stat walk on a mount with AECP on - 10,000
                      artifacts in its replica - against one with AECP off;
                      cold: the agent's first commands on a fresh mount: time to a
                      usable mount, the first git status, the first test run's reads,
                      and copying those files through the same link as the baseline)
  --replay-alt "..."  the mount options of the replay's second awcpfs arm (default
                      "--writeback-cache": the setting the default mount does not use)
  --big-mib N         size of the sequential-read file in MiB (default 512)
  --c-units N         C compilation units (default 300)
  --fio-secs N        length of each fio job in seconds (default 5)
  --samples N         close->visible samples (default 20)
  --ttl-sleep S       sleep before the "after the TTL" git status (default 1.5), which
                      also drops the kernel's dentries and inodes
  --bin-dir DIR       directory holding awcpfs and awcp-ctl (env AWCP_BENCH_BIN_DIR);
                      default: build them with cargo into the workspace's target/release
  --work-dir DIR      where the dataset, mounts and logs live (env AWCP_BENCH_WORK_DIR;
                      default a new directory under /var/tmp, removed at exit);
                      an existing dataset of the same parameters there is reused
  --out-dir DIR       where results-<time>.md and .tsv go
                      (env AWCP_BENCH_OUT_DIR; default /var/tmp/awcpfs-bench-results)
  --keep              keep the work directory (dataset, logs) at exit
  --step-timeout S    upper bound on any single timed command (default 900)
  --idle-wait S       before each cell, wait up to S seconds for other processes to leave
                      the CPUs idle, at most 10*S in all (default 30; 10 with --quick;
                      0 = don't wait); cells measured on a busy machine are counted
  --mount-opts "..."  extra options for `awcpfs mount` (e.g. "--passthrough",
                      "--no-writeback-cache", "--hydrate none")
  --warm-only         skip the cold cells (fresh mounts, dropped caches): for comparing
                      mount options on the warm loop quickly
  --link-delay-ms N   emulate a network link between the Executor and the Delegator:
                      N ms round trip (each direction delayed N/2 ms) for the awcpfs
                      data plane and for sshfs's ssh connection, through a userspace
                      TCP proxy (scripts/bench/linkproxy.py); default 0 = loopback
  --no-sshfs          leave out the sshfs arms of every cell (their figures do not depend
                      on awcpfs: useful to re-measure awcpfs alone; sshd still runs for
                      the cold workload's copy baseline)
  --libfuse           add a fourth arm to the git (warm), make and loop workloads: the
                      same workload on libfuse's own passthrough filesystem (passthrough_ll,
                      built from Debian's libfuse3-dev examples, -o cache=always,xattr)
                      over a copy of the tree, over /dev/fuse - a FUSE filesystem that
                      only forwards each request to a directory: what the kernel's FUSE
                      round trips cost a plain FUSE filesystem. It keeps a descriptor per
                      inode: a part with more entries than the open-file limit
                      (--files 20000 where that limit is 20,000) gets no such arm
  --link-mbit M       the emulated link's bandwidth, M Mbit/s each way, shared by all
                      connections (default 0 = unlimited); e.g. --link-delay-ms 20
                      --link-mbit 200 for a 20 ms / 200 Mbit/s link
  --cell-budget S     stop repeating a cell once its runs took this long, keeping the
                      samples so far (default 300; 60 with --quick); the table marks
                      cells with fewer than --runs samples
  --fleet N           instead of the workloads above: fleet mode. One Delegator, N Executors
                      (separate `awcp-ctl executor` processes and state dirs, no block
                      cache), all delegated one synthetic workspace of --files files of
                      4 KiB; each agent reads every file. Side by side: 1 Executor alone,
                      N without the block tier, N with it on a cold store, N on the warm
                      store (a second delegation). Reports the bytes the Delegator's
                      process sent vs those the store served, and the time until every
                      Executor had hydrated vs one alone. Starts s3s-fs on loopback
                      (installs it with cargo when missing). See docs/SCALING.md
  -h, --help          this text
EOF
}

T_START=$SECONDS
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HELPERS=$REPO_DIR/scripts/bench

FILES= BIG_MIB= C_UNITS= RUNS= FIO_SECS= QUICK=0 ONLY= KEEP=0 FLEET= WARM_ONLY=0 NO_SSHFS=0
SAMPLES=20 TTL_SLEEP=1.5 STEP_TIMEOUT=900 CELL_BUDGET= IDLE_WAIT= MOUNT_OPTS=
LINK_DELAY_MS=0 LINK_MBIT=0 NO_SSHFS=0 REPLAY_ALT=--writeback-cache LIBFUSE=0
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
        --warm-only) WARM_ONLY=1 ;;
        --no-sshfs) NO_SSHFS=1 ;;
        --libfuse) LIBFUSE=1 ;;
        --step-timeout) need_arg "$@"; STEP_TIMEOUT=$2; shift ;;
        --cell-budget) need_arg "$@"; CELL_BUDGET=$2; shift ;;
        --idle-wait) need_arg "$@"; IDLE_WAIT=$2; shift ;;
        --mount-opts) need_arg "$@"; MOUNT_OPTS=$2; shift ;;
        --replay-alt) need_arg "$@"; REPLAY_ALT=$2; shift ;;
        --fleet) need_arg "$@"; FLEET=$2; shift ;;
        --link-delay-ms) need_arg "$@"; LINK_DELAY_MS=$2; shift ;;
        --link-mbit) need_arg "$@"; LINK_MBIT=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [[ $QUICK == 1 ]]; then
    : "${FILES:=2000}" "${BIG_MIB:=64}" "${C_UNITS:=30}" "${RUNS:=3}" "${FIO_SECS:=2}" "${CELL_BUDGET:=60}" "${IDLE_WAIT:=10}"
else
    : "${FILES:=20000}" "${BIG_MIB:=512}" "${C_UNITS:=300}" "${RUNS:=5}" "${FIO_SECS:=5}" "${CELL_BUDGET:=300}" "${IDLE_WAIT:=30}"
fi
for v in FILES BIG_MIB C_UNITS RUNS FIO_SECS SAMPLES STEP_TIMEOUT CELL_BUDGET; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { o=${v,,}; echo "bench: --${o//_/-} must be a positive integer" >&2; exit 2; }
done
[[ $IDLE_WAIT =~ ^[0-9]+$ ]] || { echo "bench: --idle-wait must be a whole number" >&2; exit 2; }
[[ $TTL_SLEEP =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "bench: --ttl-sleep must be a number" >&2; exit 2; }
for v in LINK_DELAY_MS LINK_MBIT; do
    [[ ${!v} =~ ^[0-9]+(\.[0-9]+)?$ ]] || { o=${v,,}; echo "bench: --${o//_/-} must be a number" >&2; exit 2; }
done
LINK=0
[[ $LINK_DELAY_MS != 0 || $LINK_MBIT != 0 ]] && LINK=1
LINK_DESC=loopback
((LINK)) && LINK_DESC="emulated link: ${LINK_DELAY_MS} ms round trip, ${LINK_MBIT} Mbit/s each way (0: unlimited)"
ALL_WORKLOADS=(replay gitfsm delegate git stat read seq fio make loop pyc visible aecp cold)
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

# Fleet mode (--fleet N): its own harness (tests/src/bin/awcp-fleet.rs), then done.
if [[ -n $FLEET ]]; then
    [[ $FLEET =~ ^[1-9][0-9]*$ ]] || { echo "bench: --fleet must be a positive integer" >&2; exit 2; }
    [[ $(s3s-fs --version 2>/dev/null) == "s3s-fs 0.14.1" ]] ||
        cargo install --locked s3s-fs --version 0.14.1 --features binary ||
        { echo "bench: cannot install s3s-fs" >&2; exit 1; }
    FLEET_BIN=${BIN_DIR:-${CARGO_TARGET_DIR:-$REPO_DIR/target}/release}
    if [[ -z $BIN_DIR ]]; then
        (cd "$REPO_DIR" && timeout 3600 cargo build --release -q -p awcp-ctl -p awcp-tests --bin awcp-ctl --bin awcp-fleet) ||
            { echo "bench: cargo build failed" >&2; exit 1; }
    fi
    mkdir -p "$OUT_DIR"
    FLEET_OUT=$OUT_DIR/fleet-$(date +%Y%m%d-%H%M%S).md
    AWCP_CTL_BIN=$FLEET_BIN/awcp-ctl "$FLEET_BIN/awcp-fleet" --executors "$FLEET" --files "$FILES" \
        ${WORK:+--work "$WORK"} | tee "$FLEET_OUT"
    echo "bench: fleet results in $FLEET_OUT" >&2
    exit "${PIPESTATUS[0]}"
fi

# ---------------------------------------------------------------------------------------------
# logging and process bookkeeping

log() { printf '[bench %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

declare -A EXPORT_PID=() MOUNT_PID=() STATE_OF=() SRC_OF=() LINK_PID=() MOUNT_HANDLE=()
declare -A MOUNT_EXTRA=()   # mount options of one mount by name, after $MOUNT_OPTS
declare -A LIBFUSE_PID=()   # libfuse's passthrough_ll by part (--libfuse)
SSH_LINK_PID=
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
    for n in "${!LINK_PID[@]}"; do stop_pid "${LINK_PID[$n]}" 10 TERM; done
    for n in "${!LIBFUSE_PID[@]}"; do stop_pid "${LIBFUSE_PID[$n]}" 10 TERM; done
    local p
    for p in "${CTL_PIDS[@]}"; do stop_pid "$p" 60; done
    if [[ -n ${WORK:-} ]]; then   # anything still mounted below the work directory, deepest first
        while read -r n; do force_unmount "$n"; done < <(
            awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r)
    fi
    force_unmount "$SSHFS_MNT"
    stop_pid "$SSHD_PID" 10 TERM
    stop_pid "$SSH_LINK_PID" 10 TERM
    if ((rc != 0)) && [[ -n ${LOGS:-} && -d $LOGS ]]; then
        local keep_logs
        keep_logs=$OUT_DIR/failed-$(date +%Y%m%d-%H%M%S).logs
        cp -r "$LOGS" "$keep_logs" 2>/dev/null && log "logs copied to $keep_logs"
        [[ -n ${RAW:-} && -s $RAW ]] && cp "$RAW" "$keep_logs/raw.tsv" 2>/dev/null
    fi
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

BUILT=0
if [[ -z $BIN_DIR ]]; then
    BUILT=1
    command -v cargo >/dev/null || die "cargo not found; build awcpfs and awcp-ctl and pass --bin-dir"
    BIN_DIR=${CARGO_TARGET_DIR:-$REPO_DIR/target}/release
    log "building awcpfs and awcp-ctl (release) into $BIN_DIR"
    (cd "$REPO_DIR" && timeout 3600 cargo build --release -q -p awcpfs -p awcp-ctl) ||
        die "cargo build failed"
fi
BIN_DIR=$(cd "$BIN_DIR" && pwd) || die "--bin-dir $BIN_DIR does not exist"
AWCPFS=$BIN_DIR/awcpfs
AWCP_CTL=$BIN_DIR/awcp-ctl
[[ -x $AWCPFS ]] || die "no awcpfs in $BIN_DIR"
# awcp-ctl only for the delegate workload
! wants delegate || [[ -x $AWCP_CTL ]] || die "no awcp-ctl in $BIN_DIR (the delegate workload needs it)"

# ---------------------------------------------------------------------------------------------
# work directory, dataset

if [[ -z $WORK ]]; then
    WORK=$(mktemp -d /var/tmp/awcpfs-bench.XXXXXX)
    # mktemp's 0700 would stop the Executor's agent user on its way to its mounts
    # (the delegate workload); nothing below it is secret.
    chmod 711 "$WORK"
    WORK_CREATED=1
else
    mkdir -p "$WORK"
    WORK=$(cd "$WORK" && pwd)
fi
DATA=$WORK/data        # the generated dataset, and one copy of it per configuration:
D_NAT=$DATA/native     #   measured in place
D_AW=$DATA/awcpfs      #   exported by awcpfs, mounted at $MNT/<part>
D_SSH=$DATA/sshfs      #   served by sshd, mounted at $MNT/sshfs
MNT=$WORK/mnt
RUN=$WORK/run
LOGS=$WORK/logs
mkdir -p "$DATA" "$MNT" "$RUN" "$LOGS" "$WORK/state" "$OUT_DIR"
STAMP="files=$FILES big=$BIG_MIB units=$C_UNITS v2"
RAW=$RUN/raw.tsv
: >"$RAW"
STEPLOG=$LOGS/steps.log
export GIT_CONFIG_GLOBAL=$RUN/gitconfig GIT_CONFIG_NOSYSTEM=1
printf '[safe]\n\tdirectory = *\n[user]\n\tname = bench\n\temail = bench@example.invalid\n' \
    >"$GIT_CONFIG_GLOBAL"

if [[ -f $D_NAT/.stamp && $(cat "$D_NAT/.stamp") == "$STAMP" ]]; then
    log "reusing the dataset in $D_NAT ($STAMP)"
else
    rm -rf "$DATA"
    log "generating the dataset: $FILES files, ${BIG_MIB} MiB file, $C_UNITS C units"
    timeout 3600 python3 "$HELPERS/gen.py" --root "$D_NAT" --files "$FILES" \
        --big-mib "$BIG_MIB" --c-units "$C_UNITS" || die "dataset generation failed"
    echo "$STAMP" >"$D_NAT/.stamp"
fi
# The write-heavy build's tree: the Python standard library's modules (~1,800 .py files
# with its tests), compiled by `python3 -m compileall` (one .pyc each).
if [[ ! -f $D_NAT/pytree/.done1 ]]; then
    rm -rf "$D_NAT/pytree"
    mkdir -p "$D_NAT/pytree/stdlib"
    PYLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
    (cd "$PYLIB" && find . \( -name site-packages -o -name dist-packages -o -name __pycache__ \) -prune \
        -o -name '*.py' -print0 | tar --null -T - -cf - | tar -xf - -C "$D_NAT/pytree/stdlib") ||
        die "cannot copy the Python standard library from $PYLIB"
    touch "$D_NAT/pytree/.done1"
fi
# Each configuration works on its own copy, so what one writes (git's index, build outputs,
# edits) cannot change what another one sees while runs are interleaved. big.bin is only
# read: the copies share it through a hard link.
reset_copy() {
    local d=$1
    make -s -C "$d/cproj" clean >/dev/null
    find "$d/scratch" -mindepth 1 -delete
    find "$d/pytree" -name __pycache__ -prune -exec rm -rf {} +
    git -C "$d/repo" status >/dev/null      # the index holds this copy's native stat data
    git -C "$d/repo-1k" status >/dev/null
}
# Every copy a workload resets: native, awcpfs's, sshfs's, and libfuse's (--libfuse).
D_LF=$DATA/libfuse     #   served by libfuse's passthrough_ll, mounted at $MNT/libfuse-<part>
COPIES=("$D_NAT" "$D_AW" "$D_SSH")
((LIBFUSE)) && COPIES+=("$D_LF")
log "copying the dataset for ${#COPIES[@]} configurations"
for d in "${COPIES[@]:1}"; do
    rm -rf "$d"
    mkdir -p "$d"
    for part in repo repo-1k cproj scratch pytree; do cp -a "$D_NAT/$part" "$d/$part"; done
    cp -al "$D_NAT/big" "$d/big"
done
for d in "${COPIES[@]}"; do reset_copy "$d"; done
# The copies' pages are dirty: written back while the first cells run, they would slow
# those cells down (at 100,000 files the delegate cell took 1.0-1.2 s instead of 0.6 s).
log "writing the copies to disk (sync)"
sync
BIG_BYTES=$(stat -c %s "$D_NAT/big/big.bin")

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
# awcpfs_export_up NAME SRC [OPTION...]: serve SRC (registering walks and hashes the whole
# tree), with any further options for `awcpfs export`
awcpfs_export_up() {
    local name=$1 src=$2
    shift 2
    local h=$RUN/$name.handle st=$WORK/state/$name.$((++SEQ))
    rm -f "$h"
    mkdir -p "$st"
    STATE_OF[$name]=$st
    SRC_OF[$name]=$src
    "$AWCPFS" export "$src" --listen 127.0.0.1:0 --handle-out "$h" --state-dir "$st/export" "$@" \
        >>"$LOGS/awcpfs-$name-export.log" 2>&1 &
    EXPORT_PID[$name]=$!
    wait_for "awcpfs export of $src" 900 "${EXPORT_PID[$name]}" \
        python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$RUN/$name.handle" || return 1
    MOUNT_HANDLE[$name]=$RUN/$name.handle
    if ((LINK)); then
        # The mount reaches the export through the emulated link: a proxy in front of the
        # export's port, and a copy of the handle naming the proxy.
        local port
        port=$(python3 -c 'import json,sys,urllib.parse as u; print(u.urlsplit(json.load(open(sys.argv[1]))["endpoint"]).port)' "$h") || return 1
        link_proxy_up "$port" "$RUN/$name.proxy-port" >>"$LOGS/linkproxy-$name.log" 2>&1 || return 1
        LINK_PID[$name]=$LINK_PROXY_PID
        python3 - "$h" "$h.link" "$(cat "$RUN/$name.proxy-port")" <<'PY' || return 1
import json, sys, urllib.parse as u
h = json.load(open(sys.argv[1]))
e = u.urlsplit(h["endpoint"])
h["endpoint"] = u.urlunsplit((e.scheme, f"{e.hostname}:{sys.argv[3]}", e.path, e.query, e.fragment))
json.dump(h, open(sys.argv[2], "w"))
PY
        MOUNT_HANDLE[$name]=$h.link
    fi
}
# link_proxy_up TARGET_PORT PORT_FILE: start the link emulator in front of 127.0.0.1:TARGET_PORT
# -> LINK_PROXY_PID; its own port is written to PORT_FILE
link_proxy_up() {
    rm -f "$2"
    python3 "$HELPERS/linkproxy.py" --target "127.0.0.1:$1" --rtt-ms "$LINK_DELAY_MS" \
        --mbit "$LINK_MBIT" --port-file "$2" &
    LINK_PROXY_PID=$!
    wait_for "link proxy to port $1" 30 "$LINK_PROXY_PID" test -s "$2"
}
# awcpfs_mount_up NAME: mount NAME's export at $MNT/NAME with an empty state directory
awcpfs_mount_up() {
    local name=$1 mnt=$MNT/$1 st=${STATE_OF[$1]}
    mkdir -p "$mnt"
    # shellcheck disable=SC2086 # MOUNT_OPTS is a list of options
    local t0=${EPOCHREALTIME/./}
    "$AWCPFS" mount "${MOUNT_HANDLE[$name]}" "$mnt" --state-dir "$st/mount" $MOUNT_OPTS ${MOUNT_EXTRA[$name]:-} \
        >>"$LOGS/awcpfs-$name-mount.log" 2>&1 &
    MOUNT_PID[$name]=$!
    wait_for "awcpfs mount at $mnt" 300 "${MOUNT_PID[$name]}" mount_ready "$mnt" "${SRC_OF[$name]}" || return 1
    MOUNT_US=$((${EPOCHREALTIME/./} - t0))
}
awcpfs_up() { awcpfs_export_up "$1" "$2" && awcpfs_mount_up "$1"; }
# awcpfs_remount NAME: end NAME's mount (SIGINT: write back, unmount) and mount the same
# running export again with an empty state directory - a fresh mount, as after an
# Executor restart
awcpfs_remount() {
    local name=$1 st=${STATE_OF[$1]}
    if [[ -n ${MOUNT_PID[$name]:-} ]]; then
        stop_pid "${MOUNT_PID[$name]}" 300
        unset "MOUNT_PID[$name]"
    fi
    force_unmount "$MNT/$name"
    rm -rf "$st/mount"
    awcpfs_mount_up "$name"
}
# hydrated NAME...: wait until each named awcpfs mount's background hydration is through (its
# status.json says so, refreshed every few seconds), so that one fresh mount's hydration does
# not share the CPUs with another configuration's timed run.
hydrated() {
    local n
    for n in "$@"; do
        [[ -n ${STATE_OF[$n]:-} && -n ${MOUNT_PID[$n]:-} ]] || continue
        wait_for "hydration of the $n mount" 300 "${MOUNT_PID[$n]}" hydration_finished "${STATE_OF[$n]}/mount" ||
            return 1
    done
}
hydration_finished() {
    local sj
    sj=$(find "$1" -name status.json 2>/dev/null | head -n 1)
    [[ -n $sj ]] && python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["hydration"]["finished"] else 1)' "$sj"
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
        local sj
        sj=$(find "$st/mount" -name status.json 2>/dev/null | head -n 1)
        [[ -n $sj ]] && cp "$sj" "$LOGS/awcpfs-$name-status.$SEQ.json"
        stop_pid "${MOUNT_PID[$name]}" 300   # SIGINT: write back, unmount
        unset "MOUNT_PID[$name]"
    fi
    force_unmount "$MNT/$name"
    if [[ -n ${EXPORT_PID[$name]:-} ]]; then
        stop_pid "${EXPORT_PID[$name]}" 30
        unset "EXPORT_PID[$name]"
    fi
    if [[ -n ${LINK_PID[$name]:-} ]]; then
        stop_pid "${LINK_PID[$name]}" 10 TERM
        unset "LINK_PID[$name]"
    fi
    [[ -n $st ]] && rm -rf "$st"
    unset "STATE_OF[$name]" "SRC_OF[$name]"
    return 0
}

# awcpfs_cold NAME SRC, the remote-cold state: a fresh export (re-registered: the manifest is
# a snapshot), the page cache dropped (so the export reads from disk, like native cold), then
# a fresh mount with an empty state directory. The timed command starts as soon as the mount
# is usable, as an agent's first command would.
awcpfs_cold() {
    awcpfs_down "$1"
    awcpfs_export_up "$1" "$2" && drop_caches && awcpfs_mount_up "$1"
}

# ---------------------------------------------------------------------------------------------
# A plain FUSE filesystem (--libfuse): libfuse's own low-level passthrough example over a copy
# of a part, at $MNT/libfuse-<part>. It forwards every request to the copy and does nothing
# else (no journal, no write-back, no fetching): what it costs over native is what the
# kernel's FUSE round trips cost a filesystem that adds nothing. Built from Debian's
# libfuse3-dev examples at run time, never kept in the repository.

LIBFUSE_BIN=
LIBFUSE_WL=0   # set by the workloads that measure it (git, make, loop)
LIBFUSE_OK=0   # the current part's passthrough_ll mount is up and warm
libfuse_build() {
    local ex=/usr/share/doc/libfuse3-dev/examples src=$RUN/passthrough_ll.c
    if [[ ! -d $ex ]] || ! command -v pkg-config >/dev/null; then
        log "installing libfuse3-dev (libfuse's examples) for --libfuse"
        export DEBIAN_FRONTEND=noninteractive
        timeout 900 apt-get update -qq >/dev/null && timeout 1800 apt-get install -y -qq \
            --no-install-recommends libfuse3-dev pkg-config >/dev/null ||
            die "apt-get install libfuse3-dev pkg-config failed (needed by --libfuse)"
    fi
    if [[ -f $ex/passthrough_ll.c.gz ]]; then zcat "$ex/passthrough_ll.c.gz" >"$src"; else cp "$ex/passthrough_ll.c" "$src"; fi ||
        die "no passthrough_ll.c in $ex"
    # shellcheck disable=SC2046 # pkg-config prints a list of flags
    gcc -O2 -I"$ex" -o "$RUN/passthrough_ll" "$src" $(pkg-config --cflags --libs fuse3) ||
        die "cannot build libfuse's passthrough_ll (--libfuse)"
    LIBFUSE_BIN=$RUN/passthrough_ll
    log "libfuse arm: libfuse $(pkg-config --modversion fuse3)'s passthrough_ll, -o cache=always,xattr"
}
# libfuse_up PART: mount passthrough_ll over $D_LF/PART; fails (logged) when PART has more entries
# than passthrough_ll may hold descriptors for.
libfuse_up() {
    local part=$1 mnt=$MNT/libfuse-$1 n lim
    lim=$(ulimit -n)
    n=$(find "$D_LF/$part" | wc -l)
    if ((n + 256 > lim)); then
        log "  libfuse: $part has $n entries and passthrough_ll keeps a descriptor for each: over the open-file limit ($lim); no libfuse arm"
        return 1
    fi
    mkdir -p "$mnt"
    "$LIBFUSE_BIN" -f -o "source=$D_LF/$part,cache=always,xattr" "$mnt" >>"$LOGS/libfuse-$part.log" 2>&1 &
    LIBFUSE_PID[$part]=$!
    wait_for "passthrough_ll at $mnt" 30 "${LIBFUSE_PID[$part]}" mountpoint -q "$mnt"
}
libfuse_down() {
    local part=$1
    LIBFUSE_OK=0
    [[ -n ${LIBFUSE_PID[$part]:-} ]] || return 0
    stop_pid "${LIBFUSE_PID[$part]}" 30 TERM
    unset "LIBFUSE_PID[$part]"
    force_unmount "$MNT/libfuse-$part"
}
if ((LIBFUSE)); then
    libfuse_build
    # one descriptor per inode: as many as this process may have
    ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
fi

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
    SSH_LINK_PORT=$SSH_PORT
    if ((LINK)); then
        link_proxy_up "$SSH_PORT" "$RUN/sshd.proxy-port" >>"$LOGS/linkproxy-sshd.log" 2>&1 ||
            die "the link proxy in front of sshd did not start (see $LOGS/linkproxy-sshd.log)"
        SSH_LINK_PID=$LINK_PROXY_PID
        SSH_LINK_PORT=$(cat "$RUN/sshd.proxy-port")
        log "sshfs and copies reach sshd through the link emulator on port $SSH_LINK_PORT"
    fi
}

sshfs_up() {
    local d=$WORK/sshd
    timeout 60 sshfs -o "IdentityFile=$d/client_key,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR" \
        -o "port=$SSH_LINK_PORT" "root@127.0.0.1:$D_SSH" "$SSHFS_MNT" 2>>"$LOGS/sshfs.log" || return 1
    wait_for "sshfs mount" 30 - mount_ready "$SSHFS_MNT" "$D_SSH"
}
sshfs_down() { force_unmount "$SSHFS_MNT"; }
sshfs_fresh() { sshfs_down; sshfs_up; }

# ---------------------------------------------------------------------------------------------
# timing

# CPU time used by anything on the machine over 0.5 s, in percent of all CPUs -> BUSY_PCT
cpu_busy() {
    local c u1 n1 s1 i1 w1 q1 sq1 st1 u2 n2 s2 i2 w2 q2 sq2 st2
    read -r c u1 n1 s1 i1 w1 q1 sq1 st1 _ </proc/stat
    sleep 0.5
    read -r c u2 n2 s2 i2 w2 q2 sq2 st2 _ </proc/stat
    local busy=$(((u2 + n2 + s2 + q2 + sq2 + st2) - (u1 + n1 + s1 + q1 + sq1 + st1)))
    local idle=$(((i2 + w2) - (i1 + w1)))
    BUSY_PCT=$((100 * busy / (busy + idle > 0 ? busy + idle : 1)))
}
# Wait (up to --idle-wait) until the machine is idle before a cell, so a build or test run
# of someone else's does not land in one configuration's figures only.
BUSY_CELLS=0 IDLE_WAITED=0
wait_idle() {
    ((IDLE_WAIT > 0)) || return 0
    local start=$SECONDS said=0
    while cpu_busy; ((BUSY_PCT > 25)); do
        if ((SECONDS - start >= IDLE_WAIT || IDLE_WAITED + SECONDS - start >= 10 * IDLE_WAIT)); then
            log "  WARNING: the machine is busy (${BUSY_PCT}% CPU used by other processes); measuring anyway"
            BUSY_CELLS=$((BUSY_CELLS + 1))
            IDLE_WAITED=$((IDLE_WAITED + SECONDS - start))
            return 0
        fi
        ((said)) || log "  waiting for the machine to be idle (${BUSY_PCT}% CPU in use)"
        said=1
        sleep 2
    done
    IDLE_WAITED=$((IDLE_WAITED + SECONDS - start))
}

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

# mounted DIR: DIR is not below $MNT, or the mount it is on is still there (a vanished
# FUSE mount leaves an empty directory behind, on which every workload "succeeds" at once).
mounted() {
    local rel=${1#"$MNT"/}
    [[ $rel == "$1" ]] && return 0
    if ! mountpoint -q "$MNT/${rel%%/*}"; then
        log "  $MNT/${rel%%/*} is no longer mounted"
        local f
        for f in "$LOGS/awcpfs-${rel%%/*}-mount.log" "$LOGS/sshfs.log"; do
            [[ $rel == sshfs* && $f == *awcpfs* ]] && continue
            [[ $rel != sshfs* && $f == *sshfs.log ]] && continue
            [[ -f $f ]] && tail -n 5 "$f" | sed 's/^/      /' >&2
        done
        return 1
    fi
}

# run_step DIR CMD: run CMD with sh in DIR, bounded by the step timeout; output to the step
# log. Fails if DIR's mount is gone before or after.
run_step() {
    local dir=$1 cmd=$2 rc=0
    mounted "$dir" || return 1
    cd "$dir" || return 1
    timeout -k 10 "$STEP_TIMEOUT" sh -c "$cmd" >>"$STEPLOG" 2>&1 || rc=$?
    cd "$WORK"
    mounted "$dir" || return 1
    return $rc
}

# A cell is one workload variant (say git/warm) measured on every configuration. Its arms
# (one per configuration) are run interleaved - run 1 of each, then run 2 of each, ... - so a
# slow drift in the machine's load touches every configuration alike.
#
#   cell WORKLOAD VARIANT
#   arm CONFIG DIR PREP CMD [CHECK]     PREP: eval'd before each run, untimed ("-": none)
#   run_cell                            CHECK: eval'd after each run; must succeed
#
# The time of CMD (run by sh in DIR, bounded by the step timeout) less the fixed overhead is
# one sample. With UNIT=iops the sample is instead the IOPS in fio's JSON output ($FIO_OUT).
# An arm's first failure records "fail" and ends that arm; so does the cell budget.
CELL_W= CELL_V= UNIT=s
ARM_C=() ARM_DIR=() ARM_PREP=() ARM_CMD=() ARM_CHECK=()
FIO_OUT=$RUN/fio.json
cell() {
    CELL_W=$1 CELL_V=$2 UNIT=${3:-s}
    ARM_C=() ARM_DIR=() ARM_PREP=() ARM_CMD=() ARM_CHECK=()
}
arm() {
    [[ $1 == sshfs && $NO_SSHFS == 1 ]] && return 0
    ARM_C+=("$1") ARM_DIR+=("$2") ARM_PREP+=("$3") ARM_CMD+=("$4") ARM_CHECK+=("${5:-}")
}

# run_one K I: run I of arm K; records the sample or "fail" (then returns 1).
run_one() {
    local k=$1 i=$2 w=$CELL_W v=$CELL_V c=${ARM_C[$1]} dir=${ARM_DIR[$1]}
    local prep=${ARM_PREP[$1]} cmd=${ARM_CMD[$1]} check=${ARM_CHECK[$1]} t0 t1 d s rc=0 iops
    if [[ $prep != - ]] && ! eval "$prep" >>"$STEPLOG" 2>&1; then
        log "  FAILED to prepare $w/$v on $c (run $i): $prep"
        record "$w" "$v" "$c" "$UNIT" fail
        return 1
    fi
    echo "== $w/$v/$c run $i: $cmd" >>"$STEPLOG"
    [[ $UNIT == iops ]] && rm -f "$FIO_OUT"
    t0=${EPOCHREALTIME/./}
    run_step "$dir" "$cmd" || rc=$?
    t1=${EPOCHREALTIME/./}
    if ((rc != 0)); then
        log "  FAILED: $w/$v on $c (run $i) exited $rc$( ((rc == 124)) && echo " (timed out after ${STEP_TIMEOUT}s)"); last output:"
        tail -n 5 "$STEPLOG" | sed 's/^/      /' >&2
        record "$w" "$v" "$c" "$UNIT" fail
        return 1
    fi
    if [[ -n $check ]] && ! eval "$check" >>"$STEPLOG" 2>&1; then
        log "  FAILED: $w/$v on $c (run $i): the result check failed: $check"
        tail -n 3 "$STEPLOG" | sed 's/^/      /' >&2
        record "$w" "$v" "$c" "$UNIT" fail
        return 1
    fi
    if [[ $UNIT == iops ]]; then
        if ! iops=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["jobs"][0]["read"]["iops"])' "$FIO_OUT" 2>>"$STEPLOG"); then
            log "  FAILED: $w/$v on $c (run $i): no IOPS in fio's output"
            record "$w" "$v" "$c" iops fail
            return 1
        fi
        record "$w" "$v" "$c" iops "$iops"
        return 0
    fi
    d=$((t1 - t0 - OVERHEAD_US))
    ((d > 0)) || d=1
    us_to_s s "$d"
    record "$w" "$v" "$c" s "$s"
}

run_cell() {
    local n=${#ARM_C[@]} i k t
    ((n > 0)) || return 0
    local -a live spent
    for ((k = 0; k < n; k++)); do live[k]=1 spent[k]=0; done
    wait_idle
    log "  $CELL_W/$CELL_V on ${ARM_C[*]}: ${ARM_CMD[0]}"
    # The arms take turns in alternating order (A B, B A, A B, ...): what one run leaves in
    # the CPU caches or the kernel's lists favours neither arm.
    local j
    for ((i = 1; i <= RUNS; i++)); do
        for ((j = 0; j < n; j++)); do
            if ((i % 2)); then k=$j; else k=$((n - 1 - j)); fi
            ((live[k])) || continue
            t=$SECONDS
            run_one "$k" "$i" || live[k]=0
            spent[k]=$((spent[k] + SECONDS - t))
            if ((live[k] && i < RUNS && spent[k] > CELL_BUDGET)); then
                log "  $CELL_W/$CELL_V on ${ARM_C[k]}: $i run(s) took ${spent[k]}s, over the cell budget (${CELL_BUDGET}s); keeping $i sample(s)"
                live[k]=0
            fi
        done
    done
}

# warmup CONFIG DIR CMD: one untimed run (fills caches / fetches content).
warmup() {
    echo "== warm-up on $1: $3" >>"$STEPLOG"
    run_step "$2" "$3" || { log "  warm-up on $1 failed: $3"; return 1; }
}

# fail_cells WORKLOAD CONFIG UNIT VARIANT...: record failures when a setup step broke.
fail_cells() {
    local w=$1 c=$2 u=$3 v
    shift 3
    for v in "$@"; do record "$w" "$v" "$c" "$u" fail; done
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
    # The agent's first action is to print the time; it runs with cwd = the mount, confined
    # to its workspace, so the time comes back on its output (`delegate` prints it).
    "$AWCP_CTL" executor --dir "$d/executor" --listen "127.0.0.1:$exec_port" \
        --agent-cmd "echo agent-started-at \$(date +%s%N); ls -A > /dev/null" >>"$LOGS/ctl-executor.log" 2>&1 &
    CTL_PIDS+=($!)
    local exec_pid=$!
    if ! wait_for "awcp-ctl serve" 60 "$serve_pid" \
            python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$api_port" ||
        ! wait_for "awcp-ctl executor" 60 "$exec_pid" \
            python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$exec_port"; then
        fail_cells delegate awcpfs s 1k n
        return 0
    fi
    local variant dir i t0 t1 s rc
    for variant in 1k n; do
        [[ $variant == 1k ]] && dir=$D_AW/repo-1k || dir=$D_AW/repo
        wait_idle
        log "  delegate/$variant: awcp-ctl delegate $dir --wait"
        for ((i = 0; i <= RUNS; i++)); do   # run 0 is the warm-up
            rm -f "$ts"
            rc=0
            t0=${EPOCHREALTIME/./}
            timeout -k 10 "$STEP_TIMEOUT" "$AWCP_CTL" --daemon "http://127.0.0.1:$api_port" \
                --api-token-file "$d/delegator/api-token" \
                delegate "$dir" --to "http://127.0.0.1:$exec_port/awcp" --task bench --wait \
                --executor-token-file "$d/executor/state/executor-token" \
                >"$ts.log" 2>&1 || rc=$?
            cat "$ts.log" >>"$LOGS/ctl-delegate.log"
            grep -o 'agent-started-at [0-9]*' "$ts.log" | tail -n 1 | cut -d' ' -f2 >"$ts" || true
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

# The three arms of a cold cell, over DATASET PART (repo, big, cproj) and awcpfs mount NAME:
# native = page cache dropped; awcpfs = remote-cold; sshfs = fresh sshfs mount, cache dropped.
# EXTRA_PREP_<config> run first (e.g. make clean), with @D@ replaced by that copy's path.
cold_arms() {
    ((WARM_ONLY)) && return 0
    local part=$1 sub=$2 cmd=$3 check=${4:-} xn xa xs
    xn=${PRE_NATIVE//@D@/$D_NAT} xa=${PRE_AWCPFS//@D@/$D_AW} xs=${PRE_SSHFS//@D@/$D_SSH}
    arm native "$D_NAT/$part$sub" "${xn:+$xn && }drop_caches" "$cmd" "$check"
    arm awcpfs "$MNT/$part$sub" "awcpfs_down $part${xa:+ && $xa} && awcpfs_cold $part '$D_AW/$part'" "$cmd" "$check"
    arm sshfs "$SSHFS_MNT/$part$sub" "${xs:+$xs && }sshfs_fresh && drop_caches" "$cmd" "$check"
}
PRE_NATIVE= PRE_AWCPFS= PRE_SSHFS=

# warm_setup PART CMD: mount PART with awcpfs and run CMD once on every configuration.
# Sets AW_OK=1 when the awcpfs mount is up and warm.
warm_setup() {
    local part=$1 cmd=$2
    AW_OK=0
    warmup native "$D_NAT/$part" "$cmd" || true
    if awcpfs_up "$part" "$D_AW/$part" && warmup awcpfs "$MNT/$part" "$cmd"; then
        AW_OK=1
    fi
    LIBFUSE_OK=0
    if ((LIBFUSE && LIBFUSE_WL)) && libfuse_up "$part" && warmup libfuse "$MNT/libfuse-$part" "$cmd"; then
        LIBFUSE_OK=1
    fi
    ((NO_SSHFS)) && return 0
    # remount: the copy may have been changed behind sshfs's caches since the last mount
    sshfs_fresh || true
    warmup sshfs "$SSHFS_MNT/$part" "$cmd" || true
}
# warm_arms PART PREP CMD [CHECK]: the three arms of a warm cell (awcpfs only if AW_OK).
warm_arms() {
    local part=$1 prep=$2 cmd=$3 check=${4:-}
    arm native "$D_NAT/$part" "${prep//@D@/$D_NAT/$part}" "$cmd" "$check"
    if ((AW_OK)); then
        arm awcpfs "$MNT/$part" "${prep//@D@/$MNT/$part}" "$cmd" "$check"
    else
        record "$CELL_W" "$CELL_V" awcpfs "$UNIT" fail
    fi
    if ((LIBFUSE_OK)); then
        arm libfuse "$MNT/libfuse-$part" "${prep//@D@/$MNT/libfuse-$part}" "$cmd" "$check"
    fi
    arm sshfs "$SSHFS_MNT/$part" "${prep//@D@/$SSHFS_MNT/$part}" "$cmd" "$check"
}

GIT_CMD='git status >/dev/null'
git_refresh() { git -C "$1" status >/dev/null; }
# "After the TTL": sleep past the kernel attr TTL awcpfs used to have (1 s), then make the
# kernel forget dentries and inodes (drop_caches 2: page cache kept), so every entry and
# attribute is asked for again whatever TTL the mount gives - as once a TTL has run out.
after_ttl() {
    sleep "$TTL_SLEEP"
    [[ $DROP_OK == 1 ]] || return 0
    echo 2 >/proc/sys/vm/drop_caches 2>/dev/null || log "WARNING: cannot drop dentries and inodes"
}

wl_git() {
    log "workload: git status"
    # cold: each copy's index holds its native stat data, as after the Delegator's own work
    PRE_NATIVE= PRE_AWCPFS="git_refresh @D@/repo" PRE_SSHFS="git_refresh @D@/repo"
    cell git cold
    cold_arms repo "" "$GIT_CMD"
    run_cell
    awcpfs_down repo
    PRE_NATIVE= PRE_AWCPFS= PRE_SSHFS=
    LIBFUSE_WL=1
    warm_setup repo "$GIT_CMD"
    cell git warm
    warm_arms repo - "$GIT_CMD"
    run_cell
    cell git ttl
    warm_arms repo after_ttl "$GIT_CMD"
    run_cell
    awcpfs_down repo
    libfuse_down repo
    LIBFUSE_WL=0
    for d in "${COPIES[@]}"; do git_refresh "$d/repo"; done
}

STAT_CMD="find . -printf '%i %s %T@\n' >/dev/null"

wl_stat() {
    log "workload: stat walk"
    cell stat cold
    cold_arms repo "" "$STAT_CMD"
    run_cell
    awcpfs_down repo
    warm_setup repo "$STAT_CMD"
    cell stat warm
    warm_arms repo - "$STAT_CMD"
    run_cell
    local rss
    if ((AW_OK)) && rss=$(ps -o rss= -p "${MOUNT_PID[repo]}"); then
        record rss walk awcpfs mb "$(python3 -c "print(round(int('$rss') * 1024 / 1e6, 1))")"
        log "  awcpfs mount RSS after the walks: ${rss// /} KiB"
    fi
    awcpfs_down repo
}

READ_CMD='find . -type f -size -64k -exec cat {} + >/dev/null'

wl_read() {
    log "workload: read every small file"
    cell read cold
    cold_arms repo "" "$READ_CMD"
    run_cell
    awcpfs_down repo
    warm_setup repo "$READ_CMD"
    cell read warm
    warm_arms repo - "$READ_CMD"
    run_cell
    awcpfs_down repo
}

SEQ_CMD='dd if=big.bin of=/dev/null bs=1M status=none'

wl_seq() {
    log "workload: sequential read of big.bin ($((BIG_BYTES >> 20)) MiB)"
    cell seq cold
    cold_arms big "" "$SEQ_CMD"
    run_cell
    awcpfs_down big
    warm_setup big "$SEQ_CMD"
    cell seq warm
    warm_arms big - "$SEQ_CMD"
    run_cell
    awcpfs_down big
}

# fio: 4 KiB random reads over the whole file, psync, one job, time-bounded.
# warm: the page cache is used as it is (invalidate=0), after a sequential read of the file;
# uncached: fio drops the file's cached pages first (invalidate=1), so the filesystem's own
# read path is measured.
fio_cmd() {
    echo "fio --name=randread --filename=big.bin --readonly --rw=randread --bs=4k \
--ioengine=psync --iodepth=1 --numjobs=1 --size=$BIG_BYTES --runtime=$FIO_SECS --time_based \
--invalidate=$1 --randrepeat=1 --output-format=json --output=$FIO_OUT"
}

wl_fio() {
    log "workload: fio 4 KiB random reads on big.bin"
    warm_setup big "$SEQ_CMD"
    cell fio warm iops
    warm_arms big - "$(fio_cmd 0)"
    run_cell
    cell fio uncached iops
    warm_arms big - "$(fio_cmd 1)"
    run_cell
    awcpfs_down big
}

MAKE_OUT=$RUN/make.out
MAKE_CMD="make -j2 >'$MAKE_OUT'"
EDIT_N=0
# edit5 DIR: edit 5 C files below DIR (append a line: content and mtime change). The sleep
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
make_clean() { make -s -C "$1" clean >/dev/null; }
# compiled N: the last make compiled exactly N units
compiled() {
    local n
    n=$(grep -c -- ' -c ' "$MAKE_OUT" || true)
    [[ $n == "$1" ]] || { echo "make compiled $n units, expected $1"; return 1; }
}

wl_make() {
    log "workload: make -j2 ($C_UNITS units)"
    local all=$((C_UNITS + 1)) d
    PRE_NATIVE="make_clean @D@/cproj" PRE_AWCPFS="make_clean @D@/cproj" PRE_SSHFS="make_clean @D@/cproj"
    cell make clean-cold
    cold_arms cproj "" "$MAKE_CMD" "compiled $all"
    run_cell
    awcpfs_down cproj
    PRE_NATIVE= PRE_AWCPFS= PRE_SSHFS=
    for d in "${COPIES[@]}"; do make_clean "$d/cproj"; done
    LIBFUSE_WL=1
    warm_setup cproj "$MAKE_CMD"
    cell make clean-warm
    warm_arms cproj "make_clean @D@" "$MAKE_CMD" "compiled $all"
    run_cell
    cell make rebuild
    warm_arms cproj "edit5 @D@" "$MAKE_CMD" "compiled 5"
    run_cell
    awcpfs_down cproj
    libfuse_down cproj
    LIBFUSE_WL=0
    for d in "${COPIES[@]}"; do make_clean "$d/cproj"; done
}

# The agent's loop on the C project, under git: edit 5 files, rebuild, run the program (the
# "tests"), commit. The sleep before it (untimed) is for sshfs's whole-second mtimes.
LOOP_CMD="for u in 011 013 015 017 019; do printf '/* loop */\\n' >>src/unit\$u.c; done; \
make -j2 >'$MAKE_OUT' && ./app >/dev/null && git add -A && git commit -qm loop"
# Append a line to 200 of the repository's files, stage and commit them (the list is fixed).
COMMIT_LIST=$RUN/commit-files.txt
COMMIT_CMD="while read -r f; do echo edit >>\"\$f\"; done <'$COMMIT_LIST'; git add -A && git commit -qm edit"
git_init_cproj() {
    local d=$1
    rm -rf "$d/.git"
    printf 'build/\napp\n' >"$d/.gitignore"
    git -C "$d" init -q && git -C "$d" add -A && git -C "$d" commit -qm base
}

wl_loop() {
    log "workload: the agent's loop (edit -> make -> run -> commit; edit 200 files -> commit)"
    local d base
    for d in "${COPIES[@]}"; do
        make_clean "$d/cproj"
        git_init_cproj "$d/cproj"
    done
    LIBFUSE_WL=1
    warm_setup cproj "$MAKE_CMD"
    cell loop full
    warm_arms cproj "sleep 1.1" "$LOOP_CMD" "compiled 5"
    run_cell
    awcpfs_down cproj
    libfuse_down cproj
    for d in "${COPIES[@]}"; do
        make_clean "$d/cproj"
        rm -rf "$d/cproj/.git" "$d/cproj/.gitignore"
    done
    git -C "$D_NAT/repo" ls-files |
        awk -v n="$(git -C "$D_NAT/repo" ls-files | wc -l)" 'BEGIN { s = int(n / 200); if (s < 1) s = 1 } (NR - 1) % s == 0' |
        head -n 200 >"$COMMIT_LIST"
    base=$(git -C "$D_NAT/repo" rev-parse HEAD)
    warm_setup repo "$GIT_CMD"
    cell loop commit
    # The untimed second before each run stands for the agent's time between two commands:
    # awcpfs writes the previous run's 600 files back then (a round waits for the agent's
    # requests to pause), as the loop cell's sleep gives it time to.
    warm_arms repo "sleep 1" "$COMMIT_CMD"
    run_cell
    awcpfs_down repo
    libfuse_down repo
    LIBFUSE_WL=0
    for d in "${COPIES[@]}"; do
        git -C "$d/repo" reset -q --hard "$base"
        git_refresh "$d/repo"
    done
}

# (the standard library's own test data with syntax errors on purpose is left out: -x)
PYC_CMD="python3 -m compileall -q -x '/(data/|bad)' . >/dev/null"
pyc_clean() { find "$1" -name __pycache__ -prune -exec rm -rf {} +; }

wl_pyc() {
    log "workload: write-heavy build (python3 -m compileall, $(find "$D_NAT/pytree" -name '*.py' | wc -l) modules)"
    local d
    warm_setup pytree "$PYC_CMD"
    cell pyc warm
    # (the deletions' write-back settles in the second before each run)
    warm_arms pytree "pyc_clean @D@ && sleep 1" "$PYC_CMD"
    run_cell
    awcpfs_down pytree
    for d in "${COPIES[@]}"; do pyc_clean "$d/pytree"; done
}

# The agent's first commands on a fresh mount, each run from scratch (page cache dropped,
# fresh export and mount; for sshfs a fresh mount): how long until the mount is usable, the
# first `git status` on it, and the first test run - the reads of one subtree's files
# ($COLD_TEST_DIR) - against copying those same files through the same link (tar over ssh).
COLD_TEST_DIR=d01
TEST_CMD="python3 '$HELPERS/testrun.py' $COLD_TEST_DIR >/dev/null"
cold_mount_aw() {
    awcpfs_down repo && git_refresh "$D_AW/repo" && awcpfs_cold repo "$D_AW/repo" || return 1
    us_to_s s "$MOUNT_US"
    record cold mount awcpfs s "$s"
}
cold_mount_ssh() {
    sshfs_down
    drop_caches
    local t0=${EPOCHREALTIME/./}
    sshfs_up || return 1
    us_to_s s $((${EPOCHREALTIME/./} - t0))
    record cold mount sshfs s "$s"
}
COPY_DIR=
copy_prep() { rm -rf "$COPY_DIR" && mkdir -p "$COPY_DIR" && drop_caches; }
wl_cold() {
    log "workload: the first commands on a fresh mount ($LINK_DESC)"
    cell cold git
    arm native "$D_NAT/repo" "drop_caches" "$GIT_CMD"
    arm awcpfs "$MNT/repo" "cold_mount_aw" "$GIT_CMD"
    arm sshfs "$SSHFS_MNT/repo" "git_refresh '$D_SSH/repo' && cold_mount_ssh" "$GIT_CMD"
    run_cell
    awcpfs_down repo
    COPY_DIR=$RUN/copy
    cell cold test
    arm native "$D_NAT/repo" "drop_caches" "$TEST_CMD"
    arm awcpfs "$MNT/repo" "awcpfs_down repo && awcpfs_cold repo '$D_AW/repo'" "$TEST_CMD"
    arm sshfs "$SSHFS_MNT/repo" "sshfs_fresh && drop_caches" "$TEST_CMD"
    arm copy "$COPY_DIR" copy_prep "ssh -o BatchMode=yes -o IdentityFile='$WORK/sshd/client_key' \
-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -p $SSH_LINK_PORT \
root@127.0.0.1 \"tar -C '$D_SSH/repo' -cf - $COLD_TEST_DIR\" | tar -xf -"
    run_cell
    awcpfs_down repo
    rm -rf "$COPY_DIR"
}

wl_visible() {
    log "workload: close -> visible at the Delegator ($SAMPLES samples)"
    local out=$RUN/visible.txt c mdir sdir v
    for c in awcpfs sshfs; do
        [[ $c == sshfs && $NO_SSHFS == 1 ]] && continue
        if [[ $c == awcpfs ]]; then
            if ! awcpfs_up scratch "$D_AW/scratch"; then
                record visible close awcpfs s fail
                awcpfs_down scratch
                continue
            fi
            mdir=$MNT/scratch sdir=$D_AW/scratch
        else
            sshfs_fresh || { record visible close sshfs s fail; continue; }
            mdir=$SSHFS_MNT/scratch sdir=$D_SSH/scratch
        fi
        wait_idle
        log "  visible/close on $c"
        if timeout -k 10 "$STEP_TIMEOUT" python3 "$HELPERS/visible.py" --mount-dir "$mdir" \
            --source-dir "$sdir" --samples "$SAMPLES" >"$out" 2>>"$STEPLOG"; then
            while read -r v; do record visible close "$c" s "$v"; done <"$out"
        else
            log "  FAILED: close -> visible on $c; see $STEPLOG"
            while read -r v; do record visible close "$c" s "$v"; done <"$out"
            record visible close "$c" s fail
        fi
        [[ $c == awcpfs ]] && awcpfs_down scratch
        find "$sdir" -mindepth 1 -delete
    done
}

# AECP on vs off (issue 19): two awcpfs mounts of two copies of the repository, one exported
# with an index of 10,000 artifacts bound to its files (`awcpfs export --aecp-events`), so
# every lookup and open on it runs the AECP observer against a full replica. The warm-up's
# `git status` is the first access of every file: it makes the deliveries (checked below),
# and the timed runs then measure the observer on a replica whose artifacts were received.
# "After the TTL" drops the kernel's dentries first, so every entry is looked up again.
AECP_ARTIFACTS=10000
wl_aecp() {
    log "workload: AECP on ($AECP_ARTIFACTS artifacts) vs off: git status, stat walk"
    local d_on=$DATA/aecp-on events=$RUN/aecp-events.ndjson
    rm -rf "$d_on"
    mkdir -p "$d_on"
    cp -a "$D_AW/repo" "$d_on/repo"
    git_refresh "$d_on/repo"
    git_refresh "$D_AW/repo"
    python3 "$HELPERS/aecp_events.py" --root "$d_on/repo" --n "$AECP_ARTIFACTS" >"$events" ||
        { fail_cells aecp aecp-on s git-warm git-ttl stat-warm; return 0; }
    local off_ok=0 on_ok=0
    awcpfs_up repo "$D_AW/repo" && warmup aecp-off "$MNT/repo" "$GIT_CMD" && off_ok=1
    if awcpfs_export_up aecp "$d_on/repo" --aecp-events "$events" && awcpfs_mount_up aecp &&
        warmup aecp-on "$MNT/aecp" "$GIT_CMD"; then
        # The replica is loaded and the observer works: the warm-up made deliveries.
        local delivered
        delivered=$(wc -l <"$MNT/aecp/.aecp/inbox" 2>/dev/null || echo 0)
        if ((delivered > 0)); then
            on_ok=1
            log "  AECP on: the warm-up delivered $delivered artifacts"
        else
            log "  AECP on: nothing delivered during the warm-up; is the index loaded? (see $LOGS/awcpfs-aecp-*.log)"
        fi
    fi
    local v prep cmd
    for v in git-warm git-ttl stat-warm; do
        case $v in
            git-warm) prep=- cmd=$GIT_CMD ;;
            git-ttl) prep=after_ttl cmd=$GIT_CMD ;;
            stat-warm) prep=- cmd=$STAT_CMD ;;
        esac
        cell aecp "$v"
        if ((off_ok)); then arm aecp-off "$MNT/repo" "$prep" "$cmd"; else record aecp "$v" aecp-off s fail; fi
        if ((on_ok)); then arm aecp-on "$MNT/aecp" "$prep" "$cmd"; else record aecp "$v" aecp-on s fail; fi
        run_cell
    done
    awcpfs_down aecp
    awcpfs_down repo
    rm -rf "$d_on"
    git_refresh "$D_AW/repo"
}

# The agent-session replay (scripts/bench/replay.sh), the headline figure: native, awcpfs
# as a user mounts it by default, awcpfs with the other writeback-cache setting
# ($REPLAY_ALT), and sshfs, each on its own copy of the repository (every run edits five
# files and commits). warm: mounted and replayed once before; ttl: the kernel's dentries and
# inodes dropped before each run (page cache kept), as after a pause.
REPLAY_N=0
REPLAY_CMD="sh '$HELPERS/replay.sh' \"\$(cat '$RUN/replay-n')\" '$HELPERS'"
replay_next() { echo $((++REPLAY_N)) >"$RUN/replay-n"; }
# git's settings as the Executor gives them to an agent (awcp-ctl/src/executor/fsmonitor.rs)
REPLAY_EXEC_CMD="env GIT_CONFIG_COUNT=3 GIT_CONFIG_KEY_0=core.fsmonitor GIT_CONFIG_VALUE_0='$AWCPFS fsmonitor' GIT_CONFIG_KEY_1=core.fsmonitorHookVersion GIT_CONFIG_VALUE_1=2 GIT_CONFIG_KEY_2=core.untrackedCache GIT_CONFIG_VALUE_2=true $REPLAY_CMD"
wl_replay() {
    log "workload: agent-session replay (default mount vs ${REPLAY_ALT})"
    local d_alt=$DATA/awcpfs-alt d base
    base=$(git -C "$D_NAT/repo" rev-parse HEAD)
    rm -rf "$d_alt"
    mkdir -p "$d_alt"
    cp -a "$D_AW/repo" "$d_alt/repo"
    replay_next
    warm_setup repo "$REPLAY_CMD"
    local alt_ok=0 exec_ok=0 d_exec=$DATA/awcpfs-exec
    MOUNT_EXTRA[replayalt]=$REPLAY_ALT
    awcpfs_up replayalt "$d_alt/repo" && warmup awcpfs-alt "$MNT/replayalt" "$REPLAY_CMD" && alt_ok=1
    # The mount as the Executor hands it to an agent: the default mount, with git's
    # fsmonitor served by it (the settings the Executor puts in the agent's environment).
    rm -rf "$d_exec"
    mkdir -p "$d_exec"
    cp -a "$D_AW/repo" "$d_exec/repo"
    awcpfs_up replayexec "$d_exec/repo" && warmup awcpfs-exec "$MNT/replayexec" "$REPLAY_EXEC_CMD" && exec_ok=1
    local v prep
    for v in warm ttl; do
        [[ $v == warm ]] && prep=replay_next || prep="replay_next && after_ttl"
        cell replay "$v"
        warm_arms repo "$prep" "$REPLAY_CMD"
        if ((alt_ok)); then arm awcpfs-alt "$MNT/replayalt" "$prep" "$REPLAY_CMD"; else record replay "$v" awcpfs-alt s fail; fi
        if ((exec_ok)); then arm awcpfs-exec "$MNT/replayexec" "$prep" "$REPLAY_EXEC_CMD"; else record replay "$v" awcpfs-exec s fail; fi
        run_cell
    done
    echo "$REPLAY_ALT" >"$RUN/replay-alt"
    awcpfs_down replayexec
    awcpfs_down replayalt
    awcpfs_down repo
    unset "MOUNT_EXTRA[replayalt]"
    rm -rf "$d_alt" "$d_exec"
    # the copies' repositories carry the replay's commits: back to the dataset's state
    for d in "${COPIES[@]}"; do
        git -C "$d/repo" reset -q --hard "$base"
        git_refresh "$d/repo"
    done
}

# git status with git's fsmonitor served by the mount (`awcpfs fsmonitor`, the untracked
# cache on) against the same mount without it and native ext4 without it: warm, after the
# kernel dropped its dentries and inodes, on a fresh mount of the same export (the index
# written under the mount before it), and on a fresh mount of a fresh export (a new
# delegation of the tree). Two mounts of two copies: a git run without the monitor would
# clear the index's marks the monitored one relies on.
FSM_GIT="git -c 'core.fsmonitor=$AWCPFS fsmonitor' -c core.fsmonitorHookVersion=2 -c core.untrackedCache=true"
FSM_CMD="$FSM_GIT status >/dev/null"
wl_gitfsm() {
    log "workload: git status with the mount's fsmonitor"
    local d_fsm=$DATA/awcpfs-fsm ok=0 fsm_ok=0
    rm -rf "$d_fsm"
    mkdir -p "$d_fsm"
    cp -a "$D_AW/repo" "$d_fsm/repo"
    warmup native "$D_NAT/repo" "$GIT_CMD" || true
    awcpfs_up repo "$D_AW/repo" && warmup awcpfs "$MNT/repo" "$GIT_CMD" && ok=1
    # twice: the first monitored run writes the index with the monitor's marks
    awcpfs_up fsm "$d_fsm/repo" && warmup awcpfs-fsm "$MNT/fsm" "$FSM_CMD" &&
        warmup awcpfs-fsm "$MNT/fsm" "$FSM_CMD" && fsm_ok=1
    local v prep_n prep_a prep_f
    for v in warm ttl fresh fresh-export; do
        case $v in
            warm) prep_n=- prep_a=- prep_f=- ;;
            ttl) prep_n=after_ttl prep_a=after_ttl prep_f=after_ttl ;;
            # (each arm first waits for the other fresh mount's hydration to end)
            fresh) prep_n="hydrated repo fsm && after_ttl" prep_a="hydrated fsm && awcpfs_remount repo"
                prep_f="hydrated repo && awcpfs_remount fsm" ;;
            fresh-export) prep_n="hydrated repo fsm && after_ttl"
                prep_a="hydrated fsm && awcpfs_down repo && awcpfs_up repo '$D_AW/repo'"
                prep_f="hydrated repo && awcpfs_down fsm && awcpfs_up fsm '$d_fsm/repo'" ;;
        esac
        cell gitfsm "$v"
        arm native "$D_NAT/repo" "$prep_n" "$GIT_CMD"
        if ((ok)); then arm awcpfs "$MNT/repo" "$prep_a" "$GIT_CMD"; else record gitfsm "$v" awcpfs s fail; fi
        if ((fsm_ok)); then arm awcpfs-fsm "$MNT/fsm" "$prep_f" "$FSM_CMD"; else record gitfsm "$v" awcpfs-fsm s fail; fi
        run_cell
    done
    awcpfs_down fsm
    awcpfs_down repo
    rm -rf "$d_fsm"
}

# ---------------------------------------------------------------------------------------------
# main

cd "$WORK"
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
MEM=$(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)
FS_TYPE=$(stat -f -c %T "$WORK")
MACHINE="$(nproc) CPUs ($CPU), $MEM RAM, Linux $(uname -r), work dir on $FS_TYPE"
log "machine: $MACHINE"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
log "binaries: $BIN_DIR; work dir: $WORK; runs per cell: $RUNS; workloads: ${WORKLOADS[*]}"
measure_overhead
if { ((NO_SSHFS == 0)) && { wants replay || wants git || wants stat || wants read || wants seq || wants fio || wants make || wants loop || wants pyc || wants visible; }; } || wants cold; then
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
cp -r "$LOGS" "$OUT_DIR/results-$STAMP_T.logs" 2>/dev/null || true
printf '{"files": %d, "big_bytes": %d, "runs": %d, "samples": %d, "link": "%s", "replay_alt": "%s", "mount_opts": "%s"}\n' "$FILES" "$BIG_BYTES" "$RUNS" "$SAMPLES" \
    "$( ((LINK)) && echo "${LINK_DELAY_MS} ms RTT, ${LINK_MBIT} Mbit/s" || echo loopback)" "$REPLAY_ALT" "$MOUNT_OPTS" >"$RUN/meta.json"
ELAPSED=$((SECONDS - T_START))
{
    echo "# awcpfs benchmark, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "* machine: $MACHINE"
    echo "* awcpfs mount options: ${MOUNT_OPTS:-(defaults)}$( ((WARM_ONLY)) && echo "; warm cells only")$( ((NO_SSHFS)) && echo "; no sshfs")"
    echo "* network: $LINK_DESC"
    echo "* command: \`bash scripts/bench.sh$([[ $QUICK == 1 ]] && echo " --quick") --files $FILES --runs $RUNS --big-mib $BIG_MIB --c-units $C_UNITS --fio-secs $FIO_SECS${ONLY:+ --only $ONLY}$( ((LINK)) && echo " --link-delay-ms $LINK_DELAY_MS --link-mbit $LINK_MBIT")${MOUNT_OPTS:+ --mount-opts \"$MOUNT_OPTS\"}\`"
    if [[ $BUILT == 1 ]]; then
        echo "* awcpfs: $("$AWCPFS" --version 2>/dev/null || echo '?'), built from this workspace at $(git -C "$REPO_DIR" describe --always --dirty 2>/dev/null || echo '?')"
    else
        echo "* awcpfs: $("$AWCPFS" --version 2>/dev/null || echo '?'), binaries from $BIN_DIR (built $(date -u -r "$AWCPFS" +%Y-%m-%dT%H:%MZ))"
    fi
    echo "* sshfs: $(sshfs --version 2>&1 | grep -m1 -i 'sshfs version' || echo '?'); $(ssh -V 2>&1)"
    echo "* dataset: $FILES files (log-normal, median 3 KiB) in git; $((BIG_BYTES >> 20)) MiB file; $C_UNITS C units x 30 headers"
    echo "* medians of $RUNS runs ($SAMPLES samples for close -> visible); wall time ${ELAPSED}s"
    echo "* load average at the start / end: $LOAD_START / $(cut -d' ' -f1-3 /proc/loadavg); cells measured while other processes kept the CPUs busy: $BUSY_CELLS"
    [[ $DROP_OK == 1 ]] || echo "* WARNING: the page cache could not be dropped; cold figures are warm"
    echo
    python3 "$HELPERS/table.py" "$RAW" --meta "$RUN/meta.json"
} >"$RESULT_MD"
echo
cat "$RESULT_MD"
echo
log "results: $RESULT_MD (raw samples: $RESULT_TSV, logs: $OUT_DIR/results-$STAMP_T.logs); took ${ELAPSED}s"
exit 0
}
