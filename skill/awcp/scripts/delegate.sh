#!/usr/bin/env bash
# Delegate DIR to an Executor with TASK; prints the delegation id.
usage="usage: delegate.sh DIR TASK [--to URL] [awcp-ctl delegate options…]
  Delegates DIR with the task TASK to the Executor at --to (default \$AWCP_EXECUTOR_URL)
  and prints the delegation id (dlg_…). Other options go to \`awcp-ctl delegate\`
  (--prompt, --mode, --ttl, --snapshot-mode, --transport, --exclude, --multi-round, …)."
. "$(dirname "$0")/lib.sh"
usage_if_asked "$usage" "$@"
if [ $# -lt 2 ]; then
  echo "$usage" >&2
  exit 64
fi
dir=$1
task=$2
shift 2
to=()
case " $* " in
  *" --to "*) ;;
  *)
    if [ -z "${AWCP_EXECUTOR_URL:-}" ]; then
      echo "error: no Executor: pass --to http://host:7200/awcp or set AWCP_EXECUTOR_URL" >&2
      exit 64
    fi
    to=(--to "$AWCP_EXECUTOR_URL")
    ;;
esac
out=$(ctl --json delegate "$dir" --task "$task" "${to[@]}" "$@")
id=$(printf '%s\n' "$out" | grep -o 'dlg_[0-9a-f]\{32\}' | head -n 1 || true)
if [ -z "$id" ]; then
  echo "error: the daemon gave no delegation id: $out" >&2
  exit 1
fi
echo "$id"
