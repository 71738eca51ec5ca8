"""`tessera simulate --replay`: a real engine's step log, replayed through the real scheduler with
the logged step times, gives back the same schedule step by step and the same request times."""

from __future__ import annotations

import json

import pytest

from tessera.entrypoints.cli import main
from tessera.sampling.params import SamplingParams
from tessera.simulator.replay import compare, first_divergence, replay
from tessera.simulator.trace import read_trace
from tests.tiny_llama import save_tiny_llama

# prompts of 9..40 tokens; 24 output tokens each: at 20 blocks of 4 tokens the cache holds two
# or three of them at once, so the engine preempts
PROMPTS = [list(range(3 + k, 3 + k + 9 + 5 * (k % 7))) for k in range(8)]
SETTINGS = {
    "recompute": {"preemption_mode": "recompute"},
    "swap": {"preemption_mode": "swap", "swap_space": 0.001},
    "chunked-prefix": {"preemption_mode": "recompute", "enable_chunked_prefill": True,
                       "max_num_batched_tokens": 16, "enable_prefix_caching": True},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-replay")
    save_tiny_llama(str(path), num_kv_heads=2)
    return str(path)


def _llm(model: str, **engine):
    from tessera import LLM

    return LLM(model=model, block_size=4, max_model_len=64, num_gpu_blocks_override=20,
               **engine)


@pytest.fixture(scope="module")
def logs(tiny_model, tmp_path_factory):
    """A logged run per setting. Every third request stops on a token it produces itself (its
    10th greedy token, found by a run of its own first): the replay must end it there too."""
    probe = _llm(tiny_model)
    stops = {k: probe.generate([{"prompt_token_ids": PROMPTS[k]}], SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        .token_ids[-1] for k in range(0, len(PROMPTS), 3)}
    probe.llm_engine.shutdown()
    out = {}
    shared = list(range(200, 216))  # the prefix setting: every other prompt starts with it
    for name, engine in SETTINGS.items():
        path = str(tmp_path_factory.mktemp("logs") / f"{name}.jsonl")
        prompts = [shared + p if name == "chunked-prefix" and k % 2 else p
                   for k, p in enumerate(PROMPTS)]
        params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                 stop_token_ids=[stops[k]] if k in stops else None)
                  for k in range(len(prompts))]
        llm = _llm(tiny_model, **engine)
        llm.llm_engine.start_step_log(path)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.llm_engine.shutdown()
        out[name] = path
    return out


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_replayed_run_has_the_real_schedule_step_by_step(logs, name):
    trace = read_trace(logs[name])
    assert len(trace.arrivals) == len(PROMPTS)
    outcome = replay(trace)
    real = [s.schedule() for s in trace.steps]
    assert sum(len(p) for _, p in real) > 0, "the run must preempt for this test to mean much"
    assert outcome.steps == real  # same requests, token counts, contexts and preemptions
    assert first_divergence(trace.steps, outcome.steps) is None
    lengths = trace.final_lengths()
    assert len(lengths) == len(PROMPTS) and min(lengths.values()) <= 10 < 24 == max(
        lengths.values()), "every third request stops early on its stop token"
    report = compare(trace, outcome)
    assert report["num_requests"] == len(PROMPTS)
    assert report["num_preemptions"]["real"] == report["num_preemptions"]["simulated"] > 0
    assert report["misses"] == {"ttft": [], "e2el": []}
    for key in ("ttft", "e2el"):
        assert report["relative_error"][key]["p99"] < 0.05


def _replayed_shared_tokens(trace, monkeypatch) -> list[int]:
    """The shared context tokens the replay's runner counts in each step it prices."""
    from tessera.simulator.replay import ReplayRunner

    seen: list[int] = []
    execute = ReplayRunner.execute

    def counting(self, out):
        shape, result = execute(self, out)
        if out.total_num_scheduled_tokens:  # the steps a log holds
            seen.append(shape.num_shared_context_tokens)
        return shape, result

    monkeypatch.setattr(ReplayRunner, "execute", counting)
    replay(trace)
    return seen


def test_the_log_counts_shared_prefix_blocks_as_the_simulator_does(tiny_model, tmp_path, logs,
                                                                   monkeypatch):
    """Three requests on one 16-token prefix (4 blocks of 4), the later two hitting the first's
    cached blocks: the engine logs the blocks they share in each step (2 re-reads of 16 tokens
    while all three decode), and the replay's runner, following the same scheduler's messages,
    counts the same in every step."""
    from tessera import LLM

    llm = LLM(model=tiny_model, block_size=4, max_model_len=64, num_gpu_blocks_override=64,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    log = str(tmp_path / "prefix.jsonl")
    engine.start_step_log(log)
    prefix = list(range(200, 216))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prefix + [5, 6, 7]}, greedy)
    engine.step()
    engine.add_request("b", {"prompt_token_ids": prefix + [8, 9]}, greedy)
    engine.add_request("c", {"prompt_token_ids": prefix + [10]}, greedy)
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    trace = read_trace(log)
    logged = [s.num_shared_context_tokens for s in trace.steps]
    assert 2 * 16 in logged and all(n <= 2 * 16 for n in logged)
    assert _replayed_shared_tokens(trace, monkeypatch) == logged
    private = read_trace(logs["recompute"])  # distinct prompts: no block is shared
    assert {s.num_shared_context_tokens for s in private.steps} == {0}


