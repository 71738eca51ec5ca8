"""Server flags a vLLM user types: a positional model, --chat-template, --generation-config,
--allowed-origins (CORS), --root-path and --enable-log-requests, on the fake engine."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.cli import build_parser, engine_args_from, read_chat_template
from tessera.entrypoints.openai.generation_config import load_sampling_defaults
from tessera.entrypoints.openai.server import build_app

from .conftest import UvicornThread
from .fake_engine import FakeEngine


def test_positional_model_and_flags_parse(tmp_path):
    args = build_parser().parse_args([
        "serve", "/models/x.gguf", "--allowed-origins", '["http://a.example"]',
        "--root-path", "/api", "--enable-log-requests", "--uvicorn-log-level", "warning",
        "--generation-config", "vllm"])
    assert engine_args_from(args).model == "/models/x.gguf"
    assert args.allowed_origins == ["http://a.example"] and args.root_path == "/api"
    assert args.enable_log_requests and args.uvicorn_log_level == "warning"


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 77, "eos_token_id": 2}))
    assert load_sampling_defaults("auto", str(tmp_path)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 77}
    assert load_sampling_defaults("vllm", str(tmp_path)) == {}
    assert load_sampling_defaults("auto", str(tmp_path / "model.gguf")) == {}
    assert load_sampling_defaults(str(tmp_path), "/elsewhere")["top_k"] == 20
    with pytest.raises(ValueError, match="--generation-config"):
        load_sampling_defaults(str(tmp_path / "missing"), "/elsewhere")


def test_chat_template_file_or_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template("no/such/file.jinja")


def serve(**options):
    engine = FakeEngine()
    return UvicornThread(build_app(AsyncLLMEngine(engine), **options)), engine


def test_sampling_defaults_fill_only_unset_fields():
    srv, engine = serve(sampling_defaults={"temperature": 0.3, "top_k": 7, "max_tokens": 5})
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, prompt, params, **kw: (seen.append(params),
                                                             add(rid, prompt, params, **kw))
    with srv:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 200
        assert httpx.post(srv.url + "/v1/chat/completions",
                          json={**body, "temperature": 1.0, "max_tokens": 3}).status_code == 200
    first, second = seen
    assert (first.temperature, first.top_k, first.max_tokens) == (0.3, 7, 5)
    assert (second.temperature, second.top_k, second.max_tokens) == (1.0, 7, 3)


def test_cors_root_path_and_request_log(caplog):
    srv, _ = serve(allowed_origins=["http://a.example"], root_path="/api", log_requests=True)
    with srv, caplog.at_level(logging.INFO, logger="tessera.entrypoints.openai.serving_engine"):
        r = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "http://a.example", "Access-Control-Request-Method": "POST"})
        assert r.headers["access-control-allow-origin"] == "http://a.example"
        r = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers
        assert "/api/openapi.json" in httpx.get(srv.url + "/docs").text
        # a proxy that forwards the prefix reaches the same routes
        assert httpx.get(srv.url + "/api/v1/models").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    assert any("prompt(s)" in rec.message for rec in caplog.records)
