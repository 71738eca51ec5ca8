"""Phi-3 GGUF files written here the way llama.cpp's converter writes `phi3`: q|k|v fused as
`attn_qkv`, gate|up fused as `ffn_up` (gate rows first), LongRoPE as `rope_factors_short` /
`rope_factors_long` tensors with rope.scaling.original_context_length and attn_factor, RoPE's
rotated dims as rope.dimension_count, the window as attention.sliding_window (0: none), an
embedded sentencepiece vocabulary and chat template. Norms F32, embeddings F16, the big matrices
Q8_0. From a tiny random HF Phi-3 whose weights are first rounded the way the file stores them,
so HF's own model on the same weights is the reference for logits and greedy tokens."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from tessera import LLM, SamplingParams
from tessera.distributed.sharding import ShardPlan
from tessera.model.gguf_quant import QuantizedTensor
from tessera.model.loader import load_model, read_model_config
from tests.model_logits import model_logits

Q = gguf.GGMLQuantizationType
T = gguf.TokenType
WINDOW = 16
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + "
    "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|user|>", "<|end|>", "<|system|>"]
_LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
# Phi-3's layout: <unk> <s> </s>, 256 byte tokens, then pieces and chat tokens
VOCAB = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPECIALS + _LETTERS
         + ["\u2581"] + ["\u2581" + c for c in _LETTERS] + ["[PAD0]", "[PAD1]", "[PAD2]"])
END_OF_TEXT, END = VOCAB.index("<|endoftext|>"), VOCAB.index("<|end|>")
CASES = {
    # Phi-3-mini: its own lm_head, a window shorter than the prompts, default RoPE
    "window": dict(sliding_window=WINDOW, tie_word_embeddings=False),
    # Phi-4-mini: LongRoPE over 3/4 of each head, tied embeddings, no window (written as 0);
    # an attention factor other than HF's default, so that reading attn_factor shows
    "longrope": dict(
        tie_word_embeddings=True, original_max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75, "attention_factor": 1.25,
                         "short_factor": [1.0 + 0.15 * i for i in range(6)],
                         "long_factor": [2.0 + 0.5 * i for i in range(6)]}),
}


def _round(w: torch.Tensor, qtype) -> torch.Tensor:
    """`w` as the file gives it back (the reference model must hold the same numbers)."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.half().float()
    a = w.numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
                            .reshape(a.shape).copy())


def _qtype(gguf_name: str):
    if "norm" in gguf_name or gguf_name.startswith("rope_"):
        return Q.F32
    if gguf_name in ("token_embd.weight", "output.weight"):
        return Q.F16
    return Q.Q8_0  # attn_qkv, attn_output, ffn_up (gate|up), ffn_down


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    layer, leaf = hf.removeprefix("model.layers.").split(".", 1)
    part = {"self_attn.qkv_proj.weight": "attn_qkv", "self_attn.o_proj.weight": "attn_output",
            "mlp.gate_up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
            "input_layernorm.weight": "attn_norm",
            "post_attention_layernorm.weight": "ffn_norm"}[leaf]
    return f"blk.{layer}.{part}.weight"


def make_phi3(case: str) -> transformers.Phi3ForCausalLM:
    """A tiny random Phi-3 whose weights are already rounded to their GGUF types."""
    config = transformers.Phi3Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=END_OF_TEXT, pad_token_id=0, initializer_range=0.1,
        **CASES[case])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            p.copy_(_round(p.detach().float(), _qtype(_gguf_name(name))))
    return model


