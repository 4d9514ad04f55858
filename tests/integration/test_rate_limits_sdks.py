"""The official clients see modelyard's rate limits as their own: over a token's requests per
minute, the `openai` and `anthropic` SDKs raise their `RateLimitError` (with Retry-After) and
`ollama` a `ResponseError` with status 429 — so their retry logic and a user's `except` work
unchanged. A real front served in this process (tests/integration/test_rate_limits.py's), the
limiter's clock fixed inside one minute."""

from __future__ import annotations

from pathlib import Path

import anthropic
import ollama
import openai
import pytest
from tests.e2e.compat.table import covers
from tests.integration.test_rate_limits import Clock, front, put, user_token

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

FEATURE = "Rate limits (429 `rate_limited`, `Retry-After`, `X-RateLimit-*`)"


@covers(FEATURE, "OpenAI", "Ollama", "Anthropic")
async def test_each_sdk_raises_its_own_rate_limit_error(tmp_path: Path) -> None:
    async with front(tmp_path / "home", Clock()) as (http, _app):
        token_id, headers = await user_token(http, "carol")
        token = headers["Authorization"].removeprefix("Bearer ")
        r = await put(http, f"token:{token_id}", requests_per_minute=1)
        assert r.status_code == 200, r.text
        base = str(http.base_url).rstrip("/")
        messages = [{"role": "user", "content": "hi"}]

        oa = openai.AsyncOpenAI(base_url=base + "/v1", api_key=token, max_retries=0)
        with pytest.raises(openai.NotFoundError):  # admitted: no such model on this front
            await oa.chat.completions.create(model="m", messages=messages)
        with pytest.raises(openai.RateLimitError) as refused:
            await oa.chat.completions.create(model="m", messages=messages)
        assert refused.value.code == "rate_limited"
        assert int(refused.value.response.headers["retry-after"]) > 0
        assert refused.value.response.headers["x-ratelimit-limit"] == "1"

        an = anthropic.AsyncAnthropic(base_url=base, api_key=token, max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as refused_a:
            await an.messages.create(model="m", max_tokens=5,
                                     messages=messages)
        assert refused_a.value.status_code == 429

        ol = ollama.AsyncClient(host=base, headers={"Authorization": f"Bearer {token}"})
        with pytest.raises(ollama.ResponseError) as refused_o:
            await ol.chat(model="m", messages=messages)
        assert refused_o.value.status_code == 429
        assert "requests of this minute" in refused_o.value.error
