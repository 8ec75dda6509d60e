#!/bin/bash
# What a FUSE request costs, by transport: the classic /dev/fuse read/write loop against FUSE
# over io_uring, with a server that does no work of its own (protofs, answering from memory),
# against native ext4 and, with --awcpfs-bin, against awcpfs itself. Interleaved: the variant
# order rotates every round. See README.md and docs/BENCHMARKS.md.
#
# usage: bash bench.sh [--rounds N] [--out DIR] [--awcpfs-bin DIR] [--awcpfs-bin-b DIR] [VARIANT...]
#   variants: ext4 legacy1 legacy2 uring1 uring2 uring8 legacy1p uring2p awcpfs awcpfs-uring
#   awcpfs-uring-b (a trailing "p": server and load generator pinned to CPU 0; awcpfs (over
#   /dev/fuse) and awcpfs-uring (--fuse-transport uring) need --awcpfs-bin; awcpfs-uring-b is
#   awcpfs-uring with the build in --awcpfs-bin-b, to compare two builds side by side)
# Needs root and /dev/fuse; sets /sys/module/fuse/parameters/enable_uring to Y for the run and
# puts it back after.
set -u
cd "$(dirname "$0")"
ROUNDS=7 OUT=$PWD/out AWBIN= AWBIN_B=
while (($#)); do
    case $1 in
        --rounds) ROUNDS=$2; shift ;;
        --out) OUT=$2; shift ;;
        --awcpfs-bin) AWBIN=$2; shift ;;
        --awcpfs-bin-b) AWBIN_B=$2; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        -*) echo "bench.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
    shift
