from pathlib import Path

import pytest

from modelyard.config import LlamaCppModel, Settings
from modelyard.engine.backends.llamacpp import llama_server_argv
from modelyard.engine.backends.openai_server import render_argv
from modelyard.errors import BackendUnavailable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_default_argv(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    settings = Settings(home=tmp_path, llama_server_path=binary, llama_server_threads=2)
    spec = LlamaCppModel(id="m", path=tmp_path / "m.gguf", mmproj=tmp_path / "p.gguf",
                         extra_args=["--temp", "0"])
    template, values = llama_server_argv(spec, settings)
    argv = render_argv(template, {**values, "host": "127.0.0.1", "port": "1234"})
    assert argv[0] == str(binary)
    joined = " ".join(argv)
    assert f"--model {tmp_path / 'm.gguf'}" in joined
    assert "--port 1234" in joined and "--host 127.0.0.1" in joined
    assert "--alias m" in joined
    # every one of the 4 slots gets the whole context
    assert "--ctx-size 16384 --parallel 4 --no-kv-unified" in joined
    assert f"--mmproj {tmp_path / 'p.gguf'}" in joined
    assert "--threads 2" in joined
    assert argv[-2:] == ["--temp", "0"]


def test_custom_argv_template(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, llama_server_path=tmp_path / "absent")
    spec = LlamaCppModel(id="m", path=Path("/w.gguf"), ctx_size=512,
                         argv=["my-server", "-m", "$path", "--port=$port", "-c", "$ctx"])
    template, values = llama_server_argv(spec, settings)
    argv = render_argv(template, {**values, "host": "h", "port": "9"})
    assert argv == ["my-server", "-m", "/w.gguf", "--port=9", "-c", "512"]


def test_missing_binary_is_backend_unavailable(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, llama_server_path=tmp_path / "absent")
    with pytest.raises(BackendUnavailable, match="llama_server_path"):
        llama_server_argv(LlamaCppModel(id="m", path=tmp_path / "m.gguf"), settings)
