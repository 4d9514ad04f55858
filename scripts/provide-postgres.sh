#!/usr/bin/env bash
# Debian's PostgreSQL server for the tests that run the database code against PostgreSQL
# (tests/fakes/postgres.py starts a private server from these binaries; nothing is configured
# system-wide). Prints the directory holding initdb/postgres.
set -euo pipefail

find_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/initdb" ] && [ -x "$d/postgres" ]; then
      echo "$d"
    fi
  done | sort -V | tail -n 1
}

BIN_DIR="$(find_bin)"
if [ -z "$BIN_DIR" ] && command -v initdb >/dev/null; then
  BIN_DIR="$(dirname "$(command -v initdb)")"
fi
if [ -z "$BIN_DIR" ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "installing postgresql needs root or sudo" >&2; exit 1; }
    SUDO="sudo"
  fi
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    postgresql >/dev/null
  BIN_DIR="$(find_bin)"
fi
test -n "$BIN_DIR" && test -x "$BIN_DIR/initdb"
echo "$BIN_DIR"
