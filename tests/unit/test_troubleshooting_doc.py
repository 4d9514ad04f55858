"""docs/troubleshooting.md explains every error code modelyard can return: a new code without an
entry there fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from modelyard import errors

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "troubleshooting.md"
SRC = ROOT / "src" / "modelyard"


def _codes_in_source() -> dict[str, str]:
    """`code = "…"` in the body of every class under src/modelyard → where it is defined
    (read from the source, so nothing heavy is imported)."""
    found: dict[str, str] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                target, value = None, None
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    target, value = stmt.targets[0], stmt.value
                elif isinstance(stmt, ast.AnnAssign):
                    target, value = stmt.target, stmt.value
                if (isinstance(target, ast.Name) and target.id == "code"
                        and isinstance(value, ast.Constant) and isinstance(value.value, str)):
                    found[value.value] = f"{path.relative_to(ROOT)}:{node.name}"
    return found


def _error_classes(cls: type[errors.ModelyardError]) -> list[type[errors.ModelyardError]]:
    """`cls` and its subclasses defined by modelyard (not by a test) that are imported now."""
    subs = [c for sub in cls.__subclasses__() for c in _error_classes(sub)]
    return [c for c in (cls, *subs) if c.__module__.startswith("modelyard.")]


def test_the_scan_finds_every_code_of_the_error_tree() -> None:
    found = _codes_in_source()
    assert {c.code for c in _error_classes(errors.ModelyardError)} <= found.keys()
    assert {"user_not_found", "token_not_found"} <= found.keys()  # module-local ones too


def test_every_error_code_is_in_the_troubleshooting_doc() -> None:
    text = DOC.read_text()
    missing = {code: where for code, where in _codes_in_source().items()
               if f"`{code}`" not in text}
    assert not missing, f"add these codes to docs/troubleshooting.md: {missing}"


def test_every_code_has_a_row_in_the_table_with_its_status() -> None:
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
            for line in DOC.read_text().splitlines() if line.startswith("| `")}
    for cls in _error_classes(errors.ModelyardError):
        assert rows.get(cls.code) == str(cls.status), (cls.__name__, rows.get(cls.code))
