"""/api/show names a preset's parameters as Ollama does: the request default `max_tokens` is
Ollama's `num_predict` in the Modelfile and the parameters text (front/api/ollama_models.py)."""

from __future__ import annotations

from collections.abc import Iterator

import ollama
import pytest
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    preset = {"id": "short", "model": "base",
              "parameters": {"max_tokens": 7, "temperature": 0.2, "top_k": 5}}
    with module_server(tmp_path_factory, config(fake_model("base"), presets=[preset])) as s:
        yield s


def test_show_prints_num_predict_not_max_tokens(server: Server) -> None:
    shown = ollama.Client(host=server.url, timeout=30).show("short")
    modelfile = shown.modelfile or ""
    assert "PARAMETER num_predict 7" in modelfile, modelfile
    assert "PARAMETER temperature 0.2" in modelfile and "PARAMETER top_k 5" in modelfile
    assert "max_tokens" not in modelfile
    parameters = (shown.parameters or "").split("\n")
    assert any(line.split() == ["num_predict", "7"] for line in parameters), parameters
    assert "max_tokens" not in (shown.parameters or "")
