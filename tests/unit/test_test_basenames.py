"""No two test modules share a file name: pytest imports them by basename (rootdir mode, no
__init__.py), so a second `test_x.py` in another folder stops the whole collection with
"import file mismatch" — caught here in the unit tier instead of by CI's full run."""

from __future__ import annotations

from collections import Counter

import pytest
from tests.support import ROOT

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_test_module_names_are_unique() -> None:
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
