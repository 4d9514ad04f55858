"""bench/front.py (`make bench-front`): its options, the CPU it charges to each target (by
process role, from a real process tree) and the report it draws from measured samples — each
target's CPU over the floor's, met or not against 1.3x, and a failed request as the bench's
own failure. (tests/e2e/test_benchmarks_run.py runs it as shipped, briefly.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from bench import front
from bench.proxy import Proc, RequestFailed, Samples
from tests.support import poll

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_defaults_are_issue_33s_workloads_and_flags_change_them() -> None:
    args = front.parse_args([])
    assert (args.concurrency, args.stream_tokens, args.paced_streams) == (16, 64, 64)
    assert args.saturation_requests > 0 and not args.no_features
    args = front.parse_args(["--chats", "10", "--embeddings", "5", "--saturation-requests", "0",
                             "--no-features", "--tokens-per-s", "8"])
    assert (args.chats, args.embeddings, args.saturation_requests) == (10, 5, 0)
    assert args.no_features and args.tokens_per_s == 8.0


def test_a_concurrency_below_one_is_refused() -> None:
    with pytest.raises(SystemExit):
        front.parse_args(["--concurrency", "0"])


def samples(n: int, cpu_s: dict[str, float], *, errors: int = 0,
            chunks: int = 0) -> Samples:
    s = Samples(latencies_s=[0.01] * n, busy_s=n * 0.001, cpu_s=cpu_s,
                chunks=[chunks] * n if chunks else [])
    for _ in range(errors):
        s.failed(RequestFailed("HTTP 503"))
    return s


def results(*, errors: int = 0, workers: bool = False) -> dict[str, Any]:
    """What main() gathers: 100 requests of each workload, the floor at 1 ms of CPU each,
    modelyard at 1.2 ms (met), modelyard-features at 2.5 ms (not met)."""
    def per_target() -> dict[str, Any]:
        return {"floor": front.summarize(samples(100, {"front": 0.1})),
                "modelyard": front.summarize(samples(100, {"front": 0.1, "engine": 0.02})),
                "modelyard-features": front.summarize(
                    samples(100, {"front": 0.2, "engine": 0.05}, errors=errors))}
    w: dict[str, Any] = {k: per_target() for k in front.WORKLOADS}
    w["paced"] = {  # 64 streams x 64 chunks: the floor at 20 µs a chunk, modelyard at 40
        "floor": front.per_chunk(samples(64, {"front": 0.08192}, chunks=64)),
        "modelyard": front.per_chunk(samples(64, {"front": 0.12288, "engine": 0.04096},
                                             chunks=64)),
        "modelyard-features": front.per_chunk(samples(64, {"front": 0.02}, chunks=64))}
    sat = {"floor": front.summarize(samples(100, {"front": 0.1})),
           "modelyard": front.summarize(samples(100, {"front": 0.3}))}
    return {"args": vars(front.parse_args([])), "workloads": w, "saturation": sat,
            "workers_supported": workers, "started_at": "now", "duration_s": 1.0,
            "json_path": "front.json",
            "machine": {"cpus": 2, "loadavg_start": "0", "loadavg_end": "0",
                        "busy_before_pct": 0.0}}


def test_ratios_are_each_targets_total_cpu_over_the_floors() -> None:
    r = front.ratios(results()["workloads"])
    for workload in front.WORKLOADS:
        assert r[workload]["floor"] == 1.0
        assert r[workload]["modelyard"] == pytest.approx(1.2)
    # 2.5 ms over 100 requests when all served; with failures, over those that were
    assert r["chat"]["modelyard-features"] == pytest.approx(2.5)
    assert r["paced"]["modelyard"] == pytest.approx(2.0)  # 40 µs against 20 µs a chunk
    assert r["paced"]["modelyard-features"] < 1.0


def test_the_report_says_met_or_not_met_per_target_and_workload() -> None:
    text = front.render(results())
    assert "- modelyard, 1-token chat: CPU per request 1.20x the floor's (target ≤ 1.3x) → met" \
        in text
    assert ("- modelyard-features, embedding: CPU per request 2.50x the floor's "
            "(target ≤ 1.3x) → NOT MET") in text
    assert ("- modelyard, per streamed chunk (64 paced streams): CPU per chunk 2.00x the "
            "floor's (target ≤ 1.3x) → NOT MET") in text
    assert not any("- floor," in line for line in text.splitlines())
    # the table: front + engine = total, and the ratio; the floor has no engine
    rows = {tuple(cells[:2]): cells[4:8] for cells in table_rows(text)}
    assert rows["1-token chat", "modelyard"] == ["1.000", "0.200", "1.200", "1.20x"]
    assert rows["embedding", "floor"] == ["1.000", "—", "1.000", "1.00x"]


def test_a_floor_whose_cpu_read_zero_gives_no_ratio_and_no_verdict() -> None:
    """/proc counts CPU in 10 ms ticks: at a smoke run's counts the floor can read 0. Then
    nothing is measured (the smoke test once failed on a printed `n/ax`)."""
    found = results()
    found["workloads"]["chat"]["floor"] = front.summarize(samples(100, {"front": 0.0}))
    text = front.render(found)
    rows = {tuple(cells[:2]): cells[4:8] for cells in table_rows(text)}
    assert rows["1-token chat", "modelyard"][3] == "n/a"
    assert ("- modelyard, 1-token chat: CPU per request not measured (the floor's CPU read 0 "
            "at these counts: raise them) → n/a") in text
    assert "n/ax" not in text


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ")]


def test_without_workers_the_two_worker_row_says_so() -> None:
    rows = table_rows(front.render(results(workers=False)))
    assert ["modelyard", "2", "n/a (no --workers)", "—", "—", "—", "—"] in rows


def test_a_failed_request_is_the_bench_failing_not_a_target_missed() -> None:
    assert front.failures(results()) == 0
    bad = results(errors=3)
    assert front.failures(bad) == 3 * len(front.WORKLOADS)
    assert "requests FAILED" in front.render(bad)


def test_cpu_is_charged_to_front_and_engine_processes_not_the_fake_backends(
    tmp_path: Path,
) -> None:
    """A real process tree shaped as `modelyard serve`'s: a worker, an engine and, under the
    engine, a fake backend."""
    sleep = "import time; time.sleep(60)"
    script = (
        "import subprocess, sys, time\n"
        f"s = {sleep!r}\n"
        "subprocess.Popen([sys.executable, '-c', s, 'worker'])\n"
        "engine = ('import subprocess, sys; subprocess.Popen([sys.executable, \"-c\", '\n"
        "          + repr(s) + ', \"tests/fakes/fake_backend.py\"]); ' + s)\n"
        "subprocess.Popen([sys.executable, '-c', engine, '--engine-only'])\n"
        "time.sleep(60)\n"
    )
    proc = Proc("serve", [sys.executable, "-c", script], tmp_path / "serve.log")
    try:
        poll(lambda: len(proc.descendants()) == 3, what="the process tree")
        roles = front.roles_of(proc)
        assert roles["front"][0].pid == proc.popen.pid
        assert len(roles["front"]) == 2 and len(roles["engine"]) == 1
        assert "--engine-only" in roles["engine"][0].cmdline()
        charged = {p.pid for ps in roles.values() for p in ps}
        backend = [p for p in proc.descendants() if p.pid not in charged]
        assert len(backend) == 1 and backend[0].cmdline()[-1].endswith("fake_backend.py")
    finally:
        proc.stop(grace_s=5)
