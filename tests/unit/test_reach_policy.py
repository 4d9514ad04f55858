"""Never claim a device a backend cannot use (DESIGN.md §3.15): what the engine concludes from a
backend's device listing, and how a model whose backend cannot use the GPUs is placed (whole in
host RAM, evicting only what holds host RAM) by the one policy the engine and the front share."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings, TransformersModel
from modelyard.engine.backends.transformers.reach import parse_torch_version
from modelyard.engine.device_group import DeviceGroup
from modelyard.engine.ledger import SimulatedDevice
from modelyard.engine.reach import (
    BackendReach,
    Reach,
    gpu_warning,
    llama_cpp_reach,
    should_probe,
)
from modelyard.front.api.ollama_models import ps_row
from modelyard.front.ops.overview import overview
from modelyard.hw.backend_devices import parse_list_devices
from modelyard.hw.simulated import CLAIM_SPLIT_ENV, CLAIMS_DIR_ENV, SimulatedGpu
from modelyard.placement import policy as scheduler
from modelyard.placement import view
from modelyard.placement.devices import DeviceRoom, Placement
from modelyard.store.registry import Entry
from modelyard.wire.status import DeviceStatus, EngineReport, EngineStatus, ModelMemory, ModelStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

GiB = 2**30
CPU_ONLY = "Available devices:\n  (none)\n"
CUDA = "Available devices:\n  CUDA0: NVIDIA H200 (143771 MiB, 142890 MiB free)\n"
BLAS = "Available devices:\n  BLAS: OpenBLAS (0 MiB, 0 MiB free)\n"
WHY = ("backend has no GPU support: llama-server at /opt/llama-server lists no GPU "
       "(Available devices: (none))")


# ---- what a listing means ------------------------------------------------------------------


def test_a_cpu_only_listing_says_why() -> None:
    found = llama_cpp_reach(Path("/opt/llama-server"), parse_list_devices(CPU_ONLY))
    assert found.gpus == 0 and found.reason == WHY


def test_a_cuda_listing_reaches_the_gpu() -> None:
    found = llama_cpp_reach(Path("/opt/llama-server"), parse_list_devices(CUDA))
    assert found.gpus == 1 and found.reason is None
    assert found.devices == ("CUDA0: NVIDIA H200",)


def test_a_listing_of_non_gpu_devices_only_reaches_none() -> None:
    found = llama_cpp_reach(Path("/b"), parse_list_devices(BLAS))
    assert found.reason is not None and "Available devices: BLAS: OpenBLAS" in found.reason


def test_no_listing_is_unknown_and_counts_as_reachable() -> None:
    """An older build without --list-devices (or not llama-server at all) keeps working."""
    found = llama_cpp_reach(Path("/b"), parse_list_devices("usage: llama-server [options]"))
    assert found.gpus is None and found.reason is None


@pytest.mark.parametrize(("mode", "kind", "asks"), [
    ("auto", "nvidia", True), ("auto", "simulated", False), ("auto", "cpu", False),
    ("always", "simulated", True), ("always", "cpu", False), ("never", "nvidia", False),
])
def test_when_an_engine_asks(mode: str, kind: str, asks: bool) -> None:
    assert should_probe(mode, kind) is asks


def test_the_warning_only_when_no_backend_can_use_the_gpus() -> None:
    llama = Reach("llamacpp", "llama-server at /b", 0, WHY)
    cpu_torch = Reach("transformers", "torch 2.13.0+cpu", 0,
                      "backend has no GPU support: torch 2.13.0+cpu is a CPU build")
    cuda_torch = Reach("transformers", "torch 2.13.0+cu128", 1)
    warning = gpu_warning({"llamacpp": llama, "transformers": cpu_torch}, 1, 0)
    assert warning is not None and "no backend can use them" in warning
    assert "lists no GPU" in warning and "CPU build" in warning
    assert gpu_warning({"llamacpp": llama, "transformers": cuda_torch}, 1, 0) is None
    assert gpu_warning({"llamacpp": llama}, 0, 0) is None  # no GPU: nothing to warn of
    assert gpu_warning({}, 1, 0) is None  # nothing asked


def test_torch_version_file_says_cpu_or_cuda_build() -> None:
    cpu = ("__version__ = '2.13.0+cpu'\ndebug = False\ncuda: Optional[str] = None\n"
           "git_version = 'cf30'\nhip: Optional[str] = None\n")
    assert parse_torch_version(cpu) == ("2.13.0+cpu", None, None)
    cuda = "__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\nhip = None\n"
    assert parse_torch_version(cuda) == ("2.13.0+cu128", "12.8", None)
    assert parse_torch_version("print('hello')") is None


def test_reach_backend_keys_what_serves_a_model(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    assert LlamaCppModel(id="a", path=gguf).reach_backend == "llamacpp"
    own = LlamaCppModel(id="b", path=gguf, argv=["/my/server", "-m", "$path"])
    assert own.reach_backend == "openai"  # some other binary: taken as configured
    assert TransformersModel(id="c", path=tmp_path).reach_backend == "transformers"
    assert TransformersModel(id="d", path=tmp_path, runtime="vllm").reach_backend == "vllm"
    assert OpenAIServerModel(id="e", argv=["x"]).reach_backend == "openai"


async def test_the_engine_asks_once_and_says_so(tmp_path: Path) -> None:
    asked: list[int] = []
    changes: list[int] = []

    def probe(settings: Settings) -> dict[str, Reach]:
        asked.append(1)
        return {"llamacpp": Reach("llamacpp", "llama-server at /b", 0, WHY)}

    reach = BackendReach(Settings(home=tmp_path, probe_backend_devices="always"), "simulated",
                         2, 0, on_known=lambda: changes.append(1), probe=probe)
    await asyncio.gather(reach.known(), reach.known())
    await reach.known()
    assert asked == [1] and changes == [1]
    assert reach.cpu_backends() == {"llamacpp": WHY}
    assert reach.reason_for("llamacpp") == WHY and reach.reason_for("openai") is None
    assert reach.warning is not None and "2 GPUs" in reach.warning
    assert reach.to_json()["backends"]["llamacpp"]["reason"] == WHY


async def test_a_reload_naming_another_binary_asks_again(tmp_path: Path) -> None:
    binaries: list[object] = []

    def probe(settings: Settings) -> dict[str, Reach]:
        binaries.append(settings.llama_server_path)
        return {}

    first = Settings(home=tmp_path, probe_backend_devices="always",
                     llama_server_path=tmp_path / "a")
    reach = BackendReach(first, "simulated", 1, 0, probe=probe)
    await reach.known()
    reach.update(first.model_copy(update={"keep_alive_s": 5.0}))
    await reach.known()
    reach.update(first.model_copy(update={"llama_server_path": tmp_path / "b"}))
    await reach.known()
    assert binaries == [tmp_path / "a", tmp_path / "b"]


async def test_simulated_gpus_are_reachable_unless_asked(tmp_path: Path) -> None:
    def probe(settings: Settings) -> dict[str, Reach]:
        raise AssertionError("not asked on simulated GPUs by default")

    reach = BackendReach(Settings(home=tmp_path), "simulated", 1, 0, probe=probe)
    await reach.known()
    assert reach.cpu_backends() == {} and reach.warning is None


# ---- the policy: whole in host RAM ---------------------------------------------------------

HOST = DeviceRoom(-1, 32 * GiB, 64 * GiB)


def want(name: str, gib: float, **kw: object) -> scheduler.Want:
    return scheduler.Want(name, int(gib * GiB), **kw)  # type: ignore[arg-type]


def gpu_full() -> list[scheduler.Resident]:
    return [scheduler.Resident("big", 23 * GiB, placement=Placement.whole(0, 23 * GiB))]


def test_a_model_without_gpu_support_goes_to_host_ram_and_evicts_no_gpu_model() -> None:
    rooms = [DeviceRoom(0, 1 * GiB, 24 * GiB)]
    on_gpu = scheduler.plan(want("m", 4), gpu_full(), 0, 0, devices=rooms, host=HOST)
    assert isinstance(on_gpu, scheduler.Evict)  # today's placement: evict the GPU's model
    decision = scheduler.plan(want("m", 4, cpu_reason=WHY), gpu_full(), 0, 0, devices=rooms,
                              host=HOST)
    assert isinstance(decision, scheduler.Load)
    assert decision.placement == Placement(device_bytes=(), host_bytes=4 * GiB)
    assert decision.placement.split_label() == "100% CPU"


def test_host_ram_is_made_room_in_by_what_holds_host_ram() -> None:
    cpu_model = scheduler.Resident("old", 0, last_used=1.0,
                                   placement=Placement(device_bytes=(), host_bytes=20 * GiB))
    host = DeviceRoom(-1, 10 * GiB, 64 * GiB)  # the engine counted old's 20 GiB as taken
    rooms = [DeviceRoom(0, 1 * GiB, 24 * GiB)]
    decision = scheduler.plan(want("m", 16, cpu_reason=WHY), [*gpu_full(), cpu_model], 0, 0,
                              devices=rooms, host=host)
    assert decision == scheduler.Evict(("old",), then_load="m")
    assert isinstance(decision, scheduler.Evict) and decision.placement is not None
    assert decision.placement.devices == () and decision.placement.host_bytes == 16 * GiB
    busy = [*gpu_full(), scheduler.Resident("old", 0, leases=1, placement=cpu_model.placement)]
    waits = scheduler.plan(want("m", 16, cpu_reason=WHY), busy, 0, 0, devices=rooms, host=host)
    assert isinstance(waits, scheduler.Wait) and waits.blocked_by == ("old",)


def test_bigger_than_host_ram_never_fits_and_says_why() -> None:
    decision = scheduler.plan(want("m", 80, cpu_reason=WHY), [], 0, 0,
                              devices=[DeviceRoom(0, 80 * GiB, 80 * GiB)], host=HOST)
    assert isinstance(decision, scheduler.NoFit)
    assert "runs on the CPU" in decision.reason and WHY in decision.reason


def test_a_cpu_engine_places_it_as_any_model() -> None:
    """No host room (the CPU engine: its device is host RAM already)."""
    decision = scheduler.plan(want("m", 4, cpu_reason=WHY), [], 8 * GiB, 8 * GiB)
    assert isinstance(decision, scheduler.Load)


# ---- the front predicts it from the status ---------------------------------------------------


def engine_status(cpu_backends: dict[str, str]) -> EngineStatus:
    gpu = DeviceStatus(kind="simulated", total_bytes=24 * GiB, free_bytes=1 * GiB, index=0)
    big = ModelStatus(model="big", state="ready", memory=ModelMemory(reserved_bytes=23 * GiB),
                      placement=Placement.whole(0, 23 * GiB))
    built = EngineStatus(device=gpu, devices=(gpu,), models=(big,), cpu_backends=cpu_backends,
                         host=DeviceStatus(kind="host", total_bytes=64 * GiB,
                                           free_bytes=32 * GiB, index=-1))
    return EngineStatus.from_json(orjson.loads(orjson.dumps(built.to_json())))


def test_the_status_says_which_backends_go_to_the_cpu() -> None:
    status = engine_status({"llamacpp": WHY})
    gguf = view.plan_from_status(status, want("m", 4, backend="llamacpp"))
    assert isinstance(gguf, scheduler.Load) and gguf.placement is not None
    assert gguf.placement.devices == () and gguf.placement.host_bytes == 4 * GiB
    other = view.plan_from_status(status, want("m", 4, backend="openai"))
    assert isinstance(other, scheduler.Evict) and other.victims == ("big",)
    unknown = view.plan_from_status(engine_status({}), want("m", 4, backend="llamacpp"))
    assert isinstance(unknown, scheduler.Evict)  # as today


# ---- how it is shown -------------------------------------------------------------------------


def cpu_model() -> ModelStatus:
    return ModelStatus(model="m", state="ready", backend="llamacpp",
                       memory=ModelMemory(reserved_bytes=0, host_bytes=3 * GiB),
                       placement=Placement(device_bytes=(), host_bytes=4 * GiB), cpu_reason=WHY)


def test_api_ps_counts_no_vram_for_it(tmp_path: Path) -> None:
    entry = Entry(spec=LlamaCppModel(id="m", path=tmp_path / "m.gguf"), source="config")
    rows: list[dict[str, object]] = []
    ps_row(rows, entry, {}, cpu_model(), "engine-0", True, 4096)
    (row,) = rows
    assert row["size_vram"] == 0 and row["size"] == 3 * GiB and row["cpu_reason"] == WHY
    ps_row(rows, entry, {}, cpu_model(), "engine-0", True, 4096, admin=False)
    assert rows[1]["cpu_reason"] == "backend has no GPU support"  # no local path for clients


def test_ps_shows_cpu_and_why() -> None:
    from rich.console import Console

    from modelyard.cli.status import render

    gpu = DeviceStatus(kind="simulated", total_bytes=24 * GiB, free_bytes=24 * GiB)
    status = EngineStatus(device=gpu, models=(cpu_model(),), gpu_warning="no backend can use")
    report = EngineReport("engine-0", status)
    view_ = overview({"engines": [report.to_json()], "queues": {}, "version": "t",
                      "uptime_seconds": 1.0}, [])
    (m,) = view_["engines"][0]["models"]
    assert m["processor"] == "100% CPU" and m["placement"] == "cpu"
    assert m["cpu_reason"] == WHY and m["memory_bytes"] == 4 * GiB
    console = Console(width=400, record=True)
    console.print(render(view_))
    text = console.export_text()
    assert "100% GPU" not in text and "CPU" in text and WHY in text
    assert "no backend can use" in text


def test_a_cpu_placement_hides_every_gpu_from_its_child(tmp_path: Path) -> None:
    group = DeviceGroup([(0, SimulatedDevice(SimulatedGpu(0, 24 * GiB, tmp_path / "0")))])
    env = group.child_env(Placement(device_bytes=(), host_bytes=GiB))
    assert env == {"CUDA_VISIBLE_DEVICES": "", CLAIMS_DIR_ENV: "", CLAIM_SPLIT_ENV: ""}
    group.on_spawn(12345, 0, Placement(device_bytes=(), host_bytes=GiB))
    assert not list((tmp_path / "0").iterdir())  # no stand-in claim on the GPU
