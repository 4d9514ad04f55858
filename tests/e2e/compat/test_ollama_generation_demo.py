"""End to end, issue 18's Ollama generation fields on the real llama-server and demo model,
driven by the official `ollama` client: a true `prompt_eval_count` when llama-server reuses its
prompt cache, `think` refused for a model without thinking, `options.num_ctx` beyond the
configured context served by a larger instance.

One modelyard server is shared by the module (the demo model at a 256-token context, so that a
prompt beyond it stays cheap to evaluate on a small CPU).
"""

from __future__ import annotations

from collections.abc import Iterator

import ollama
import pytest
from tests.support import Server, require_e2e_artifact

from modelyard.config import DEMO_MODEL_FILE, Settings, cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_e2e_artifact(Settings().resolve_llama_server(), "llama-server")
    gguf = require_e2e_artifact(cache_dir() / "models" / DEMO_MODEL_FILE, "the demo model")
    home = tmp_path_factory.mktemp("e2e-home")
    (home / "models").mkdir()
    (home / "models" / DEMO_MODEL_FILE).symlink_to(gguf)
    srv = Server(home, {"scan_hf_cache": False, "default_ctx_size": 256})
    try:
        srv.wait_healthy(90)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=200)


def test_prompt_eval_count_is_the_whole_prompt_when_cached(client: ollama.Client) -> None:
    """The same chat twice: llama-server reuses the cached prompt the second time, and
    `prompt_eval_count` still counts all of it (it read 1 before)."""
    options = {"num_predict": 4, "temperature": 0}
    first = client.chat(model="smollm2", messages=PROMPT, options=options)
    second = client.chat(model="smollm2", messages=PROMPT, options=options)
    assert first.prompt_eval_count is not None and first.prompt_eval_count > 10
    assert second.prompt_eval_count == first.prompt_eval_count
    streamed = list(client.chat(model="smollm2", messages=PROMPT, options=options, stream=True))
    assert streamed[-1].prompt_eval_count == first.prompt_eval_count


def test_think_on_a_model_without_thinking_is_a_400(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="smollm2", messages=PROMPT, think=True)
    assert err.value.status_code == 400
    assert err.value.error == '"smollm2" does not support thinking'
    # think false asks nothing of the model: answered
    off = client.chat(model="smollm2", messages=PROMPT, think=False, options={"num_predict": 2})
    assert off.message.content is not None and not off.message.thinking


def test_num_ctx_beyond_the_context_is_served(client: ollama.Client) -> None:
    """A ~350-token prompt does not fit the configured 256 tokens; with num_ctx 512 a larger
    llama-server (the context variant smollm2@ctx512) answers it."""
    long = [{"role": "user", "content": "apple banana cherry " * 100 + "Which fruit?"}]
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="smollm2", messages=long, options={"num_predict": 1})
    assert err.value.status_code == 400
    answer = client.chat(model="smollm2", messages=long,
                         options={"num_predict": 1, "num_ctx": 512})
    assert answer.prompt_eval_count is not None and answer.prompt_eval_count > 256


def test_generate_template_raw_and_suffix(client: ollama.Client) -> None:
    """`template` and `raw` prompts reach llama-server's completion endpoint; `suffix` on the
    demo model (no fill-in-the-middle tokens) is Ollama's 400."""
    options = {"num_predict": 3, "temperature": 0}
    templated = client.generate(
        model="smollm2", prompt="Name a colour.", system="Answer in one word.", options=options,
        template="<|im_start|>system\n{{ .System }}<|im_end|>\n<|im_start|>user\n{{ .Prompt }}"
                 "<|im_end|>\n<|im_start|>assistant\n{{ .Response }}<|im_end|>")
    assert templated.response and templated.eval_count == 3
    assert templated.prompt_eval_count is not None and templated.prompt_eval_count > 10
    raw = client.generate(model="smollm2", prompt="The sky is", raw=True, options=options)
    assert raw.response and raw.prompt_eval_count is not None and raw.prompt_eval_count <= 5
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="smollm2", prompt="def add(a, b):", suffix="return c")
    assert err.value.status_code == 400 and err.value.error == "model does not support insert"