done
VARIANTS=${*:-"ext4 legacy1 legacy2 uring1 uring2 uring8 legacy1p uring2p${AWBIN:+ awcpfs awcpfs-uring}"}
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target} cargo build --release -q || exit 1
B=${CARGO_TARGET_DIR:-$PWD/target}/release
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
MNT=$OUT/mnt EXT4=$OUT/ext4tree AWTREE=$OUT/awtree CSV=$OUT/results.csv LOGS=$OUT/logs
mkdir -p "$LOGS" "$MNT"
D=200 F=100
PID= EPID=
URING_WAS=$(cat /sys/module/fuse/parameters/enable_uring 2>/dev/null || echo N)
cleanup() {
    [ -n "$PID" ] && kill -INT "$PID" 2>/dev/null && sleep 0.5
    [ -n "$EPID" ] && kill "$EPID" 2>/dev/null
    if mountpoint -q "$MNT"; then
        umount -l "$MNT"
        for a in /sys/fs/fuse/connections/*/abort; do [ -e "$a" ] && echo 1 >"$a"; done
    fi
    echo "$URING_WAS" >/sys/module/fuse/parameters/enable_uring 2>/dev/null
}
trap 'cleanup; exit 1' INT TERM
trap cleanup EXIT
[ -f "$EXT4/sink" ] || "$B/storm" mktree "$EXT4" $D $F >/dev/null
if [[ $VARIANTS == *awcpfs* ]]; then
    [ -x "$AWBIN/awcpfs" ] || { echo "bench.sh: the awcpfs variant needs --awcpfs-bin DIR (with DIR/awcpfs)" >&2; exit 2; }
    if [[ $VARIANTS == *awcpfs-uring-b* ]]; then
        [ -x "$AWBIN_B/awcpfs" ] || { echo "bench.sh: awcpfs-uring-b needs --awcpfs-bin-b DIR (with DIR/awcpfs)" >&2; exit 2; }
    fi
    [ -f "$AWTREE/sink" ] || "$B/storm" mktree "$AWTREE" $D $F >/dev/null
fi
echo Y >/sys/module/fuse/parameters/enable_uring ||
    { echo "bench.sh: cannot enable FUSE over io_uring (needs root and CONFIG_FUSE_IO_URING)" >&2; exit 1; }
[ -f "$CSV" ] || echo "round,variant,test,wall_us,per_op_us,bad,load1" >"$CSV"

wait_mounted() {
    for _ in $(seq 200); do timeout 2 stat "$MNT/sink" >/dev/null 2>&1 && return 0; sleep 0.05; done
    echo "bench.sh: mount of $1 failed; log: $LOGS/$1.r$r.log" >&2
    exit 1
}
start_fs() { # $1 = variant
    local args pre= base=${1%p}
    case $1 in *p) pre="taskset -c 0" ;; esac
    if [[ $1 == awcpfs* ]]; then
        local transport=dev bin=$AWBIN
        [ "$1" = awcpfs-uring ] && transport=uring
        [ "$1" = awcpfs-uring-b ] && transport=uring bin=$AWBIN_B
        # Each request a round trip, as for the others: no writeback cache.
        rm -rf "$OUT/aw-state" && mkdir -p "$OUT/aw-state"
        "$bin/awcpfs" export "$AWTREE" --listen 127.0.0.1:0 --handle-out "$OUT/aw-state/h" \
            --state-dir "$OUT/aw-state/export" >"$LOGS/awcpfs-export.r$r.log" 2>&1 &
        EPID=$!
        for _ in $(seq 200); do [ -s "$OUT/aw-state/h" ] && break; sleep 0.05; done
        "$bin/awcpfs" mount "$OUT/aw-state/h" "$MNT" --state-dir "$OUT/aw-state/mount" \
            --no-writeback-cache --hydrate all --fuse-transport "$transport" >"$LOGS/$1.r$r.log" 2>&1 &
        PID=$!
        wait_mounted "$1"
        # Let hydration finish so the run measures round trips only.
        sleep 3
        return
    fi
    case $base in
        legacy*) args="--transport legacy --threads ${base#legacy}" ;;
        uring*) args="--transport uring --depth ${base#uring}" ;;
    esac
    $pre "$B/protofs" "$MNT" $args 2>"$LOGS/$1.r$r.log" &
    PID=$!
    wait_mounted "$1"
}
stop_fs() {
    kill -INT "$PID"; wait "$PID"; PID=
    [ -n "$EPID" ] && { kill "$EPID"; wait "$EPID" 2>/dev/null; EPID=; }
    if mountpoint -q "$MNT"; then echo "bench.sh: a mount was left behind" >&2; cleanup; fi
}
rec() { # variant test line
    local load w p b
    load=$(cut -d' ' -f1 /proc/loadavg)
    w=$(sed -n 's/.*wall_us=\([0-9]*\).*/\1/p' <<<"$3")
    p=$(sed -n 's/.*per_op_us=\([0-9.]*\).*/\1/p' <<<"$3")
    b=$(sed -n 's/.*bad=\([0-9]*\).*/\1/p' <<<"$3")
    echo "$r,$1,$2,$w,$p,$b,$load" >>"$CSV"
    echo "  r$r $1 $2: $3 (load $load)"
}

for r in $(seq 1 "$ROUNDS"); do
    # rotate the variant order every round
    set -- $VARIANTS
    n=$# vs=()
    for i in $(seq 0 $((n - 1))); do j=$(((i + r) % n + 1)); vs+=("${!j}"); done
    for v in "${vs[@]}"; do
        if [ "$v" = ext4 ]; then root=$EXT4; else start_fs "$v"; root=$MNT; fi
        S=$B/storm
        case $v in *p) S="taskset -c 0 $B/storm" ;; esac
        if [ "$r" = 1 ]; then
            c=$(ls -R "$root" | grep -c '^f[0-9]')
            echo "  $v: ls -R regular-file count $c (want $((D * F)))"
            [ "$c" = $((D * F)) ] || { echo "bench.sh: $v serves the wrong tree" >&2; exit 1; }
        fi
        echo 2 >/proc/sys/vm/drop_caches; sleep 1
        rec "$v" lstat1 "$(timeout 120 $S lstat "$root" $D $F 1)"
        case $v in *p) ;; *)
            echo 2 >/proc/sys/vm/drop_caches; sleep 1
            rec "$v" lstat20 "$(timeout 120 $S lstat "$root" $D $F 20)" ;;
        esac
        rec "$v" write4k "$(timeout 120 $S write "$root/sink" 5000 4096)"
        [ "$v" = ext4 ] || stop_fs
    done
done
python3 summarize.py "$CSV"
