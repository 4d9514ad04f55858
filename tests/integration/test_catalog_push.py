"""The front pushes its catalog to its engines (wire/catalog.py): an engine whose catalog is
pushed (a cluster's: `MODELYARD_CLUSTER_TOKEN_FILE` in its environment) never opens the front's
database — here its own database URL names a file that is not a database, so opening it would
fail its start or its rescan — yet serves what the database adds after it started (an
/api/copy alias, an /api/create preset), and again after a restart (the front pushes on attach).
A /rescan body that is not a catalog is a 400."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.integration.harness import config, engine_access, module_server, status
from tests.integration.test_engine_auth import raw_http
from tests.support import Server, fake_model, poll

from modelyard.wire.cluster import STORAGE_ID_FILE, TOKEN_FILE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

NOT_A_DB = b"this is not a sqlite database, and must stay as it is\n" * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    elsewhere = tmp_path_factory.mktemp("engine-db")
    (elsewhere / "modelyard.db").write_bytes(NOT_A_DB)
    env = {TOKEN_FILE_ENV: str(elsewhere / "no-token-needed-here"),
           "MODELYARD_DATABASE_URL": f"sqlite:///{elsewhere / 'modelyard.db'}"}
    cfg = config(fake_model("m1"), engine_specs={0: {"env": env}})
    with module_server(tmp_path_factory, cfg) as s:
        s.engine_db = elsewhere / "modelyard.db"  # type: ignore[attr-defined]
        yield s


def _engine_post(server: Server, path: str, body: Any = None) -> tuple[int, Any]:
    port, secret, _ = engine_access(server)
    headers = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {secret}",
               "Content-Type": "application/json"}
    payload = json.dumps(body).encode() if body is not None else b""
    return raw_http(port, "POST", path, headers, payload)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.admin_headers,
                      timeout=30)


def test_the_engine_serves_what_the_database_added_after_it_started(server: Server) -> None:
    assert _engine_post(server, "/models/m1-copy/load")[0] == 404  # not yet
    assert _post(server, "/api/copy", {"source": "m1", "destination": "m1-copy"}).is_success
    r = _post(server, "/api/create", {"model": "m1-brief", "from": "m1", "system": "Be brief.",
                                      "stream": False})
    assert r.is_success, r.text
    for name in ("m1-copy", "m1-brief"):
        code, body = _engine_post(server, f"/models/{name}/load")
        assert (code, body["model"]) == (200, "m1"), (name, body)
    assert server.engine_db.read_bytes() == NOT_A_DB  # type: ignore[attr-defined]


def test_the_front_marks_its_models_dir_and_the_engine_reports_what_it_sees(
    server: Server,
) -> None:
    front_id = (server.home / "models" / STORAGE_ID_FILE).read_text().strip()
    assert len(front_id) == 32
    engine = status(server)["engines"][0]
    assert engine["storage_id"] == front_id  # the same home: the same storage
    assert engine["missing_files"] == []


def test_a_restarted_engine_gets_the_catalog_before_it_is_up(server: Server) -> None:
    assert _post(server, "/api/copy", {"source": "m1", "destination": "m1-again"}).is_success
    _, _, pid = engine_access(server)
    os.kill(pid, signal.SIGKILL)
    # The supervisor restarts it; the front's /status shows a new pid once it is attached.
    def restarted() -> bool:
        engine = status(server)["engines"][0]
        return bool(engine.get("up")) and engine.get("pid") not in (None, pid)

    poll(restarted, 60, "the engine restarted")
    code, body = _engine_post(server, "/models/m1-again/load")
    assert (code, body["model"]) == (200, "m1"), body


@pytest.mark.parametrize("body", [
    {"version": "one", "entries": []},
    {"version": 1, "entries": [{"spec": {"id": "x", "backend": "nope"}, "source": "pulled"}]},
    [1, 2],
])
def test_a_rescan_body_that_is_not_a_catalog_is_a_400(server: Server, body: Any) -> None:
    code, answer = _engine_post(server, "/rescan", body)
    assert (code, answer["error"]) == (400, "invalid_request"), answer
    assert _engine_post(server, "/models/m1/load")[0] == 200  # it still serves its catalog
