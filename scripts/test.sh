#!/usr/bin/env bash
# The README's test command: run the whole test suite with cargo-nextest, installing it first
# when this machine does not have it yet (a fresh machine with only README's prerequisites).
# Extra arguments go to `cargo nextest run` (e.g. a test filter).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "test.sh: cargo-nextest is missing; installing it (cargo install --locked cargo-nextest)" >&2
  cargo install --locked cargo-nextest
fi
exec cargo nextest run --workspace --no-fail-fast "$@"
