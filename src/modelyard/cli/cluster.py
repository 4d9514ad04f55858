"""The cluster commands (docs/cluster.md): `modelyard join` makes this machine a node of a Ray
cluster (or, with --head, starts the cluster's head), `modelyard cluster token` makes the token
file, `modelyard cluster status` and `modelyard cluster drain` ask the front's admin API.

`join` is a thin wrapper around `ray start`: what it adds is what a node needs for modelyard and
is easy to get wrong by hand — the token file checked (0600, long enough) and handed to Ray's own
token authentication (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH) and to the node's agent
($MODELYARD_CLUSTER_TOKEN_FILE: actors inherit the raylet's environment), and the labels the front
finds nodes by. Ray itself is not imported here: `ray start` is a separate program.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from modelyard.cli.server_url import default_url
from modelyard.wire.cluster import HOST_LABEL, NODE_LABEL, TOKEN_FILE_ENV, read_token

cluster_app = typer.Typer(help="A modelyard cluster on Ray: token, status, drain.",
                          no_args_is_help=True)

console = Console()
err_console = Console(stderr=True)

INSTALL_HINT = "pip install 'modelyard[cluster]'"
DEFAULT_RAY_PORT = 6379  # Ray's default GCS port on the head
TOKEN_FILE_NAME = "cluster-token"  # under $MODELYARD_HOME, the default `cluster.token_file`


def ray_available() -> bool:
    """Whether Ray is installed (found, not imported: importing it takes seconds)."""
    return importlib.util.find_spec("ray") is not None


def serve_overrides(cluster: str | None, ray_address: str | None) -> dict[str, Any]:
    """`modelyard serve --cluster ray [--ray-address A]` as a `cluster` override for
    load_settings (a dict: pydantic-settings merges it into the YAML's `cluster:` section, so
    the file's other cluster options stay). ValueError when it cannot be served."""
    if cluster not in (None, "off", "ray"):
        raise ValueError(f"--cluster must be `ray` or `off`, not {cluster!r}")
    out: dict[str, Any] = {}
    if cluster is not None:
        out["mode"] = cluster
    if ray_address is not None:
        out["ray_address"] = ray_address
    if cluster == "ray" and not ray_available():
        raise ValueError(f"--cluster ray needs Ray, which is not installed: {INSTALL_HINT}")
    return out


def home_dir(home: Path | None = None) -> Path:
    if home is not None:
        return home.expanduser().resolve()
    env = os.environ.get("MODELYARD_HOME")
    return (Path(env) if env else Path.home() / ".modelyard").expanduser().resolve()


def make_token_file(path: Path) -> None:
    """A new random token (64 hex characters), created 0600 and never over an existing file (a
    new token would lock every node of the running cluster out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def _labels(host_name: str, extra: list[str]) -> str:
    labels = {NODE_LABEL: "true", HOST_LABEL: host_name}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key or "," in item:
            raise ValueError(f"--labels takes key=value (one per option), not {item!r}")
        if key.startswith("modelyard.io/"):
            raise ValueError(f"the label {key!r} is modelyard's own; --node-name sets the host")
        labels[key] = value
    return ",".join(f"{k}={v}" for k, v in labels.items())


def ray_start_command(
    *, head_address: str | None, token_file: Path, home: Path, host_name: str,
    advertise_address: str | None = None, labels: list[str] | None = None,
    gpus: int | None = None, simulate_gpus: str | None = None, port: int = DEFAULT_RAY_PORT,
    block: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """`ray start`'s argv, and the variables its environment needs on top of this one's (the
    raylet keeps them, and every actor it starts — the node's agent — inherits them)."""
    ray = Path(sys.executable).parent / "ray"  # the one installed beside this modelyard
    argv = [str(ray) if ray.exists() else "ray", "start"]
    if head_address is None:
        argv += ["--head", "--port", str(port)]
    else:
        argv += ["--address", head_address]
    if advertise_address:
        argv += ["--node-ip-address", advertise_address]
    argv += ["--labels", _labels(host_name, labels or [])]
    if gpus is not None:
        argv += ["--num-gpus", str(gpus)]
    if block:
        argv.append("--block")
    env = {
        "RAY_AUTH_MODE": "token",  # Ray's token authentication stays on
        "RAY_AUTH_TOKEN_PATH": str(token_file),
        TOKEN_FILE_ENV: str(token_file),  # the node's agent derives the engine secret from it
        "MODELYARD_HOME": str(home),
    }
    if simulate_gpus:
        env["MODELYARD_SIMULATE_GPUS"] = simulate_gpus
    return argv, env


def join(
    head: Annotated[str | None, typer.Argument(
        help="The head's Ray address, host:port (port 6379 by default); omit with --head.")] = None,
    token_file: Annotated[Path | None, typer.Option(
        help="The cluster token file (0600), copied from the head; default "
        "$MODELYARD_HOME/cluster-token.")] = None,
    as_head: Annotated[bool, typer.Option(
        "--head", help="Start the cluster's head here (it is a node too).")] = False,
    advertise_address: Annotated[str | None, typer.Option(
        help="This machine's address on the cluster's private network (engines bind it).")] = None,
    node_name: Annotated[str | None, typer.Option(
        help="The node's name in the cluster (engines are <name>/engine-<i>); default: the "
        "host name.")] = None,
    labels: Annotated[list[str] | None, typer.Option(
        help="An extra Ray node label key=value (repeatable).")] = None,
    home: Annotated[Path | None, typer.Option(
        help="This node's MODELYARD_HOME (models, logs); default $MODELYARD_HOME.")] = None,
    gpus: Annotated[int | None, typer.Option(
        min=0, help="GPUs Ray may give this node's engines (default: Ray counts them).")] = None,
    simulate_gpus: Annotated[str | None, typer.Option(
        help="Simulated GPUs for this node's engines, e.g. 2x24GiB (tests, demos).")] = None,
    port: Annotated[int, typer.Option(help="With --head: Ray's GCS port.")] = DEFAULT_RAY_PORT,
    block: Annotated[bool, typer.Option(
        "--block", help="Stay in the foreground (for a service manager).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the `ray start` command instead of running it.")] = False,
) -> None:
    """Make this machine a node of the modelyard cluster whose Ray head is HEAD (or, with
    --head, start the head here). Runs `ray start` with token authentication on."""
    err = typer.echo
    if (head is None) == (not as_head):
        err("give the head's address (modelyard join HOST:6379) or --head, not both", err=True)
        raise typer.Exit(2)
    node_home = home_dir(home)
    tf = (token_file.expanduser() if token_file else node_home / TOKEN_FILE_NAME).resolve()
    try:
        read_token(tf)
        argv, env = ray_start_command(
            head_address=head, token_file=tf, home=node_home,
            host_name=node_name or socket.gethostname(), advertise_address=advertise_address,
            labels=labels, gpus=gpus, simulate_gpus=simulate_gpus, port=port, block=block)
    except ValueError as exc:
        hint = " (`modelyard cluster token` makes one on the head)" if as_head else ""
        err(f"modelyard join: {exc}{hint}", err=True)
        raise typer.Exit(2) from exc
    if dry_run:
        print(shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv]))
        return
    if not ray_available():
        err(f"modelyard join needs Ray, which is not installed: {INSTALL_HINT}", err=True)
        raise typer.Exit(2)
    rc = subprocess.run(argv, env={**os.environ, **env}, check=False).returncode
    if rc == 0 and not block:
        err("joined; `modelyard cluster status` on the front lists this node" if head else
            f"head started; on the front: modelyard serve --cluster ray; on each node: "
            f"modelyard join {advertise_address or '<this address>'}:{port} --token-file F")
    raise typer.Exit(rc)


