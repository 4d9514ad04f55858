"""Each backend honours the engine's placement: llama-server's device flags, vLLM's tensor
parallel, transformers' device_map (rendered, not run: tests/e2e/test_offload_argv.py starts the
real llama-server with them, tests/gpu/test_multi_gpu_gpu.py runs them on GPUs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings, TransformersModel
from modelyard.engine.backends.base import vllm_spec
from modelyard.engine.backends.llamacpp import knows_fit, llama_server_argv, placement_args
from modelyard.engine.backends.openai_server import ChildServer, render_argv
from modelyard.engine.backends.transformers.device_map import device_map_kwargs, visible_indexes
from modelyard.engine.backends.vllm import SleepingServer, tensor_parallel_args
from modelyard.placement.devices import Placement
from modelyard.placement.tensor_parallel import tensor_parallel_sizes
from modelyard.store.attention import attention_heads

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

GIB = 2**30
ONE = Placement.whole(0, 3 * GIB)
TWO = Placement(device_bytes=((0, 20 * GIB), (1, 22 * GIB)), layers=(38, 42), total_layers=80)
OFFLOAD = Placement(device_bytes=((0, 5 * GIB),), host_bytes=10 * GIB, layers=(10,),
                    total_layers=30)


def _settings(tmp_path: Path) -> Settings:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    return Settings(home=tmp_path, llama_server_path=binary)


def _argv(tmp_path: Path, placement: Placement | None, **fields: object) -> list[str]:
    spec = LlamaCppModel(id="m", path=tmp_path / "m.gguf", **fields)  # type: ignore[arg-type]
    template, values = llama_server_argv(spec, _settings(tmp_path), placement)
    return render_argv(template, {**values, "host": "127.0.0.1", "port": "1"})


def _after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_one_device_takes_every_layer_and_no_split(tmp_path: Path) -> None:
    argv = _argv(tmp_path, ONE)
    assert _after(argv, "--n-gpu-layers") == "999"
    assert _after(argv, "--split-mode") == "none"
    assert _after(argv, "--main-gpu") == "0"
    assert _after(argv, "--fit") == "off"  # llama-server's own fitting would overrule the ledger
    assert "--tensor-split" not in argv


def test_two_devices_split_by_the_placements_layers(tmp_path: Path) -> None:
    argv = _argv(tmp_path, TWO)
    assert _after(argv, "--split-mode") == "layer"
    assert _after(argv, "--tensor-split") == "38,42"
    assert _after(argv, "--n-gpu-layers") == "999"  # all 80 are on the devices
    assert _after(argv, "--main-gpu") == "0"  # the child's first visible device


def test_two_devices_without_layers_split_by_bytes(tmp_path: Path) -> None:
    by_bytes = Placement(device_bytes=((2, 3), (5, 1)))
    assert _after(_argv(tmp_path, by_bytes), "--tensor-split") == "3,1"


def test_offload_keeps_the_rest_in_host_ram(tmp_path: Path) -> None:
    argv = _argv(tmp_path, OFFLOAD)
    assert _after(argv, "--n-gpu-layers") == "10"
    assert _after(argv, "--split-mode") == "none"
    spread = Placement(device_bytes=((0, 1), (1, 1)), host_bytes=5, layers=(8, 8),
                       total_layers=30)
    argv = _argv(tmp_path, spread)
    assert (_after(argv, "--n-gpu-layers"), _after(argv, "--tensor-split")) == ("16", "8,8")


def test_no_placement_renders_what_it_did_before(tmp_path: Path) -> None:
    argv = _argv(tmp_path, None)
    for flag in ("--n-gpu-layers", "--split-mode", "--tensor-split", "--main-gpu", "--fit"):
        assert flag not in argv


def test_the_users_extra_args_win_in_any_spelling(tmp_path: Path) -> None:
    argv = _argv(tmp_path, TWO, extra_args=["-ngl", "20", "--fit=on", "-ts", "1,1"])
    assert argv.count("-ngl") == 1 and "--n-gpu-layers" not in argv
    assert "--fit" not in argv and "--tensor-split" not in argv
    assert _after(argv, "--split-mode") == "layer"  # what they did not set is still ours
    assert argv[-5:] == ["-ngl", "20", "--fit=on", "-ts", "1,1"]
    assert placement_args(ONE, ["--gpu-layers", "3", "-sm", "row", "-mg", "1"]) == [
        "--fit", "off"]


def test_an_argv_template_gets_the_placement_as_substitutions(tmp_path: Path) -> None:
    template = ["srv", "-m", "$path", "-ngl", "$n_gpu_layers", "-sm", "$split_mode",
                "-ts", "$tensor_split"]
    assert _argv(tmp_path, TWO, argv=template)[3:] == ["-ngl", "999", "-sm", "layer",
                                                      "-ts", "38,42"]
    assert _argv(tmp_path, OFFLOAD, argv=template)[3:] == ["-ngl", "10", "-sm", "none",
                                                          "-ts", ""]
    # nothing added to a template: the user's command line is theirs
    assert len(_argv(tmp_path, TWO, argv=template)) == len(template)


def test_child_server_renders_at_place_for_gpu_children_only(tmp_path: Path) -> None:
    spec = LlamaCppModel(id="m", path=tmp_path / "m.gguf")
    server = ChildServer(spec, _settings(tmp_path))
    assert "--n-gpu-layers" not in server.process.argv  # not told yet
    server.place(TWO, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert _after(server.process.argv, "--tensor-split") == "38,42"
    assert _after(server.process.argv, "--port") == str(server.port)
    assert server.placement == TWO
    # a CPU engine (and a simulated device) hides the GPUs: nothing new on its command line
    cpu = ChildServer(spec, _settings(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    cpu.place(ONE, {})
    assert "--n-gpu-layers" not in cpu.process.argv and cpu.placement == ONE


def test_place_keeps_the_inherited_environment(tmp_path: Path) -> None:
    """A child built with no env of its own inherits the engine's: place() adds to it, never
    replaces it with the placement's few variables (PATH, HOME… would be lost)."""
    server = ChildServer(LlamaCppModel(id="m", path=tmp_path / "m.gguf"), _settings(tmp_path))
    server.place(ONE, {"CUDA_VISIBLE_DEVICES": "1"})
    env = server.process.env or {}
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env.get("PATH") == os.environ.get("PATH") is not None


