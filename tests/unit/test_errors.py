import pytest

from modelyard.errors import (
    ClientClosedRequest,
    ClientDisconnected,
    EngineUnavailable,
    InvalidRequest,
    ModelLoadFailed,
    ModelNotFound,
    VisionUnsupported,
    from_native_body,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_openai_shape_has_string_code_and_param() -> None:
    body = ModelNotFound("ghost").openai_body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "model"
    assert "ghost" in body["error"]["message"]


def test_ollama_and_native_shapes() -> None:
    err = InvalidRequest("messages: Input should be a valid list", param="messages")
    assert err.ollama_body() == {"error": "messages: Input should be a valid list"}
    native = err.native_body()
    assert native["error"] == "invalid_request" and native["param"] == "messages"
    assert native["retryable"] is False


def test_retry_after_header_and_log_tail() -> None:
    err = ModelLoadFailed("boom", model="m", retry_after_s=12.4, log_tail=["a", "b"])
    assert err.headers() == {"Retry-After": "12"}
    assert err.retryable
    assert err.full_message().endswith("a\nb")
    assert EngineUnavailable("down", retry_after_s=0.2).headers() == {"Retry-After": "1"}


@pytest.mark.parametrize(
    "err",
    [
        ModelNotFound("x"),
        ModelLoadFailed("failed", model="x", retry_after_s=3, log_tail=["line"]),
        InvalidRequest("bad", param="p"),
        EngineUnavailable("down", retry_after_s=2),
        VisionUnsupported.for_model("x"),
        ClientDisconnected("gone"),
    ],
)
def test_native_body_round_trips(err: Exception) -> None:
    assert hasattr(err, "native_body")
    rebuilt = from_native_body(err.native_body())
    assert type(rebuilt) is type(err)
    assert rebuilt.message == err.message
    assert rebuilt.retry_after_s == err.retry_after_s
    assert rebuilt.log_tail == err.log_tail


def test_client_mistakes_are_4xx_with_their_codes() -> None:
    vision = VisionUnsupported.for_model("tiny")
    assert vision.status == 400 and vision.param == "messages"
    assert vision.openai_body()["error"]["code"] == "vision_unsupported"
    assert vision.openai_body()["error"]["type"] == "invalid_request_error"
    gone = ClientDisconnected("the client left")
    assert isinstance(gone, ClientClosedRequest)
    assert gone.status == 499 and gone.native_body()["error"] == "client_disconnected"
