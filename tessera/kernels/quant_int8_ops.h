// The integer path's entry points (`--quantization gguf_int8`), bound in quant_linear.cpp's
// module: the linear y = x @ W^T on x quantized per row to Q8 blocks, the embedding rows, and
// what this build runs the products on. The kernels themselves: quant_int8.h, quant_int8_amx.h.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "linear_tiles.h"
#include "quant_int8.h"
#include "quant_int8_amx.h"

namespace tessera_int8_ops {

using tessera_tiles::Scratch;
using tessera_tiles::thread_scratch;

inline int64_t int8_record_bytes(int64_t kind) { return tessera_int8::record_bytes(kind); }

// Which instruction the integer products run on in this build (for logs and docs).
inline std::string int8_dot_instruction() {
#if defined(TESSERA_INT8_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "vpdpbusd";
#elif defined(TESSERA_INT8_AVX2)
  return "vpmaddubsw";
#else
  return "portable";
#endif
}

// From how many rows of x a call runs the interleaved kinds on AMX-INT8 tiles (tdpbsud /
// tdpbssd, quant_int8_amx.h), or 0 where this build or process does not use them.
inline int64_t int8_amx_min_rows() {
#if defined(TESSERA_HAVE_AMX_INT8)
  return tessera_tiles::amx_ready() ? tessera_int8::kTileRows : 0;
#else
  return 0;
#endif
}

// y (an [M, N] view with a contiguous last dim) = x [M, K] @ W^T (+ bias) on the integer path
// (quant_int8.h): x fp32 or bf16, quantized here per row to Q8 blocks, plus a residual plane
// (QRow) when `planes` is 2; `packed` the row-major records of `kind` ([N, K / 32 records]);
// `bias` float32 [>= N] or None.
inline void quant_linear_int8_out(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t N,
                                  c10::optional<torch::Tensor> bias, torch::Tensor y,
                                  int64_t planes) {
  using namespace tessera_int8;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with a contiguous last dim");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.size(1) == N,
              "y must be [M, N] with a contiguous last dim");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "x and y dtypes differ");
  TORCH_CHECK(planes == 1 || planes == 2, "planes must be 1 or 2, got ", planes);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be uint8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % k_multiple(kind) == 0, "K (", K, ") is not a multiple of ", k_multiple(kind));
  TORCH_CHECK(packed.numel() == (N + kCols - 1) / kCols * (K / kQK) *
                                    tessera_int8::record_bytes(kind),
              "packed weight does not match N, K and the kind");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() >= N,
                "bias must be float32 with at least N entries");
    b = bias->data_ptr<float>();
  }
  if (M == 0) return;
  const int64_t nb = K / kQK;
  // the rows' Q8 blocks (and residual planes), in this thread's scratch (grown once, never
  // zeroed)
  int8_t* q = thread_scratch<int8_t, Scratch::kPackedRows>(planes * M * K);
  int8_t* lo = planes == 2 ? q + M * K : nullptr;
  float* d = thread_scratch<float, Scratch::kBlockSums>(M * nb * 2);
  float* dsums = d + M * nb;
  std::vector<QRow> rows(M);
  for (int64_t m = 0; m < M; ++m)
    rows[m] = QRow{q + m * K, lo ? lo + m * K : nullptr, d + m * nb, dsums + m * nb};
  const bool f32 = x.scalar_type() == torch::kFloat32;
  TORCH_CHECK(f32 || x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (f32) {
        quantize_row(x.data_ptr<float>() + m * x.stride(0), K, rows[m]);
      } else {
        quantize_row(x.data_ptr<at::BFloat16>() + m * x.stride(0), K, rows[m]);
      }
    }
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  with_kind(kind, [&](auto f) {
    using F = decltype(f);
    auto groups = [&](auto* yp) {
#if defined(TESSERA_HAVE_AMX_INT8)
      if (run_int8_groups_amx<F>(M, K, w, N, yp, y.stride(0), b, rows.data())) return;
#endif
      run_int8_groups<F>(M, K, w, N, yp, y.stride(0), b, rows.data());
    };
    if (f32) {
      groups(y.data_ptr<float>());
    } else {
      groups(y.data_ptr<at::BFloat16>());
    }
  });
}

// Rows `ids` of a weight in the integer path's layout (quant_int8.py), dequantized into out
// [T, K] (float32, or bf16 as torch's cast rounds): the embedding lookup of a tied lm_head. In
// torch ops (dequantize_int8_rows: a gather of the rows' groups, then ~15 ops decoding them) it
// cost ~0.28 ms of a batch-1 decode step (one token); here it is a pass over one row's bytes.
inline void int8_rows_out(torch::Tensor packed, int64_t kind, int64_t K, torch::Tensor ids,
                   torch::Tensor out) {
  using namespace tessera_int8;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be uint8");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "ids must be a contiguous int64 vector");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == ids.numel() && out.size(1) == K,
              "out must be a contiguous [T, K]");
  TORCH_CHECK(K > 0 && K % k_multiple(kind) == 0, "K (", K, ") is not a multiple of ",
              k_multiple(kind));
  const int64_t rows = packed.numel() / ((K / kQK) * tessera_int8::record_bytes(kind)) * kCols;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "id ", id[t], " is outside the packed rows");
  const bool f32 = out.scalar_type() == torch::kFloat32;
  TORCH_CHECK(f32 || out.scalar_type() == torch::kBFloat16, "out must be float32 or bfloat16");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  with_kind(kind, [&](auto f) {
    using F = decltype(f);
    at::parallel_for(0, ids.numel(), 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (f32) {
          int8_row<F>(w, K, id[t], out.data_ptr<float>() + t * K);
        } else {
          int8_row<F>(w, K, id[t], out.data_ptr<at::BFloat16>() + t * K);
        }
      }
    });
  });
}

}  // namespace tessera_int8_ops
