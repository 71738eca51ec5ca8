"""Small helpers shared across layers. Torch-free, so `tessera/core` may import it."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Integer ceiling division: how many blocks of `b` hold `a` items (blocks for a sequence's
    tokens, for example). Exact for any int size, unlike `math.ceil(a / b)`, which rounds through a
    float; and one named home instead of the unreadable `-(-a // b)` idiom at every call site."""
    return -(-a // b)


def token_range(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without concatenating the two (a per-step path: a decode
    reads one token of a long sequence)."""
    num_prompt = len(prompt)
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return prompt[start:end]
    return prompt[start:] + output[: end - num_prompt]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """KV cache bytes one token takes across all layers, K and V. The one home of this rule: the
    cache engine sizes its pools with it and the simulator (tessera/simulator) counts blocks and
    KV traffic with it."""
    return 2 * num_layers * num_kv_heads * head_dim * elem_size


# Architectures whose q/k RMSNorm spans all heads at once (OLMoE), which a tensor-parallel rank's
# slice of the heads cannot compute: the engine and the simulator refuse them at TP > 1
# (tessera/model/registry.py's `qk_norm_full` trait is checked against this set).
QK_NORM_OVER_ALL_HEADS = frozenset({"OlmoeForCausalLM"})


def hf_windows(
    cfg: dict, architecture: str, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of an HF config.json as `ModelArchConfig` reads them:
    Gemma's interleaved local layers, Mistral's window on every layer, Qwen's
    `use_sliding_window` (off by default). Here, below both, because the model loader and the
    simulator's model specs (which may not import the model layer) both read it."""
    window = cfg.get("sliding_window")
    types = tuple(cfg.get("layer_types") or ())
    if architecture == "Qwen2MoeForCausalLM":  # a window is refused at load (hf_loader)
        return None, ()
    if architecture == "Qwen3MoeForCausalLM":  # HF: the window on every layer, if used
        if not cfg.get("use_sliding_window"):
            return None, ()
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window"):
            return None, ()
        if not types:  # HF: layers from max_window_layers on use the window
            first = int(cfg.get("max_window_layers", num_layers))
            types = tuple(
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            )
    elif architecture == "Gemma2ForCausalLM" and not types:
        types = tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        )
    elif architecture == "Gemma3ForCausalLM" and not types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        )
    if window is None:
        return None, ()
    if types and "sliding_attention" not in types:
        return None, ()
    return int(window), types
