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
# The database DATABASE_URL names by default (.cargo/config.toml). `almanac`
# creates it on its own; `#[sqlx::test]` needs it to exist to create the
# per-test databases from.
if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'almanac'" postgres | grep -q 1; then
  psql -q -h 127.0.0.1 -U postgres -c 'CREATE DATABASE almanac' postgres
fi

# RabbitMQ (127.0.0.1:5672, guest/guest).
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if ! port_open 5672; then
  echo "services: starting RabbitMQ" >&2
  rabbitmq-server -detached
  wait_for RabbitMQ 120 port_open 5672
fi

# A Kafka-protocol broker: tansu (Apache-2.0, Rust), in memory, on 127.0.0.1:9092.
if ! port_open 9092; then
  if ! command -v tansu >/dev/null 2>&1; then
    echo "services: installing tansu (cargo install, about 16 minutes the first time)" >&2
    cargo install tansu --locked --features dynostore
  fi
  echo "services: starting tansu on 127.0.0.1:9092" >&2
  mkdir -p target
  nohup tansu broker \
    --listener-url tcp://127.0.0.1:9092 \
    --advertised-listener-url tcp://127.0.0.1:9092 \
    --storage-engine memory://tansu/ > target/tansu.log 2>&1 &
  wait_for tansu 60 port_open 9092
fi

# Headless Chromium and its WebDriver for the dashboard's browser tests
# (tests/it/ui.rs), from Debian's packages.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  echo "services: installing chromium and chromium-driver" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y chromium chromium-driver >/dev/null 2>&1; then
    apt-get update -q
    apt-get install -y chromium chromium-driver
  fi
fi

# promtool, for the alert rules' tests (tests/it/alerts.rs), from Debian's
# `prometheus` package (only its files are needed; no server is started).
if ! command -v promtool >/dev/null 2>&1; then
  echo "services: installing prometheus (for promtool)" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; then
    apt-get update -q
    apt-get install -y --no-install-recommends prometheus
  fi
fi

# The enqueue examples' clients (examples/python, examples/node), which
# tests/it/enqueue_sql.rs runs: a Python venv with psycopg in target/py, and
# node-postgres in examples/node/node_modules, each (re)installed when its
# pinned list changed since the last install.
root=$(cd "$(dirname "$0")/.." && pwd)
if ! cmp -s "$root/examples/python/requirements.txt" "$root/target/py/.installed" 2>/dev/null; then
  echo "services: installing psycopg into target/py (examples/python)" >&2
  rm -rf "$root/target/py"
  python3 -m venv "$root/target/py"
  "$root/target/py/bin/pip" install --quiet -r "$root/examples/python/requirements.txt"
  cp "$root/examples/python/requirements.txt" "$root/target/py/.installed"
fi
if ! cmp -s "$root/examples/node/package-lock.json" "$root/examples/node/node_modules/.installed" 2>/dev/null; then
  echo "services: npm ci in examples/node" >&2
  (cd "$root/examples/node" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$root/examples/node/package-lock.json" "$root/examples/node/node_modules/.installed"
fi
