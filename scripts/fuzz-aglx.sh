#!/usr/bin/env bash
# Fuzz the AGLX frame decoder for a bounded time (default 60 s).
#
# Needs a nightly toolchain and cargo-fuzz, which CI does not install:
#   rustup toolchain install nightly
#   cargo install cargo-fuzz
#
# usage: scripts/fuzz-aglx.sh [SECONDS]
# Seeds the corpus with the byte-exact examples from docs/aglx-examples. A crash leaves its
# input in fuzz/artifacts/aglx_decode/ and makes this script exit non-zero; reproduce it with
#   cargo +nightly fuzz run aglx_decode fuzz/artifacts/aglx_decode/<file>
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
if ! cargo +nightly fuzz --help >/dev/null 2>&1; then
  echo "fuzz-aglx: needs nightly and cargo-fuzz: rustup toolchain install nightly && cargo install cargo-fuzz" >&2
  exit 2
fi
corpus=fuzz/corpus/aglx_decode
mkdir -p "$corpus"
cp docs/aglx-examples/*.aglx "$corpus"/
cd fuzz
exec cargo +nightly fuzz run aglx_decode "corpus/aglx_decode" -- -max_total_time="$seconds" -max_len=4096
