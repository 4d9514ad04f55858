"""The `modelyard` command: serve, and the client commands ls, ps, run."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from modelyard import __version__
from modelyard.cli.server_url import MODELYARD_DEFAULT, auth_headers, default_url
from modelyard.cli.status import size
from modelyard.config import Settings, load_settings
from modelyard.request_ids import handler_setup

if TYPE_CHECKING:  # the front's modules are imported only by the commands that serve
    from modelyard.front.app import FrontApp

app = typer.Typer(
    help="modelyard: one endpoint for every model on your GPUs.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)

DEFAULT_URL = default_url()  # $OLLAMA_HOST when set (cli/server_url.py)
UrlOption = Annotated[
    str, typer.Option("--url", envvar="MODELYARD_URL",
                      help="The modelyard server to talk to (else $OLLAMA_HOST, else "
                      f"{MODELYARD_DEFAULT}).")
]
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config file (default: $MODELYARD_HOME/config.yaml)."),
]


def _setup_logging(settings: Settings, log_file: str | None, level: str, process: str) -> None:
    """Log to stderr, and to `log_file` under the logs directory when given (rotated at
    `log_file_max_bytes`, keeping `log_file_backups` old files), as text or JSON lines, each
    record with the id of the request it was written for.

    Engines pass None: their supervisor already keeps their output in `logs/engine-N.log`.
    """
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        settings.logs_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.handlers.RotatingFileHandler(
            settings.logs_dir / log_file, maxBytes=settings.log_file_max_bytes,
            backupCount=settings.log_file_backups,
        ))
    for handler in handlers:
        handler_setup(handler, settings.log_format, process)
    logging.basicConfig(level=level.upper(), handlers=handlers, force=True)
    # httpx logs every request at INFO: that is our hot path, not news.
    logging.getLogger("httpx").setLevel(logging.WARNING)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Public port (default 8770).")] = None,
    config: ConfigOption = None,
    single_process: Annotated[
        bool, typer.Option("--single-process", help="Run the front and one engine in one process.")
    ] = False,
    engine_only: Annotated[
        bool, typer.Option("--engine-only", help="Run one engine (started by the front).")
    ] = False,
    internal_port: Annotated[
        int | None, typer.Option(help="Loopback port of an --engine-only process.")
    ] = None,
    internal_fd: Annotated[
        int | None, typer.Option(help="A listening socket an --engine-only process inherits "
                                      "(on --internal-port), instead of binding that port.")
    ] = None,
    engine_index: Annotated[int, typer.Option(help="Index of an --engine-only process.")] = 0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    log_format: Annotated[
        str | None, typer.Option(help="text or json (one object per line); engines follow.")
    ] = None,
    simulate_gpus: Annotated[
        str | None,
        typer.Option(help="Simulated GPUs instead of real ones, e.g. 2x24GiB or 24GiB,8GiB."),
    ] = None,
    import_dir: Annotated[
        list[Path] | None,
        typer.Option(help="Add every GGUF under DIR to the catalog (repeatable; kept)."),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(help="`ray`: serve every node of a Ray cluster (docs/cluster.md); `off`."),
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="With --cluster ray: the Ray head, host:port.")
    ] = None,
    workers: Annotated[
        str | None,
        typer.Option(help="Front processes on the port (SO_REUSEPORT), sharing the engines "
                     "and the database: N, or `auto` (the cores, at most 8). Default 1."),
    ] = None,
) -> None:
    """Serve the OpenAI, Ollama and native APIs (or, with --engine-only, one engine).

    SIGTERM or Ctrl-C stops it gracefully (requests in flight get `shutdown_grace_s`); a second
    one stops it at once, killing every child process."""
    from modelyard import home, serving

    home.private_umask()  # before the first byte: engines and llama-server inherit it
    if log_format is not None:  # through the environment, so engine processes follow it
        os.environ["MODELYARD_LOG_FORMAT"] = log_format
    from modelyard.cli.cluster import serve_overrides

    try:
        settings = load_settings(
            config, host=host, port=port, single_process=single_process or None,
            simulate_gpus=simulate_gpus, cluster=serve_overrides(cluster, ray_address) or None,
            workers=_workers_option(workers),
        )
    except (FileNotFoundError, ValueError) as exc:
        err_console.print(f"[red]config error:[/red] {escape(str(exc))}")  # [..] is no markup
        raise typer.Exit(2) from exc
    from modelyard.front.identity.auth import check_bind

    try:
        check_bind(settings)
    except ValueError as exc:
        err_console.print(f"[red]refusing to start:[/red] {exc}")
        raise typer.Exit(2) from exc
    home.secure(settings.home, skip=(settings.models_dir,))
    settings.models_dir.mkdir(parents=True, exist_ok=True)

    if engine_only:
        if internal_port is None:
            err_console.print("--engine-only needs --internal-port")
            raise typer.Exit(2)
        _hold_home(settings.home / "run" / f"engine-{engine_index}.lock",
                   f"engine-{engine_index} on port {internal_port}", "an engine",
                   wait_s=ENGINE_LOCK_WAIT_S)
        from modelyard.engine.app import create_engine_app
        from modelyard.engine.loop import Engine
        from modelyard.engine.pushed_catalog import catalog_pushed
        from modelyard.store.registry import ModelRegistry
        from modelyard.wire.lease import SECRET_ENV

        # Taken out of the environment before anything is spawned: a model's server must not
        # inherit the key to the engine that runs it.
        secret = os.environ.pop(SECRET_ENV, "")
        if not secret:
            err_console.print(
                f"--engine-only needs the secret its front calls it with in ${SECRET_ENV} (the "
                "front sets it for the engines it starts); refusing to serve without one"
            )
            raise typer.Exit(2)
        _setup_logging(settings, None, log_level, f"engine-{engine_index}")
        # A cluster's engine never opens the front's database: the front pushes its catalog.
        registry = ModelRegistry.build(settings, database=not catalog_pushed(settings))
        engine = Engine(settings, registry, index=engine_index)
        engine_app = create_engine_app(engine, secret=secret, watch_parent=True)
        inherited = [] if internal_fd is None else [_adopt_socket(internal_fd)]
        serving.run(engine_app, host=settings.node_address, port=internal_port,
                    sockets=inherited, keep_alive_s=serving.ENGINE_SERVER_KEEPALIVE_S,
                    limits=serving.http_limits(settings))
        return

    from modelyard import db, metrics
    from modelyard.cli import workers as pool
    from modelyard.front.app import create_app
    from modelyard.store.registry import ModelRegistry

    token = pool.take_token()  # a worker of a `serve --workers N` (cli/workers.py)
    count = settings.worker_count
    if count > 1 and (settings.single_process or settings.cluster.mode == "ray"):
        err_console.print("--workers N needs engine processes on this machine: not with "
                          "--single-process or --cluster ray")
        raise typer.Exit(2)
    if token is not None:  # the supervisor's lock, on the descriptor it inherited
        _join_home(pool.lock_path(settings), token.lock_fd)
        _serve_worker(settings, token, config, log_level)
        return
    # Before the front writes anything into the home (its log, its metrics, its database).
    _hold_home(pool.lock_path(settings),
               f"front http://{settings.host}:{settings.port}", "a front")
    if settings.single_process:  # its engine-0 runs inside: no stray engine-0 beside it
        _hold_home(settings.home / "run" / "engine-0.lock",
                   f"engine-0 inside the front http://{settings.host}:{settings.port}",
                   "a front")
    metrics.setup_multiprocess(settings.home)  # before anything records; engines inherit it
    try:  # before any migration, and before a damaged file could pass for a first boot
        db.check(settings.db_url)
    except db.DatabaseDamaged as exc:
        print(f"modelyard: refusing to start: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    _setup_logging(settings, "modelyard.log", log_level, "front")
    registry = ModelRegistry.build(settings)
    names = ", ".join(e.id for e in registry.entries()) or "none yet"
    logging.getLogger("modelyard").info(
        "modelyard %s on http://%s:%s — models: %s", __version__, settings.host, settings.port,
        names,
    )
    if count > 1:
        _serve_supervisor(settings, registry, config, import_dir or ())
        return
    front = create_app(
        settings, registry=registry, config_file=config, import_dirs=import_dir or ()
    )
    grace_s = settings.shutdown_grace_s
    # Requests in flight when a shutdown begins: their grace, then an error (dispatch/drain.py).
    drain = front.drain
    serving.run(front, host=settings.host, port=settings.port, grace_s=grace_s,
                on_shutdown=lambda: drain.begin(grace_s), limits=serving.http_limits(settings),
                keep_alive_s=settings.client_keep_alive_s,
                forwarded_allow_ips=settings.forwarded_allow_ips)


def _workers_option(value: str | None) -> int | str | None:
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        err_console.print(f"--workers: a number or `auto`, not {value!r}")
        raise typer.Exit(2) from None


def _serve_front(settings: Settings, front: FrontApp, *, worker: int, count: int,
                 sockets: list[Any], hooks: Any = None) -> None:
    """Serve one worker's front on its socket; answers say which worker gave them."""
    from modelyard import serving
    from modelyard.cli import workers as pool

    drain = front.drain  # requests in flight when a shutdown begins (dispatch/drain.py)
    grace_s = settings.shutdown_grace_s
    serving.run(front, host=settings.host, port=settings.port, grace_s=grace_s,
                on_shutdown=lambda: drain.begin(grace_s), limits=serving.http_limits(settings),
                keep_alive_s=settings.client_keep_alive_s,
                forwarded_allow_ips=settings.forwarded_allow_ips, sockets=sockets,
                hooks=hooks, headers=[(pool.HEADER, f"{worker}/{count}")])


