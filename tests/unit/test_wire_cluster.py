"""wire/cluster.py: the token file's checks, the derived engine secret, report round trips."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from modelyard.wire.cluster import (
    EngineEndpoint,
    NodeReport,
    agent_name,
    engine_name,
    engine_secret,
    read_token,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _token_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_a_private_token_file_is_read(tmp_path: Path) -> None:
    token = secrets.token_hex(32)
    assert read_token(_token_file(tmp_path, token)) == token


@pytest.mark.parametrize(("text", "mode", "says"), [
    ("x" * 64, 0o644, "readable by others"),
    ("x" * 64, 0o640, "readable by others"),
    ("short", 0o600, "too short"),
])
def test_a_token_file_others_can_read_or_too_short_is_refused(
    tmp_path: Path, text: str, mode: int, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        read_token(_token_file(tmp_path, text, mode))


def test_a_missing_token_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the cluster token file"):
        read_token(tmp_path / "nope")


def test_the_engine_secret_is_derived_not_the_token() -> None:
    token = secrets.token_hex(32)
    secret = engine_secret(token)
    assert secret == engine_secret(token)  # every node derives the same one
    assert token not in secret and secret != engine_secret(secrets.token_hex(32))
    assert len(secret) == 64


def test_names() -> None:
    assert agent_name("gpu-box-1") == "node:gpu-box-1"
    assert engine_name("gpu-box-1", 2) == "gpu-box-1/engine-2"


def test_a_report_round_trips_through_json() -> None:
    report = NodeReport(
        host="n2", address="127.0.0.2", node_id="abc", version=7, gpus=2,
        engines=(EngineEndpoint(0, "http://127.0.0.2:4000", 4001, True, 1),
                 EngineEndpoint(1, "http://127.0.0.2:4002", 4003, False)),
        storage_id="s1", draining=True, error=None, configured=True, labels={"a": "b"},
    )
    assert NodeReport.from_json(report.to_json()) == report
    bare = NodeReport.from_json({"host": "n3", "address": "127.0.0.3", "node_id": "x",
                                 "version": 1, "gpus": 0})
    assert bare.engines == () and not bare.configured and not bare.draining
