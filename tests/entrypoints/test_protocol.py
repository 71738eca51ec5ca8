"""The HTTP request models alone (pydantic, no server, no torch): strict types, ranges, and no
unknown fields, so a bad request fails before it reaches the engine. Part of `make test-fast`."""

import pytest
from pydantic import ValidationError

from tessera.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def test_a_plain_completion_request_takes_the_defaults():
    req = CompletionRequest.model_validate({"prompt": "hi"})
    assert (req.n, req.max_tokens, req.stream, req.min_tokens) == (1, 16, False, 0)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", 2.5), ("top_p", 0), ("max_tokens", 0), ("min_p", 1.5),
    ("repetition_penalty", 0), ("stop", [""]), ("unknown_field", 1), ("max_tokens", "16"),
    ("temperature", float("nan")), ("prompt", []), ("prompt", [[-1]]),
])
def test_out_of_range_unknown_or_mistyped_fields_are_refused(field, value):
    body = {"prompt": "hi", field: value}
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate(body)
    assert field in str(err.value)


def test_a_chat_request_needs_messages():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m"})
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert req.messages[0].content == "hi"