def _serve_supervisor(settings: Settings, registry: Any, config: Path | None,
                      import_dirs: list[Path] | tuple[()]) -> None:
    """Worker 0 of `serve --workers N`: the engines, the worker processes, socket 0."""
    from modelyard import home_lock
    from modelyard.cli import workers as pool
    from modelyard.front.app import create_app
    from modelyard.front.engines.shared import Worker

    count = settings.worker_count
    try:
        sockets = pool.bind(settings.host, settings.port, count)
    except OSError as exc:
        print(f"modelyard: cannot listen on {settings.host}:{settings.port}: {exc}",
              file=sys.stderr)
        raise typer.Exit(1) from None
    secret = pool.new_secret()
    lock_fd = home_lock.held_descriptor(pool.lock_path(settings))
    front = create_app(settings, registry=registry, config_file=config,
                       import_dirs=import_dirs, worker=Worker(0, count, secret))
    workers = pool.WorkerPool(settings, sockets, lock_fd, secret)
    _serve_front(settings, front, worker=0, count=count, sockets=[sockets[0]], hooks=workers)


def _serve_worker(settings: Settings, token: Any, config: Path | None, log_level: str) -> None:
    """Worker 1..N-1 of `serve --workers N`: a front on the engines worker 0 supervises."""
    from modelyard.cli import workers as pool
    from modelyard.front.app import create_app
    from modelyard.store.registry import ModelRegistry

    # Its output goes to logs/worker-N.log (its supervisor's ChildProcess), like an engine's.
    _setup_logging(settings, None, log_level, f"worker-{token.index}")
    registry = ModelRegistry.build(settings)
    front = create_app(settings, registry=registry, config_file=config, worker=token.worker)
    _serve_front(settings, front, worker=token.index, count=token.count,
                 sockets=[pool.adopt(token)])


