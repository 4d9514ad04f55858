"""The public front: the OpenAI, Ollama and native APIs over one or more engines.

`create_app` builds the ASGI app. It learns its engines from an `EngineProvider`
(front/engines/provider.py), started on startup and stopped on shutdown; by default one engine in
this process for `single_process`, otherwise one supervised engine process per GPU (one CPU engine
when there is none). Errors are rendered in the shape of the API that was called.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from modelyard import db, metrics
from modelyard.config import Settings
from modelyard.errors import ClientDisconnected, MethodNotAllowed, ModelyardError, RouteNotFound
from modelyard.front.api import accounts as accounts_api
from modelyard.front.api import activity as activity_api
from modelyard.front.api import (
    admin,
    embeddings,
    native,
    ollama,
    ollama_create,
    ollama_models,
    openai,
    pulls,
    services,
)
from modelyard.front.api import anthropic as anthropic_api
from modelyard.front.api import archive as archive_api
from modelyard.front.api import batches as batches_api
from modelyard.front.api import cluster as cluster_api
from modelyard.front.api import limits as limits_api
from modelyard.front.api import logs as logs_api
from modelyard.front.api import openapi as openapi_api
from modelyard.front.api import rerank as rerank_api
from modelyard.front.api import responses as responses_api
from modelyard.front.api import sessions as sessions_api
from modelyard.front.api import studio as studio_api
from modelyard.front.api import usage as usage_api
from modelyard.front.api.edge import Edge, endpoint_app
from modelyard.front.archive.store import ArchiveStore
from modelyard.front.batches.files import FileStore
from modelyard.front.batches.runner import BatchRunner
from modelyard.front.batches.store import BatchStore
from modelyard.front.catalog import Catalog
from modelyard.front.chat.sessions.kv import SessionKv
from modelyard.front.chat.sessions.store import SessionStore
from modelyard.front.chat.tools.mcp import McpHub
from modelyard.front.dispatch.dispatcher import Dispatcher
from modelyard.front.dispatch.drain import Drain
from modelyard.front.dispatch.relay import new_upstream_session
from modelyard.front.engines.catalog_feed import CatalogFeed
from modelyard.front.engines.client import EngineClient
from modelyard.front.engines.provider import ChildProcess, InProcessEngines, LocalEngines
from modelyard.front.engines.shared import PublishingEngines, SharedEngines, Worker
from modelyard.front.identity import accounts, auth, tokens
from modelyard.front.identity.limits import Limiter
from modelyard.front.ops import fronts
from modelyard.front.ops import metrics as front_metrics
from modelyard.front.ops.activity import Activity
from modelyard.front.ops.draft_pulls import pull_drafts
from modelyard.front.ops.jobs import PullJobs
from modelyard.front.ops.logs import LogBuffer
from modelyard.front.ops.reload import ConfigReloader
from modelyard.front.ops.replace import Replacer
from modelyard.front.ops.usage import UsageRecorder
from modelyard.front.render import render_error
from modelyard.front.state import Chat, FrontState, Identity, Ops
from modelyard.store.registry import Entry, ModelRegistry
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


class FrontApp(Starlette):
    """The front's Starlette app, with its edge (front/api/edge.py) as its whole middleware stack;
    `drain` knows the requests in flight, for a graceful shutdown."""

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        self.edge_settings = settings
        self.drain = Drain()
        super().__init__(**kwargs)
        for route in self.router.routes:
            if isinstance(route, Route) and inspect.isfunction(route.endpoint):
                route.app = endpoint_app(route.endpoint)

    def build_middleware_stack(self) -> ASGIApp:
        return Edge(self.router, self.edge_settings, self.drain, dict(self.exception_handlers))


def create_app(
    settings: Settings,
    *,
    provider: EngineProvider | None = None,
    registry: ModelRegistry | None = None,
    config_file: Path | None = None,
    import_dirs: Sequence[Path] = (),
    worker: Worker | None = None,
) -> FrontApp:
    """`worker`: this process's place in a `serve --workers N` (front/engines/shared.py);
    worker 0 supervises the engines and does the once-per-start work (imports, startup models),
    the others attach to its engines."""
    registry = registry or ModelRegistry.build(settings)
    first = worker is None or worker.index == 0

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if provider is None and not settings.single_process and first:  # (`serve` did)
                metrics.setup_multiprocess(settings.home)  # before engines start: they inherit
            metrics.prepare()  # not on the first request's time
            stack.callback(metrics.release_multiprocess)  # last, once the engines have stopped
            stack.callback(metrics.fold)  # a worker's last second of counts, into the files
            # The front's own records, for GET /admin/logs (and an in-process engine's).
            logs = stack.enter_context(LogBuffer(settings.log_buffer_lines).capture())
            feed = CatalogFeed()  # the catalog engines are pushed (front/catalog.py)
            engines = provider or _default_provider(settings, registry, config_file, logs, feed,
                                                    worker)
            try:
                await engines.start()
            finally:  # what started stops, even when the first start failed
                stack.push_async_callback(engines.stop)
            upstream = new_upstream_session(settings.request_timeout_s)
            stack.push_async_callback(upstream.close)
            started_at = time.time()
            mcp = McpHub(settings.mcp_servers)  # the tool loop's MCP servers
            stack.push_async_callback(mcp.close)  # their processes end with the front
            session_kv = SessionKv(lambda: engines.view.engines)
            identity = await _open_identity(settings, stack)
            # A pull job that finishes places its model through the dispatcher, built next.
            catalog = await _open_catalog(settings, registry, engines, identity.db, stack,
                                          lambda entry: dispatch.route(entry), feed, worker)
            dispatch = Dispatcher(catalog, engines, upstream, session_kv)
            archive = ArchiveStore.for_settings(settings, identity.db)
            await archive.start()  # and its sweeper; stopped before the database closes
            stack.push_async_callback(archive.stop)
            sessions = SessionStore.for_settings(settings, identity.db,
                                                 on_drop=session_kv.drop_session)
            await sessions.start()  # reloads persisted ones; stopped (and flushed) first
            stack.push_async_callback(sessions.stop)
            reloader = ConfigReloader(catalog, dispatch, config_file)  # POST /admin/reload
            activity = Activity(settings.activity_max_entries)  # GET /activity
            usage = UsageRecorder(identity.db, settings.usage_flush_interval_s,
                                  settings.usage_metric_owners, settings.usage_metric_top_owners)
            await usage.start()  # flushed a last time at stop, before the database closes
            stack.push_async_callback(usage.stop)
            await _open_front_sync(settings, identity.db, catalog.jobs, reloader, stack)
            state = FrontState(
                catalog, dispatch, identity, archive, Chat(sessions, session_kv, mcp),
                Ops(reloader, logs, activity=activity, usage=usage), started_at=started_at,
            )
            state.ops.requests.add_sink(activity)  # the activity view's ring and live feed
            state.ops.requests.add_sink(usage.record)
            app.state.front = state
            # Quotas and rate limits (front/identity/limits.py): the edge's limits step
            # finds it here; it counts finished requests' tokens from the request log.
            limiter = app.state.limits = Limiter(identity.db, settings.limits_refresh_s)
            await limiter.start()
            stack.push_async_callback(limiter.stop)
            state.ops.requests.add_sink(limiter.on_record)
            for directory in import_dirs if first else ():
                added = await pulls.import_models(state, directory)
                log.info("imported %d model(s) from %s", len(added), directory)
            stack.enter_context(reloader.on_sighup())
            stack.push_async_callback(dispatch.replicas.close)
            if first:  # the workers share worker 0's engines: it places what starts on them
                replacer = Replacer(dispatch, catalog)  # front/ops/replace.py
                await replacer.load_startup()
                await dispatch.replicas.load_pinned()  # `replicas: N`: N copies at start
                replacer.start()  # an engine that leaves: its startup models and copies move
                stack.push_async_callback(replacer.close)
            # /v1/batches: its runner sends lines through this app (front/batches/runner.py).
            app.state.batches = BatchRunner(
                app, state, FileStore(
                    identity.db, settings.home / "files", settings.files_max_bytes,
                    max_total_bytes_per_owner=settings.files_max_total_bytes_per_owner,
                    max_requests=settings.batch_max_requests),
                BatchStore(identity.db,
                           max_open_per_owner=settings.batches_max_open_per_owner),
                max_concurrency=settings.batch_max_concurrency,
                lease_s=settings.batch_claim_lease_s)
            app.state.batches.start()
            stack.push_async_callback(app.state.batches.close)
            yield

    app = FrontApp(
        settings,
        routes=[
            *openai.routes, *services.routes, *ollama.routes, *ollama_models.routes,
            *ollama_create.routes, *native.routes, *admin.routes,
            *pulls.routes, *embeddings.routes, *accounts_api.routes, *logs_api.routes,
            *archive_api.routes, *studio_api.routes, *front_metrics.routes,
            *sessions_api.routes, *openapi_api.routes, *responses_api.routes,
            *rerank_api.routes, *anthropic_api.routes, *cluster_api.routes,
            *activity_api.routes,
            *limits_api.routes,
            *usage_api.routes,
            *batches_api.routes,
        ],
        lifespan=lifespan,
        exception_handlers={
            ModelyardError: _on_modelyard_error,
            HTTPException: _on_http_error,
            ClientDisconnect: _on_client_disconnect,
            Exception: _on_unexpected,
        },
    )
    return app


async def _open_identity(settings: Settings, stack: contextlib.AsyncExitStack) -> Identity:
    """The database, and the accounts in it. First boot: `admin` with a one-time password,
    printed once (never logged), and the CLI's admin token in $MODELYARD_HOME/cli-token
    (0600)."""
    database = await asyncio.to_thread(db.connect, settings.db_url)
    stack.callback(database.dispose)
    password = os.environ.get("MODELYARD_ADMIN_PASSWORD") or None
    generated = await asyncio.to_thread(accounts.ensure_first_admin, database, password)
    if generated:
        print(f"\nmodelyard first boot: log in to http://{settings.host}:{settings.port}/ as "
              f"`admin` with the one-time password\n\n    {generated}\n\nYou will choose a new "
              "one at first login. (This is shown only once.)\n", file=sys.stderr, flush=True)
    admins = [u.name for u in await asyncio.to_thread(accounts.list_users, database)
              if u.is_admin]
    if admins:
        owner = accounts.ADMIN if accounts.ADMIN in admins else admins[0]
        # Several fronts (shared_dir): each front's CLI token is its own (fronts.py).
        name = "cli" if settings.shared_dir is None else "cli-" + await asyncio.to_thread(
            fronts.front_id, settings.home)
        await asyncio.to_thread(tokens.ensure_cli_token, database, settings.home, owner, name)
    key = await asyncio.to_thread(auth.load_secret_key, settings.shared_path)
    return Identity(database, auth.Auth(settings, database, key))


async def _open_catalog(
    settings: Settings,
    registry: ModelRegistry,
    provider: EngineProvider,
    database: sa.Engine,
    stack: contextlib.AsyncExitStack,
    route: Callable[[Entry], Awaitable[EngineClient]],
    feed: CatalogFeed,
    worker: Worker | None = None,
) -> Catalog:
    """The catalog and its pull jobs; jobs a previous run left unfinished become interrupted.
    `route` places a model a job pulled with `init` (the dispatcher's)."""

    async def on_pulled(job: dict[str, Any]) -> None:
        if job.get("init") and job.get("model_id"):
            # Its hub draft's job (submitted by `pulled_with`) first: the load needs the file.
            for draft in await pull_drafts(catalog.jobs, catalog.registry, job):
                await catalog.jobs.wait(draft["id"])
            entry = catalog.registry.resolve(job["model_id"])
            await (await route(entry)).load(entry.id)

    async def catalog_changed() -> None:
        await catalog.rescan()

    async def pulled_with(job: dict[str, Any]) -> None:
        # A declared model's hub draft comes with it (front/ops/draft_pulls.py).
        await pull_drafts(catalog.jobs, catalog.registry, job)

    front_id = await asyncio.to_thread(fronts.front_id, settings.home)
    if worker is not None and worker.index > 0:
        # Each worker's jobs are its own: a restarted worker recovers (marks interrupted)
        # only what it ran, never a job another live worker is downloading.
        front_id = f"{front_id}-w{worker.index}"
    jobs = PullJobs(settings, database, catalog_changed=catalog_changed, on_pulled=on_pulled,
                    spawn=ChildProcess, pulled_with=pulled_with, front_id=front_id)
    interrupted = await jobs.recover()
    if interrupted:
        log.warning("%d pull job(s) were interrupted by the last shutdown: POST "
                    "/jobs/{id}/resume continues them", interrupted)
    stack.push_async_callback(jobs.shutdown)
    catalog = Catalog(settings, registry, jobs, provider, feed)
    await catalog.rescan()  # the catalog now includes what the database holds
    return catalog


async def _open_front_sync(settings: Settings, database: sa.Engine, jobs: PullJobs,
                           reloader: ConfigReloader, stack: contextlib.AsyncExitStack) -> None:
    """Several fronts on one database (front/ops/fronts.py): claims renewed, reloads shared."""
    sync = fronts.FrontSync(database, jobs.front_id, settings.front_sync_interval_s,
                            heartbeat=jobs.heartbeat, reload=reloader.reload)
    await sync.start()
    stack.push_async_callback(sync.stop)
    reloader.announce = sync.announce_reload


def _default_provider(
    settings: Settings, registry: ModelRegistry, config_file: Path | None, logs: LogBuffer,
    feed: CatalogFeed,
    worker: Worker | None = None,
) -> EngineProvider:
    if worker is not None:
        if worker.index == 0:
            return PublishingEngines(settings, worker, config_file=config_file, catalog=feed)
        return SharedEngines(settings, worker, catalog=feed)
    if settings.single_process:
        return InProcessEngines(settings, registry, log_buffer=logs)
    if settings.cluster.mode == "ray":
        from modelyard.front.engines.ray_provider import RayProvider

        return RayProvider(settings, catalog=feed)
    return LocalEngines(settings, config_file=config_file, catalog=feed)
