#!/usr/bin/env bash
# Apply a kept snapshot to the workspace (--snapshot SID; default the recommended one); conflicts are kept beside the file.
usage="usage: apply.sh ID [options of \`awcp-ctl apply\`]
  Apply a kept snapshot to the workspace (--snapshot SID; default the recommended one); conflicts are kept beside the file."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
exec "$AWCP_CTL" apply "$@"
