"""`tessera serve --tensor-parallel-size 2` as a user runs it: the `openai` client against the
real server in a subprocess; a worker killed under load makes the server fail the request and
exit non-zero with no process left; and two "nodes" (two launches on loopback) serve as one.
Outputs are compared with the same checkpoint run by TP=1 in this process (greedy)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from tiny_llama import save_tiny_llama_with_tokenizer

from tessera import LLM, SamplingParams

from .conftest import ServerProcess, free_port

pytestmark = pytest.mark.heavy

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("tiny-tp-server")
    save_tiny_llama_with_tokenizer(str(path), default_model_path)
    return str(path)


@pytest.fixture(scope="module")
def expected_text(tiny_path):
    llm = LLM(model=tiny_path, max_model_len=256)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].text


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _ranks(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The worker ranks among a server's descendants (not multiprocessing's resource tracker)."""
    return [p for p in procs if p.is_running() and "spawn_main" in " ".join(p.cmdline())]


def _assert_gone(procs: list[psutil.Process], timeout: float = 15) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def test_openai_client_against_tp2_server(tiny_path, expected_text):
    openai = pytest.importorskip("openai")
    srv = ServerProcess("--model", tiny_path, "-tp", "2", "--max-model-len", "256")
    workers = _descendants(srv.proc.pid)
    try:
        assert len(_ranks(workers)) == 2, workers
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected_text
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected_text
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0)
        assert chat.choices[0].message.content is not None
    finally:
        code = srv.stop()
        _assert_gone(workers)
    assert code == 0, srv.output() if not srv.log.closed else code


def test_killed_worker_fails_the_request_and_the_server_exits_nonzero(tiny_path):
    srv = ServerProcess("--model", tiny_path, "-tp", "2", "--max-model-len", "512")
    workers = _descendants(srv.proc.pid)
    result: dict = {}

    def long_request() -> None:
        try:
            r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "temperature": 0})
            result["status"], result["body"] = r.status_code, r.text
        except httpx.HTTPError as e:
            result["error"] = repr(e)

    try:
        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(2.0)
        _ranks(workers)[-1].kill()
        t0 = time.monotonic()
        code = srv.proc.wait(60)  # exits by itself: no hang
        assert time.monotonic() - t0 < 60
        t.join(30)
        output = srv.output()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        _assert_gone(workers)
        srv.stop()
    assert code != 0, output
    assert "died with exit code -9" in output, output
    # the request in flight failed with a server error, or its connection dropped as it exited
    assert result.get("status", 500) >= 500 or "error" in result, result


def test_two_nodes_on_loopback(tiny_path, expected_text):
    """Node 1 runs only worker ranks and needs no model flags: rank 0 sends it the settings."""
    init = f"tcp://127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "-tp", "2", "--nnodes", "2",
         "--node-rank", "1", "--distributed-init-method", init],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = None
    workers: list[psutil.Process] = []
    try:
        srv = ServerProcess("--model", tiny_path, "-tp", "2", "--nnodes", "2", "--node-rank",
                            "0", "--distributed-init-method", init, "--max-model-len", "256")
        workers = _descendants(srv.proc.pid) + _descendants(node1.pid)
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_text
        assert srv.stop() == 0
        assert node1.wait(30) == 0  # rank 0 told node 1's ranks to stop
    finally:
        if srv is not None and srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
        if node1.poll() is None:
            os.kill(node1.pid, signal.SIGKILL)
            node1.wait()
        node1.stdout.close()
        _assert_gone(workers)


def test_worker_killed_while_idle_stops_the_server(tiny_path):
    srv = ServerProcess("--model", tiny_path, "-tp", "2", "--max-model-len", "256")
    workers = _descendants(srv.proc.pid)
    try:
        _ranks(workers)[-1].kill()
        code = srv.proc.wait(30)  # noticed without any request
        output = srv.output()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        _assert_gone(workers)
        srv.stop()
    assert code != 0 and "died with exit code -9" in output, output
