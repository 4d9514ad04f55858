"""The cluster CLI (cli/cluster.py): `join` builds the `ray start` a node needs (token auth on,
the labels the front finds nodes by, the agent's environment), refuses a token file that is not
private or too short, `cluster token` makes a 0600 file and never overwrites one, `cluster status`
draws GET /admin/cluster, and `serve --cluster ray` refuses without Ray."""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from modelyard.cli import cluster as cli_cluster
from modelyard.cli.main import app
from modelyard.front.identity.auth import RouteClass, route_class
from modelyard.wire.cluster import HOST_LABEL, NODE_LABEL, TOKEN_FILE_ENV

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

runner = CliRunner()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster-token"
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(autouse=True)
def _keep_umask() -> Iterator[None]:
    """`serve` sets a private umask for its process: give the test process its own back."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


def dry_run(*args: str) -> tuple[dict[str, str], list[str]]:
    """`modelyard join ... --dry-run`: the environment it adds and `ray start`'s argv."""
    result = runner.invoke(app, ["join", *args, "--dry-run"])
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout.strip())
    assert words[0] == "env"
    env: dict[str, str] = {}
    i = 1
    while "=" in words[i] and not words[i].startswith("-"):
        key, _, value = words[i].partition("=")
        env[key] = value
        i += 1
    return env, words[i:]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_join_runs_ray_start_with_token_auth_labels_and_the_agents_environment(
    token_file: Path, tmp_path: Path
) -> None:
    home = tmp_path / "node-home"
    env, argv = dry_run("10.0.0.1:6379", "--token-file", str(token_file),
                        "--advertise-address", "10.0.0.2", "--node-name", "n2",
                        "--labels", "rack=a", "--home", str(home), "--gpus", "2",
                        "--simulate-gpus", "2x24GiB")
    assert Path(argv[0]).name == "ray" and argv[1] == "start"
    assert option(argv, "--address") == "10.0.0.1:6379"
    assert "--head" not in argv
    assert option(argv, "--node-ip-address") == "10.0.0.2"
    labels = dict(kv.split("=", 1) for kv in option(argv, "--labels").split(","))
    assert labels == {NODE_LABEL: "true", HOST_LABEL: "n2", "rack": "a"}
    assert option(argv, "--num-gpus") == "2"
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN_PATH"] == str(token_file.resolve())
    assert env[TOKEN_FILE_ENV] == str(token_file.resolve())
    assert env["MODELYARD_HOME"] == str(home.resolve())
    assert env["MODELYARD_SIMULATE_GPUS"] == "2x24GiB"


def test_join_head_starts_the_head_as_a_node_too(token_file: Path) -> None:
    env, argv = dry_run("--head", "--token-file", str(token_file), "--port", "6380",
                        "--node-name", "head")
    assert "--head" in argv and option(argv, "--port") == "6380"
    assert "--address" not in argv
    assert f"{NODE_LABEL}=true" in option(argv, "--labels")
    assert env["RAY_AUTH_MODE"] == "token"


