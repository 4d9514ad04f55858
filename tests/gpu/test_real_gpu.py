"""On a machine with NVIDIA GPUs: the real nvidia-smi parses, and the front plans engines by
device group (per_gpu: one each; per_node, the default: one for all).

Skipped where no GPU answers (see tests/conftest.py); run them on a GPU host with `pytest -m gpu`.
"""

import pytest

from modelyard.config import Settings
from modelyard.front.engines.supervisor import plan_engines
from modelyard.hw.smi import query_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]


def test_real_nvidia_smi_is_parsed() -> None:
    gpus = query_gpus()
    assert gpus, "nvidia-smi reported no GPU"
    for gpu in gpus:
        assert gpu.total_bytes > 0 and gpu.name
        assert gpu.free_bytes is None or gpu.free_bytes <= gpu.total_bytes


def test_engines_per_real_device_group() -> None:
    gpus = query_gpus()
    plans = plan_engines(Settings(engine_devices="per_gpu"), len(gpus))
    assert [p.cuda_visible_devices for p in plans] == [str(i) for i in range(len(gpus))]
    (node,) = plan_engines(Settings(), len(gpus))
    assert node.cuda_visible_devices == ",".join(str(i) for i in range(len(gpus)))


def test_an_engine_owns_every_gpu_of_its_group_and_reads_each() -> None:
    """Per-device accounting through NVML (or nvidia-smi): one reading per GPU of the group,
    the group's total their sum."""
    from modelyard.engine.device_group import DeviceGroup
    from modelyard.hw.gpu_probe import gpu_devices_for

    gpus = query_gpus()
    found = gpu_devices_for(",".join(str(g.index) for g in gpus))
    assert [i for i, _ in found] == [g.index for g in gpus]
    group = DeviceGroup(found)
    infos = group.infos()
    assert [i.total_bytes for i in infos] == [g.total_bytes for g in gpus]
    assert group.info().total_bytes == sum(g.total_bytes for g in gpus)


def test_nvml_agrees_with_nvidia_smi_and_sees_a_process() -> None:
    from modelyard.hw.nvml import NvmlProbe

    probe = NvmlProbe()
    if not probe.available():
        pytest.skip("nvidia-ml-py is not installed (pip install modelyard[gpu])")
    smi = {g.index: g for g in query_gpus()}
    nvml = probe.devices()
    assert {d.index for d in nvml} == set(smi)
    for d in nvml:
        assert d.total_bytes == smi[d.index].total_bytes
        assert d.temperature_c is None or 0 < d.temperature_c < 120
    assert isinstance(probe.processes(nvml[0].index), dict)


def test_engine_reads_its_own_gpu() -> None:
    from modelyard.hw.gpu_probe import gpu_device_for

    device = gpu_device_for("0")
    assert device is not None
    info = device.info()
    assert info.total_bytes == query_gpus()[0].total_bytes
    assert info.free_bytes is not None and 0 <= info.free_bytes <= info.total_bytes
