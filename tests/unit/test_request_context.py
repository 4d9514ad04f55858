"""The request's context (front/request_context.py), as the API layer builds it once
(front/api/context.py): the caller the auth gate attached, its priority, the chat session it
names, the archive plan, the limits' admission and the client's receive channel. Everything
below the API layer reads these instead of the request (tests/unit/test_request_context_rule.py
checks that nothing there takes one)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.requests import Request
from starlette.types import Message, Scope

from modelyard import db
from modelyard.errors import InvalidRequest
from modelyard.front.api.context import chat_context, context_of
from modelyard.front.archive.store import ArchiveStore
from modelyard.front.chat.request import CHAT_PATH, COMPLETION_PATH, ChatCall
from modelyard.front.identity import limits, limits_store
from modelyard.front.identity.limits import Limiter
from modelyard.front.identity.principal import Principal
from modelyard.front.request_context import RequestContext

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ALICE = Principal("alice", False, frozenset({"inference"}), "token", "t1")
ROOT = Principal("root", True, frozenset({"inference", "admin"}), "token", "t2")


@pytest.fixture
def database(tmp_path: Path) -> sa.Engine:
    return db.connect(f"sqlite:///{tmp_path / 'modelyard.db'}")


@pytest.fixture
def front(database: sa.Engine, tmp_path: Path) -> SimpleNamespace:
    """The parts of FrontState the context reads: the archive (for its plan)."""
    return SimpleNamespace(archive=ArchiveStore(database, tmp_path / "archive",
                                                default_retention="1w"))


async def _receive() -> Message:
    return {"type": "http.disconnect"}


def _scope(front: SimpleNamespace, principal: Principal, headers: dict[str, str],
           path: str = "/v1/chat/completions", limits: Limiter | None = None) -> Scope:
    return {"type": "http", "method": "POST", "path": path, "query_string": b"",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "app": SimpleNamespace(state=SimpleNamespace(front=front, limits=limits)),
            "modelyard.principal": principal}


def _chat(fields: dict[str, Any], *, chat: bool = True) -> ChatCall:
    return ChatCall("openai", "/v1/chat/completions", "m", CHAT_PATH if chat else COMPLETION_PATH,
                    False, {"model": "m"}, fields=fields, archive=fields.get("archive"),
                    chat=chat)


def test_a_plain_chat_carries_its_caller_and_nothing_it_did_not_ask(
        front: SimpleNamespace) -> None:  # fmt: skip
    request = Request(_scope(front, ALICE, {}), _receive)
    ctx = chat_context(request, _chat({}))
    assert isinstance(ctx, RequestContext)
    assert ctx.state is front and ctx.principal is ALICE and ctx.receive is _receive
    assert (ctx.priority, ctx.session_id, ctx.archive, ctx.admission) == (0, None, None, None)


def test_the_headers_are_decided_once_for_the_caller(front: SimpleNamespace) -> None:
    headers = {"X-Modelyard-Priority": "50", "X-Session-Id": "s1", "X-Modelyard-Archive": "1d"}
    ctx = chat_context(Request(_scope(front, ALICE, headers), _receive),
                       _chat({"session_id": "s1"}))
    assert ctx.priority == 0  # only an admin may raise it
    assert ctx.session_id == "s1"
    assert ctx.archive is not None and (ctx.archive.owner, ctx.archive.retention) == (
        "alice", "1d")
    admin = chat_context(Request(_scope(front, ROOT, headers), _receive), _chat({}))
    assert admin.priority == 50 and admin.session_id == "s1"
    # The body's `archive` field, when no header says otherwise: the caller's default retention.
    asked = chat_context(Request(_scope(front, ALICE, {}), _receive), _chat({"archive": True}))
    assert asked.archive is not None and asked.archive.retention == "1w"


def test_a_client_mistake_in_what_the_context_holds_is_a_400(front: SimpleNamespace) -> None:
    def build(headers: dict[str, str], fields: dict[str, Any], *, chat: bool = True) -> None:
        chat_context(Request(_scope(front, ALICE, headers), _receive), _chat(fields, chat=chat))

    cases = [
        ({"X-Modelyard-Priority": "high"}, {}, True, "priority"),
        ({"X-Session-Id": "a"}, {"session_id": "b"}, True, "session_id"),  # two sessions named
        ({}, {"session_id": "s1"}, False, "session_id"),  # sessions are for chats
        ({"X-Modelyard-Archive": "2h"}, {}, True, "X-Modelyard-Archive"),
    ]
    for headers, fields, chat, param in cases:
        with pytest.raises(InvalidRequest) as refused:
            build(headers, fields, chat=chat)
        assert refused.value.status == 400 and refused.value.param == param, param
    # Not a chat: the header is ignored (a client may send it on every call).
    ctx = chat_context(Request(_scope(front, ALICE, {"X-Session-Id": "s1"}), _receive),
                       _chat({}, chat=False))
    assert ctx.session_id is None


async def test_the_limits_admission_reaches_the_context(
        front: SimpleNamespace, database: sa.Engine) -> None:  # fmt: skip
    """The edge's limits step admits a limited caller; the handler's context holds that
    admission (its slot), and a caller no limit applies to has none."""
    limiter = Limiter(database, 60.0)
    limits_store.set_limit(database, "user:alice", requests_per_minute=None,
                           tokens_per_day=None, max_concurrent=2, by=None)
    await limiter.refresh()
    seen: list[RequestContext] = []

    for who in (ALICE, ROOT):
        scope = _scope(front, who, {}, limits=limiter)
        await limits.admit(scope)
        seen.append(context_of(Request(scope, _receive)))
    limited, free = seen
    assert limited.admission is not None and len(limited.admission.slots) == 1
    assert free.admission is None  # root has no limit: no database work, nothing held
    await asyncio.wait_for(limiter.stop(), 10)