def test_join_defaults_to_the_host_name_and_the_homes_token(
    token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELYARD_HOME", str(token_file.parent))
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-box-7")
    env, argv = dry_run("10.0.0.1:6379")
    assert f"{HOST_LABEL}=gpu-box-7" in option(argv, "--labels")
    assert env[TOKEN_FILE_ENV] == str(token_file.resolve())
    assert "--num-gpus" not in argv  # Ray counts them


@pytest.mark.parametrize(("mode", "text", "why"), [
    (0o644, "ab" * 32, "readable by others"),
    (0o600, "short", "too short"),
])
def test_join_refuses_a_token_file_that_is_not_private_or_too_short(
    tmp_path: Path, mode: int, text: str, why: str
) -> None:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    result = runner.invoke(app, ["join", "10.0.0.1:6379", "--token-file", str(path),
                                 "--dry-run"])
    assert result.exit_code == 2
    assert why in result.stderr
    assert "ray" not in result.stdout


def test_join_refuses_a_missing_token_file_and_bad_arguments(
    tmp_path: Path, token_file: Path
) -> None:
    missing = runner.invoke(app, ["join", "h:6379", "--token-file", str(tmp_path / "nope"),
                                  "--dry-run"])
    assert missing.exit_code == 2 and "cannot read the cluster token file" in missing.stderr
    both = runner.invoke(app, ["join", "h:6379", "--head", "--token-file", str(token_file),
                               "--dry-run"])
    assert both.exit_code == 2 and "not both" in both.stderr
    neither = runner.invoke(app, ["join", "--token-file", str(token_file), "--dry-run"])
    assert neither.exit_code == 2
    ours = runner.invoke(app, ["join", "h:6379", "--token-file", str(token_file),
                               "--labels", f"{HOST_LABEL}=x", "--dry-run"])
    assert ours.exit_code == 2 and "modelyard's own" in ours.stderr
    comma = runner.invoke(app, ["join", "h:6379", "--token-file", str(token_file),
                                "--labels", "a=1,b=2", "--dry-run"])
    assert comma.exit_code == 2 and "key=value" in comma.stderr


def test_cluster_token_makes_a_private_random_file_and_never_overwrites_it(
    tmp_path: Path
) -> None:
    path = tmp_path / "sub" / "cluster-token"
    result = runner.invoke(app, ["cluster", "token", "--file", str(path)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0
    assert "modelyard join" in result.stdout and token not in result.stdout  # never shown
    again = runner.invoke(app, ["cluster", "token", "--file", str(path)])
    assert again.exit_code == 1 and "exists already" in again.stderr
    assert path.read_text().strip() == token
    other = tmp_path / "other"
    assert runner.invoke(app, ["cluster", "token", "--file", str(other)]).exit_code == 0
    assert other.read_text().strip() != token


VIEW: dict[str, Any] = {
    "mode": "ray",
    "storage_id": "s-1",
    "nodes": [
        {"host": "n2", "address": "10.0.0.2", "node_id": "0123456789abcdef", "version": 4,
         "gpus": 2, "draining": True, "error": None, "storage": "shared",
         "engines": [
             {"index": 0, "name": "n2/engine-0", "up": True, "models_loaded": ["qwen", "llama"]},
             {"index": 1, "name": "n2/engine-1", "up": False, "models_loaded": None}]},
        {"host": "n3", "address": "10.0.0.3", "node_id": "fedcba9876543210", "version": 1,
         "gpus": 0, "draining": False, "error": "no cluster token", "storage": "local",
         "engines": []},
    ],
}


def rendered(view: dict[str, Any]) -> str:
    console = Console(width=200, record=True)
    console.print(cli_cluster.render_status(view))
    return console.export_text()


def test_cluster_status_table_has_a_row_per_node() -> None:
    text = rendered(VIEW)
    n2 = next(line for line in text.splitlines() if "n2" in line)
    for cell in ("10.0.0.2", "01234567", "1/2", "llama, qwen", "yes", "shared", "ok"):
        assert cell in n2, (cell, n2)
    assert "0123456789abcdef" not in n2  # the id is shortened
    n3 = next(line for line in text.splitlines() if "n3" in line)
    for cell in ("0/0", "no", "local", "error: no cluster token"):
        assert cell in n3, (cell, n3)
    assert "2 node(s)" in text


def test_cluster_status_of_a_single_machine_front_says_so() -> None:
    assert "not a cluster front" in rendered({"mode": "off", "nodes": []})


def test_serve_cluster_ray_refuses_without_ray(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setattr(cli_cluster, "ray_available", lambda: False)
    monkeypatch.setenv("MODELYARD_HOME", str(tmp_path))
    result = runner.invoke(app, ["serve", "--cluster", "ray"])
    assert result.exit_code == 2
    assert "pip install 'modelyard[cluster]'" in " ".join(result.stderr.split())


def test_serve_overrides_set_the_cluster_section_and_keep_the_files_other_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelyard.config import load_settings

    monkeypatch.setattr(cli_cluster, "ray_available", lambda: True)
    config = tmp_path / "config.yaml"
    config.write_text("cluster:\n  node_poll_interval_s: 5\n")
    settings = load_settings(config, home=tmp_path,
                             cluster=cli_cluster.serve_overrides("ray", "10.0.0.1:6379"))
    assert settings.cluster.mode == "ray"
    assert settings.cluster.ray_address == "10.0.0.1:6379"
    assert settings.cluster.node_poll_interval_s == 5
    with pytest.raises(ValueError, match="ray` or `off"):
        cli_cluster.serve_overrides("kubernetes", None)


def test_cluster_admin_routes_need_the_admin_scope() -> None:
    assert route_class("GET", "/admin/cluster") is RouteClass.ADMIN
    assert route_class("POST", "/admin/cluster/drain") is RouteClass.ADMIN
