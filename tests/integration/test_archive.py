"""The archive through a real `modelyard serve`: service outputs archived by default, chat
transcripts only when asked (OpenAI, Ollama, native; streamed and whole), downloads, deletes,
and who sees what.

Callers are real identities: users made through /admin/users with bearer tokens from /tokens
(the admin's token is the CLI's, written at first boot). Items are saved after the response has
gone, so a test waits for an item to be listed. Expiry itself (the sweeper, with a clock) is
tested in tests/unit/test_archive.py; here `expires_at` is checked.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fakes.fake_service import image_b64, speech_audio
from tests.integration.harness import (
    APIS,
    answer_text,
    chat_request,
    config,
    event_text,
    stream_events,
)
from tests.support import ROOT, Server, fake_model, free_port, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAKE_SERVICE = ROOT / "tests" / "fakes" / "fake_service.py"
HOUR, DAY, WEEK = 3600.0, 86400.0, 7 * 86400.0
Headers = dict[str, str]


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Always-loaded fake services (no load route): kind → URL."""
    logs = tmp_path_factory.mktemp("fakes")
    procs: list[subprocess.Popen[bytes]] = []
    urls = {}
    try:
        for kind in ("image", "speech", "transcription"):
            port = free_port()
            with (logs / f"{kind}.log").open("w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, str(FAKE_SERVICE), "--host", "127.0.0.1", "--port",
                     str(port), "--kind", kind, "--start-loaded"],
                    stdout=out, stderr=subprocess.STDOUT))
            urls[kind] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            poll(lambda u=url: _up(u), what=f"fake service at {url}")
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, fakes: dict[str, str]) -> Iterator[Server]:
    paths = {"image": "/v1/images/generations", "speech": "/v1/audio/speech",
             "transcription": "/v1/audio/transcriptions"}
    services = [
        {"id": name, "backend": "service", "url": fakes[kind], "paths": {kind: paths[kind]},
         "load_path": None, "unload_path": None}
        for name, kind in (("painter", "image"), ("tts", "speech"), ("stt", "transcription"))
    ]
    cfg = config(*services, fake_model("chatty"), fake_model("slow", "--tokens-per-s", "20"))
    s = Server(tmp_path_factory.mktemp("front"), cfg, "--single-process")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _token(server: Server, owner: str, **fields: Any) -> Headers:
    r = httpx.post(server.url + "/admin/users", headers=server.admin_headers, timeout=10,
                   json={"name": owner, "password": f"{owner}-password-1", "is_admin": False,
                         "must_change_password": False})
    assert r.status_code in (201, 409), r.text  # 409: made by an earlier call
    r = httpx.post(server.url + "/tokens", headers=server.admin_headers, timeout=10,
                   json={"name": f"{owner}-{len(fields)}", "scopes": ["inference"],
                         "owner": owner, **fields})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


@pytest.fixture(scope="module")
def alice(server: Server) -> Headers:
    return _token(server, "alice")


@pytest.fixture(scope="module")
def bob(server: Server) -> Headers:
    return _token(server, "bob")


def items(server: Server, who: Headers, **query: Any) -> list[dict[str, Any]]:
    r = httpx.get(server.url + "/archive", params=query, headers=who, timeout=10)
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


def wait_item(server: Server, who: Headers, match: Any, **query: Any) -> dict[str, Any]:
    """The first listed item `match(item)` accepts, once it has been saved."""
    def find() -> dict[str, Any] | None:
        return next((i for i in items(server, who, **query) if match(i)), None)

    return poll(find, timeout_s=20, what="the archived item")


def content(server: Server, who: Headers, item_id: str) -> httpx.Response:
    return httpx.get(f"{server.url}/archive/{item_id}/content", headers=who, timeout=10)


def draw(server: Server, who: Headers, prompt: str, **headers: str) -> httpx.Response:
    body = {"model": "painter", "prompt": prompt, "response_format": "b64_json"}
    return httpx.post(server.url + "/v1/images/generations", json=body,
                      headers={**who, **headers}, timeout=30)


def speak(server: Server, who: Headers, text: str, **headers: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/speech",
                      json={"model": "tts", "input": text, "voice": "alloy"},
                      headers={**who, **headers}, timeout=30)


def meta_is(key: str, value: Any) -> Any:
    return lambda i: i["meta"].get(key) == value


# ---- service outputs: archived by default -------------------------------------------------------


