"""Lease churn, the soak's length (`make soak`; issue 31's "done when"): 64 clients for
CHURN_SECONDS (default 60) a round, streaming, cutting streams and giving up after up to
CHURN_GIVE_UP_S (default 20: the issue's 120 s client timeout, scaled to the round), three
rounds from a cold model in a row. After each: zero leases on the engine, no queue slot held, and
`POST /admin/models/<m>/unload` completes. The outcomes are printed (run with -s)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from tests.integration.churn import churn_config, churn_round
from tests.support import Server

SECONDS = float(os.environ.get("CHURN_SECONDS", "60"))
GIVE_UP_S = float(os.environ.get("CHURN_GIVE_UP_S", "20"))
pytestmark = [pytest.mark.soak, pytest.mark.timeout(3 * (SECONDS + 120) + 120)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("churn-soak"), churn_config())
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("round_", range(3))
def test_churn_leaves_no_lease(server: Server, round_: int) -> None:
    seen = churn_round(server, SECONDS, GIVE_UP_S, seed=100 + round_)
    print(json.dumps({"round": round_, "seconds": SECONDS, "outcomes": dict(seen)}))
    assert seen["finished"] and seen["cut mid-stream"] and seen["gave up"], dict(seen)
