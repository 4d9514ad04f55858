"""The front never imports torch, transformers, pynvml, vLLM or llguidance (DESIGN.md §1)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

HEAVY = ("torch", "transformers", "pynvml", "vllm", "llguidance")

# A meta-path spy sees every import *attempt*, so the check holds even where the heavy packages
# are not installed (an `import torch` guarded by try/except would otherwise go unnoticed).
SPY = f"""
import sys
attempts = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            attempts.append(name)
        return None
sys.meta_path.insert(0, Spy())
import modelyard.cli.main, modelyard.front.app, modelyard.front.engines.supervisor
from modelyard.config import Settings
modelyard.front.app.create_app(Settings(scan_hf_cache=False))
print(",".join(attempts))
"""


def test_front_process_imports_no_heavy_stack() -> None:
    out = subprocess.run([sys.executable, "-c", SPY], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_spy_catches_an_attempt() -> None:
    code = SPY.replace("import modelyard.cli.main,", "import contextlib\nwith contextlib.suppress("
                       "ImportError):\n    import torch\nimport modelyard.cli.main,")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" in out.stdout


def test_lint_bans_heavy_imports() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    for module in HEAVY:
        assert f'"{module}".msg' in pyproject
