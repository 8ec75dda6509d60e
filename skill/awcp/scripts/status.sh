#!/usr/bin/env bash
# Show one delegation in detail, or all of them.
usage="usage: status.sh [ID] [options of \`awcp-ctl status\`]
  Show one delegation in detail, or all of them."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
exec "$AWCP_CTL" status "$@"
