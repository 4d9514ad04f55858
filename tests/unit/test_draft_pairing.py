"""Speculative decoding's pairing (issue 19 point 7): the draft follows the target's placement in
llama-server's argv, a pulled draft is found by its hub reference, the drafts a pull brings
along, and the transformers engine's per-request `X-Modelyard-Speculative` header."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from starlette.testclient import TestClient

from modelyard.config import LlamaCppModel, Settings, TransformersModel
from modelyard.engine.backends.llamacpp import draft_args, llama_server_argv
from modelyard.engine.backends.openai_server import render_argv
from modelyard.engine.backends.transformers.generator import BatchGenerator
from modelyard.engine.backends.transformers.params import ContextOverflow, SamplingParams
from modelyard.engine.backends.transformers.server import build_app
from modelyard.engine.speculative import TRANSFORMERS_OFF_SHORT, off_header_value
from modelyard.front.ops.draft_pulls import drafts_to_pull, pull_drafts
from modelyard.placement.devices import Placement
from modelyard.store.draft import draft_entry, draft_path, missing_hub_draft
from modelyard.store.registry import Entry, ModelRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

GIB = 2**30
ONE = Placement.whole(0, 3 * GIB)
TWO = Placement(device_bytes=((0, 20 * GIB), (1, 22 * GIB)), layers=(38, 42), total_layers=80)
OFFLOAD = Placement(device_bytes=((0, 5 * GIB),), host_bytes=10 * GIB, layers=(10,),
                    total_layers=30)
HUB_DRAFT = "hf.co/org/small-GGUF:Q4_K_M"


def _after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _spec(tmp_path: Path, **fields: Any) -> LlamaCppModel:
    return LlamaCppModel(id="m", path=tmp_path / "m.gguf", draft_model=str(tmp_path / "d.gguf"),
                         **fields)


# ---- the draft follows the placement --------------------------------------------------------


def test_on_one_gpu_every_draft_layer_goes_there_and_no_device_is_named(tmp_path: Path) -> None:
    args = draft_args(_spec(tmp_path), ONE)
    assert _after(args, "--spec-draft-ngl") == "999"
    assert "--spec-draft-device" not in args  # the child sees one GPU: the draft's default


def test_on_a_split_the_draft_stays_on_the_targets_main_device(tmp_path: Path) -> None:
    args = draft_args(_spec(tmp_path), TWO)
    assert _after(args, "--spec-draft-ngl") == "999"
    # By default the draft would follow --tensor-split across both GPUs.
    assert _after(args, "--spec-draft-device") == "CUDA0"


def test_a_partial_offload_keeps_the_whole_draft_on_the_device(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    settings = Settings(home=tmp_path, llama_server_path=binary)
    template, values = llama_server_argv(_spec(tmp_path), settings, OFFLOAD)
    argv = render_argv(template, {**values, "host": "127.0.0.1", "port": "1"})
    assert _after(argv, "--n-gpu-layers") == "10"  # the target: part of its layers
    assert _after(argv, "--spec-draft-ngl") == "999"  # the draft: all of them
    assert _after(argv, "--model-draft") == str(tmp_path / "d.gguf")


def test_a_cpu_child_gets_no_draft_device_flags(tmp_path: Path) -> None:
    args = draft_args(_spec(tmp_path), None)
    assert "--model-draft" in args
    assert "--spec-draft-ngl" not in args and "--spec-draft-device" not in args


@pytest.mark.parametrize("given", [["-ngld", "4"], ["--gpu-layers-draft=4"], ["-devd", "CUDA1"]])
def test_the_users_draft_device_flags_win(tmp_path: Path, given: list[str]) -> None:
    args = draft_args(_spec(tmp_path, extra_args=given), TWO)
    flag = given[0].split("=")[0]
    mine = "--spec-draft-device" if flag in ("-devd",) else "--spec-draft-ngl"
    assert mine not in args
    assert ("--spec-draft-ngl" in args) == (mine != "--spec-draft-ngl")


# ---- a pulled draft, named by its hub reference ----------------------------------------------


def _registry(*entries: Entry) -> ModelRegistry:
    return ModelRegistry(entries)


def test_a_pulled_draft_is_found_by_the_reference_it_was_pulled_as(tmp_path: Path) -> None:
    small = tmp_path / "small.gguf"
    small.write_bytes(b"GGUF")
    target = LlamaCppModel(id="big", path=tmp_path / "big.gguf", draft_model=HUB_DRAFT)
    registry = _registry(Entry(target, "config"))
    assert missing_hub_draft(target, registry) == HUB_DRAFT
    pulled = Entry(LlamaCppModel(id="org/small-gguf:q4_k_m", path=small), "pulled")
    registry = _registry(Entry(target, "config"), pulled)
    # The pull names it `org/small-gguf:q4_k_m`; the draft keeps the reference it was given.
    assert draft_entry(HUB_DRAFT, registry) is pulled
    assert missing_hub_draft(target, registry) is None
    assert draft_path(target, registry, Settings(home=tmp_path)) == small


def test_only_a_missing_hub_draft_is_to_be_pulled(tmp_path: Path) -> None:
    registry = _registry()
    local = LlamaCppModel(id="a", path=tmp_path / "a.gguf", draft_model="small")
    by_path = LlamaCppModel(id="b", path=tmp_path / "b.gguf", draft_model="/m/d.gguf")
    safetensors = TransformersModel(id="c", path=tmp_path, draft_model=HUB_DRAFT)
    for spec in (local, by_path, safetensors):
        assert missing_hub_draft(spec, registry) is None


def test_a_pull_brings_the_drafts_of_the_declared_models_it_is(tmp_path: Path) -> None:
    pulled_file = tmp_path / "hub" / "big-Q4_0.gguf"
    by_alias = LlamaCppModel(id="big", aliases=["org/big-gguf:q4_0"], path=tmp_path / "x.gguf",
                             draft_model=HUB_DRAFT)
    other = "hf.co/org/other-GGUF:Q8_0"
    by_path = LlamaCppModel(id="big2", path=pulled_file, draft_model=other)
    unrelated = LlamaCppModel(id="c", path=tmp_path / "c.gguf", draft_model="hf.co/o/u:Q4_0")
    registry = _registry(Entry(by_alias, "config"), Entry(by_path, "config"),
                         Entry(unrelated, "config"))
    job = {"id": "j", "model_id": "org/big-gguf:q4_0", "local_path": str(pulled_file)}
    assert drafts_to_pull(registry, job) == [HUB_DRAFT, other]
    assert drafts_to_pull(registry, {"id": "k", "model_id": "org/nothing:q4_0"}) == []


def test_pull_drafts_submits_one_job_per_missing_draft(tmp_path: Path) -> None:
    import asyncio

    spec = LlamaCppModel(id="big", aliases=["org/big-gguf:q4_0"], path=tmp_path / "x.gguf",
                         draft_model=HUB_DRAFT)
    submitted: list[str] = []

    class Jobs:
        async def submit(self, model: str, quantize: str = "auto", init: bool = False
                         ) -> tuple[dict[str, Any], bool]:
            submitted.append(model)
            return {"id": "d", "model": model}, True

    got = asyncio.run(pull_drafts(Jobs(), _registry(Entry(spec, "config")),
                                  {"id": "j", "model_id": "org/big-gguf:q4_0"}))
    assert submitted == [HUB_DRAFT] and got == [{"id": "d", "model": HUB_DRAFT}]


# ---- the transformers engine says why not, per request --------------------------------------


class _Overflow:
    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 session: str | None = None, constraint: Any = None) -> Any:  # fmt: skip
        raise ContextOverflow(len(prompt_ids), 8)


def _app(off: str | None) -> TestClient:
    return TestClient(build_app("tiny", cast(BatchGenerator, _Overflow()),
                                chat_ids=lambda body: [1, 2], prompt_ids=lambda body: [1, 2],
                                speculative_off=off))


def test_every_answer_of_a_model_with_an_unused_draft_says_why() -> None:
    with _app(TRANSFORMERS_OFF_SHORT) as client:
        answers = [client.get("/health"),
                   client.post("/v1/completions", json={"prompt": "x"}),
                   client.post("/v1/chat/completions", content=b"not json")]
    want = f'off; reason="{TRANSFORMERS_OFF_SHORT}"'
    assert [r.headers.get("x-modelyard-speculative") for r in answers] == [want] * 3


def test_a_model_without_a_draft_answers_without_the_header() -> None:
    with _app(None) as client:
        r = client.get("/health")
    assert r.status_code == 200 and "x-modelyard-speculative" not in r.headers


def test_the_reason_is_a_quoted_string() -> None:
    assert off_header_value('a "b" \\c') == 'off; reason="a \\"b\\" \\\\c"'
