"""`LLMEngine` around a fake executor (no model): the loop, n > 1, prompt logprobs in chunks,
counters, and the messages crossing a process boundary."""

from __future__ import annotations

import multiprocessing
import pickle
import zlib

import pytest

from tessera.config import EngineArgs
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.engine.llm_engine import LLMEngine
from tessera.executor.abstract import Executor
from tessera.sampling.params import RequestOutputKind, SamplingParams

VOCAB = 256
EOS = 3


class CharTokenizer:
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


class FakeExecutor(Executor):
    """A runner that keeps only what the messages tell it and "samples" from a hash of a
    request's tokens (a child's first token is offset by its index)."""

    def __init__(self, num_gpu_blocks: int = 64, num_cpu_blocks: int = 64) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.tokens: dict[str, list[int]] = {}
        self.prompt_logprobs: dict[str, int | None] = {}
        self.messages: list[SchedulerOutput] = []

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.messages.append(out)
        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.prompt_logprobs[new.req_id] = new.sampling_params.prompt_logprobs
        result = ModelRunnerOutput()
        for diff in out.scheduled_cached_reqs:
            self.tokens[diff.req_id] += diff.new_token_ids
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed |= {r.req_id: r.num_computed_tokens for r in out.scheduled_cached_reqs}
        for req_id, n in out.num_scheduled_tokens.items():
            tokens, start = self.tokens[req_id], computed[req_id]
            if self.prompt_logprobs[req_id] is not None and start + 1 < len(tokens):
                targets = tokens[start + 1 : start + n + 1]
                result.prompt_logprobs[req_id] = (start + 1, [{t: -float(t)} for t in targets])
            if start + n == len(tokens):
                base = 97 + zlib.crc32(bytes(tokens[-4:])) % 26
                picks = [base + k for k in range(out.num_samples.get(req_id, 1))]
                result.req_ids.append(req_id)
                result.sampled_token_ids.append(picks)
                result.logprobs.append([{t: -0.5} for t in picks])
        return result


def make_engine(executor: FakeExecutor | None = None, **args) -> LLMEngine:
    config = EngineArgs(max_model_len=128, block_size=4, **args).create_engine_config(128)
    return LLMEngine(config, executor or FakeExecutor(), CharTokenizer(), (EOS,), VOCAB)


def run(engine: LLMEngine) -> dict:
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("engine made no progress")


