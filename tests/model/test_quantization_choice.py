"""Which weights path `--quantization` resolves to (tessera/model/loader.py): `auto` by build,
dtype, AMX and file, and the fallbacks where a kernel does not serve; no model is run."""

from __future__ import annotations

import pytest
import torch

import tessera.kernels.quant_linear as ql


def test_without_the_kernel_weights_are_dequantized_at_load(monkeypatch):
    """--quantization gguf keeps blocks only where the kernel serves the compute dtype on the
    device; elsewhere the loader is asked for dense weights (a layer dequantizing on every
    call was several times slower)."""
    import tessera.kernels.quant_linear as ql
    from tessera.model.loader import weight_quantization

    monkeypatch.setattr(ql, "quant_kernel_supported", lambda dtype, device: False)
    monkeypatch.setattr(ql, "int8_kernel_supported", lambda dtype, device: False)
    assert weight_quantization("gguf", "float32", "cpu") == "none"
    assert weight_quantization("gguf_int8", "float32", "cpu") == "none"
    assert weight_quantization("gguf_int8_a16", "float32", "cpu") == "none"
    assert weight_quantization("none", "float32", "cpu") == "none"
    monkeypatch.setattr(ql, "quant_kernel_supported", lambda dtype, device: dtype == torch.bfloat16)
    assert weight_quantization("gguf", "bfloat16", "cpu") == "gguf"
    assert weight_quantization("gguf", "float32", "cpu") == "none"
    assert weight_quantization("gguf_int8", "bfloat16", "cpu") == "gguf"  # the exact one
    monkeypatch.setattr(ql, "int8_kernel_supported", lambda dtype, device: True)
    assert weight_quantization("gguf_int8", "float32", "cpu") == "gguf_int8"
    assert weight_quantization("gguf_int8_a16", "float32", "cpu") == "gguf_int8_a16"


@pytest.mark.parametrize(("isa", "amx", "device", "dtype", "expected"), [
    ("avx2", False, "cpu", "float32", "gguf_int8_a16"),
    ("avx2", False, "cpu", "bfloat16", "gguf_int8"),
    ("avx512", False, "cpu", "float32", "gguf_int8_a16"),
    ("avx512", False, "cpu", "bfloat16", "gguf_int8"),
    ("avx512", True, "cpu", "float32", "gguf_int8_a16"),
    ("avx512", True, "cpu", "bfloat16", "gguf"),
    ("portable", False, "cpu", "float32", "gguf"), ("avx2", False, "cuda:0", "float32", "gguf"),
])
def test_auto_picks_the_integer_path_by_build_and_dtype(monkeypatch, default_model_path, isa, amx,
                                                        device, dtype, expected):
    """--quantization auto (the default) for a 4-bit GGUF (the default model: Q4_1 layers, a
    Q8_0 embedding) on x86 builds: the integer path with 16-bit activations in fp32 (the float
    model's tokens, faster than the exact kernels), 8-bit ones in bf16, except on a CPU whose bf16
    linears run AMX tiles (the exact products); the exact products elsewhere."""
    import tessera.kernels.build as build
    import tessera.kernels.linear as linear
    from tessera.model.loader import auto_quantization, weight_quantization

    monkeypatch.setattr(build, "cpu_isa", lambda: isa)
    monkeypatch.setattr(linear, "linear_kernel_uses_amx", lambda: amx)
    assert auto_quantization(device, default_model_path, dtype) == expected
    if device == "cpu" and expected != "gguf" and ql.int8_kernel_supported(
            getattr(torch, dtype), torch.device("cpu")):
        assert weight_quantization("auto", dtype, device, default_model_path) == expected


def test_auto_runs_quantized_files_on_the_integer_path_and_keeps_float_ones(monkeypatch, tmp_path):
    """On the AVX2 build auto picks the integer path for a file whose matrices are mostly in types
    the integer path keeps (4-bit and 8-bit alike: its kernels are the faster ones for both), and
    gguf for a float file (no blocks); an HF directory has no blocks either."""
    import gguf
    import numpy as np

    import tessera.kernels.build as build
    from tessera.model.gguf_loader import integer_path_share
    from tessera.model.loader import auto_quantization

    monkeypatch.setattr(build, "cpu_isa", lambda: "avx2")
    rng = np.random.default_rng(0)
    paths = {}
    for name, qtype in (("q8", gguf.GGMLQuantizationType.Q8_0),
                        ("q4", gguf.GGMLQuantizationType.Q4_0),
                        ("f16", gguf.GGMLQuantizationType.F16)):
        w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        data = rng.standard_normal((64, 256)).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor("blk.0.ffn_up.weight", data.astype(np.float16))
        else:
            w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        w.add_tensor("blk.0.ffn_norm.weight", np.ones(256, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths[name] = str(tmp_path / f"{name}.gguf")
    assert integer_path_share(paths["q8"]) == 1.0 and integer_path_share(paths["q4"]) == 1.0
    assert integer_path_share(paths["f16"]) == 0.0
    assert auto_quantization("cpu", paths["q8"]) == "gguf_int8_a16"
    assert auto_quantization("cpu", paths["q4"]) == "gguf_int8_a16"
    assert auto_quantization("cpu", paths["f16"]) == "gguf"
    assert auto_quantization("cpu", str(tmp_path)) == "gguf"
