"""Concurrent long requests at equal KV memory, with and without releasing the blocks a sliding
window has left behind.

    --family mistral   Mistral-7B's geometry: every layer attends within 4096 tokens (one table)
    --family gemma3    Gemma 3 270M's: 3 global layers and 15 local ones (window 512), as KV
                       cache groups of 3 layers (core/kv_cache_groups.py) against one full-length
                       table for every layer (what --disable-hybrid-kv-cache-manager keeps)

The real scheduler and block manager run on a virtual clock; a stand-in runner "samples" a fixed
token (the memory question does not need a model). Each request has a long prompt and a long
output; the figure is how many of them decode at once, step by step, in the same memory:
`--blocks` blocks of every layer, which KV cache groups cut into `num_groups` times as many.

    python benchmarks/sliding_window.py [--family mistral] [--blocks 3000] [--requests 32]
        [--prompt 6000] [--output 2000] [--window 4096] [--figure docs/sliding_window.png]
"""

from __future__ import annotations

import argparse
import itertools

from tessera.config import CacheConfig, SchedulerConfig
from tessera.core.kv_cache_groups import kv_cache_groups
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler import Scheduler
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceGroup, new_seq_id


def gemma3_270m_layers(window: int) -> tuple[int | None, ...]:
    """Gemma 3 270M: 18 layers, every sixth global (5, 11, 17), the rest local."""
    return tuple(None if (i + 1) % 6 == 0 else window for i in range(18))


def run(cache: CacheConfig, args: argparse.Namespace) -> list[int]:
    """Requests running at each step, until all finish, with `--blocks` blocks of every layer
    (`num_groups` times as many pool blocks with KV cache groups)."""
    max_len = args.prompt + args.output
    steps = itertools.count()
    num_groups = len(kv_cache_groups(cache.layer_windows)) if cache.layer_windows else 1
    num_blocks = args.blocks * num_groups
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_len, max_num_seqs=256, max_model_len=max_len,
                        enable_chunked_prefill=False),
        cache, num_blocks, num_blocks, clock=lambda: float(next(steps)),
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
    parser.add_argument("--family", choices=["mistral", "gemma3"], default="mistral")
    parser.add_argument("--window", type=int, default=None,
                        help="the window (default: 4096 for mistral, 512 for gemma3)")
    parser.add_argument("--figure", default=None, help="write the plot here (PNG)")
    args = parser.parse_args()
    if args.window is None:
        args.window = 4096 if args.family == "mistral" else 512

    bs = args.block_size
    if args.family == "mistral":
        released_cache = CacheConfig(block_size=bs, sliding_window=args.window)
        label = f"blocks behind the {args.window}-token window released"
        kept_label = "every block kept"
    else:
        released_cache = CacheConfig(block_size=bs, layer_windows=gemma3_270m_layers(args.window))
        label = f"KV cache groups: local layers release what their {args.window}-token window left"
        kept_label = "one full-length table for every layer"
    kept, released = run(CacheConfig(block_size=bs), args), run(released_cache, args)
    print(f"{args.family}: {args.requests} requests of {args.prompt} + {args.output} tokens, "
          f"window {args.window}, {args.blocks} blocks of {bs} tokens of every layer")
    short = "window released" if args.family == "mistral" else "KV cache groups"
    for name, steps in ((kept_label, kept), (short, released)):
        mean = sum(steps) / len(steps)
        print(f"  {name:37s} peak {max(steps):3d} running, mean {mean:5.1f}, {len(steps)} steps")
    print(f"  ratio (mean concurrent, released / kept): "
          f"{(sum(released) / len(released)) / (sum(kept) / len(kept)):.2f}x")
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(kept, label=kept_label)
        ax.plot(released, label=label)
        ax.set_xlabel("engine step")
        ax.set_ylabel("requests running")
        ax.set_title(f"{args.family}: {args.requests} requests of {args.prompt}+{args.output} "
                     f"tokens, {args.blocks} blocks of every layer")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=110)
        print(f"  figure: {args.figure}")


if __name__ == "__main__":
    main()