def test_n_children_share_the_prompt_and_finish_together():
    executor = FakeExecutor()
    engine = make_engine(executor)
    engine.add_request("r", "hello world", SamplingParams(n=3, max_tokens=5, temperature=1.0))
    out = run(engine)["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    assert len({c.token_ids[0] for c in out.outputs}) == 3  # n first tokens, one per stream
    # the prompt was computed once: 11 prompt tokens scheduled in all
    assert engine.get_metrics()["tessera:prompt_tokens_total"] == 11
    assert engine.get_metrics()["tessera:generation_tokens_total"] == 15
    first = executor.messages[0]
    assert first.num_samples == {"r": 3} and first.num_scheduled_tokens == {"r": 11}
    children = [r.req_id for m in executor.messages for r in m.scheduled_new_reqs]
    assert children == ["r", "1_r", "2_r"]
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 64


def test_prompt_logprobs_arrive_in_chunks_and_once():
    engine = make_engine(enable_chunked_prefill=True, max_num_batched_tokens=8)
    prompt = "abcdefghijklmnopqrst"  # 20 tokens: 3 chunks
    engine.add_request("p", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
    out = run(engine)["p"]
    assert out.prompt_logprobs[0] is None
    assert [next(iter(d)) for d in out.prompt_logprobs[1:]] == [ord(c) for c in prompt[1:]]
    assert len(out.prompt_logprobs) == len(prompt)


def test_counters_and_stop_strings_finish_through_the_scheduler():
    engine = make_engine()
    engine.add_request("free", "xyz", SamplingParams(max_tokens=20))
    text = run(engine)["free"].outputs[0].text
    stop = text[6:8]
    cut = text.find(stop)
    engine.add_request("a", "xyz", SamplingParams(max_tokens=4))
    engine.add_request("s", "xyz", SamplingParams(max_tokens=50, stop=[stop]))
    finals = run(engine)
    assert len(finals["a"].outputs[0].token_ids) == 4
    s = finals["s"].outputs[0]
    assert (s.finish_reason, s.stop_reason, s.text) == ("stop", stop, text[:cut])
    assert len(s.token_ids) == cut + len(stop)  # the scheduler stopped it at the match
    metrics = engine.get_metrics()
    assert metrics["tessera:prompt_tokens_total"] == 9
    assert metrics["tessera:num_requests_running"] == 0
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 64


def test_delta_outputs_concatenate_to_the_final_one():
    engine = make_engine()
    engine.add_request(
        "d", "hello", SamplingParams(max_tokens=12, output_kind=RequestOutputKind.DELTA)
    )
    engine.add_request(
        "f", "hello", SamplingParams(max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY)
    )
    texts, tokens, finals = [], [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "d":
                texts.append(out.outputs[0].text)
                tokens += out.outputs[0].token_ids
            if out.finished:
                finals[out.request_id] = out
    assert (
        "".join(texts) == finals["f"].outputs[0].text and tokens == finals["f"].outputs[0].token_ids
    )
    assert len(texts) > 1


def test_prefix_cache_hits_are_reported_per_request():
    engine = make_engine(enable_prefix_caching=True)
    prompt = "abcdefghij"  # 10 tokens: 2 full blocks of 4
    engine.add_request("first", prompt, SamplingParams(max_tokens=2))
    run(engine)
    engine.add_request("second", prompt, SamplingParams(max_tokens=2))
    out = run(engine)["second"]
    assert out.num_cached_tokens == 8
    assert engine.get_metrics()["tessera:prompt_tokens_total"] == 10 + 2


def test_never_fitting_request_finishes_at_once_with_its_reason():
    engine = make_engine()
    engine.add_request("big", "x" * 200, SamplingParams())
    [out] = engine.step()
    assert out.finished and out.outputs == [] and "max_model_len 128" in out.error


def test_abort_frees_and_tells_the_runner():
    executor = FakeExecutor()
    engine = make_engine(executor)
    engine.add_request("a", "hello", SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    engine.add_request("b", "hi", SamplingParams(max_tokens=1))
    engine.step()
    assert executor.messages[-1].finished_req_ids == ["a"] and "a" not in executor.tokens


def _roundtrip(blob: bytes, queue) -> None:
    queue.put(pickle.dumps(pickle.loads(blob)))


@pytest.mark.parametrize("which", ["scheduler", "runner"])
def test_messages_pickle_into_another_process(which):
    executor = FakeExecutor()
    engine = make_engine(executor, enable_chunked_prefill=True, max_num_batched_tokens=8)
    engine.add_request("m", "hello world!", SamplingParams(n=2, seed=7, max_tokens=3, logprobs=2))
    engine.step()
    engine.step()
    sched_out = executor.messages[-1]
    message = sched_out if which == "scheduler" else executor.execute_model(sched_out)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_roundtrip, args=(pickle.dumps(message), queue))
    proc.start()
    try:
        back = pickle.loads(queue.get(timeout=60))
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert back == message and type(back) is type(message)


def test_limits_that_need_the_model_are_checked_when_added():
    engine = make_engine(max_logprobs=5)
    with pytest.raises(ValueError, match=r"^logprobs must be at most 5"):
        engine.add_request("a", "hi", SamplingParams(logprobs=6))
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be at most 5"):
        engine.add_request("b", "hi", SamplingParams(prompt_logprobs=6))
    engine.add_request("c", "hi", SamplingParams(logprobs=5, top_k=2**31 - 1, temperature=1.0))
    # a top_k above the vocabulary is off; clamped, so no wider integer reaches the runner
    assert engine.scheduler._groups["c"].sampling_params.top_k == VOCAB
    assert run(engine)["c"].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="--max-logprobs"):
        EngineArgs(max_logprobs=-1).create_engine_config()


def test_n_that_could_outgrow_the_cache_is_refused_when_added():
    # 16 blocks of 4 tokens; 4 sequences of up to 11 + 5 = 16 tokens need 4 x 4 blocks: fits
    engine = make_engine(FakeExecutor(num_gpu_blocks=16))
    engine.add_request("ok", "hello world", SamplingParams(n=4, max_tokens=5, temperature=1.0))
    with pytest.raises(ValueError, match=r"^n must be at most 4 .* lower n or max_tokens"):
        engine.add_request("big", "hello world", SamplingParams(n=5, max_tokens=5, temperature=1))
    assert len(run(engine)["ok"].outputs) == 4


def test_step_log_records_the_trace_and_each_step(tmp_path, monkeypatch):
    """The step log (tessera/engine/step_log.py; TESSERA_STEP_LOG turns it on for any engine):
    a header with the configs, each arrival with its prompt ids, one line per step with each
    stream's (req_id, new, computed) tokens, the tokens it gained and where it finished, the
    engine's busy flag false only after the last step, and aborts."""
    import json

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TESSERA_STEP_LOG", str(log))
    engine = make_engine()
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    run(engine)
    engine.add_request("b", [9, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.abort_request("b")
    engine.shutdown()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    header, arrival = records[0], records[1]
    assert header["type"] == "header" and header["version"] == 1
    assert header["num_gpu_blocks"] == engine.scheduler.block_manager.num_gpu_blocks
    assert header["scheduler"]["max_model_len"] == 128 and header["cache"]["block_size"] == 4
    assert arrival["type"] == "arrival" and arrival["request_id"] == "a"
    assert arrival["prompt_token_ids"] == [5, 6, 7, 8] and arrival["max_tokens"] == 3
    assert arrival["arrival_time"] <= arrival["time"]
    steps = [r for r in records if r["type"] == "step"]
    assert [s["reqs"] for s in steps] == [[["a", 4, 0]], [["a", 1, 4]], [["a", 1, 5]],
                                          [["b", 2, 0]]]
    assert [s["busy"] for s in steps] == [True, True, False, True]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(len(s["tokens"]["a"]) == 1 for s in steps[:3])
    assert [s["finished"] for s in steps] == [{}, {}, {"a": 3}, {}]
    assert all(s["start"] <= s["end"] for s in steps)
    assert steps[0]["end"] <= steps[1]["start"]
    assert records[-1]["type"] == "abort" and records[-1]["request_ids"] == ["b"]
