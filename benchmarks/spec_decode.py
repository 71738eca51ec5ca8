"""Speculative decoding (n-gram prompt lookup, draft model): output tok/s with and without it, in
the same run.

    python benchmarks/spec_decode.py [--dtype bfloat16] [--k 4] [--repeat 2]
        [--workloads A1,A8,B1,B64,A1/k8,A1/draft,B1/draft] [--draft-model PATH]

Workloads (greedy, so both modes produce identical tokens; the script checks it):
  A1, A8  the output mostly copies from the prompt: chat prompts asking to correct the spelling of
          a passage, or to quote one back; batch 1 (one request at a time) and 8;
  B1, B64 W1-like random-token prompts (64-512 tokens), where prompt lookup finds little; batch 1
          and 64 (the batch-64 run speculates with `disable_by_batch_size`,
          --disable-by-batch-size, 16 by default).
A suffix picks the speculation of a row: none (ngram, k = --k), `/kN` (ngram with k = N; `/kNfixed`:
always N drafts, not adapted per request to its acceptance), `/draft`
(method draft_model with --draft-model, by default the default model drafting for itself: a
correctness and acceptance demo, since that draft costs as much as the target). Each workload's
run without speculation is measured once and compared with all its rows.
Per workload: output tok/s without and with speculation and their ratio, acceptance rate (accepted /
drafted tokens), mean accepted length (tokens per verified request step: 1 + accepted / drafts),
and the proposer's cost per step (ms, and as a share of the step). Each mode runs `--repeat`
times, alternating, and the best run counts (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tessera import LLM, SamplingParams
from tessera.config import EngineArgs
from tessera.engine.llm_engine import LLMEngine
from tessera.engine.loading import load_bundle

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. The dog did not move, and the fox ran on into "
    "the forest, where it found a small stream and drank from it before resting under an oak tree. "
    "When the sun went down, the fox walked back to its den at the edge of the field. Its cubs "
    "were "
    "waiting there, and together they ate the berries it had picked on the way home.",
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre museum and its "
    "cafes. Every year millions of tourists visit the city to see its monuments and eat its food. "
    "The river Seine runs through the middle of the city, and many of its bridges are hundreds of "
    "years old. In the evening, people walk along its banks and watch the boats pass by.",
    "To install the package, run pip install tessera. Then start the server with tessera serve and "
    "send a request to the completions endpoint with curl, passing the model name and a prompt. "
    "The server answers with a JSON object that holds the generated text and the number of tokens "
    "it used. To stop the server, press Control and C in the terminal where it runs.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure "
    "is lower, so water boils at a lower temperature, which is why cooking takes longer there. "
    "Climbers on high mountains often bring pressure cookers to make their meals. A pressure "
    "cooker "
    "keeps the steam inside, which raises the pressure and lets the water get hotter.",
]


def with_typos(text: str, every: int = 6) -> str:
    """The passage with two letters swapped in every `every`-th long word: text to correct."""
    words = text.split(" ")
    for i in range(2, len(words), every):
        w = words[i]
        if len(w) >= 5 and w.isalpha():
            words[i] = w[:2] + w[3] + w[2] + w[4:]
    return " ".join(words)


def workload_a(tokenizer, num: int) -> list[list[int]]:
    """Editing and quoting: fix the typos of a passage, or repeat one back word for word.

    The default 135M model copies a passage when asked either (its answers are 40-45 tokens, all
    but a few taken from the prompt). It does not rename a variable in code: it rewrites the
    function as a one-liner, which copies nothing, so code editing is not part of this workload.
    """
    from tessera.tokenizer import apply_chat_template

    prompts = []
    for i in range(num):
        passage = PASSAGES[(i // 2) % len(PASSAGES)]
        if i % 2 == 0:
            text = f"Correct the spelling mistakes in this text:\n\n{with_typos(passage)}"
        else:
            text = f"Repeat the following text exactly, word for word:\n\n{passage}"
        prompts.append(apply_chat_template(tokenizer, [{"role": "user", "content": text}]))
    return prompts


def workload_b(num: int, max_out: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(0)  # W1's draw: 64-512 prompt tokens, random ids
    in_lens = rng.integers(64, 513, num)
    out_lens = [int(n) for n in rng.integers(16, max_out + 1, num)]
    return [rng.integers(100, 49000, n).tolist() for n in in_lens], out_lens


def run(bundle, dtype, prompts, params, batch: int, spec: dict | None, max_num_seqs: int,
        adaptive: bool = True):
    engine = LLMEngine.from_engine_args(
        EngineArgs(dtype=dtype, max_model_len=1024, max_num_seqs=max_num_seqs,
                   speculative_config=spec), bundle=bundle)
    llm = LLM.from_engine(engine)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)  # warm-up
    runner = engine.executor.runner
    runner.adaptive_num_drafts = adaptive
    runner.proposer_seconds, runner.num_propose_calls = 0.0, 0
    engine.step_times.__init__()
    before = dict(llm.get_metrics())
    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + batch]],
                             params[i : i + batch], use_tqdm=False)
    elapsed = time.perf_counter() - start
    m = llm.get_metrics()

    def delta(name):
        return m.get(name, 0.0) - before.get(name, 0.0)

    tokens = [o.outputs[0].token_ids for o in outs]
    steps = engine.step_times.num_steps
    return {
        "tokens": tokens, "elapsed": elapsed, "tok_s": sum(map(len, tokens)) / elapsed,
        "drafts": delta("tessera:spec_decode_num_drafts_total"),
        "draft_tokens": delta("tessera:spec_decode_num_draft_tokens_total"),
        "accepted": delta("tessera:spec_decode_num_accepted_tokens_total"),
        "steps": steps, "step_ms": 1e3 * engine.step_times.execute / max(steps, 1),
        "propose_ms": 1e3 * runner.proposer_seconds / max(steps, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workloads", default="A1,A8,B1,B64")
    ap.add_argument("--draft-model", default=None,
                    help="the draft model of /draft rows (default: the default model itself)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of workload A")
    ap.add_argument("--disable-by-batch-size", type=int, default=16,
                    help="disable_by_batch_size of the batch-64 rows")
    args = ap.parse_args()
    bundle = load_bundle(EngineArgs(dtype=args.dtype, max_model_len=1024))
    draft_path = args.draft_model or bundle.path
    print(f"dtype {args.dtype}, ngram prompt_lookup 2..4, draft model {draft_path}, "
          f"best of {args.repeat}")
    print(
        f"{'workload':<12} {'reqs':>4} {'batch':>5} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>6} "
        f"{'accept':>6} {'mean len':>8} {'steps off/on':>12} {'propose ms/step':>15}"
    )
    offs: dict[str, dict] = {}
    for name in args.workloads.split(","):
        base, _, variant = name.partition("/")
        batch = int(base[1:])
        k = int(variant[1:].removesuffix("fixed")) if variant.startswith("k") else args.k
        adaptive = not variant.endswith("fixed")
        if variant == "draft":
            spec: dict = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": k}
        else:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2}
        if base.startswith("A"):
            prompts = workload_a(bundle.tokenizer, 4 if batch == 1 else batch)
            params = [SamplingParams(temperature=0, max_tokens=args.max_tokens)] * len(prompts)
        else:
            prompts, out_lens = workload_b(4 if batch == 1 else batch, 64)
            params = [
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens
            ]
            if batch >= 16:
                spec = {**spec, "disable_by_batch_size": args.disable_by_batch_size}
        best: dict[str, dict] = {}
        for _ in range(args.repeat):
            modes = [("on", spec)] if base in offs else [("off", None), ("on", spec)]
            for mode, cfg in modes:
                r = run(bundle, args.dtype, prompts, params, batch, cfg, max(batch, 8), adaptive)
                if mode not in best or r["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = r
        off = offs.setdefault(base, best.get("off"))
        on = best["on"]
        assert on["tokens"] == off["tokens"], f"{name}: speculation changed greedy output"
        accept = on["accepted"] / on["draft_tokens"] if on["draft_tokens"] else 0.0
        mean_len = 1 + on["accepted"] / on["drafts"] if on["drafts"] else 1.0
        share = on["propose_ms"] / on["step_ms"] if on["step_ms"] else 0.0
        label = f"{name}" + ("" if variant else f"/k{args.k}")
        print(
            f"{label:<12} {len(prompts):>4} {batch:>5} {off['tok_s']:>9.1f} {on['tok_s']:>9.1f} "
            f"{on['tok_s'] / off['tok_s']:>5.2f}x {accept:>6.1%} {mean_len:>8.2f} "
            f"{off['steps']:>5}/{on['steps']:<6} {on['propose_ms']:>8.3f} ({share:.1%})",
            flush=True,
        )


if __name__ == "__main__":
    main()
