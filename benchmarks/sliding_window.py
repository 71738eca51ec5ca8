"""Concurrent long requests at equal KV memory, with and without releasing the blocks a sliding
window has left behind (Mistral-7B's geometry: every layer attends within 4096 tokens).

The real scheduler and block manager run on a virtual clock; a stand-in runner "samples" a fixed
token (the memory question does not need a model). Each request has a long prompt and a long
output; the figure is how many of them decode at once, step by step, in the same number of blocks.

    python benchmarks/sliding_window.py [--blocks 3000] [--requests 32] [--prompt 6000]
        [--output 2000] [--window 4096] [--figure docs/sliding_window.png]
"""

from __future__ import annotations

import argparse
import itertools

from tessera.config import CacheConfig, SchedulerConfig
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler import Scheduler
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceGroup, new_seq_id


def run(window: int | None, args: argparse.Namespace) -> list[int]:
    """Requests running at each step, until all finish."""
    max_len = args.prompt + args.output
    steps = itertools.count()
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_len, max_num_seqs=256, max_model_len=max_len,
                        enable_chunked_prefill=False),
        CacheConfig(block_size=args.block_size, sliding_window=window),
        args.blocks, args.blocks, clock=lambda: float(next(steps)),
    )
    for i in range(args.requests):
        prompt = [(i * 7919 + j) % 30000 + 10 for j in range(args.prompt)]
        scheduler.add_seq_group(SequenceGroup(
            request_id=str(i), seqs=[Sequence(seq_id=new_seq_id(), prompt_token_ids=prompt)],
            sampling_params=SamplingParams(max_tokens=args.output, ignore_eos=True),
            arrival_time=0.0,
        ))
    running: list[int] = []
    while scheduler.has_unfinished_seqs():
        out = scheduler.schedule()
        result = ModelRunnerOutput()
        for req_id in out.num_scheduled_tokens:
            result.req_ids.append(req_id)
            result.sampled_token_ids.append([5])  # every step completes a prompt or a decode
        scheduler.update_from_output(out, result)
        running.append(len(scheduler.running))
    return running


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=3000, help="device KV blocks (both runs)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=6000, help="prompt tokens a request")
    parser.add_argument("--output", type=int, default=2000, help="output tokens a request")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--figure", default=None, help="write the plot here (PNG)")
    args = parser.parse_args()

    kept, released = run(None, args), run(args.window, args)
    print(f"{args.requests} requests of {args.prompt} + {args.output} tokens, window "
          f"{args.window}, {args.blocks} blocks of {args.block_size}")
    for name, steps in (("every block kept", kept), ("window released", released)):
        mean = sum(steps) / len(steps)
        print(f"  {name:18s} peak {max(steps):3d} running, mean {mean:5.1f}, {len(steps)} steps")
    print(f"  ratio (mean concurrent, released / kept): "
          f"{(sum(released) / len(released)) / (sum(kept) / len(kept)):.2f}x")
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(kept, label="every block kept")
        ax.plot(released, label=f"blocks behind the {args.window}-token window released")
        ax.set_xlabel("engine step")
        ax.set_ylabel("requests running")
        ax.set_title(f"{args.requests} requests of {args.prompt}+{args.output} tokens in "
                     f"{args.blocks} blocks of {args.block_size}")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=110)
        print(f"  figure: {args.figure}")


if __name__ == "__main__":
    main()
