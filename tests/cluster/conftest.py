"""The `cluster` tier's fixture: one Ray cluster per module (tests/cluster/harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.cluster.harness import RayTestCluster


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayTestCluster]:
    pytest.importorskip("ray", reason="the cluster tier needs the `cluster` extra")
    base = tmp_path_factory.mktemp("cluster")
    token = base / "cluster-token"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "token")
        env.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        env.setenv("MODELYARD_EMBEDDING_DEMO", "false")
        reset_ray_auth()
        try:
            started = RayTestCluster(base)
            try:
                yield started
            finally:
                started.shutdown()
        finally:
            env.undo()
            reset_ray_auth()


def reset_ray_auth() -> None:
    """Make this process's Ray read RAY_AUTH_* again: its config and token are read once per
    process and cached (Ray's own tests reset them the same way, after each change)."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    reset_auth_token_state()
