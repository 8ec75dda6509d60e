#!/bin/sh
# An agent's session on a workspace, replayed: the commands a coding agent's tool calls
# come down to, in the order a session makes them - orient (git status, log, listings),
# search (grep), read what the searches found, run the tests, edit with sed, look at the
# diff, check the status, re-run the tests, commit, search and check once more. Mostly
# reads, as a session is. Run by scripts/bench.sh (workload `replay`) in the synthetic
# repository, with the run number as $1 (each run's edits and commit are its own) and
# scripts/bench as $2 (testrun.py).
#
#   sh replay.sh N HELPERS_DIR
set -e
n=${1:-0}
helpers=${2:?usage: replay.sh N HELPERS_DIR}
q() { "$@" >/dev/null 2>&1 || true; }   # a search that finds nothing is no failure

# orient
git status >/dev/null
git log --oneline -10 >/dev/null
ls -la >/dev/null
q find . -maxdepth 3 -type d -not -path './.git*'
# search the tree, then narrower
q grep -rn "manifest" --exclude-dir=.git .
q grep -rln "lease token" --exclude-dir=.git d00 d01
q grep -rnw "journal" --exclude-dir=.git --include='*.py' .
# read what was found (an agent reads the first hits, in pieces)
for f in $(grep -rl "commit journal" --exclude-dir=.git d00 | head -n 20); do
    sed -n '1,120p' "$f" >/dev/null
done
for f in $(find d03 -type f | sort | head -n 30); do cat "$f" >/dev/null; done
# the tests
python3 "$helpers/testrun.py" d01 >/dev/null
# edit five files in place (sed -i: a new file renamed over the old one)
for f in $(find d02 -type f -name '*.c' | sort | head -n 5); do
    sed -i "1s|^|/* edit $n */\n|" "$f"
done
git diff --stat >/dev/null
git diff >/dev/null
git status >/dev/null
# the tests again, the commit, a last look
python3 "$helpers/testrun.py" d02 >/dev/null
git add -A
git commit -qm "agent edit $n"
q grep -rn "executor" --exclude-dir=.git d02
git status --porcelain >/dev/null
