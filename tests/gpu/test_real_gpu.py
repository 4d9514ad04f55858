"""On a machine with NVIDIA GPUs: the real nvidia-smi parses, and the front plans one engine each.

Skipped where no GPU answers (see tests/conftest.py); run them on a GPU host with `pytest -m gpu`.
"""

import pytest

from modelyard.config import Settings
from modelyard.front.supervisor import plan_engines
from modelyard.hw.smi import query_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]


def test_real_nvidia_smi_is_parsed() -> None:
    gpus = query_gpus()
    assert gpus, "nvidia-smi reported no GPU"
    for gpu in gpus:
        assert gpu.total_bytes > 0 and gpu.name
        assert gpu.free_bytes is None or gpu.free_bytes <= gpu.total_bytes


def test_one_engine_per_real_gpu() -> None:
    gpus = query_gpus()
    plans = plan_engines(Settings(), len(gpus))
    assert [p.cuda_visible_devices for p in plans] == [str(i) for i in range(len(gpus))]
