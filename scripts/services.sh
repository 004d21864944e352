#!/usr/bin/env bash
# Starts the services almanac and its tests need, when they are not running.
# Idempotent; safe to run before every command.
set -euo pipefail

wait_for() { # what, deadline seconds, command...
  local what=$1 deadline=$2; shift 2
  for _ in $(seq 1 $((deadline * 5))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "services: $what did not come up within ${deadline}s" >&2
  return 1
}

# PostgreSQL (127.0.0.1:5432, trust auth).
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  echo "services: starting PostgreSQL" >&2
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n1)" main start
  wait_for PostgreSQL 60 pg_isready -q -h 127.0.0.1 -p 5432
fi