@cluster_app.command("token")
def token(
    file: Annotated[Path | None, typer.Option(
        help="Where to write it (default $MODELYARD_HOME/cluster-token).")] = None,
) -> None:
    """Make a new cluster token file (0600, random): the head, the front and every node use
    the same file. It never overwrites one: a new token would lock the running cluster out."""
    path = (file.expanduser() if file else home_dir() / TOKEN_FILE_NAME).resolve()
    try:
        make_token_file(path)
    except FileExistsError:
        typer.echo(f"{path} exists already; remove it first to make a new token (every node "
                   "then needs the new file)", err=True)
        raise typer.Exit(1) from None
    print(f"wrote the cluster token to {path} (mode 600)")
    print("copy it to each node over a channel you trust, keeping it private, e.g.")
    print(f"  scp -p {path} NODE:.modelyard/cluster-token")
    print(f"then on each node: modelyard join HEAD:{DEFAULT_RAY_PORT} --token-file "
          "~/.modelyard/cluster-token --advertise-address NODE_IP")


def _short(node_id: str) -> str:
    return node_id[:8] if node_id else "-"


def render_status(view: dict[str, Any]) -> Table | str:
    """GET /admin/cluster as a table: one row per node."""
    if view.get("mode") != "ray":
        return "this server is not a cluster front (cluster.mode: off): `modelyard serve " \
               "--cluster ray` makes it one (docs/cluster.md)"
    table = Table("HOST", "ADDRESS", "NODE", "ENGINES", "GPUS", "MODELS", "DRAINING", "STORAGE",
                  "STATE", title=f"{len(view['nodes'])} node(s)")
    for node in view["nodes"]:
        engines = node.get("engines") or []
        up = sum(1 for e in engines if e.get("up"))
        models = sorted({m for e in engines for m in (e.get("models_loaded") or [])})
        state = (f"error: {node['error']}" if node.get("error") else
                 "starting" if not engines else "ok")
        table.add_row(
            node["host"], node.get("address") or "-", _short(node.get("node_id") or ""),
            f"{up}/{len(engines)}", str(node.get("gpus", 0)), ", ".join(models) or "-",
            "yes" if node.get("draining") else "no", node.get("storage") or "-", state)
    return table


