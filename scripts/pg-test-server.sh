#!/usr/bin/env bash
# A throwaway PostgreSQL server on loopback for the tests that need one (the state-store
# suite and the daemon failover test read AWCP_TEST_POSTGRES_URL). Uses Debian's
# `postgresql` package (`apt-get install postgresql`); CI (.ci/run) and developers both
# use this script.
#
#   eval "$(scripts/pg-test-server.sh start)"   # starts it (or finds it running) and
#                                               # exports AWCP_TEST_POSTGRES_URL
#   scripts/pg-test-server.sh url               # prints the export line again
#   scripts/pg-test-server.sh stop              # stops it and deletes its data
#
# Knobs: AWCP_PG_DIR (data directory; default /tmp/awcp-pg-test), AWCP_PG_PORT (default
# 25432: below the kernel's ephemeral ports, 32768-60999, so no client connection of
# another process holds it). The cluster trusts loopback connections (user `awcp`, a superuser, so tests can
# create a database each): never point it at anything but tests.
set -euo pipefail

dir="${AWCP_PG_DIR:-/tmp/awcp-pg-test}"
port="${AWCP_PG_PORT:-25432}"
url="postgres://awcp@127.0.0.1:${port}/postgres"

bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
  echo "pg-test-server: PostgreSQL is not installed (apt-get install postgresql)" >&2
  exit 1
fi

# initdb and postgres refuse to run as root: as root, run them as the `postgres` user the
# Debian package creates.
as_pg() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

running() {
  [ -f "$dir/PG_VERSION" ] && as_pg "$bindir/pg_ctl" -D "$dir" status >/dev/null 2>&1
}

case "${1:-}" in
  start)
    if ! running; then
      if [ ! -f "$dir/PG_VERSION" ]; then
        rm -rf "$dir"
        mkdir -p "$dir"
        [ "$(id -u)" = 0 ] && chown postgres: "$dir"
        chmod 700 "$dir"
        as_pg "$bindir/initdb" -D "$dir" -U awcp --auth=trust --encoding=UTF8 \
          --no-sync >"$dir.initdb.log" 2>&1 \
          || { cat "$dir.initdb.log" >&2; exit 1; }
      fi
      # Its socket in its own directory (the default one may not be writable), TCP only on
      # loopback, and no fsync: test data is thrown away.
      as_pg "$bindir/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 \
        -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$dir \
            -c fsync=off -c max_connections=200" start >&2 \
        || { cat "$dir/server.log" >&2; exit 1; }
    fi
    echo "pg-test-server: PostgreSQL on 127.0.0.1:$port (data in $dir)" >&2
    echo "export AWCP_TEST_POSTGRES_URL=$url"
    ;;
  url)
    echo "export AWCP_TEST_POSTGRES_URL=$url"
    ;;
  stop)
    if running; then
      as_pg "$bindir/pg_ctl" -D "$dir" -m fast -w stop >&2
    fi
    rm -rf "$dir" "$dir.initdb.log"
    ;;
  *)
    echo "usage: $0 start|url|stop" >&2
    exit 2
    ;;
esac
