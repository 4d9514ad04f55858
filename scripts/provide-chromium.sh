#!/usr/bin/env bash
# Debian's chromium for the Web Studio's end-to-end tests (Playwright drives it through
# executable_path=/usr/bin/chromium; Playwright's own browser download needs the internet).
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "installing chromium needs root or sudo" >&2; exit 1; }
  SUDO="sudo"
fi
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  chromium fonts-dejavu-core >/dev/null
test -x /usr/bin/chromium
