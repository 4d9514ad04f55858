"""Speculative decoding's pure parts: the draft's argv, its resolution and refusal, its memory,
llama-server's counters parsed and accumulated across servers, the status field, the bench table."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from bench import spec as bench_spec
from pydantic import ValidationError

from modelyard.config import LlamaCppModel, Settings, TransformersModel
from modelyard.engine.backends.llamacpp import draft_args
from modelyard.engine.speculative import DraftCounts, parse_draft_counts
from modelyard.errors import InvalidRequest
from modelyard.store.draft import draft_path, with_draft_path
from modelyard.store.registry import Entry
from modelyard.wire.speculative import SpeculativeStatus
from modelyard.wire.status import ModelStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

# Captured from the pinned llama-server (--metrics, the demo model drafting for itself).
METRICS = """\
# HELP llamacpp:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:tokens_predicted_total 60
llamacpp:spec_decode_num_draft_tokens_total 45
llamacpp:spec_decode_num_accepted_tokens_total 44
llamacpp:spec_decode_num_drafts_total 15
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 15
"""


class _Registry:
    def __init__(self, *specs: LlamaCppModel | TransformersModel) -> None:
        self.entries = {s.id: Entry(s, "config") for s in specs}

    def get(self, name: str) -> Entry | None:
        return self.entries.get(name)


def test_draft_args_render_the_pinned_binarys_flags() -> None:
    assert draft_args(LlamaCppModel(id="t", path=Path("/m.gguf"))) == []
    spec = LlamaCppModel(id="t", path=Path("/m.gguf"), draft_model="/d.gguf", draft_max=6,
                         draft_min=1, draft_p_min=0.5)
    assert draft_args(spec) == [
        "--model-draft", "$draft", "--spec-type", "draft-simple", "--metrics",
        "--spec-draft-n-max", "6", "--spec-draft-n-min", "1", "--spec-draft-p-min", "0.5",
    ]


def test_a_draft_path_must_be_a_gguf() -> None:
    with pytest.raises(ValidationError, match="draft_model"):
        LlamaCppModel(id="t", path=Path("/m.gguf"), draft_model="/models/draft.safetensors")


def test_draft_resolves_by_id_and_refuses_what_cannot_pair(tmp_path: Path) -> None:
    gguf = tmp_path / "d.gguf"
    gguf.write_bytes(b"x")
    draft = LlamaCppModel(id="small", path=gguf)
    st = TransformersModel(id="st", path=tmp_path)
    registry = _Registry(draft, st)
    settings = Settings(home=tmp_path / "home")
    target = LlamaCppModel(id="big", path=gguf, draft_model="small")
    assert draft_path(target, registry, settings) == gguf
    resolved = with_draft_path(target, registry, settings)
    assert isinstance(resolved, LlamaCppModel) and resolved.draft_model == str(gguf)
    for name, words in (("st", "GGUF"), ("ghost", "declare it"),
                        ("org/repo-GGUF", "modelyard pull org/repo-GGUF"),
                        (str(tmp_path / "none.gguf"), "not a file")):
        bad = LlamaCppModel(id="big", path=gguf, draft_model=name)
        with pytest.raises(InvalidRequest, match=words) as err:
            draft_path(bad, registry, settings)
        assert err.value.status == 400 and err.value.param == "draft_model"


def test_draft_memory_counts_with_the_target(tmp_path: Path) -> None:
    from modelyard.config import DEMO_MODEL_FILE, cache_dir
    from modelyard.store.estimate import estimate_model

    gguf = cache_dir() / "models" / DEMO_MODEL_FILE
    if not gguf.is_file():
        pytest.skip("demo model not downloaded")
    settings = Settings(home=tmp_path, default_ctx_size=1024, llama_server_parallel=2)
    alone = estimate_model(LlamaCppModel(id="t", path=gguf), settings)
    paired = estimate_model(LlamaCppModel(id="t", path=gguf, draft_model=str(gguf)), settings)
    assert alone is not None and paired is not None
    assert alone.draft_bytes == 0 and "draft_bytes" not in alone.to_json()
    # The same file as its own draft: its weights, KV and compute once more.
    assert paired.draft_bytes == alone.total_bytes
    assert paired.total_bytes == 2 * alone.total_bytes


def test_parse_llama_server_metrics() -> None:
    assert parse_draft_counts(METRICS) == (45, 44)
    assert parse_draft_counts("llamacpp:tokens_predicted_total 60\n") is None


def test_counts_accumulate_across_servers() -> None:
    counts = DraftCounts("m", "small")
    counts.observe(45, 44)
    counts.observe(60, 50)  # the same server, later
    assert (counts.drafted, counts.accepted) == (60, 50)
    counts.new_server()
    counts.observe(10, 5)  # a new server counts from zero
    assert (counts.drafted, counts.accepted) == (70, 55)
    counts.observe(3, 1)  # a restart nobody announced: a reading that went down
    assert (counts.drafted, counts.accepted) == (73, 56)
    assert counts.status().acceptance_rate == pytest.approx(56 / 73)


def test_poke_reads_once_at_a_time_and_again_if_poked_meanwhile() -> None:
    async def scenario() -> list[str]:
        counts = DraftCounts("m", "small")
        reads: list[str] = []
        gate = asyncio.Event()
        readings = iter([(4, 3), (9, 7)])

        async def read(url: str) -> tuple[int, int] | None:
            reads.append(url)
            await gate.wait()
            return next(readings)

        def spawn(coro: object, name: str) -> asyncio.Task[None]:
            return asyncio.ensure_future(coro)  # type: ignore[arg-type]

        counts.poke("u", spawn, read)
        counts.poke("u", spawn, read)  # while the first read is in flight
        counts.poke("u", spawn, read)
        await asyncio.sleep(0)
        gate.set()
        await counts.settled()
        assert (counts.drafted, counts.accepted) == (9, 7)
        return reads

    assert asyncio.run(scenario()) == ["u", "u"]


def test_status_round_trips_the_speculative_field() -> None:
    status = ModelStatus(model="m", state="ready",
                         speculative=SpeculativeStatus("small", drafted=8, accepted=6))
    body = status.to_json()
    assert body["speculative"] == {"draft_model": "small", "drafted": 8, "accepted": 6,
                                   "acceptance_rate": 0.75, "off_reason": None}
    assert ModelStatus.from_json(body).speculative == status.speculative
    assert ModelStatus.from_json(ModelStatus(model="m", state="ready").to_json()).speculative \
        is None


def test_bench_table_shows_ratio_and_acceptance() -> None:
    runs = [bench_spec.Run("without draft", 100, 2.0, 2.5),
            bench_spec.Run("with draft", 100, 1.0, 1.4, drafted=80, accepted=60)]
    text = bench_spec.table(runs)
    assert "| without draft | 100 | 50.0 | 1.00x | 2.50 | - | - | - |" in text
    assert "| with draft | 100 | 100.0 | 2.00x | 1.40 | 80 | 60 | 75.0% |" in text
