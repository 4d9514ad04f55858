"""Lint exceptions live in pyproject's [tool.ruff.lint.per-file-ignores], each with its reason,
not in inline comments scattered through the code (issue 16)."""

from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ROOT = Path(__file__).resolve().parents[2]
MARKER = "# " + "noqa"  # spelled in two parts so this file does not match itself


def test_no_inline_noqa() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("src", "tests", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if MARKER in line
    ]
    assert found == [], "use a per-file ignore in pyproject.toml instead: " + ", ".join(found)
