#!/usr/bin/env bash
# End the delegation's access now (--no-flush: drop what the Executor has not written back).
usage="usage: revoke.sh ID [options of \`awcp-ctl revoke\`]
  End the delegation's access now (--no-flush: drop what the Executor has not written back)."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
exec "$AWCP_CTL" revoke "$@"
