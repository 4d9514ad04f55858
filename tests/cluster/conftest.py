"""The `cluster` tier's fixture: one Ray cluster per module (tests/cluster/harness.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from tests.cluster.harness import RayTestCluster

# The tier's share of `make test` (~4 min here): past it, every further cluster test fails, so a
# slow-down shows as a failure to look at, not as a suite that quietly grows.
TIER_BUDGET_S = 480.0
_tier_started: list[float] = []


@pytest.fixture(autouse=True)
def _within_the_tier_budget() -> None:
    if not _tier_started:
        _tier_started.append(time.monotonic())
    spent = time.monotonic() - _tier_started[0]
    if spent > TIER_BUDGET_S:
        pytest.fail(f"the cluster tier is over its budget: {spent:.0f} s > {TIER_BUDGET_S:.0f} s "
                    "(tests/cluster/conftest.py TIER_BUDGET_S)")


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
