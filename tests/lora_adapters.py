"""PEFT LoRA adapters over the tiny random Llama of tests/tiny_llama.py, with their HF + PEFT
references: `init_lora_weights=False` gives random, non-zero A and B, so every adapter changes
the output."""

from __future__ import annotations

import copy

import torch

# name -> (target modules, r, lora_alpha, use_rslora)
ADAPTERS = {
    "all7": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
             8, 16, False),
    "qv": (["q_proj", "v_proj"], 4, 8, False),
    "mlp_rs": (["gate_proj", "up_proj", "down_proj"], 16, 4, True),
}


def save_peft_adapter(base, path: str, targets: list[str], r: int, alpha: float,
                      use_rslora: bool = False, seed: int = 0, **extra):
    """Save a LoRA adapter of a copy of HF model `base` at `path` (PEFT's format); returns the
    PEFT model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False, **extra)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
