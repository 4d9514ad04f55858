"""Fixtures of the integration tier."""

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch directory shared by one module's tests (start logs, markers)."""
    return tmp_path_factory.mktemp("files")
