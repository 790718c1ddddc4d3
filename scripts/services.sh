#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on their standard local ports (or at DATABASE_URL/REDIS_URL,
# which are then the caller's to run). Starts the Debian-packaged servers when they are installed
# but stopped; with --install (`make test`, CI) it first installs what is missing, Chromium included.
set -euo pipefail

install=0
[ "${1:-}" = "--install" ] && install=1

need_install=()
command -v pg_ctlcluster >/dev/null 2>&1 || need_install+=(postgresql)
command -v redis-server >/dev/null 2>&1 || need_install+=(redis-server)
# The dashboard's browser tests drive Debian's Chromium (never a downloaded browser).
if [ $install = 1 ] && ! command -v chromium >/dev/null 2>&1; then need_install+=(chromium); fi
if [ ${#need_install[@]} -gt 0 ]; then
  if [ $install = 1 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_install[@]}" >/dev/null
  elif [ -z "${DATABASE_URL:-}" ] || [ -z "${REDIS_URL:-}" ]; then
    echo "missing: ${need_install[*]} (run: apt-get install ${need_install[*]}, or set DATABASE_URL/REDIS_URL)" >&2
    exit 1
  fi
fi

if [ -z "${DATABASE_URL:-}" ]; then
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    version=$(ls /etc/postgresql | sort -V | tail -1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start
    for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
  fi
  pg_isready -h 127.0.0.1 -p 5432
fi

if [ -z "${REDIS_URL:-}" ]; then
  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log
    for _ in $(seq 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  redis-cli -h 127.0.0.1 -p 6379 ping
fi
