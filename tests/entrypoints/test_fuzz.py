"""schemathesis over the app's own OpenAPI schema, both POST endpoints: whatever a client sends,
valid or not, the answer is never a 5xx and always comes within a timeout.

Against the fake engine (many examples, fast) and, marked slow, against the real model served by
`tessera serve --max-model-len 48` (few examples; the short context bounds every request's work)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.openai.server import build_app

from .conftest import ServerProcess, serve_fake
from .fake_engine import FakeEngine

schemathesis = pytest.importorskip("schemathesis")  # a dev dependency

SCHEMA = schemathesis.openapi.from_dict(
    build_app(AsyncLLMEngine(FakeEngine())).openapi()).include(method="POST")
# /v1/responses runs on the chat path, which the real engine is fuzzed through already; against
# the real model it would double this test's time for little more coverage
REAL_SCHEMA = SCHEMA.exclude(path="/v1/responses")
TIMEOUT_S = 60  # per request: a hang fails the test instead of stalling the suite


@pytest.fixture(scope="module")
def fake_server():
    srv, _ = serve_fake(max_model_len=64)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def real_server():
    server = ServerProcess("--max-model-len", "48", "--max-num-seqs", "8")
    yield server
    assert server.stop() == 0


def _check(case, url: str) -> None:
    response = case.call(base_url=url, timeout=TIMEOUT_S)
    assert response.status_code < 500, f"{case.body!r} -> {response.status_code} {response.text}"
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@SCHEMA.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_fake_engine(case, fake_server):
    _check(case, fake_server.url)


@REAL_SCHEMA.parametrize()
# random cases only, no shrinking: each real request costs real decode steps, and schemathesis'
# boundary-value phase alone is ~600 requests (it runs against the fake engine above; the
# boundary sampling values are also sent to the real model in test_openai_server.py)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
def test_fuzz_real_engine(case, real_server):
    _check(case, real_server.url)
