"""The public front: the OpenAI, Ollama and native APIs over one or more engines.

`create_app` builds the ASGI app. It learns its engines from an `EngineProvider`
(front/engine_provider.py), started on startup and stopped on shutdown; by default one engine in
this process for `single_process`, otherwise one supervised engine process per GPU (one CPU engine
when there is none). Errors are rendered in the shape of the API that was called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from modelyard import db, metrics
from modelyard.config import Settings
from modelyard.errors import ClientDisconnected, MethodNotAllowed, ModelyardError, RouteNotFound
from modelyard.front import accounts, auth, tokens
from modelyard.front import metrics as front_metrics
from modelyard.front.api import accounts as accounts_api
from modelyard.front.api import admin, embeddings, native, ollama, openai, pulls, services
from modelyard.front.api import archive as archive_api
from modelyard.front.api import logs as logs_api
from modelyard.front.api import openapi as openapi_api
from modelyard.front.api import sessions as sessions_api
from modelyard.front.api import studio as studio_api
from modelyard.front.archive import ArchiveStore
from modelyard.front.engine_provider import ChildProcess, InProcessEngines, LocalEngines
from modelyard.front.jobs import PullJobs
from modelyard.front.logs import LogBuffer
from modelyard.front.mcp_client import McpHub
from modelyard.front.proxy import new_upstream_session
from modelyard.front.reload import ConfigReloader
from modelyard.front.render import render_error
from modelyard.front.session_kv import SessionKv
from modelyard.front.sessions import SessionStore
from modelyard.front.state import FrontState
from modelyard.request_ids import RequestIdMiddleware
from modelyard.store.registry import ModelRegistry
from modelyard.wire.engines import EngineProvider

log = logging.getLogger("modelyard.front")


async def _on_modelyard_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ModelyardError)
    return render_error(request, exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if exc.status_code == 404:
        return render_error(request, RouteNotFound(message))
    if exc.status_code == 405:
        return render_error(request, MethodNotAllowed(message))
    return render_error(request, ModelyardError(message))


async def _on_client_disconnect(request: Request, exc: Exception) -> Response:
    """A client that closed its connection before its body had all arrived (starlette raises
    ClientDisconnect from `request.body()`, wherever a handler reads it): its own doing, so a
    499 that the metrics count as such, and no traceback. Nobody receives the response."""
    assert isinstance(exc, ClientDisconnect)
    log.debug("%s %s: the client left before sending its whole body", request.method,
              request.url.path)
    return render_error(request, ClientDisconnected(
        "the client closed the connection before it sent its whole request body"))


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return render_error(request, ModelyardError(f"internal error: {type(exc).__name__}: {exc}"))


def create_app(
    settings: Settings,
    *,
    provider: EngineProvider | None = None,
    registry: ModelRegistry | None = None,
    config_file: Path | None = None,
    import_dirs: Sequence[Path] = (),
) -> Starlette:
    registry = registry or ModelRegistry.build(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if provider is None and not settings.single_process:  # (`modelyard serve` did it)
                metrics.setup_multiprocess(settings.home)  # before engines start: they inherit
            stack.callback(metrics.release_multiprocess)  # last, once the engines have stopped
            # The front's own records, for GET /admin/logs (and an in-process engine's).
            app.state.logs = stack.enter_context(LogBuffer(settings.log_buffer_lines).capture())
            engines = provider or _default_provider(settings, registry, config_file,
                                                    app.state.logs)
            try:
                await engines.start()
            finally:  # what started stops, even when the first start failed
                stack.push_async_callback(engines.stop)
            upstream = new_upstream_session(settings.request_timeout_s)
            stack.push_async_callback(upstream.close)
            state = FrontState(settings, registry, engines, upstream)
            app.state.front = state
            app.state.mcp = McpHub(settings.mcp_servers)  # the tool loop's MCP servers
            stack.push_async_callback(app.state.mcp.close)  # their processes end with the front
            await _open_model_store(state, stack)
            assert state.db is not None
            state.archive = ArchiveStore.for_settings(settings, state.db)
            await state.archive.start()  # and its sweeper; stopped before the database closes
            stack.push_async_callback(state.archive.stop)
            state.sessions = SessionStore.for_settings(settings, state.db)
            state.session_kv = SessionKv(lambda: state.engines)
            state.sessions.on_drop = state.session_kv.drop_session
            await state.sessions.start()  # reloads persisted ones; stopped (and flushed) first
            stack.push_async_callback(state.sessions.stop)
            for directory in import_dirs:
                added = await pulls.import_models(state, directory)
                log.info("imported %d model(s) from %s", len(added), directory)
            app.state.reloader = ConfigReloader(state, config_file)  # POST /admin/reload
            stack.enter_context(app.state.reloader.on_sighup())
            await load_startup_models(state)
            yield

    app = Starlette(
        routes=[
            *openai.routes, *services.routes, *ollama.routes, *native.routes, *admin.routes,
            *pulls.routes, *embeddings.routes, *accounts_api.routes, *logs_api.routes,
            *archive_api.routes, *studio_api.routes, *front_metrics.routes,
            *sessions_api.routes, *openapi_api.routes,
        ],
        middleware=_middleware(settings),
        lifespan=lifespan,
        exception_handlers={
            ModelyardError: _on_modelyard_error,
            HTTPException: _on_http_error,
            ClientDisconnect: _on_client_disconnect,
            Exception: _on_unexpected,
        },
    )
    return app


def _middleware(settings: Settings) -> list[Middleware]:
    """Request ids, then CORS (only when origins are configured) outside the auth gate, so a
    browser's preflight is answered without credentials, as the CORS protocol requires."""
    # Outermost: even a refused request has an id, and is counted.
    stack = [Middleware(RequestIdMiddleware), Middleware(front_metrics.RequestMetrics)]
    if settings.cors_origins:
        stack.append(Middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_credentials=True,
            allow_methods=["*"], allow_headers=["*"]))
    stack.append(Middleware(auth.AuthGate, settings=settings))
    return stack


