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


async def test_output_is_watched_between_polls() -> None:
    """With `watch_interval_s`, a probe waits out the poll interval unless the child's output
    grew since the last probe: the line a server logs as it starts listening is probed at once.
    """
    clock = Clock()
    probes: list[float] = []

    def output() -> int:  # a line at 0.07 s, "listening" at 0.15 s
        return 2 if clock.now >= 0.15 else 1 if clock.now >= 0.07 else 0

    def exit_code() -> None:
        clock.now = round(clock.now + 0.002, 6)  # each look: one watch interval later
        return None

    async def probe() -> bool:
        probes.append(clock.now)
        return output() == 2

    await wait_ready(probe=probe, exit_code=exit_code, progress=output,
                     stall_timeout_s=5, total_timeout_s=5, poll_interval_s=0.05,
                     watch_interval_s=0, clock=clock)
    # At once; a poll interval later; at once as a line came; a poll interval later; at once
    # as "listening" came (not at the next poll, 0.17 s).
    assert probes == pytest.approx([0.002, 0.052, 0.07, 0.12, 0.15], abs=0.0021)
