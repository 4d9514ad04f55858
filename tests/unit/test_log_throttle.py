"""A log line anyone outside can trigger is written at most once per interval (log_throttle.py),
and the next one written counts those held back."""

from __future__ import annotations

import logging

import pytest

from modelyard.log_throttle import Throttled

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_one_line_per_interval_then_the_count_of_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    line = Throttled(logging.getLogger("t"), logging.WARNING, "refused", 10.0,
                     clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "t"):
        for _ in range(500):
            line()
            now[0] += 0.01  # 500 in 5 s
        assert [r.getMessage() for r in caplog.records] == ["refused"]
        now[0] = 112.0
        line()
        line()
    assert [r.getMessage() for r in caplog.records] == [
        "refused", "refused (and 499 more like it in the 12 s before)"]
    assert line.held_back == 1
