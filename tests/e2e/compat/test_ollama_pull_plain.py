"""`ollama.pull` of a plain name against modelyard on its embedded defaults: the demo model is
here, so `smollm2` (with or without `:latest`) is pulled at once, as Ollama answers for a model
it has; a name neither here nor in the library table is a 404 naming the Hub form
(front/api/pulls.py). Pulling a library name from the Hub: tests/integration/
test_ollama_pull_names.py, against the fake Hub."""

from __future__ import annotations

import ollama
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def admin(compat_server: Server) -> ollama.Client:
    # Pulls are an admin's (docs/security.md): a loopback client sends the admin token.
    return ollama.Client(host=compat_server.url, timeout=60, headers=compat_server.admin_headers)


@covers("Pull (`/api/pull`)", "Ollama")
def test_pulling_the_demo_model_by_its_plain_name_is_success_at_once(
        admin: ollama.Client) -> None:
    assert admin.pull("smollm2").status == "success"
    assert admin.pull("smollm2:latest").status == "success"
    statuses = [p.status for p in admin.pull("smollm2", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"


@covers("Pull (`/api/pull`)", "Ollama")
def test_an_unknown_plain_name_is_a_404(admin: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        admin.pull("no-such-model:13b")
    assert err.value.status_code == 404
    assert "hf.co/<org>/<repo>[:quant]" in err.value.error
