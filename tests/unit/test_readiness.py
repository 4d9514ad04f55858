import pytest

from modelyard.proc.readiness import NotReady, wait_ready

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_ready_when_probe_succeeds() -> None:
    answers = iter([False, False, True])

    async def probe() -> bool:
        return next(answers)

    await wait_ready(probe=probe, exit_code=lambda: None, progress=lambda: 0,
                     stall_timeout_s=5, total_timeout_s=5, poll_interval_s=0)


async def test_exit_while_loading_is_reported() -> None:
    async def probe() -> bool:
        return False

    with pytest.raises(NotReady, match="exited with status 1"):
        await wait_ready(probe=probe, exit_code=lambda: 1, progress=lambda: 0,
                         stall_timeout_s=5, total_timeout_s=5, poll_interval_s=0)


async def test_stall_deadline_resets_on_progress() -> None:
    clock = Clock()
    lines = 0
    polls = 0

    async def probe() -> bool:
        nonlocal lines, polls
        polls += 1
        clock.now += 1.0  # every poll costs a simulated second
        if polls < 8:
            lines += 1  # the child keeps printing: never stalled
        return polls == 10

    await wait_ready(probe=probe, exit_code=lambda: None, progress=lambda: lines,
                     stall_timeout_s=2.5, total_timeout_s=100, poll_interval_s=0, clock=clock)
    assert polls == 10


async def test_silence_means_stalled_and_total_is_a_ceiling() -> None:
    clock = Clock()

    async def silent() -> bool:
        clock.now += 1.0
        return False

    with pytest.raises(NotReady, match="stalled"):
        await wait_ready(probe=silent, exit_code=lambda: None, progress=lambda: 0,
                         stall_timeout_s=3, total_timeout_s=100, poll_interval_s=0, clock=clock)
    clock.now = 0.0
    chatty = iter(range(1000))
    with pytest.raises(NotReady, match="not ready after 5"):
        await wait_ready(probe=silent, exit_code=lambda: None, progress=lambda: next(chatty),
                         stall_timeout_s=3, total_timeout_s=5, poll_interval_s=0, clock=clock)
