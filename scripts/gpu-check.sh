#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): one command, on a bare machine with an NVIDIA GPU and no
# network, within 9 minutes. `make gpu-kit` (on a CPU machine) first makes gpu-kit/, which this
# script needs beside the working tree: the wheels the machine's Python lacks, the trimmed
# llama.cpp source (and a CUDA llama-server built ahead, when one was), the demo tokenizer.
#
#   scripts/gpu-check.sh OUTDIR             # on the GPU machine
#   scripts/gpu-check.sh --dry-run OUTDIR   # on a CPU machine: every step but the CUDA build and
#                                           # the device readings (the project's venv, the CPU
#                                           # llama-server, the demo-sized stand-in)
#
# Results: OUTDIR/gpu-check.json and OUTDIR/gpu-check.md (each step's result as it ends), the
# build log, the tests' log. Variables: MODELYARD_GPU_KIT (default ./gpu-kit),
# MODELYARD_GPU_WORK (scratch, default /tmp/gpu-check), MODELYARD_GPU_DEADLINE_S (default 500: the
# steps' share of the 9 minutes; the set-up before them takes ~20 s).
set -uo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:?usage: scripts/gpu-check.sh [--dry-run] OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=$(realpath -m "${MODELYARD_GPU_KIT:-$ROOT/gpu-kit}")
WORK=${MODELYARD_GPU_WORK:-/tmp/gpu-check}
DEADLINE=${MODELYARD_GPU_DEADLINE_S:-500}
mkdir -p "$OUT" "$WORK"
OUT=$(realpath "$OUT")
say() { echo "gpu-check: $*" >&2; }

if [ ! -f "$KIT/manifest.json" ]; then
  say "no kit at $KIT: run \`make gpu-kit\` on a CPU machine first"
  exit 2
fi

if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  BIN=$("$PY" -c 'from modelyard.config import Settings; print(Settings().resolve_llama_server() or "")')
  [ -n "$BIN" ] || { say "no llama-server here: run \`make llama-server\`"; exit 2; }
  exec "$PY" "$ROOT/bench/gpu/check.py" --dry-run --out "$OUT" --kit "$KIT" --work "$WORK" \
    --binary "$BIN" --deadline-s "$DEADLINE"
fi

PY=${PYTHON:-python3}
# 1. What the image's Python lacks, into a folder of its own: nothing of the image (its torch
#    above all) is replaced.
SITE=$WORK/site
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" \
  "$KIT"/wheels/*.whl >"$OUT/pip.log" 2>&1 || { say "wheel install failed (pip.log)"; }
export PYTHONPATH="$SITE:$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 2. The CUDA libraries a llama-server links (cuBLAS, the runtime), wherever this image keeps
#    them: the CUDA toolkit's lib64, or the nvidia-* wheels of its Python.
LIBS=$WORK/cuda-libs
mkdir -p "$LIBS"
for name in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcublas.so.12 libcublasLt.so.12 \
            libcudart.so.12; do
  found=$( (ls /usr/local/cuda/lib64/$name /usr/local/cuda/targets/*/lib/$name 2>/dev/null;
            "$PY" -c 'import nvidia, os, glob, sys; [print(p) for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "**", sys.argv[1]), recursive=True)]' "$name" 2>/dev/null) | head -1)
  if [ -n "$found" ]; then
    ln -sf "$found" "$LIBS/$name"
    ln -sf "$found" "$LIBS/${name%.so.*}.so"
  fi
done
INCS=$("$PY" -c 'import nvidia, os, glob; print(";".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "**", "cublas_v2.h"), recursive=True)})))' 2>/dev/null)
DRIVER=$( (ls /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/nvidia/lib64/libcuda.so.1 2>/dev/null;
           ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}') | head -1)
# At run time the driver's own libcuda.so.1 (never a link-time stub).
RUNTIME_DRIVER_DIR=$( (ls -d /usr/local/nvidia/lib64 2>/dev/null;
  ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}' | xargs -r dirname) | head -1)
export LD_LIBRARY_PATH="$LIBS${RUNTIME_DRIVER_DIR:+:$RUNTIME_DRIVER_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{ nvidia-smi; echo; nvcc --version 2>&1 | tail -2; "$PY" --version; cmake --version | head -1;
  ninja --version; echo "nproc $(nproc)"; free -g | head -2; df -h "$WORK" | tail -1
  echo "cuda libs: $(ls -l "$LIBS" | tail -n +2 | awk '{print $9, $11}' | tr '\n' ' ')"
  echo "cublas headers: $INCS"; echo "driver library: $DRIVER"
} >"$OUT/machine.txt" 2>&1

# 3. llama-server: the one built ahead, if it runs here with CUDA; else built now, for this GPU's
#    architecture only, in the background while the steps that need no binary run.
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
BUILD=$WORK/build
BIN_ARGS=(--build-dir "$BUILD")
PREBUILT=$WORK/prebuilt/llama-server
if [ -f "$KIT/llama-server-cuda.xz" ]; then
  mkdir -p "$(dirname "$PREBUILT")"
  xz -dc "$KIT/llama-server-cuda.xz" >"$PREBUILT" && chmod +x "$PREBUILT"
  if timeout 60 "$PREBUILT" --list-devices 2>"$OUT/prebuilt.log" | grep -q "CUDA0"; then
    say "using the llama-server built ahead ($("$PREBUILT" --version 2>&1 | grep -m1 version))"
    BIN_ARGS=(--binary "$PREBUILT")
  else
    say "the llama-server built ahead does not see the GPU here (prebuilt.log): building"
  fi
fi
if [ "${BIN_ARGS[0]}" = "--build-dir" ]; then
  # The project's own build script, with the kit's source instead of the download, for this
  # GPU's architecture only (scripts/detect_accel.py), cuBLAS from wherever it was found above.
  extra=""
  [ -e "$LIBS/libcublas.so" ] && extra="-DCUDA_cublas_LIBRARY=$LIBS/libcublas.so -DCUDA_cublasLt_LIBRARY=$LIBS/libcublasLt.so"
  [ -n "$DRIVER" ] && extra="$extra -DCUDA_cuda_driver_LIBRARY=$DRIVER"
  [ -n "$INCS" ] && extra="$extra -DCMAKE_CUDA_FLAGS=-I${INCS%%;*} -DCMAKE_CXX_FLAGS=-I${INCS%%;*}"
  rm -rf "$BUILD" && mkdir -p "$BUILD/bin"
  ( MODELYARD_ACCEL=cuda MODELYARD_CUDA_ARCHS="${CC:-90}" MODELYARD_CACHE="$WORK/cache" \
    MODELYARD_NO_CPU_FALLBACK=1 \
    MODELYARD_LLAMA_SOURCE="$KIT/llama-cpp-cuda-src.tar.xz" MODELYARD_BUILD_JOBS="$(nproc)" \
    MODELYARD_CMAKE_ARGS="$extra" PYTHON="$PY" \
    bash "$ROOT/scripts/provide-llama-server.sh" >"$BUILD/path" &&
    ln -sf "$(cat "$BUILD/path")" "$BUILD/bin/llama-server"
    echo $? >"$BUILD/rc" ) 2>"$OUT/build.log" &
  say "building llama-server for sm_${CC:-90} in the background (build.log)"
fi

# 4. The steps.
"$PY" "$ROOT/bench/gpu/check.py" --out "$OUT" --kit "$KIT" --work "$WORK" "${BIN_ARGS[@]}" \
  --deadline-s "$DEADLINE"
rc=$?
cp "$BUILD/rc" "$OUT/build.rc" 2>/dev/null || true
exit $rc
