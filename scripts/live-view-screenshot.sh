#!/usr/bin/env bash
# Remake docs/img/live-view.png: the live view's browser test (tests/tests/live_view.rs)
# runs a real daemon, Executor and delegation on loopback, opens the page in headless
# Chromium, and saves what it shows before it revokes the delegation.
#
#   scripts/live-view-screenshot.sh [OUT.png]
#
# Needs FUSE, root (as the tests do), `chromium` (apt-get install chromium) and
# cargo-nextest (scripts/test.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-docs/img/live-view.png}")"
mkdir -p "$(dirname "$out")"
command -v chromium >/dev/null || { echo "chromium is missing: apt-get install chromium" >&2; exit 1; }
AWCP_UI_SCREENSHOT="$out" cargo nextest run -p awcp-tests --no-capture \
  -E 'test(=live_view::live_view_lists_a_running_delegation_and_revokes_it_from_the_page)'
[ -s "$out" ] || { echo "the test wrote no screenshot to $out" >&2; exit 1; }
echo "wrote $out"
