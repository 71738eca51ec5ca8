"""Tessera's offline `LLM.generate` (or HF static batching) on a request file: one side of
benchmarks/peers.py, run in a fresh process per peer.

    PYTHONPATH=TREE python benchmarks/tessera_peer.py tessera REQUESTS.json RESULT.json
    python benchmarks/tessera_peer.py hf REQUESTS.json RESULT.json

`tessera` imports whichever `tessera` PYTHONPATH points at: the current tree, or a temporary
worktree of the baseline commit (this file comes from the current tree either way, so it uses only
the `LLM`/`SamplingParams` interface that both have). REQUESTS.json holds `dtype`,
`prompt_token_ids`, `out_lens`, the engine settings and, for `hf`, `hf_batch`; RESULT.json gets the
timed seconds, the output token count and each request's output token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_tessera(req: dict) -> dict:
    import tessera
    from tessera import LLM, SamplingParams

    t_load = time.perf_counter()
    llm = LLM(
        dtype=req["dtype"],
        quantization=req["quantization"],
        max_num_seqs=req["max_num_seqs"],
        max_num_batched_tokens=req["max_num_batched_tokens"],
        max_model_len=req["max_model_len"],
        kv_cache_space=req["kv_cache_space"],
    )
    load_s = time.perf_counter() - t_load
    prompts = [{"prompt_token_ids": p} for p in req["prompt_token_ids"]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in req["out_lens"]
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (not timed)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    return {
        "engine": "tessera " + os.path.dirname(os.path.dirname(os.path.abspath(tessera.__file__))),
        "seconds": elapsed,
        "load_seconds": load_s,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
    }


def run_hf(req: dict) -> dict:
    """HF transformers static batching on the same GGUF (benchmarks/hf_static.py's loop): useful
    tokens are the requested ones, the padding and over-generation are its own cost."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_static import load_hf_model, run_static

    from tessera.model.default_model import default_model_path

    t_load = time.perf_counter()
    model = load_hf_model(default_model_path(), req["dtype"])
    load_s = time.perf_counter() - t_load
    pad_id = model.config.pad_token_id or 0
    prompts, out_lens = req["prompt_token_ids"], req["out_lens"]
    run_static(model, [prompts[0][:8], prompts[1][:4]], [2, 2], 2, pad_id)  # warm-up (not timed)
    start = time.perf_counter()
    run_static(model, prompts, out_lens, req["hf_batch"], pad_id)
    elapsed = time.perf_counter() - start
    return {"engine": f"hf static batch {req['hf_batch']} (torch {torch.__version__})",
            "seconds": elapsed, "load_seconds": load_s, "output_tokens": sum(out_lens),
            "token_ids": None}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("tessera", "hf"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        req = json.load(f)
    result = run_tessera(req) if argv[0] == "tessera" else run_hf(req)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
