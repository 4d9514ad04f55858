"""Everything under MODELYARD_HOME is the owner's only (src/modelyard/home.py): a real
`modelyard serve` started with a permissive umask (022) on a fresh home, with its engine process
and a fake llama-server that saves a chat session's KV, writes its database (and -wal/-shm while
they exist), logs, secret key, CLI token and session KV file with no group/other access, makes
the home 0700, and takes group/other access off a file an older version left readable."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.harness import config
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    old = os.umask(0o022)  # what a login shell usually has: files 0644, directories 0755
    try:
        yield
    finally:
        os.umask(old)


def test_every_file_under_home_is_private(tmp_path: Path, permissive_umask: None) -> None:
    home = tmp_path / "home"
    old_log = home / "logs" / "modelyard.log.1"
    old_log.parent.mkdir(parents=True)
    old_log.write_text("a prompt an older version logged\n")
    assert old_log.stat().st_mode & 0o077  # readable by others, as left by an older version
    kv = fake_model("kv", "--parallel", "2", "--slot-save-path", "$slot_dir")
    server = Server(home, config(kv, chat_session_persist=True))
    try:
        server.wait_healthy()
        body = {"model": "kv", "messages": [{"role": "user", "content": "a private thought"}],
                "max_tokens": 3, "session_id": "diary"}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        poll(lambda: list((home / "session-kv").glob("*.bin")), what="the saved session KV")
        written = {p.relative_to(home).as_posix() for p in home.rglob("*")}
        for expected in ("modelyard.db", "secret-key", "cli-token", "logs/modelyard.log",
                         "logs/engine-0.log", "session-kv"):
            assert expected in written, sorted(written)
        open_to_others = [
            f"{p.relative_to(home)} {stat.filemode(p.lstat().st_mode)}"
            for p in [home, *home.rglob("*")]
            if not p.is_symlink() and p.lstat().st_mode & 0o077
        ]
        assert open_to_others == []
    finally:
        server.stop()
