"""Every benchmark runs as shipped: its `make bench-…` recipe, read from the Makefile, run as a
subprocess from the repository root with the benchmark's smallest options appended, exits 0 and
prints its table (a known row, parsed). `make bench-proxy` crashed before measuring for a wave
because nothing ran it; a benchmark that cannot rot is one a test runs.

To add a benchmark: a `Bench` row in BENCHES (its target, the small options, the rows its output
must show, the artefacts it needs).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.support import ROOT, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

RUN_TIMEOUT_S = 360  # each run is meant to take under a minute; this is for a loaded CI machine
STOP_GRACE_S = 60  # what a benchmark told to stop may take to stop its servers
BOX = "[│|]"  # rich draws its tables with box characters, or ASCII where the locale cannot


@dataclass(frozen=True)
class Bench:
    target: str
    small: tuple[str, ...]  # options appended to the recipe: its smallest configuration
    rows: tuple[str, ...]  # regular expressions, each matching a line of the output
    needs: tuple[str, ...] = ()  # "llama-server", "demo-model", "demo-safetensors"


BENCHES = [
    Bench(
        "bench-sched", ("--quick", "--out", "{tmp}/sched.json"),
        (rf"^{BOX} modelyard\s+{BOX}\s+300 {BOX}\s+0 {BOX}\s+\d+ {BOX}",
         r"^agent: modelyard swaps <= 1\.3x belady: \d+ <= [\d.]+\s+(PASS|MISS)$"),
    ),
    Bench(
        "bench-load", ("--quick", "--out", "{tmp}/load.json"),
        (r"^\| connections \| \d+ \| 50 \| 4 \| [\d.]+ \| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|",
         r"^\| front RSS MB \| [+-][\d.]+ \| [+-][\d.]+ \|$",
         r"^- /health p99 < 20 ms: [\d.]+\s+(PASS|MISS)$"),
    ),
    Bench(
        "bench-batch", ("--smallest",),
        (r"^\| 4 \| \d+ \| \d+ \| \d+ \| [\d.]+x \| [\d.]+ \|$",
         r"^\| paged \| [\d,]+ \| \d+ \| [\d.]+ \| \d+ \|$",
         r"^\| padded \| [\d,]+ \| \d+ \| [\d.]+ \| \d+ \|$",
         r"^\s+without prefix cache [\d.]+ ms, with [\d.]+ ms, ratio [\d.]+"),
        needs=("demo-safetensors",),
    ),
    Bench(
        "bench-session", ("--quick", "--turns", "2", "--agents", "1", "--swap-agents", "1",
                          "--words", "12", "--answer-tokens", "4"),
        tuple(rf"^\| {scenario} \| 1 \| \d+ \| \d+ \| \d+ \| \d+ ms \| \d+ ms \| [\d.]+ \|$"
              for scenario in ("interleaved", "swapped", "transformers")),
        needs=("llama-server", "demo-model", "demo-safetensors"),
    ),
    Bench(
        "bench-proxy", ("--requests", "20", "--concurrent-requests", "16", "--batch", "8",
                        "--concurrency", "4", "--wide-concurrency", "8", "--wide-requests", "8",
                        "--streams", "2", "--stream-tokens", "16", "--warmup", "2",
                        "--cold-repeats", "0", "--no-router"),
        (r"^\| modelyard\s+\|\s+[\d.]+ \|\s+[\d.]+ \|.*\|\s+front [\d.]+ \+ engine [\d.]+ \|",
         r"^\| floor\s+\|\s+[\d.]+ \|\s+[\d.]+ \|.*\|\s+floor [\d.]+ \|", r"^## Goals$"),
        needs=("llama-server", "demo-model"),
    ),
    Bench(
        "bench-front", ("--chats", "32", "--embeddings", "32", "--streams", "8", "--batch", "16",
                        "--paced-streams", "8", "--paced-rounds", "1", "--saturation-requests",
                        "32", "--saturation-concurrency", "8", "--warmup", "2"),
        # A ratio is n/a when the floor's CPU reads 0 at these small counts (10 ms ticks); the
        # cells are right-aligned, padded to their column's widest (e.g. the floor's 1090.8).
        (r"^\| 1-token chat\s+\|\s+modelyard \|( +[\d.]+ \|){5} +([\d.]+x|n/a) \| +0 \|$",
         r"^\| modelyard-features \| +8 \| +\d+ \|( +[\d.]+ \|){3} +([\d.]+x|n/a) \| +0 \|$",
         r"^\| modelyard +\| +2 \| +(n/a \(no --workers\)|[\d.]+) \|",
         r"^- modelyard, embedding: CPU per request .* → (met|NOT MET|n/a)$"),
    ),
    Bench(
        "bench-swap", ("--repeats", "1"),
        (r"^\| transformers \| \d+ ms \| \d+ ms \| \*\*[\d.]+\*\* \|",
         r"^\| gguf \| \d+ ms \| \d+ ms \| \*\*[\d.]+\*\* \|"),
        needs=("llama-server", "demo-model", "demo-safetensors"),
    ),
    Bench(
        "bench-spec", ("--quick",),
        (r"^\| without draft \| \d+ \| [\d.]+ \| 1\.00x \| [\d.]+ \| - \| - \| - \|$",
         r"^\| with draft \(same model\) \| \d+ \| [\d.]+ \| [\d.]+x \| [\d.]+ \| \d+ \| \d+ \| "
         r"[\d.]+% \|$"),
        needs=("llama-server", "demo-model"),
    ),
    Bench(
        "bench-cluster", ("--requests", "20", "--warmup", "2"),
        (r"^\| p50 \| [\d.]+ \| [\d.]+ \| [+-][\d.]+ \| [\d.]+x \|$",
         r"^\| n\d/engine-0 \| n\d/engine-0 \| \d+ \| \d+ \|$"),
    ),
    Bench(
        "bench-batches", ("--requests", "12", "--load-time-s", "0.1"),
        (r"^\| one by one \| 12 \| \d+ \| [\d.]+ \| 1\.00x \| 1\.00x \|$",
         r"^\| batch API \| 12 \| \d+ \| [\d.]+ \| 0\.\d\dx \| [\d.]+x \|$"),
    ),
]


def demo_safetensors() -> Path:
    """Where `make` puts the demo model as safetensors (the Makefile's DEMO_ST)."""
    given = os.environ.get("MODELYARD_DEMO_SAFETENSORS")
    return Path(given) if given else cache_dir() / "models" / "smollm2-135m-instruct-safetensors"


def recipe(target: str) -> list[str]:
    """The command line `make <target>` runs, with the Makefile's variables filled in."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"{target}:")), None)
    assert start is not None, f"the Makefile has no `{target}` target"
    assert target in next(line for line in lines if line.startswith(".PHONY:")), \
        f"`{target}` is not .PHONY"
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        body.append(line.strip())
    commands = [c for c in body if c.startswith("$(BIN)/python bench/")]
    assert len(commands) == 1, f"`{target}` should run one bench/ script: {body}"
    command = commands[0].replace("$(BIN)/python", shlex.quote(sys.executable))
    command = command.replace("$(DEMO_ST)", str(demo_safetensors()))
    assert "$(" not in command, f"a Makefile variable this test does not know: {command}"
    return shlex.split(command)


def require(needs: tuple[str, ...]) -> None:
    for need in needs:
        if need == "llama-server":
            require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
        elif need == "demo-model":
            require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
        elif need == "demo-safetensors":
            require_e2e_artifact(demo_safetensors(), "the demo model as safetensors")
        else:
            raise AssertionError(f"unknown artefact {need!r}")


def test_every_bench_target_is_in_the_table() -> None:
    """A benchmark the Makefile ships but nothing runs would rot again."""
    text = (ROOT / "Makefile").read_text()
    shipped = set(re.findall(r"^(bench-[\w-]+):", text, flags=re.M))
    assert shipped == {b.target for b in BENCHES}


@pytest.mark.parametrize("bench", BENCHES, ids=[b.target for b in BENCHES])
def test_benchmark_runs_as_shipped(bench: Bench, tmp_path: Path) -> None:
    require(bench.needs)
    argv = recipe(bench.target) + [a.format(tmp=tmp_path) for a in bench.small]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MODELYARD_HOME", None)  # each benchmark makes its own
    env.pop("MODELYARD_CONFIG", None)
    rc, stdout, stderr = run_bench(argv, env)
    output = stdout + stderr
    assert rc == 0, f"{shlex.join(argv)} exited {rc}:\n{output[-4000:]}"
    missing = [row for row in bench.rows if not re.search(row, stdout, flags=re.M)]
    assert not missing, f"{bench.target} did not print {missing}:\n{stdout[-4000:]}"


def run_bench(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run it to the end; one that overruns gets SIGTERM first, on which the benchmarks stop the
    servers they started (each in a session of its own, which killing the benchmark's group
    would orphan), then SIGKILL."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"{shlex.join(argv)} ran past {RUN_TIMEOUT_S} s:\n{(stdout + stderr)[-4000:]}")
    return proc.returncode, stdout, stderr
