"""pytest's default import mode needs every test module basename to be unique.

Two `test_x.py` in different folders pass when run one folder at a time and break
collection of the whole suite ("import file mismatch"), so guard it here.
"""

from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
