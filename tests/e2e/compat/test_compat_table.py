"""docs/compatibility.md's table says no more than the compatibility tests prove.

The table's cells read `supported`, `partial (why)`, `no (why)` or `n/a`. Every supported or
partial cell must be covered by a test (`@covers` in this folder's modules); every covered cell
must be claimed. The covering tests run in the same `make test`, so a claim that stops being
true fails there.
"""

from __future__ import annotations

import importlib
import re

import pytest
from tests.e2e.compat.table import APIS, COVERED
from tests.support import ROOT

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# Every module with `@covers` marks (the compatibility suite, and the tests of a feature's
# positive path that need a fake backend or a tiny model the suite's server does not have).
MODULES = [
    *(f"tests.e2e.compat.test_compat_{name}"
      for name in ("openai", "responses", "ollama", "anthropic", "langchain", "litellm")),
    "tests.e2e.compat.test_vision",
    "tests.e2e.compat.test_compat_embeddings_tokens",
    "tests.e2e.compat.test_ollama_context_demo",
    "tests.e2e.compat.test_ollama_long_chat",
    "tests.e2e.compat.test_ollama_pull_plain",
    "tests.integration.test_ollama_pull_names",
    "tests.integration.test_ollama_generation",
    "tests.integration.test_rerank_embed_kinds",
    "tests.integration.test_anthropic_api",
    "tests.unit.transformers.test_reranker",
    "tests.unit.test_openai_compat",
    "tests.integration.test_auth",
    "tests.e2e.compat.test_openai_fidelity_demo",
    "tests.e2e.compat.test_compat_openai_choices",
    "tests.integration.test_usage_api",
    "tests.integration.test_rate_limits_sdks",
    "tests.e2e.compat.test_compat_error_shapes",
    "tests.e2e.compat.test_compat_anthropic_stops",
    "tests.e2e.compat.test_compat_anthropic_clients",
]
DOC = ROOT / "docs" / "compatibility.md"


def read_table() -> dict[tuple[str, str], str]:
    """(feature, api) → the cell's first word, from the table under `## Feature table`."""
    text = DOC.read_text().split("## Feature table", 1)[1]
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[1:] == list(APIS), header
    cells: dict[tuple[str, str], str] = {}
    for row in rows[2:]:
        parts = [c.strip() for c in row.strip("|").split("|")]
        feature = parts[0]
        for api, cell in zip(APIS, parts[1:], strict=True):
            word = re.match(r"[a-z/]+", cell)
            assert word and word.group(0) in ("supported", "partial", "no", "n/a"), (feature, cell)
            cells[(feature, api)] = word.group(0)
    return cells


def test_every_claim_has_a_test_and_every_test_a_claim() -> None:
    for name in MODULES:
        importlib.import_module(name)
    claimed = {key for key, word in read_table().items() if word in ("supported", "partial")}
    assert claimed - COVERED.keys() == set(), "claimed in the table, proven by no test"
    assert COVERED.keys() - claimed == set(), "proven by a test, not claimed in the table"