def test_an_image_is_archived_and_downloads_byte_for_byte(server: Server, alice: Headers) -> None:
    r = draw(server, alice, "a red fox")
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["b64_json"] == image_b64("a red fox")  # the answer is unchanged

    item = wait_item(server, alice, meta_is("prompt", "a red fox"), kind="image")
    assert (item["owner"], item["kind"], item["model"]) == ("alice", "image", "painter")
    assert item["media_type"] == "image/png" and item["filename"].endswith(".png")
    assert item["retention"] == "1w"  # the server's default
    assert item["expires_at"] == pytest.approx(item["created_at"] + WEEK)

    got = content(server, alice, item["id"])
    assert got.status_code == 200
    assert got.content == base64.b64decode(image_b64("a red fox"))
    assert got.headers["content-type"] == "image/png"
    assert got.headers["content-disposition"] == f'attachment; filename="{item["filename"]}"'
    assert item["size_bytes"] == len(got.content)
    assert (server.home / "archive" / item["id"]).read_bytes() == got.content


def test_speech_and_transcriptions_are_archived(server: Server, alice: Headers) -> None:
    r = speak(server, alice, "archived words")
    assert r.status_code == 200 and r.content == speech_audio("archived words")
    item = wait_item(server, alice, meta_is("input", "archived words"), kind="speech")
    got = content(server, alice, item["id"])
    assert got.content == speech_audio("archived words")
    assert got.headers["content-type"] == "audio/wav" and item["filename"].endswith(".wav")

    r = httpx.post(server.url + "/v1/audio/transcriptions", headers=alice, timeout=30,
                   files={"file": ("clip.wav", b"RIFF" * 100, "audio/wav")},
                   data={"model": "stt"})
    assert r.status_code == 200, r.text
    item = wait_item(server, alice, lambda i: True, kind="transcription")
    assert content(server, alice, item["id"]).content == r.content
    assert item["media_type"] == "application/json"


def test_off_skips_the_archive_and_a_retention_sets_it(server: Server, alice: Headers) -> None:
    assert speak(server, alice, "not kept", **{"X-Modelyard-Archive": "off"}).status_code == 200
    assert speak(server, alice, "kept a day", **{"X-Modelyard-Archive": "1d"}).status_code == 200
    item = wait_item(server, alice, meta_is("input", "kept a day"), kind="speech")
    assert item["retention"] == "1d"
    assert item["expires_at"] == pytest.approx(item["created_at"] + DAY)
    # Saved before the later request's item was: it would be listed by now.
    assert not [i for i in items(server, alice, kind="speech") if i["meta"]["input"] == "not kept"]


def test_a_tokens_default_retention_applies(server: Server) -> None:
    carol = _token(server, "carol", archive_retention="never")
    assert draw(server, carol, "forever fox").status_code == 200
    item = wait_item(server, carol, meta_is("prompt", "forever fox"))
    assert (item["retention"], item["expires_at"]) == ("never", None)


def test_a_token_without_a_retention_takes_its_owners_default(server: Server) -> None:
    erin = _token(server, "erin")
    # The owner sets the default in the Studio (a login): an inference token may not.
    with httpx.Client(base_url=server.url, timeout=30) as studio:
        r = studio.post("/auth/login", json={"username": "erin", "password": "erin-password-1"})
        assert r.status_code == 200, r.text
        r = studio.patch("/auth/me", json={"archive_retention": "1d"},
                         headers={"X-CSRF-Token": r.json()["csrf_token"]})
        assert r.status_code == 200, r.text
    assert draw(server, erin, "owner default fox").status_code == 200
    item = wait_item(server, erin, meta_is("prompt", "owner default fox"))
    assert item["retention"] == "1d"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_chat_response_names_its_archive_item(
    server: Server, alice: Headers, stream: bool
) -> None:
    path, body = chat_request("openai", "chatty", stream=stream)
    body = {**body, "messages": [{"role": "user", "content": f"name my item {stream}"}]}
    r = httpx.post(server.url + path, json=body, timeout=30,
                   headers={**alice, "X-Modelyard-Archive": "1d"})
    assert r.status_code == 200, r.text
    item_id = r.headers["x-modelyard-archive-id"]
    found = poll(lambda: httpx.get(f"{server.url}/archive/{item_id}", headers=alice,
                                   timeout=10).status_code == 200,
                 timeout_s=20, what="the announced archive item")
    assert found
    item = httpx.get(f"{server.url}/archive/{item_id}", headers=alice, timeout=10).json()
    assert item["meta"]["title"] == f"name my item {stream}" and item["retention"] == "1d"


