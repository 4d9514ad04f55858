from pathlib import Path

import pytest

from modelyard.config import LlamaCppModel, Settings, load_settings
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


def test_cache_types_and_flash_attn_rendered(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    settings = Settings(home=tmp_path, llama_server_path=binary)
    spec = LlamaCppModel(id="m", path=tmp_path / "m.gguf", cache_type_k="q8_0",
                         cache_type_v="q4_0", flash_attn="on", extra_args=["-ctk", "f16"])
    template, values = llama_server_argv(spec, settings)
    argv = render_argv(template, {**values, "host": "h", "port": "1"})
    joined = " ".join(argv)
    assert "--cache-type-k q8_0 --cache-type-v q4_0 --flash-attn on" in joined
    assert argv[-2:] == ["-ctk", "f16"]  # extra_args last: llama-server's last occurrence wins
    plain = LlamaCppModel(id="m", path=tmp_path / "m.gguf")
    plain_argv = llama_server_argv(plain, settings)[0]
    assert not {"--cache-type-k", "--cache-type-v", "--flash-attn"} & set(plain_argv)
    # a custom argv is the user's: the fields are not added to it
    custom = LlamaCppModel(id="m", path=tmp_path / "m.gguf", cache_type_k="q8_0",
                           argv=["$llama_server", "-m", "$path"])
    assert llama_server_argv(custom, settings)[0] == ["$llama_server", "-m", "$path"]


def test_quantized_v_cache_without_flash_attention_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_type_v q8_0 needs flash attention"):
        LlamaCppModel(id="m", path=tmp_path / "m.gguf", cache_type_v="q8_0", flash_attn="off")
    LlamaCppModel(id="m", path=tmp_path / "m.gguf", cache_type_v="q8_0", flash_attn="auto")
    LlamaCppModel(id="m", path=tmp_path / "m.gguf", cache_type_v="bf16", flash_attn="off")
    with pytest.raises(ValueError):
        LlamaCppModel(id="m", path=tmp_path / "m.gguf", cache_type_k="q6_k")


def test_yaml_bare_on_and_off_are_flash_attn_values(tmp_path: Path) -> None:
    # YAML 1.1 reads `flash_attn: on` as True; the docs write it bare.
    config = tmp_path / "config.yaml"
    config.write_text(
        "models:\n"
        f"  - {{id: a, backend: llamacpp, path: {tmp_path}/a.gguf, flash_attn: on}}\n"
        f"  - {{id: b, backend: llamacpp, path: {tmp_path}/b.gguf, flash_attn: off}}\n"
    )
    models = load_settings(config).models
    assert [m.flash_attn for m in models if isinstance(m, LlamaCppModel)] == ["on", "off"]
