"""A failed load's cooldown ends when what failed is fixed (issue 31).

After a failed load the engine refuses new loads of that model for `load_cooldown_s` (300 s), so
a broken model cannot spin. But a model file deleted, then restored, stayed refused for the whole
cooldown (a restore still copying when the first request came: the file was there, empty), even
after `POST /admin/rescan`. Now a rescan clears the cooldown, and so does the model's file coming
back or changing (its inode, size or mtime). Real `modelyard serve` and fake llama-server
processes; the fake fails to start, as llama-server does, when its file is empty or when a
`broken` marker says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.harness import HELLO, config, module_server
from tests.integration.pull_support import post
from tests.support import Server, fake_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# Start the fake only if the model file ($path, as llama-server's -m) holds something and no
# `broken` marker lies beside it; else fail as llama-server does when it cannot read its model.
GUARD = ('if [ ! -s "$0" ] || [ -e "$0.broken" ]; then echo "failed to load model $0" >&2; '
         'exit 1; fi; exec "$@"')


def guarded(model_id: str, path: Path) -> dict[str, Any]:
    spec = fake_model(model_id)
    spec["argv"] = ["sh", "-c", GUARD, "$path", *spec["argv"]]
    return {**spec, "path": str(path)}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, files: Path) -> Iterator[Server]:
    cfg = config(guarded("restored", files / "restored.gguf"),
                 guarded("fixed", files / "fixed.gguf"), load_cooldown_s=300)
    with module_server(tmp_path_factory, cfg) as s:
        yield s


def chat(server: Server, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": HELLO, "max_tokens": 3})


def fails_then_cools(server: Server, model: str) -> None:
    first = chat(server, model)
    assert first.status_code == 503 and "failed to load model" in first.text, first.text
    again = chat(server, model)
    assert again.status_code == 503 and "load_cooldown_s" in again.text, again.text


def test_a_restored_file_ends_the_cooldown(server: Server, files: Path) -> None:
    (files / "restored.gguf").write_bytes(b"")  # its restore has only begun
    fails_then_cools(server, "restored")
    (files / "restored.gguf").write_bytes(b"GGUF restored")
    r = chat(server, "restored")
    assert r.status_code == 200, r.text


def test_a_rescan_ends_the_cooldown(server: Server, files: Path) -> None:
    weights = files / "fixed.gguf"
    weights.write_bytes(b"GGUF")
    (files / "fixed.gguf.broken").touch()
    fails_then_cools(server, "fixed")
    (files / "fixed.gguf.broken").unlink()  # fixed beside the model file, which is unchanged
    assert chat(server, "fixed").status_code == 503, "still cooling: nobody said so"
    assert post(server, "/admin/rescan").status_code == 200
    r = chat(server, "fixed")
    assert r.status_code == 200, r.text
