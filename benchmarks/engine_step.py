"""The engine's own cost per step, without a model: `LLMEngine.step()` over a fake runner that
answers instantly, at 256 running requests (all decoding) and a waiting queue. This is everything
the boundary adds or removes: scheduling, the messages, the runner-side bookkeeping a real runner
would do, `update_from_output` and the output processor (no tokenizer, so no detokenization).

    .venv/bin/python benchmarks/engine_step.py [--steps 200] [--repeats 5]

Run it in a checkout of the previous commit too (`git worktree add /tmp/base <commit>`;
`PYTHONPATH=/tmp/base python /tmp/base/benchmarks/engine_step.py` if it has the file, else point
this script at it with PYTHONPATH): it detects the older engine (runner.execute with seq_id-keyed
samples) and drives that instead. CPU time of this process, best of the repeats.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from types import SimpleNamespace

from tessera.config import EngineArgs
from tessera.engine.llm_engine import LLMEngine
from tessera.sampling.params import SamplingParams

try:  # the core-boundary engine
    from tessera.core.runner_output import ModelRunnerOutput
    from tessera.executor.abstract import Executor

    NEW = True
except ImportError:  # the engine before it
    NEW = False


def _new_executor(num_blocks: int):
    # the simulator's runner: token lengths from the messages alone, one token a request
    from tessera.simulator.batch import SyntheticRunner

    class FakeExecutor(Executor):
        def __init__(self) -> None:
            self.num_gpu_blocks, self.num_cpu_blocks = num_blocks, 0
            self.runner = SyntheticRunner(block_bytes=0)

        def execute_model(self, out) -> ModelRunnerOutput:
            return self.runner.execute(out)[1]

    return FakeExecutor()


def _old_runner(num_blocks: int):
    from tessera.sampling.sampler import SampledToken
    from tessera.worker.model_runner import ModelRunnerOutput as OldOutput

    class FakeRunner:
        cache_engine = SimpleNamespace(num_gpu_blocks=num_blocks, num_cpu_blocks=0)
        device = "cpu"

        def execute(self, out, generators=None):
            samples = {s.seq.seq_id: [SampledToken(7, -0.5)]
                       for g in out.scheduled_groups for s in g.seqs if s.do_sample}
            return OldOutput(samples=samples)

    return FakeRunner()


def run(num_running: int, num_waiting: int, steps: int) -> float:
    rng = random.Random(0)
    config = EngineArgs(max_num_seqs=num_running, max_num_batched_tokens=2048, max_model_len=2048,
                        block_size=16).create_engine_config(2048)
    num_blocks = num_running * 40
    backend = _new_executor(num_blocks) if NEW else _old_runner(num_blocks)
    engine = LLMEngine(config, backend, None, (2,), 32000)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for i in range(num_running + num_waiting):
        prompt = [rng.randrange(100, 32000) for _ in range(rng.randint(64, 192))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while len(engine.scheduler.running) < num_running:
        engine.step()
    gc.collect()
    gc.freeze()
    t0 = time.process_time()
    for _ in range(steps):
        engine.step()
    elapsed = time.process_time() - t0
    gc.unfreeze()
    return elapsed / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"engine: {'core boundary' if NEW else 'before the core boundary'}")
    for waiting in (1_000, 10_000):
        best = min(run(256, waiting, args.steps) for _ in range(args.repeats))
        print(
            f"256 running, {waiting:>6} waiting: {best:7.0f} µs per engine step (best of "
            f"{args.repeats})"
        )


if __name__ == "__main__":
    main()
