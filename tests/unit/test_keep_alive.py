"""front.api.ollama.keep_alive_seconds: Ollama's `keep_alive` (a number or a Go duration)."""

from __future__ import annotations

import pytest

from modelyard.errors import InvalidRequest
from modelyard.front.api.ollama import keep_alive_seconds

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),  # the configured default
        (0, 0),  # unload right away
        ("0", 0),
        (-1, -1),  # negative: keep forever
        (-300, -1),
        (-0.5, -1),
        ("-1", -1),
        ("-5m", -1),
        (300, 300),
        (2.5, 2.5),
        ("300", 300),
        (" 300 ", 300),
        ("5m", 300),
        ("1h", 3600),
        ("1h30m", 5400),
        ("1h30m15s", 5415),
        ("5m0s", 300),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("1500us", 0.0015),
        ("2µs", 2e-6),
        ("10ns", 1e-8),
    ],
)
def test_keep_alive_seconds(value: str | int | float | None, expected: float | None) -> None:
    got = keep_alive_seconds(value)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize(
    "value", ["soon", "5 m", "m5", "", "  ", "-", "--5m", "5mm", "1d", "5m-3s", "h1", "1.s"]
)
def test_keep_alive_rejects_non_durations(value: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        keep_alive_seconds(value)
    assert err.value.param == "keep_alive"
    assert repr(value) in str(err.value)
    assert err.value.status == 400


def test_keep_alive_rejects_nan() -> None:
    with pytest.raises(InvalidRequest):
        keep_alive_seconds("nan")
