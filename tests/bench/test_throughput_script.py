"""benchmarks/throughput.py: `--num-requests` is the number that runs (no silent cap at W1's 64),
and the output says how many ran. The engine is stubbed: this checks the script, not the speed."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tessera.engine.step_times import StepTimes

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "throughput.py")


@pytest.fixture(scope="module")
def throughput():
    spec = importlib.util.spec_from_file_location("throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _w1() -> tuple[list[list[int]], list[int]]:
    """W1 as the figures in docs/ were measured on it (seed 0, 64 requests)."""
    rng = np.random.default_rng(0)
    in_lens, out_lens = rng.integers(64, 513, 64), rng.integers(16, 257, 64)
    return [rng.integers(100, 49000, n).tolist() for n in in_lens], [int(n) for n in out_lens]


def test_workload_has_the_requested_size_and_starts_with_w1(throughput):
    assert throughput.workload(64) == _w1()
    assert throughput.workload(10) == tuple(part[:10] for part in _w1())
    prompts, out_lens = throughput.workload(200)
    assert len(prompts) == len(out_lens) == 200
    assert (prompts[:64], out_lens[:64]) == _w1()
    assert prompts[64:128] != prompts[:64]  # a new draw, not W1 repeated
    assert all(64 <= len(p) <= 512 for p in prompts) and all(16 <= n <= 256 for n in out_lens)
    with pytest.raises(ValueError, match="--num-requests"):
        throughput.workload(0)


def test_main_runs_and_reports_every_request(throughput, monkeypatch, capsys):
    ran = {}

    def fake_run_tessera(prompts, out_lens, dtype, **engine_args):
        ran["num_prompts"] = len(prompts)
        step_times = StepTimes(num_steps=10, schedule=1.0, execute=8.0, update=1.0,
                               num_multi_token_steps=2, multi_token_execute=3.0)
        return (
            2.0,
            sum(out_lens),
            SimpleNamespace(llm_engine=SimpleNamespace(step_times=step_times)),
        )

    monkeypatch.setattr(throughput, "run_tessera", fake_run_tessera)
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--num-requests", "100", "--skip-hf"])
    throughput.main()
    assert ran["num_prompts"] == 100
    out = capsys.readouterr().out
    assert "float32: 100 requests, " in out
    assert "2 steps with prompt tokens 3.00s, 8 decode steps 5.00s" in out


def test_step_times_split_prompt_steps_from_decode_steps():
    st = StepTimes()
    st.record(0.1, 2.0, 0.1, num_tokens=300, num_reqs=3)  # prompt tokens
    st.record(0.1, 0.5, 0.1, num_tokens=3, num_reqs=3)  # one token a request: decode
    assert (st.num_steps, st.num_multi_token_steps) == (2, 1)
    assert st.multi_token_execute == 2.0 and st.execute == 2.5