def test_an_openai_server_template_gets_the_placement(tmp_path: Path) -> None:
    spec = OpenAIServerModel(id="o", argv=["srv", "--port", "$port", "--tp",
                                           "$tensor_parallel_size", "-ngl", "$n_gpu_layers"])
    server = ChildServer(spec, _settings(tmp_path))
    assert server.process.argv[3:] == ["--tp", "1", "-ngl", "0"]
    server.place(OFFLOAD, {"CUDA_VISIBLE_DEVICES": "0"})
    assert server.process.argv[3:] == ["--tp", "1", "-ngl", "10"]


# ---- vLLM ---------------------------------------------------------------------------------


def test_vllm_tensor_parallel_over_the_placements_devices() -> None:
    assert tensor_parallel_args(TWO, []) == [
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    assert tensor_parallel_args(ONE, []) == []
    assert tensor_parallel_args(None, []) == []
    # the user's vllm_args win
    assert tensor_parallel_args(TWO, ["--tensor-parallel-size=2"]) == []
    assert tensor_parallel_args(TWO, ["--distributed-executor-backend", "ray"]) == [
        "--tensor-parallel-size", "2"]


def test_vllm_memory_share_is_the_largest_share_of_a_device() -> None:
    totals = {0: 80 * GIB, 1: 40 * GIB}
    args = tensor_parallel_args(TWO, [], totals)
    # (22 + 2 GiB of vLLM's own runtime) / 40 = 0.60, the larger of it and (20 + 2) / 80
    assert _after(args, "--gpu-memory-utilization") == "0.60"
    assert _after(tensor_parallel_args(ONE, [], {0: 100 * GIB}),
                  "--gpu-memory-utilization") == "0.05"
    assert _after(tensor_parallel_args(Placement.whole(0, 39 * GIB), [], {0: 40 * GIB}),
                  "--gpu-memory-utilization") == "0.98"  # capped
    assert "--gpu-memory-utilization" not in tensor_parallel_args(TWO, [], {0: 80 * GIB})
    assert tensor_parallel_args(ONE, ["--gpu-memory-utilization", "0.5"], {0: GIB}) == []


def test_a_vllm_child_is_told_its_tensor_parallel_size(tmp_path: Path) -> None:
    spec = vllm_spec(TransformersModel(id="v", path=tmp_path, runtime="vllm"))
    server = SleepingServer(spec, Settings(home=tmp_path))
    assert "--tensor-parallel-size" not in server.process.argv
    server.place(TWO, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert _after(server.process.argv, "--tensor-parallel-size") == "2"
    assert server.process.env is not None and server.process.env["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.parametrize(("heads", "devices", "sizes"), [
    (32, 4, {1, 2, 4}), (14, 4, {1, 2}), (12, 8, {1, 2, 3, 4, 6}), (7, 2, {1}),
    (None, 4, {1}), (32, 0, set()),
])
def test_tensor_parallel_sizes_divide_the_heads(heads: int | None, devices: int,
                                                sizes: set[int]) -> None:
    assert tensor_parallel_sizes(heads, devices) == sizes


def test_attention_heads_from_config_json(tmp_path: Path) -> None:
    assert attention_heads(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert attention_heads(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9}))
    assert attention_heads(tmp_path) == 9
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 16}}))
    assert attention_heads(tmp_path) == 16
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": True}))
    assert attention_heads(tmp_path) is None


