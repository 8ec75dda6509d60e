#!/usr/bin/env bash
# Show what a kept snapshot changes, file by file (--snapshot SID for another than the latest).
usage="usage: diff.sh ID [options of \`awcp-ctl diff\`]
  Show what a kept snapshot changes, file by file (--snapshot SID for another than the latest)."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
exec "$AWCP_CTL" diff "$@"
