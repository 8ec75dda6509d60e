# Shared by the skill's scripts: find awcp-ctl, and say clearly when it is missing.
# Environment: AWCP_CTL (the binary), AWCP_DAEMON_URL, AWCP_API_TOKEN (read by awcp-ctl).
set -euo pipefail

AWCP_CTL=${AWCP_CTL:-awcp-ctl}
if ! command -v "$AWCP_CTL" >/dev/null 2>&1; then
  echo "error: awcp-ctl not found (put it on PATH or set AWCP_CTL=/path/to/awcp-ctl)" >&2
  exit 127
fi

ctl() { "$AWCP_CTL" "$@"; }

usage_if_asked() { # usage_if_asked "$usage" "$@"
  local usage=$1
  shift
  for a in "$@"; do
    if [ "$a" = "-h" ] || [ "$a" = "--help" ]; then
      echo "$usage"
      exit 0
    fi
  done
}

need_id() { # need_id "$usage" "$1"
  case "${2:-}" in
    dlg_*) ;;
    *)
      echo "$1" >&2
      echo "error: give a delegation id (dlg_…; scripts/status.sh lists them)" >&2
      exit 64
      ;;
  esac
}

# The state line of `awcp-ctl status ID`.
state_of() { ctl status "$1" | awk '$1 == "state" { print $2; exit }'; }
