#!/usr/bin/env bash
# The README's test command: run the whole test suite with cargo-nextest, installing it first
# when this machine does not have it yet (a fresh machine with only README's prerequisites).
# Extra arguments go to `cargo nextest run` (e.g. a test filter).
#
# A test whose tool is missing here (pjdfstest, fsx, s3s-fs, PostgreSQL, FUSE, …) passes
# without running, and nextest hides its notice; each one records itself in the file named
# by AWCP_TEST_SKIPS, and the last line of this script names every suite that did not run
# with the command that installs it (`.ci/run` installs them all; CI=true fails instead).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "test.sh: cargo-nextest is missing; installing it (cargo install --locked cargo-nextest)" >&2
  cargo install --locked cargo-nextest
fi
skips=$(mktemp "${TMPDIR:-/tmp}/awcp-test-skips.XXXXXX")
trap 'rm -f "$skips"' EXIT
status=0
AWCP_TEST_SKIPS="$skips" cargo nextest run --workspace --no-fail-fast "$@" || status=$?
if [ -s "$skips" ]; then
  # One line per suite: its name and how to install what it needs.
  summary=$(sort -u "$skips" | awk -F '\t' '{ printf "%s%s (%s)", sep, $1, $2; sep = "; " }')
  echo "test.sh: NOT RUN here: $summary" >&2
else
  echo "test.sh: every suite ran (none skipped for a missing tool)" >&2
fi
exit "$status"
