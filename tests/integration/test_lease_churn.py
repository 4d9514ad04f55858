"""Lease churn in `make test` (issue 31): 64 clients streaming, cutting streams, and giving up in
the queue, during loads and mid-stream, three short rounds from a cold model in a row; after each
no lease or queue slot is held and the model unloads on request (a leaked lease would hang the
unload). The real front, engine process and lease channel; the model is the fake backend. The
minute-long rounds are the soak's (tests/soak/test_lease_churn_soak.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
from tests.integration.churn import churn_config, churn_round
from tests.support import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

ROUND_S = 3.0
GIVE_UP_S = 1.5  # a client's 120 s timeout, scaled to rounds of seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("churn"), churn_config())
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_churn_leaves_no_lease_three_times_in_a_row(server: Server) -> None:
    total: Counter[str] = Counter()
    for seed in range(3):
        total += churn_round(server, ROUND_S, GIVE_UP_S, seed)
    # The mix happened: answers read to the end, streams cut, clients that gave up.
    assert total["finished"] and total["cut mid-stream"] and total["gave up"], dict(total)