UrlOption = Annotated[
    str, typer.Option("--url", envvar="MODELYARD_URL", help="The modelyard front to ask.")
]


def _call(method: str, url: str, path: str, body: Any = None) -> Any:
    """An admin call with the CLI's token (as `modelyard load` makes them); the server's error
    message, or an unreachable server, ends the command cleanly."""
    from modelyard.front.identity.tokens import read_cli_token

    token = read_cli_token(home_dir())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body, timeout=30.0,
                          headers=headers)
    except httpx.HTTPError as exc:
        err_console.print(f"cannot reach modelyard at {url}: {exc}")
        raise typer.Exit(1) from exc
    if r.status_code >= 400:
        try:
            data = r.json()
            err = data.get("error")
            message = data.get("message") or (err.get("message") if isinstance(err, dict) else err)
        except ValueError:
            message = r.text
        err_console.print(f"[red]error:[/red] {message}")
        raise typer.Exit(1)
    return r.json()


@cluster_app.command("status")
def status(
    url: UrlOption = default_url(),
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """The cluster's nodes as the front sees them (GET /admin/cluster): address, Ray node id,
    engines up, GPUs, models loaded, drain and model storage."""
    view = _call("GET", url, "/admin/cluster")
    if as_json:
        console.print_json(data=view)
    else:
        console.print(render_status(view))


@cluster_app.command("drain")
def drain(
    host: Annotated[str, typer.Argument(help="The node's name (`modelyard cluster status`).")],
    undo: Annotated[bool, typer.Option("--undo", help="End the drain: take loads again.")] = False,
    url: UrlOption = default_url(),
) -> None:
    """Stop new loads on a node (its loaded models keep serving until they unload), e.g. before
    maintenance; --undo ends it."""
    node = _call("POST", url, "/admin/cluster/drain", {"host": host, "drain": not undo})
    if node.get("draining"):
        console.print(f"{node['host']} is draining: no new loads there; its loaded models keep "
                      "serving until they unload")
    else:
        console.print(f"{node['host']} takes new loads again")