def test_aborts_refusals_and_n_above_one_replay_too(tiny_model, tmp_path, monkeypatch):
    """A request refused as too long, one aborted mid-run, one with n = 2 (forked children),
    and a late arrival after the engine idled: the replay still has the real schedule."""
    llm = _llm(tiny_model, preemption_mode="recompute")
    engine = llm.llm_engine
    log = str(tmp_path / "events.jsonl")
    engine.start_step_log(log)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": list(range(3, 80))}, greedy)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, greedy)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, greedy)
    engine.add_request("two", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(
        n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("late", {"prompt_token_ids": PROMPTS[3]}, greedy)
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    trace = read_trace(log)
    assert [t for t, _ in trace.aborts] and "1_two" in trace.final_lengths()
    outcome = replay(trace)
    assert outcome.steps == [s.schedule() for s in trace.steps]
    report = compare(trace, outcome)
    assert report["first_divergence"] is None
    assert report["misses"] == {"ttft": [], "e2el": []}
    assert {r["request_id"] for r in report["requests"]} == {"a", "two", "late"}
    # the forked children read their prompt's blocks together; the replay counts the same
    logged = [s.num_shared_context_tokens for s in trace.steps]
    assert max(logged) > 0
    assert _replayed_shared_tokens(trace, monkeypatch) == logged


def test_a_divergence_is_found_and_named(logs):
    """Three fewer KV blocks: the scheduler admits and preempts otherwise, and the report says
    where."""
    trace = read_trace(logs["recompute"])
    trace.header = {**trace.header, "num_gpu_blocks": trace.header["num_gpu_blocks"] - 3}
    report = compare(trace, replay(trace))
    d = report["first_divergence"]
    assert d is not None and d["real"] != d["simulated"]


def test_simulate_replay_prints_and_writes_the_report(logs, tmp_path, capsys):
    result = tmp_path / "replay.json"
    assert main(["simulate", "--replay", logs["swap"], "--result-file", str(result)]) == 0
    out = capsys.readouterr().out
    assert "schedules: identical, step by step" in out
    assert "TTFT" in out and "E2E" in out and "preemptions: real" in out
    data = json.loads(result.read_text())
    assert data["first_divergence"] is None
    assert data["num_requests"] == len(PROMPTS) and len(data["requests"]) == len(PROMPTS)


def test_simulate_replay_refuses_what_it_would_ignore(logs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--replay", logs["swap"], "--no-enable-chunked-prefill"])
    assert "enable-chunked-prefill cannot be combined with it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--replay", logs["swap"], "--request-rate", "3"])
    assert "--request-rate cannot be combined" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"start": 1.0}\n')
    with pytest.raises(SystemExit):
        main(["simulate", "--replay", str(bad)])
    assert "not a step log" in capsys.readouterr().err


@pytest.mark.heavy  # a server and a simulate subprocess: ~30 s on 2 shared cores
def test_a_served_trace_replays_from_the_command_line(tiny_model, tmp_path):
    """`tessera serve --step-log F` (a real uvicorn subprocess) with requests sent while others
    run, then `tessera simulate --replay F` as a subprocess: the same schedule, every request
    within the tolerance."""
    import subprocess
    import sys
    import threading
    import time

    import httpx

    from tests.entrypoints.conftest import ServerProcess

    log, result = tmp_path / "served.jsonl", tmp_path / "replay.json"
    server = ServerProcess("--model", tiny_model, "--step-log", str(log), "--block-size", "4",
                           "--max-model-len", "64", "--num-gpu-blocks-override", "20",
                           "--preemption-mode", "recompute")
    try:
        def send(k: int) -> None:
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": PROMPTS[k], "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text

        threads = [threading.Thread(target=send, args=(k,)) for k in range(len(PROMPTS))]
        for t in threads:  # staggered: requests arrive while others run
            t.start()
            time.sleep(0.03)
        for t in threads:
            t.join()
    finally:
        server.stop()
    done = subprocess.run([sys.executable, "-m", "tessera.entrypoints.cli", "simulate",
                           "--replay", str(log), "--result-file", str(result)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "schedules: identical, step by step" in done.stdout, done.stdout
    data = json.loads(result.read_text())
    assert data["num_requests"] == len(PROMPTS)
    assert data["num_preemptions"]["real"] == data["num_preemptions"]["simulated"]
    assert data["misses"] == {"ttft": [], "e2el": []}, done.stdout
