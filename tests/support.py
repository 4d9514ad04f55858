"""Test helpers: real `modelyard serve` processes, configs that use the fake backend."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
FAKE_BACKEND = ROOT / "tests" / "fakes" / "fake_backend.py"

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_model(model_id: str, *flags: str, **fields: Any) -> dict[str, Any]:
    """A config entry whose backend is the fake llama-server process with fault `flags`,
    keyed as llama-server is (`--api-key-file`: a request without the load's key is a 401)."""
    argv = [sys.executable, str(FAKE_BACKEND), "--host", "$host", "--port", "$port",
            "--alias", "$id", "--api-key-file", "$api_key_file", *flags]
    return {"id": model_id, "backend": "openai", "argv": argv, **fields}


def backend_headers(home: Path, model: str) -> dict[str, str]:
    """What a test needs to call `model`'s backend straight (the load's key, from the private
    file the engine wrote under `home` for llama-server's `--api-key-file`): a keyed backend
    answers its other routes than health with a 401 without it. Nothing when it runs no key."""
    where = home / "run" / "backend-keys"
    files = [f for f in where.glob("*.key") if f.name.rsplit("-", 1)[0] == model]
    if not files:
        return {}
    [found] = files
    return {"Authorization": f"Bearer {found.read_text().strip()}"}


class Server:
    """A `modelyard serve` process on a free port, with its own MODELYARD_HOME."""

    def __init__(self, home: Path, config: dict[str, Any], *args: str,
                 preexec_fn: Callable[[], Any] | None = None) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        home.mkdir(parents=True, exist_ok=True)
        self.config_file = home / "config.yaml"
        self.config_file.write_text(yaml.safe_dump(config))
        env = {**os.environ, "MODELYARD_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        env.pop("MODELYARD_CONFIG", None)
        self.log = (home / "serve.out").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modelyard", "serve", "--port", str(self.port),
             "--config", str(self.config_file), *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=preexec_fn,  # e.g. a resource limit the test puts on the front
        )

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"modelyard exited: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).json()["status"] == "healthy":
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"modelyard not healthy: {self.output()}")

    def output(self) -> str:
        return (self.home / "serve.out").read_text()

    @property
    def admin_headers(self) -> dict[str, str]:
        """The admin token first boot wrote for the CLI (auth `auto` needs it on /admin …)."""
        token = (self.home / "cli-token").read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def sleeper() -> subprocess.Popen[bytes]:
    """A real process that lives 30 s unless killed (the caller reaps it)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])


# The GPU check (scripts/gpu-check.sh) runs the GPU tests on random-weight stand-ins of the demo
# model (bench/gpu/standins.py): same shapes, same tokenizer, nonsense words. It sets this, and a
# test that checks what the real demo model answers checks only that an answer came.
STANDIN_MODELS = os.environ.get("MODELYARD_STANDIN_MODELS") == "1"


def require_e2e_artifact(path: Path | None, what: str) -> Path:
    """Skip when a real artefact is missing locally; fail when `make test` should have made it."""
    if path is not None and path.exists():
        return path
    message = f"{what} is missing: run `make test` (it provides it)"
    if os.environ.get("MODELYARD_REQUIRE_E2E") == "1":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def demo_batch_generator(max_batch_size: int = 4) -> Iterator[tuple[Any, Any, Any]]:
    """The demo model as safetensors (`make demo-safetensors`) loaded in process, with the
    transformers engine's batch generator running on it: (model, tokenizer, generator)."""
    from modelyard.config import TransformersModel, cache_dir
    from modelyard.engine.backends.transformers.generator import BatchGenerator
    from modelyard.engine.backends.transformers.loader import decide_precision, load_causal_lm

    env = os.environ.get("MODELYARD_DEMO_SAFETENSORS")
    default = cache_dir() / "models" / "smollm2-135m-instruct-safetensors"
    repo = require_e2e_artifact(Path(env) if env else default,
                                "the demo model as safetensors (make demo-safetensors)")
    spec = TransformersModel(id="smol", backend="transformers", path=repo)
    done = load_causal_lm(spec, decide_precision(spec))
    gen = BatchGenerator(done.model, done.tokenizer, max_batch_size=max_batch_size)
    gen.start()
    try:
        yield done.model, done.tokenizer, gen
    finally:
        gen.stop()


def poll(check: Callable[[], T], timeout_s: float = 20.0, what: str = "condition") -> T:
    """`check()` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def tiny_gguf(path: Path, arch: str = "llama", template: str | None = None,
              extra: dict[str, int] | None = None) -> Path:
    """A real (tiny) GGUF file with the metadata the catalog's rules read, and one tensor."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    writer.add_context_length(2048)
    if template is not None:
        writer.add_chat_template(template)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
