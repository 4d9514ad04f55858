"""The compatibility suite's one modelyard server, shared by every module of this folder.

It runs as `make run` does, on the embedded defaults: the demo model found by itself (served as
`smollm2`, also `smollm2:latest`) and all-MiniLM-L6-v2 from its wheel (served as `all-minilm`),
with no model declared in the config. Session-scoped, so one llama-server serves the whole
suite; it is started only when a compatibility test runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.support import Server, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir


@pytest.fixture(scope="session")
def compat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("compat-home")
    (home / "models").mkdir()
    (home / "models" / DEMO_MODEL_FILE).symlink_to(gguf)
    # 2048 tokens per slot: the num_ctx and overflow tests ask for more than one slot holds.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MODELYARD_EMBEDDING_DEMO")  # tests/conftest.py hides it from other tests
        srv = Server(home, {"scan_hf_cache": False, "default_ctx_size": 2048})
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()
