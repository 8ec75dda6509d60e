#!/usr/bin/env bash
# Drop a kept snapshot (--snapshot SID; default the recommended one).
usage="usage: discard.sh ID [options of \`awcp-ctl discard\`]
  Drop a kept snapshot (--snapshot SID; default the recommended one)."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
exec "$AWCP_CTL" discard "$@"