async def _open_accounts(state: FrontState) -> None:
    """First boot: `admin` with a one-time password, printed once (never logged), and the
    CLI's admin token in $MODELYARD_HOME/cli-token (0600)."""
    assert state.db is not None
    settings = state.settings
    password = os.environ.get("MODELYARD_ADMIN_PASSWORD") or None
    generated = await asyncio.to_thread(accounts.ensure_first_admin, state.db, password)
    if generated:
        print(f"\nmodelyard first boot: log in to http://{settings.host}:{settings.port}/ as "
              f"`admin` with the one-time password\n\n    {generated}\n\nYou will choose a new "
              "one at first login. (This is shown only once.)\n", file=sys.stderr, flush=True)
    admins = [u.name for u in await asyncio.to_thread(accounts.list_users, state.db)
              if u.is_admin]
    if admins:
        owner = accounts.ADMIN if accounts.ADMIN in admins else admins[0]
        await asyncio.to_thread(tokens.ensure_cli_token, state.db, settings.home, owner)
    key = await asyncio.to_thread(auth.load_secret_key, settings.home)
    state.auth = auth.Auth(settings, state.db, key)


async def _open_model_store(state: FrontState, stack: contextlib.AsyncExitStack) -> None:
    """The database and the pull jobs; jobs a previous run left unfinished become interrupted."""
    database = await asyncio.to_thread(db.connect, state.settings.db_url)
    stack.callback(database.dispose)
    state.db = database
    await _open_accounts(state)

    async def on_pulled(job: dict[str, Any]) -> None:
        if job.get("init") and job.get("model_id"):
            entry = state.registry.resolve(job["model_id"])
            await (await state.route(entry)).load(entry.id)

    jobs = PullJobs(state.settings, database, catalog_changed=state.rescan, on_pulled=on_pulled,
                    spawn=ChildProcess)
    interrupted = await jobs.recover()
    if interrupted:
        log.warning("%d pull job(s) were interrupted by the last shutdown: POST "
                    "/jobs/{id}/resume continues them", interrupted)
    stack.push_async_callback(jobs.shutdown)
    state.jobs = jobs
    await state.rescan()  # the catalog now includes what the database holds


async def load_startup_models(state: FrontState) -> None:
    """`startup_models` are loaded before the server reports ready; a failure is logged, not
    fatal (the model will say why on its first request)."""
    for name in state.settings.startup_models:
        try:
            entry = state.registry.resolve(name)
            engine = await state.route(entry)
            await engine.load(entry.id)
            log.info("startup model %s loaded on %s", entry.id, engine.name)
        except ModelyardError as exc:
            log.error("startup model %s not loaded: %s", name, exc.full_message())


def _default_provider(
    settings: Settings, registry: ModelRegistry, config_file: Path | None, logs: LogBuffer
) -> EngineProvider:
    if settings.single_process:
        return InProcessEngines(settings, registry, log_buffer=logs)
    return LocalEngines(settings, config_file=config_file)
