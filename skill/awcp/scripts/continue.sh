#!/usr/bin/env bash
# Run the next round of an idle multi-round delegation with a new instruction.
usage="usage: continue.sh ID TASK [--prompt TEXT] [--ttl DURATION]
  Starts the next round of delegation ID (it must be idle) on the same workspace; wait for
  it with wait.sh."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
if [ $# -lt 2 ]; then
  echo "$usage" >&2
  exit 64
fi
id=$1
task=$2
shift 2
exec "$AWCP_CTL" continue "$id" --task "$task" "$@"
