#!/usr/bin/env bash
# Longer runs of the random-operation exerciser (tests/tests/exerciser.rs), of the crash
# recovery tests, of every crash point of the journal (awcpfs/tests/crash_points.rs) and of
# the whole state directory through the real recovery (awcpfs/tests/crash_states.rs), of the
# network fault matrix (awcpfs/tests/fault_matrix.rs: one reset,
# seconds of resets, a blackhole, kill -9 with a commit's answer in flight) and of fsx with
# every operation (awcpfs/tests/posix_suites.rs, 100,000 operations), each with a fresh
# seed, until a time budget is used up. Prints the seeds, the operations done and the
# failures; a failure's seed reproduces it:
#   AWCP_SEED=<seed> AWCP_EXERCISER_OPS=<n> cargo test -p awcp-tests --test e2e exerciser::
#   AWCP_SEED=<seed> AWCP_CRASH_OPS=120 AWCP_CRASH_STATES=400 cargo test -p awcpfs --test crash_states
#   AWCP_SEED=<seed> AWCP_FAULT_SEEDS=1 AWCP_FAULT_SECS=<s> cargo test -p awcpfs --test fault_matrix
#   AWCP_FSX_SEED=<seed> AWCP_FSX_OPS=100000 cargo test -p awcpfs --test posix_suites fsx
# Usage: scripts/soak.sh [minutes (default 10)] [ops per exerciser run (default 10000)]
#        [seconds of workload per fault run (default 20)]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
ops=${2:-10000}
fault_secs=${3:-20}
deadline=$(( $(date +%s) + minutes * 60 ))
cargo test -q -p awcp-tests --test e2e --no-run
cargo test -q -p awcpfs --test crash_recovery --no-run
cargo test -q -p awcpfs --test fault_matrix --no-run
cargo test -q -p awcpfs --test posix_suites --no-run
cargo test -q -p awcpfs --test crash_points --no-run
cargo test -q -p awcpfs --test crash_states --no-run
runs=0; failures=0; total_ops=0
while [ "$(date +%s)" -lt "$deadline" ]; do
  seed=$(python3 -c 'import random; print(random.getrandbits(63))')
  if AWCP_SEED=$seed AWCP_EXERCISER_OPS=$ops cargo test -q -p awcp-tests --test e2e exerciser:: >/tmp/awcp-soak.log 2>&1; then
    echo "exerciser seed $seed: ok ($ops ops)"
  else
    failures=$((failures + 1)); echo "exerciser seed $seed: FAILED (log: /tmp/awcp-soak.$seed.log)"
    cp /tmp/awcp-soak.log "/tmp/awcp-soak.$seed.log"
  fi
  if cargo test -q -p awcpfs --test crash_recovery >/tmp/awcp-soak.log 2>&1; then
    echo "kill -9 + recover: ok (no acknowledged write lost)"
  else
    failures=$((failures + 1)); echo "kill -9 + recover: FAILED"; cp /tmp/awcp-soak.log "/tmp/awcp-soak.crash.$runs.log"
  fi
  # The fault matrix: every fault once with this seed and a longer, randomized workload
  # (the fault's moment is drawn from the seed too). Each run checks every acknowledged
  # state against the Delegator's tree.
  if AWCP_SEED=$seed AWCP_FAULT_SEEDS=1 AWCP_FAULT_SECS=$fault_secs cargo test -q -p awcpfs --test fault_matrix >/tmp/awcp-soak.log 2>&1; then
    echo "fault matrix seed $seed: ok (4 faults, ${fault_secs}s each, no acknowledged state lost)"
  else
    failures=$((failures + 1)); echo "fault matrix seed $seed: FAILED (log: /tmp/awcp-soak.faults.$seed.log)"
    cp /tmp/awcp-soak.log "/tmp/awcp-soak.faults.$seed.log"
  fi
  # Every crash point of the journal (awcpfs/tests/crash_points.rs), at a larger size than CI's.
  if AWCP_SEED=$seed AWCP_CRASH_OPS=400 AWCP_CRASH_STATES=20 cargo test -q -p awcpfs --test crash_points >/tmp/awcp-soak.log 2>&1; then
    echo "journal crash points seed $seed: ok (400 operations, 20 power-loss states per point)"
  else
    failures=$((failures + 1)); echo "journal crash points seed $seed: FAILED (log: /tmp/awcp-soak.crash-points.$seed.log)"
    cp /tmp/awcp-soak.log "/tmp/awcp-soak.crash-points.$seed.log"
  fi
  # Every crash point of the whole state directory through the real recovery
  # (awcpfs/tests/crash_states.rs), at a larger size than CI's.
  if AWCP_SEED=$seed AWCP_CRASH_OPS=120 AWCP_CRASH_STATES=400 cargo test -q -p awcpfs --test crash_states every_crash_point >/tmp/awcp-soak.log 2>&1; then
    echo "state-directory crash points seed $seed: ok (120 operations, 400 crash states recovered)"
  else
    failures=$((failures + 1)); echo "state-directory crash points seed $seed: FAILED (log: /tmp/awcp-soak.crash-states.$seed.log)"
    cp /tmp/awcp-soak.log "/tmp/awcp-soak.crash-states.$seed.log"
  fi
  if AWCP_FSX_SEED=$seed AWCP_FSX_OPS=100000 cargo test -q -p awcpfs --test posix_suites fsx >/tmp/awcp-soak.log 2>&1; then
    echo "fsx seed $seed: ok (100000 ops, every operation)"
  else
    failures=$((failures + 1)); echo "fsx seed $seed: FAILED (log: /tmp/awcp-soak.fsx.$seed.log)"
    cp /tmp/awcp-soak.log "/tmp/awcp-soak.fsx.$seed.log"
  fi
  runs=$((runs + 1)); total_ops=$((total_ops + ops))
done
# A failed exerciser or crash-recovery run is how a lost write shows (each checks every
# acknowledged write), so "writes lost" is 0 exactly when there were no failures.
echo "soak: $runs round(s), $total_ops exerciser operations, $runs kill -9 fault(s) injected, $((runs * 4)) network fault run(s), $failures failure(s); writes lost: $([ "$failures" -eq 0 ] && echo 0 || echo 'see the failed runs')"
[ "$failures" -eq 0 ]