# ---- transformers --------------------------------------------------------------------------


def test_device_map_one_device_is_that_device() -> None:
    assert device_map_kwargs(ONE, [0]) == {"device_map": {"": 0}}
    # in-process, the engine sees its whole group: physical 3 is CUDA ordinal 1 of "2,3"
    assert device_map_kwargs(Placement.whole(3, GIB), [2, 3]) == {"device_map": {"": 1}}


def test_device_map_split_and_offload_bound_each_device() -> None:
    assert device_map_kwargs(TWO, [0, 1]) == {
        "device_map": "auto", "max_memory": {0: 20 * GIB, 1: 22 * GIB, "cpu": 0}}
    assert device_map_kwargs(OFFLOAD, [0]) == {
        "device_map": "auto", "max_memory": {0: 5 * GIB, "cpu": 10 * GIB}}


def test_device_map_on_cpu_changes_nothing() -> None:
    assert device_map_kwargs(TWO, []) == {}
    assert device_map_kwargs(None, [0, 1]) == {}


def test_visible_indexes() -> None:
    assert visible_indexes("2,3", 2) == [2, 3]
    assert visible_indexes(None, 2) == [0, 1]
    assert visible_indexes("GPU-abc,GPU-def", 2) == [0, 1]
    assert visible_indexes("", 0) == []


def test_an_older_build_without_fit_is_not_given_it(tmp_path: Path) -> None:
    """llama.cpp builds before `--fit` refuse unknown flags: ours is left out for them."""
    old = tmp_path / "old-llama-server"
    old.write_text("#!/bin/sh\necho '-ngl, --gpu-layers, --n-gpu-layers N   layers'\n")
    old.chmod(0o755)
    spec = LlamaCppModel(id="m", path=tmp_path / "m.gguf")
    template, _ = llama_server_argv(spec, Settings(home=tmp_path, llama_server_path=old), ONE)
    assert "--fit" not in template and "--n-gpu-layers" in template
    assert knows_fit(Settings().resolve_llama_server()) or Settings().resolve_llama_server() is None


@pytest.mark.parametrize(("row", "placement"), [
    ("one GPU", ONE),
    ("two GPUs, 38 + 42 layers", TWO),
    ("partial offload: 10 of 30 layers on GPU 0", OFFLOAD),
])
def test_docs_show_the_flags_each_placement_gets(row: str, placement: Placement) -> None:
    doc = (Path(__file__).parents[2] / "docs" / "multi-gpu.md").read_text(encoding="utf-8")
    flags = " ".join(placement_args(placement))
    assert f"| {row} | `{flags}` |" in doc