def write_phi3_gguf(path, model, *, drop: tuple[str, ...] = (), extra: dict | None = None) -> None:
    """`model` as llama.cpp's converter writes it; `drop` leaves out those metadata keys or
    tensors and `extra` adds keys (to build files the loader must refuse)."""
    cfg = model.config
    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    writer = gguf.GGUFWriter(str(path), "phi3")
    keys = {
        "phi3.context_length": (writer.add_uint32, cfg.max_position_embeddings),
        "phi3.rope.scaling.original_context_length":
            (writer.add_uint32, cfg.original_max_position_embeddings),
        "phi3.embedding_length": (writer.add_uint32, cfg.hidden_size),
        "phi3.feed_forward_length": (writer.add_uint32, cfg.intermediate_size),
        "phi3.block_count": (writer.add_uint32, cfg.num_hidden_layers),
        "phi3.attention.head_count": (writer.add_uint32, cfg.num_attention_heads),
        "phi3.attention.head_count_kv": (writer.add_uint32, cfg.num_key_value_heads),
        "phi3.attention.layer_norm_rms_epsilon": (writer.add_float32, cfg.rms_norm_eps),
        "phi3.rope.dimension_count": (writer.add_uint32, rotary),
        "phi3.rope.freq_base": (writer.add_float32, rope["rope_theta"]),
        "phi3.attention.sliding_window": (writer.add_uint32, cfg.sliding_window or 0),
        **{key: (writer.add_float32 if isinstance(value, float) else writer.add_uint32, value)
           for key, value in (extra or {}).items()},
    }
    tensors = {}
    if rope.get("rope_type") == "longrope":
        # the converter writes HF's default, sqrt(1 + ln(max / orig) / ln(orig)); a config's
        # own attention_factor stands in for it here
        keys["phi3.rope.scaling.attn_factor"] = (writer.add_float32, rope["attention_factor"])
        for kind in ("long", "short"):
            tensors[f"rope_factors_{kind}.weight"] = np.array(rope[f"{kind}_factor"], np.float32)
    for key, (add, value) in keys.items():
        if key not in drop:
            add(key, value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(VOCAB)
    writer.add_token_scores([0.0] * 3 + [-1000.0] * (len(VOCAB) - 3))
    writer.add_token_types([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
                           + [T.CONTROL] * len(_SPECIALS)
                           + [T.NORMAL] * (len(VOCAB) - 259 - len(_SPECIALS) - 3)
                           + [T.UNUSED] * 3)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(END_OF_TEXT)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(END_OF_TEXT)  # as Phi-3 pads
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensors[_gguf_name(name)] = p.float().numpy()
    for name, w in tensors.items():
        if name.removesuffix(".weight") in drop:
            continue
        qtype = _qtype(name)
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(CASES))
def phi3(request, tmp_path_factory):
    model = make_phi3(request.param)
    path = tmp_path_factory.mktemp(request.param) / f"phi3-{request.param}.gguf"
    write_phi3_gguf(path, model)
    return request.param, str(path), model


def _our_logits(path: str, prompt: list[int], quantization: str) -> torch.Tensor:
    def kept_quantized(weights) -> None:
        # "gguf": the Q8_0 rows of the fused tensors stay in their blocks, split by rows
        kept = isinstance(weights["model.layers.0.mlp.up_proj.weight"], QuantizedTensor)
        assert kept == (quantization == "gguf")

    return model_logits(path, prompt, quantization, kept_quantized)


def test_config_from_phi3_metadata(phi3):
    case, path, model = phi3
    cfg, _ = load_model(path)
    assert cfg.architecture == "Phi3ForCausalLM"
    assert cfg.head_dim == 16 and cfg.tie_word_embeddings == model.config.tie_word_embeddings
    assert cfg.eos_token_ids == (END_OF_TEXT, END)  # <|end|> closes a chat turn
    if case == "window":
        assert cfg.sliding_window == WINDOW and cfg.rope_scaling is None
        assert cfg.partial_rotary_factor == 1.0
    else:
        assert cfg.sliding_window is None and cfg.partial_rotary_factor == 0.75
        rope = model.config.rope_parameters
        scaling = cfg.rope_scaling
        assert scaling["rope_type"] == "longrope"
        assert scaling["original_max_position_embeddings"] == 128
        assert scaling["max_position_embeddings"] == 512
        assert scaling["attention_factor"] == 1.25
        np.testing.assert_allclose(scaling["short_factor"], rope["short_factor"], rtol=1e-6)
        np.testing.assert_allclose(scaling["long_factor"], rope["long_factor"], rtol=1e-6)


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_logits_match_hf(phi3, quantization):
    """Every position of a prompt longer than the window: HF's Phi-3 on the same weights."""
    _, path, model = phi3
    prompt = list(range(260, 300)) + list(range(5, 30))  # 65 tokens, below LongRoPE's 128
    got = _our_logits(path, prompt, quantization)
    with torch.inference_mode():
        ref = model(torch.tensor([prompt])).logits[0].float()
    assert (got - ref).abs().max().item() < 2e-4 * max(1.0, ref.abs().max().item())


def test_weights_match_transformers_reading_the_gguf(phi3):
    """transformers' own GGUF reader keeps qkv_proj and gate_up_proj fused: our parts, stacked
    in HF's order, are its tensors (an independent check of the split and of gate before up)."""
    pytest.importorskip("accelerate")
    _, path, _ = phi3
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    state = hf.state_dict()
    _, weights = load_model(path)
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([weights[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(qkv, state[f"{p}self_attn.qkv_proj.weight"])
        gate_up = torch.cat([weights[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")])
        assert torch.equal(gate_up, state[f"{p}mlp.gate_up_proj.weight"])


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_llm_greedy_matches_hf_and_chat_template(phi3, tmp_path, monkeypatch):
    """`LLM(model=FILE)`: greedy tokens of prompts longer than the window equal HF's generate,
    batched, and under preemption, chunked prefill and prefix caching; the chat template and
    vocabulary come from the file."""
    _, path, model = phi3
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))  # the built tokenizer's cache
    prompts = [list(range(260, 300)), [7, 300, 301, 9] * 6, list(range(280, 320, 2)) * 2]
    expected = [_hf_greedy(model, p, 16) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # then a cache of 64-80 tokens for the three (152 tokens in all): chunks of 8, prefix
    # caching, and preemption (with the window, blocks behind it are released instead)
    blocks = 16 if model.config.sliding_window else 20
    small = dict(num_gpu_blocks_override=blocks, block_size=4, max_model_len=64,
                 max_num_batched_tokens=8, enable_prefix_caching=True, max_num_seqs=3)
    for engine_args in (dict(max_model_len=128), small):
        llm = LLM(model=path, dtype="float32", **engine_args)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, engine_args
    if not model.config.sliding_window:
        assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE
    (chat,) = llm.chat([{"role": "user", "content": "hi"}],
                       SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    rendered = "<|user|>\nhi<|end|>\n<|assistant|>\n"  # the file's template, chat tokens whole
    tokenizer = llm.get_tokenizer()
    assert chat.prompt_token_ids == tokenizer(rendered, add_special_tokens=False).input_ids
    assert chat.prompt_token_ids[0] == VOCAB.index("<|user|>") and END in chat.prompt_token_ids


@pytest.mark.parametrize(("drop", "extra", "field"), [
    (("rope_factors_short",), None, "rope_factors_short.weight is missing"),
    (("phi3.rope.scaling.original_context_length",), None,
     "lacks phi3.rope.scaling.original_context_length"),
    ((), {"phi3.rope.dimension_count": 8}, "rope_factors_short.weight has 6 entries"),
    ((), {"phi3.rope.dimension_count": 32}, "rope.dimension_count"),
])
def test_refused_longrope_files(tmp_path, drop, extra, field):
    """What the loader cannot honour is refused at load, naming the field."""
    model = make_phi3("longrope")
    path = tmp_path / "bad.gguf"
    write_phi3_gguf(path, model, drop=drop, extra=extra)
    with pytest.raises(ValueError, match=field):
        load_model(str(path))


def test_refused_attn_factor_without_longrope(tmp_path):
    model = make_phi3("window")
    path = tmp_path / "bad.gguf"
    write_phi3_gguf(path, model, extra={"phi3.rope.scaling.attn_factor": 1.2})
    with pytest.raises(ValueError, match="attn_factor"):
        load_model(str(path))


def test_tensor_parallel_ranks_get_their_slice_of_each_part(phi3):
    """Under -tp 2 each rank reads its rows of q, k, v, gate and up out of the fused tensors,
    Q8_0 blocks whole: the two ranks' slices stacked are the whole part."""
    _, path, _ = phi3
    arch = read_model_config(path)
    _, whole = load_model(path, "none")
    ranks = [load_model(path, "gguf", ShardPlan.for_arch(arch, r, 2))[1] for r in range(2)]
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        name = f"model.layers.1.{part}.weight"
        slices = [w[name] for w in ranks]
        assert all(isinstance(s, QuantizedTensor) for s in slices)
        stacked = torch.cat([s.dequantize() for s in slices])
        assert torch.equal(stacked, whole[name]), name
