"""`tessera simulate --dashboard-file`: the live dashboard's frames on the virtual clock, thinned
past a bound, in one self-contained replay page."""

from __future__ import annotations

import json
import re
from itertools import pairwise

import pytest

from tessera.config import EngineArgs
from tessera.entrypoints.cli import main
from tessera.simulator.dashboard import DashboardFrames
from tessera.simulator.simulator import SimRequest, Simulator
from tests.simulator.sim_fakes import FixedCost


def _run(max_frames: int = 400, interval_s: float = 0.05, num: int = 12):
    config = EngineArgs(max_model_len=256, block_size=4, max_num_seqs=4).create_engine_config(256)
    sim = Simulator(config, FixedCost(per_step=0.01), 64, 16)
    frames = DashboardFrames(sim.scheduler, "fixed", interval_s=interval_s, max_frames=max_frames)
    requests = [SimRequest([k * 100 + i for i in range(20 + 4 * k)], 10, 0.02 * k)
                for k in range(num)]
    outcome = sim.run(requests, observer=frames)
    return outcome, frames, frames.finish()


def test_frames_follow_the_run():
    outcome, frames, out = _run()
    times = [f["time"] for f in out]
    assert times == sorted(times) and all(b - a >= 0.05 - 1e-9 for a, b in pairwise(times))
    assert out[-1]["time"] == pytest.approx(outcome.duration_s, abs=1e-9)
    assert max(f["queues"]["waiting"] for f in out) > 0  # 12 requests, 4 seats
    assert max(f["queues"]["running"] for f in out) == 4
    last = out[-1]
    assert (last["queues"]["running"], last["kv"]["num_used"]) == (0, 0)
    assert last["rates"]["num_finished"] > 0 and last["rates"]["ttft_p50_ms"] > 0
    # every step lands in exactly one frame
    assert sum(len(f["steps"]) for f in out) == outcome.num_steps
    assert [s["step"] for f in out for s in f["steps"]] == list(range(1, outcome.num_steps + 1))


def test_thinning_keeps_the_last_frame_and_every_step():
    outcome, frames, out = _run(max_frames=6, interval_s=0.01)
    assert len(out) <= 7 and frames.interval_s > 0.01
    assert out[-1]["time"] == pytest.approx(outcome.duration_s, abs=1e-9)
    steps = [s["step"] for f in out for s in f["steps"]]
    assert steps == sorted(steps) and steps[-1] == outcome.num_steps  # the latest, in order


def test_cli_writes_one_self_contained_page(tmp_path):
    html = tmp_path / "run.html"
    assert main(["simulate", "--dtype", "bfloat16", "--kv-cache-space", "10", "--dataset",
                 "random", "--num-prompts", "12", "--random-input-len", "48",
                 "--random-output-len", "6", "--request-rate", "20", "--quiet",
                 "--dashboard-file", str(html)]) == 0
    page = html.read_text(encoding="utf-8")
    for fetched in ("src=", 'href="http', "https://", "http://"):
        assert fetched not in page
    boot = json.loads(re.search(r'id="tessera-boot">(.*?)</script>', page, re.S).group(1))
    assert boot["mode"] == "replay" and "Llama-3-8B" in boot["frames"][0]["config"]["model"]
    assert sum(len(f["steps"]) for f in boot["frames"]) > 0
    with pytest.raises(SystemExit):
        main(["simulate", "--dataset", "random", "--num-prompts", "4", "--sweep",
              "--dashboard-file", str(html)])
