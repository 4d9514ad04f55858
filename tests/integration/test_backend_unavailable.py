"""No llama-server binary: GGUF models answer a clear 503 backend_unavailable, nothing crashes."""

from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_gguf_without_llama_server_is_backend_unavailable(
    start_server: Any, tmp_path: Path
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 20)
    server = start_server(
        {
            "scan_hf_cache": False,
            "llama_server_path": str(tmp_path / "no-such-llama-server"),
            "models": [{"id": "tiny", "backend": "llamacpp", "path": str(gguf)}],
        }
    )
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny",
                                                               "messages": messages})
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "backend_unavailable"
    assert "llama_server_path" in error["message"]
    r = httpx.post(server.url + "/api/chat", json={"model": "tiny", "messages": messages})
    assert r.status_code == 503 and "llama-server" in r.json()["error"]
    # The front and the engine are still up and healthy.
    assert httpx.get(server.url + "/health").json()["status"] == "healthy"