def test_a_bad_archive_header_is_400_in_the_routes_shape(server: Server, alice: Headers) -> None:
    r = speak(server, alice, "x", **{"X-Modelyard-Archive": "2h"})
    assert r.status_code == 400
    error = r.json()["error"]  # an OpenAI route: OpenAI's envelope (issue 32 item 8)
    assert (error["code"], error["param"]) == ("invalid_request", "X-Modelyard-Archive")
    path, body = chat_request("openai", "chatty", stream=False)
    r = httpx.post(server.url + path, json=body, timeout=30,
                   headers={**alice, "X-Modelyard-Archive": "forever"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "X-Modelyard-Archive"
    r = httpx.post(server.url + "/api/chat", json={**body, "archive": "later"}, timeout=30)
    assert r.status_code == 400 and "archive" in r.json()["error"]


# ---- chat transcripts: only when asked ---------------------------------------------------------


def _chat(server: Server, who: Headers, api: str, stream: bool, marker: str,
          headers: Headers | None = None, **fields: Any) -> str:
    """Run one chat; the answer's text as the client saw it."""
    path, body = chat_request(api, "chatty", stream=stream)
    body = {**body, **fields, "messages": [{"role": "user", "content": marker}]}
    r = httpx.post(server.url + path, json=body, headers={**who, **(headers or {})}, timeout=30)
    assert r.status_code == 200, r.text
    if not stream:
        return answer_text(api, r.json())
    return "".join(event_text(api, e) for e in stream_events(api, r.text))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_a_chat_is_archived_when_asked(
    server: Server, alice: Headers, api: str, stream: bool
) -> None:
    marker = f"archive me {api} {stream}"
    answer = _chat(server, alice, api, stream, marker, {"X-Modelyard-Archive": "1h"})
    assert answer  # the fake's deterministic words

    item = wait_item(server, alice, meta_is("title", marker), kind="chat")
    assert (item["owner"], item["model"], item["retention"]) == ("alice", "chatty", "1h")
    assert item["expires_at"] == pytest.approx(item["created_at"] + HOUR)
    assert item["meta"]["complete"] is True and item["meta"]["stream"] is stream
    assert item["meta"]["finish_reason"] == "stop"
    assert item["media_type"] == "application/json" and item["filename"].endswith(".json")
    doc = content(server, alice, item["id"]).json()
    assert doc["messages"] == [{"role": "user", "content": marker},
                               {"role": "assistant", "content": answer}]
    assert doc["model"] == "chatty" and doc["complete"] is True
    if api != "openai" or not stream:  # an OpenAI stream has usage only if the client asks
        assert doc["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("api", APIS)
def test_a_chat_is_not_archived_unless_asked(server: Server, alice: Headers, api: str) -> None:
    _chat(server, alice, api, False, f"forget me {api}")
    _chat(server, alice, api, False, f"forget me too {api}", {"X-Modelyard-Archive": "off"})
    _chat(server, alice, api, False, f"keep me {api}", {"X-Modelyard-Archive": "on"})
    kept = wait_item(server, alice, meta_is("title", f"keep me {api}"), kind="chat")
    assert kept["retention"] == "1w"
    titles = {i["meta"]["title"] for i in items(server, alice, kind="chat")}
    assert f"forget me {api}" not in titles and f"forget me too {api}" not in titles


@pytest.mark.parametrize(("api", "value", "retention"),
                         [("openai", "1d", "1d"), ("ollama", True, "1w"), ("native", "1m", "1m")])
def test_the_body_field_asks_too(
    server: Server, alice: Headers, api: str, value: Any, retention: str
) -> None:
    marker = f"body field {api}"
    _chat(server, alice, api, True, marker, archive=value)
    item = wait_item(server, alice, meta_is("title", marker), kind="chat")
    assert item["retention"] == retention
    doc = content(server, alice, item["id"]).json()
    assert "archive" not in doc["parameters"]


def test_a_stream_the_client_leaves_is_archived_as_incomplete(
    server: Server, alice: Headers
) -> None:
    marker = "leave early"
    path, body = chat_request("openai", "slow", stream=True, max_tokens=200)
    body["messages"] = [{"role": "user", "content": marker}]
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", server.url + path, json=body, headers={**alice, "X-Modelyard-Archive": "1d"}
    ) as r:
        assert r.status_code == 200
        received = ""
        for line in r.iter_lines():
            if line.startswith("data:"):
                received += event_text("openai", json.loads(line[5:]))
            if len(received.split()) >= 3:
                break  # leave: the stream is closed here
    item = wait_item(server, alice, meta_is("title", marker), kind="chat")
    assert item["meta"]["complete"] is False
    doc = content(server, alice, item["id"]).json()
    produced = doc["messages"][-1]["content"]
    assert produced.startswith(received) and len(produced.split()) < 200
    assert doc["complete"] is False


# ---- who sees what ------------------------------------------------------------------------------


def test_other_users_get_404_and_admins_see_all(
    server: Server, alice: Headers, bob: Headers
) -> None:
    assert draw(server, alice, "alice's fox").status_code == 200
    assert draw(server, bob, "bob's fox").status_code == 200
    assert draw(server, {}, "nobody's fox").status_code == 200  # anonymous: loopback, auth auto
    mine = wait_item(server, alice, meta_is("prompt", "alice's fox"))
    admin = server.admin_headers
    anonymous = wait_item(server, admin, meta_is("prompt", "nobody's fox"))
    assert anonymous["owner"] is None
    wait_item(server, admin, meta_is("prompt", "bob's fox"))

    assert {i["owner"] for i in items(server, alice)} == {"alice"}
    assert {i["owner"] for i in items(server, bob)} == {"bob"}
    assert {"alice", "bob", None} <= {i["owner"] for i in items(server, admin, limit=500)}
    for who, item in ((bob, mine), (alice, anonymous)):
        for method, suffix in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            r = httpx.request(method, f"{server.url}/archive/{item['id']}{suffix}",
                              headers=who, timeout=10)
            assert r.status_code == 404, r.text
            assert r.json()["error"] == "archive_item_not_found"
    assert content(server, admin, mine["id"]).status_code == 200

    r = httpx.get(server.url + "/archive", timeout=10)  # no identity at all
    assert r.status_code == 401


def test_the_owner_deletes_an_item_and_its_file(server: Server, alice: Headers) -> None:
    assert draw(server, alice, "to delete").status_code == 200
    item = wait_item(server, alice, meta_is("prompt", "to delete"))
    path = server.home / "archive" / item["id"]
    assert path.exists()
    r = httpx.delete(f"{server.url}/archive/{item['id']}", headers=alice, timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "deleted"}
    assert not path.exists()
    assert httpx.get(f"{server.url}/archive/{item['id']}", headers=alice,
                     timeout=10).status_code == 404
    assert item["id"] not in {i["id"] for i in items(server, alice)}


def test_a_studio_session_browses_downloads_and_deletes(server: Server) -> None:
    """The Studio's way in: a login (cookie + CSRF) and the user's own default retention."""
    _token(server, "dave")  # makes the user
    with httpx.Client(base_url=server.url, timeout=30) as studio:
        r = studio.post("/auth/login", json={"username": "dave", "password": "dave-password-1"})
        assert r.status_code == 200, r.text
        csrf = {"X-CSRF-Token": r.json()["csrf_token"]}
        r = studio.patch("/auth/me", json={"archive_retention": "1d"}, headers=csrf)
        assert r.status_code == 200, r.text
        r = studio.post("/v1/audio/speech", json={"model": "tts", "input": "dave's words"},
                        headers=csrf)
        assert r.status_code == 200, r.text

        def listed() -> dict[str, Any] | None:
            found = studio.get("/archive", params={"kind": "speech"}).json()["items"]
            return found[0] if found else None

        item = poll(listed, what="dave's item")
        assert (item["owner"], item["retention"]) == ("dave", "1d")  # the user's default
        assert item["expires_at"] == pytest.approx(item["created_at"] + DAY)
        assert studio.get(f"/archive/{item['id']}/content").content == speech_audio(
            "dave's words")
        r = studio.delete(f"/archive/{item['id']}")  # no CSRF token
        assert r.status_code == 403 and r.json()["error"] == "csrf_failed"
        assert studio.delete(f"/archive/{item['id']}", headers=csrf).status_code == 200
        assert studio.get("/archive").json() == {"items": []}


def test_the_list_pages_and_filters(server: Server, alice: Headers) -> None:
    for i in range(3):
        assert draw(server, alice, f"page {i}").status_code == 200
    wait_item(server, alice, meta_is("prompt", "page 2"))
    every = items(server, alice, kind="image", limit=500)
    assert [i["created_at"] for i in every] == sorted((i["created_at"] for i in every),
                                                      reverse=True)
    first = items(server, alice, kind="image", limit=2)
    rest = items(server, alice, kind="image", before=first[-1]["created_at"], limit=500)
    assert [i["id"] for i in first + rest] == [i["id"] for i in every]
    r = httpx.get(server.url + "/archive", params={"kind": "video"}, headers=alice, timeout=10)
    assert r.status_code == 400 and r.json()["param"] == "kind"


def test_archive_files_are_named_by_ids_only(server: Server) -> None:
    names = [p.name for p in Path(server.home / "archive").iterdir()]
    assert names and all(len(n) == 32 and int(n, 16) >= 0 for n in names)
