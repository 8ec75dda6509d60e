#!/usr/bin/env bash
# List the snapshots (kept changes) of a delegation.
usage="usage: snapshots.sh ID [options of \`awcp-ctl snapshots\`]
  List the snapshots (kept changes) of a delegation."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
exec "$AWCP_CTL" snapshots "$@"
