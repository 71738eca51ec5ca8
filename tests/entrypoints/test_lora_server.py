"""`tessera serve --enable-lora --lora-modules NAME=PATH` as a user runs it: the `openai` client's
output for `model=NAME` equals HF + PEFT's greedy tokens; /v1/models lists the adapters with their
parent; an unknown name is a 404; adapters load and unload at runtime
(--allow-runtime-lora-updating), a bad path is a 400 and the server keeps serving; /metrics has
tessera:lora_requests_info. One server for the module."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

pytest.importorskip("peft", reason="the LoRA tests build their adapters with peft (dev extra)")
openai = pytest.importorskip("openai")

from lora_adapters import ADAPTERS, hf_greedy, save_peft_adapter  # noqa: E402
from tiny_llama import save_tiny_llama_with_tokenizer  # noqa: E402

from .conftest import ServerProcess  # noqa: E402

PROMPT = "The capital of France is"
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model_path):
    """(base path, {name: (adapter path, expected text)})."""
    from tessera.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("lora-server")
    base_path = str(root / "base")
    base = save_tiny_llama_with_tokenizer(base_path, default_model_path)
    tokenizer = load_tokenizer(base_path)
    prompt_ids = tokenizer.encode(PROMPT)
    result = {}
    for i, (name, (targets, r, alpha, rslora)) in enumerate(sorted(ADAPTERS.items())):
        path = str(root / name)
        model = save_peft_adapter(base, path, targets, r, alpha, rslora, seed=10 + i)
        result[name] = (path, tokenizer.decode(hf_greedy(model, prompt_ids, NUM_TOKENS)))
    base_text = tokenizer.decode(hf_greedy(base, prompt_ids, NUM_TOKENS))
    assert all(text != base_text for _, text in result.values())
    return base_path, result


@pytest.fixture(scope="module")
def server(adapters):
    base, ads = adapters
    srv = ServerProcess("--model", base, "--max-model-len", "256", "--enable-lora",
                        "--max-loras", "2", "--max-lora-rank", "16",
                        "--lora-modules", f"all7={ads['all7'][0]}",
                        f'{{"name": "qv", "path": "{ads["qv"][0]}"}}',
                        "--allow-runtime-lora-updating")
    try:
        yield srv
    finally:
        srv.stop()


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                    temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_openai_client_with_adapters_matches_hf_peft(server, adapters):
    base, ads = adapters
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    for name in ("all7", "qv"):
        assert _complete(client, name) == ads[name][1], name
    models = {m.id: m for m in client.models.list().data}
    base_name = [k for k, m in models.items() if getattr(m, "parent", None) is None][0]
    assert {k: getattr(m, "parent", None) for k, m in models.items()} == {
        base_name: None, "all7": base_name, "qv": base_name}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _complete(client, "no-such-adapter")
    chat = client.chat.completions.create(
        model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert chat.model == "qv"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'tessera:lora_requests_info{' in metrics and 'max_lora="2"' in metrics


def test_load_and_unload_at_runtime(server, adapters, tmp_path):
    _, ads = adapters
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        bad = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "bad", "lora_path": str(tmp_path / "missing")})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "lora_path"
        assert _complete(client, "all7") == ads["all7"][1]  # still serving
        dup = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "qv", "lora_path": ads["mlp_rs"][0]})
        assert dup.status_code == 400 and "already" in dup.json()["error"]["message"]
        ok = http.post("/v1/load_lora_adapter",
                       json={"lora_name": "mlp", "lora_path": ads["mlp_rs"][0]})
        assert ok.status_code == 200, ok.text
        assert _complete(client, "mlp") == ads["mlp_rs"][1]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            _complete(client, "mlp")
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 404


def test_lora_flags_need_enable_lora():
    proc = subprocess.run(
        [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--lora-modules", "a=/x"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--lora-modules needs --enable-lora" in proc.stderr
