#!/usr/bin/env bash
# Wait until a delegation ends (or goes idle between rounds); print state and summary.
usage="usage: wait.sh ID [TIMEOUT_SECONDS]
  Waits (default 600 s) until delegation ID is completed, idle (a round of a multi-round
  delegation is done), or ended otherwise; then prints its status.
  Exit 0: completed or idle; 1: error, cancelled or expired; 2: still running at the timeout."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
need_id "$usage" "${1:-}"
id=$1
limit=${2:-600}
start=$(date +%s)
while :; do
  state=$(state_of "$id")
  case "$state" in
    completed | idle)
      ctl status "$id"
      exit 0
      ;;
    error | cancelled | expired)
      ctl status "$id"
      exit 1
      ;;
  esac
  if [ $(($(date +%s) - start)) -ge "$limit" ]; then
    echo "still $state after ${limit}s: wait again, follow it with watch.sh, or revoke.sh it" >&2
    exit 2
  fi
  sleep 1
done