# An engine restarted right after its predecessor was killed may find it still dying (its
# lock goes with its last breath): it waits this long before it gives up.
ENGINE_LOCK_WAIT_S = 5.0


def _adopt_socket(fd: int) -> socket.socket:
    """The listening socket an engine inherited from its supervisor; its own children (model
    servers) must not inherit it in turn."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    return sock


def _hold_home(lock: Path, owner: str, what: str, wait_s: float = 0.0) -> None:
    """This process's lock on its place in the home (home_lock.py), or exit 1 naming who has
    it: two fronts on one home would share its database, logs, front id and engines' files."""
    from modelyard import home_lock

    try:
        home_lock.hold(lock, owner, wait_s=wait_s)
    except home_lock.HomeBusy as exc:
        print(f"modelyard: refusing to start {what}: this MODELYARD_HOME is in use ({exc}); "
              "stop that one, or give this one its own MODELYARD_HOME", file=sys.stderr)
        raise typer.Exit(1) from None


def _join_home(lock: Path, fd: int) -> None:
    """A worker's share of its supervisor's lock (home_lock.join), or exit 1."""
    from modelyard import home_lock

    try:
        home_lock.join(lock, fd)
    except home_lock.HomeBusy as exc:
        print(f"modelyard: refusing to start a worker: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None


def _home() -> Path:
    return Path(os.environ.get("MODELYARD_HOME", Path.home() / ".modelyard")).expanduser()


def _get(url: str, path: str) -> Any:
    try:
        r = httpx.get(url.rstrip("/") + path, timeout=10.0, headers=auth_headers())
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot reach modelyard at {url}: {exc}") from exc
    r.raise_for_status()
    return r.json()


@app.command("ls")
def list_models(url: UrlOption = DEFAULT_URL, config: ConfigOption = None) -> None:
    """List models: name, where it came from (pulled, imported, config, found on disk), format,
    size, path, and — when the server is up — whether it is loaded and on which engine."""
    try:
        models = _get(url, "/models")["models"]
        online = True
    except ConnectionError:
        from modelyard.store.registry import ModelRegistry

        registry = ModelRegistry.build(load_settings(config))
        models = [
            {"model": e.name, "format": e.format, "size_bytes": e.size_bytes,
             "source": e.source, "local_path": str(e.path) if e.path else None}
            for e in registry.entries()
        ]
        online = False
    table = Table("ID", "SOURCE", "FORMAT", "SIZE", "PATH", *(["LOADED"] if online else []))
    for m in models:
        row = [m["model"], m.get("source") or "-", m["format"], size(m.get("size_bytes")),
               m.get("local_path") or "-"]
        if online:
            row.append(f"yes ({m['engine']})" if m.get("loaded") else "no")
        table.add_row(*row)
    console.print(table)


def _call(method: str, url: str, path: str, body: Any = None) -> Any:
    """`_request`, where an unreachable server ends the command with a clean message."""
    try:
        return _request(method, url, path, body)
    except ConnectionError as exc:
        err_console.print(str(exc))
        raise typer.Exit(1) from exc


@app.command()
def load(
    model: Annotated[str, typer.Argument(help="Model id or alias.")],
    keep_alive: Annotated[
        float | None, typer.Option(help="Seconds to keep it loaded once idle; -1: forever.")
    ] = None,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Load a model now (evicting idle ones if memory is short)."""
    body = {"keep_alive_s": keep_alive} if keep_alive is not None else None
    result = _call("POST", url, f"/admin/models/{quote(model, safe='')}/load", body)
    seconds = result.get("load_duration_ns", 0) / 1e9
    console.print(f"{result['model']} loaded on {result.get('engine')} ({seconds:.2f} s)")


@app.command()
def unload(
    model: Annotated[str, typer.Argument(help="Model id or alias.")],
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Unload a model once its requests in flight are done."""
    result = _call("POST", url, f"/admin/models/{quote(model, safe='')}/unload")
    if result["status"] == "unloaded":
        console.print(f"{result['model']} unloaded from {', '.join(result['engines'])}")
    else:
        console.print(f"{result['model']} was not loaded")


@app.command()
def reload(url: UrlOption = DEFAULT_URL) -> None:
    """Re-read the server's config file: models whose spec changed restart once their requests
    are done, the others keep running; an invalid file is refused and changes nothing."""
    result = _call("POST", url, "/admin/reload")
    for key in ("changed", "updated", "added", "removed"):
        if result.get(key):
            console.print(f"{key}: {', '.join(result[key])}")
    if not any(result.get(k) for k in ("changed", "updated", "added", "removed")):
        console.print("no model changed")
    if result.get("restart_required"):
        console.print("[yellow]take effect only after a restart:[/yellow] "
                      + ", ".join(result["restart_required"]))
    for engine in result.get("engines", []):
        if engine.get("status") == "failed":
            err_console.print(f"[red]{engine['name']}:[/red] {engine.get('error')}")


@app.command()
def ps(url: UrlOption = DEFAULT_URL) -> None:
    """Show engines with their device memory, the models loaded, services, queues, pulls and
    recent swaps (GET /v1/status)."""
    from modelyard.cli.status import render

    try:
        view = _get(url, "/v1/status")
    except ConnectionError as exc:
        err_console.print(str(exc))
        raise typer.Exit(1) from exc
    console.print(render(view))


@app.command()
def top(
    url: UrlOption = DEFAULT_URL,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
    count: Annotated[int | None, typer.Option(help="Stop after this many refreshes.")] = None,
) -> None:
    """A live view of `ps`, refreshed every INTERVAL seconds (Ctrl-C quits)."""
    from rich.live import Live

    from modelyard.cli.status import render

    def frame() -> Any:
        try:
            return render(_get(url, "/v1/status"))
        except ConnectionError as exc:
            return f"{exc} (retrying)"

    done = 0
    with Live(frame(), console=console, auto_refresh=False) as live:
        try:
            while count is None or (done := done + 1) < count:
                time.sleep(interval)
                live.update(frame(), refresh=True)
        except KeyboardInterrupt:
            pass


def _request(method: str, url: str, path: str, body: Any = None) -> Any:
    """A call to the server; its error message (any API shape) becomes a clean exit."""
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body, timeout=30.0,
                          headers=auth_headers())
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot reach modelyard at {url}: {exc}") from exc
    if r.status_code >= 400:
        try:
            data = r.json()
            err = data.get("error")
            message = data.get("message") or (err.get("message") if isinstance(err, dict) else err)
        except ValueError:
            message = r.text
        err_console.print(f"[red]error:[/red] {message}")
        raise typer.Exit(1)
    return r.json() if r.content else None


@app.command()
def pull(
    model: Annotated[str, typer.Argument(help="org/repo, org/repo:Q4_K_M, org/repo/file.gguf, "
                                              "optionally @revision.")],
    quantize: Annotated[str, typer.Option(help="auto, q4, fp16 or no.")] = "auto",
    init: Annotated[bool, typer.Option("--init", help="Load it once downloaded.")] = False,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Download a model from the Hugging Face hub (HF_ENDPOINT) with a live progress bar.

    The download runs on the server: Ctrl-C leaves it running, and if the server restarts the
    bar waits for it, then resumes the interrupted job.
    """
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    accepted = _call("POST", url, "/pull", {"model": model, "quantize": quantize, "init": init})
    job_id = accepted["job_id"]
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=False) as bar:
        task = bar.add_task(f"pulling {model}", total=None)
        job = _follow(url, job_id, bar, task)
    if job["status"] != "succeeded":
        err_console.print(f"[red]{job['status']}:[/red] {job.get('error')}")
        raise typer.Exit(1)
    console.print(f"{job['model_id']} pulled to {job['local_path']}")


def _follow(url: str, job_id: str, bar: Any, task: Any) -> dict[str, Any]:
    """Poll the job until it is final; ride out a server restart and resume the job."""
    while True:
        try:
            job = _request("GET", url, f"/jobs/{job_id}")
        except ConnectionError:
            bar.update(task, description="server unreachable; waiting for it")
            time.sleep(1.0)
            continue
        if job["status"] == "interrupted":
            bar.update(task, description="resuming after a restart")
            job = _request("POST", url, f"/jobs/{job_id}/resume")
        name = job.get("current_file") or job["model"]
        bar.update(task, total=job.get("bytes_total"), completed=job.get("bytes_done") or 0,
                   description=f"{job['status']} {name}")
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        time.sleep(0.3)


@app.command()
def rm(
    model: Annotated[str, typer.Argument(help="A model modelyard pulled or imported.")],
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Delete a pulled (or forget an imported) model: unloaded, files removed, aliases gone."""
    _call("DELETE", url, f"/models/{quote(model, safe='')}")
    console.print(f"deleted {model}")


@app.command()
def show(
    model: Annotated[str, typer.Argument(help="Model id or alias.")],
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Show a model's details: format, parameters, quantization, template, metadata."""
    info = _call("POST", url, "/api/show", {"model": model})
    details = info.get("details") or {}
    table = Table(show_header=False)
    for key in ("family", "parameter_size", "quantization_level", "format"):
        table.add_row(key, str(details.get(key) or "-"))
    table.add_row("capabilities", ", ".join(info.get("capabilities") or []))
    console.print(table)
    if info.get("template"):
        console.print("[bold]template[/bold]")
        console.print(info["template"][:2000], markup=False)


def _stream_chat(client: httpx.Client, model: str, messages: list[dict[str, str]]) -> str:
    answer = ""
    with client.stream(
        "POST", "/chat", json={"model": model, "messages": messages, "stream": True}
    ) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(r.json().get("message", r.text))
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event and event.get("done") is None:
                raise RuntimeError(event.get("message", event["error"]))
            text = event.get("delta", {}).get("content", "")
            answer += text
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return answer


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="Model id or alias.")],
    prompt: Annotated[str | None, typer.Argument(help="One prompt; omit for a chat.")] = None,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Stream an answer to PROMPT, or open an interactive chat when no prompt is given."""
    messages: list[dict[str, str]] = []
    with httpx.Client(base_url=url, timeout=httpx.Timeout(10.0, read=None),
                      headers=auth_headers()) as client:
        try:
            if prompt is not None:
                _stream_chat(client, model, [{"role": "user", "content": prompt}])
                return
            err_console.print(f"chatting with {model}; Ctrl-D or /bye to quit")
            while True:
                try:
                    line = input(">>> ")
                except EOFError:
                    break
                if line.strip() in ("/bye", "/exit"):
                    break
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line})
                answer = _stream_chat(client, model, messages)
                messages.append({"role": "assistant", "content": answer})
        except httpx.HTTPError as exc:
            err_console.print(f"cannot reach modelyard at {url}: {exc}")
            raise typer.Exit(1) from exc
        except RuntimeError as exc:
            err_console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(1) from exc


@app.command("config-schema")
def config_schema() -> None:
    """Print the JSON schema of the configuration file."""
    console.print_json(json.dumps(Settings.model_json_schema()))


@app.command()
def version() -> None:
    """Print modelyard's version."""
    console.print(__version__)


def _register_account_commands() -> None:
    from modelyard.cli.accounts import tokens_app, users_app
    from modelyard.cli.cluster import cluster_app, join
    from modelyard.cli.db import db_app
    from modelyard.cli.doctor import doctor
    from modelyard.cli.limits import limits_app
    from modelyard.cli.usage import usage

    app.add_typer(cluster_app, name="cluster")
    app.command()(join)
    app.add_typer(users_app, name="users")
    app.add_typer(tokens_app, name="tokens")
    app.add_typer(db_app, name="db")
    app.add_typer(limits_app, name="limits")
    app.command()(usage)
    app.command()(doctor)


_register_account_commands()


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
