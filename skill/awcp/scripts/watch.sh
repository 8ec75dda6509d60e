#!/usr/bin/env bash
# Follow a delegation's events until it ends (exit 0 completed, 3 cancelled, 4 expired, 5 error).
usage="usage: watch.sh ID [options of \`awcp-ctl watch\`]
  Follow a delegation's events until it ends (exit 0 completed, 3 cancelled, 4 expired, 5 error)."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
exec "$AWCP_CTL" watch "$@"
