#!/usr/bin/env bash
# End an idle multi-round delegation: it completes.
usage="usage: close.sh ID [options of \`awcp-ctl close\`]
  End an idle multi-round delegation: it completes."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
exec "$AWCP_CTL" close "$@"
