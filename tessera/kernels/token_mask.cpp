// Applies structured-output token bitmasks to logits in place: logits[r, t] = -inf where bit t of
// row r's mask is 0.
//
// Why: xgrammar's own CPU kernel costs ~50 us per 49k-token row when most tokens are allowed but
// ~600-800 us when most are masked (a JSON number, a closing brace), which at batch 16 is ~10 ms of
// an ~80 ms decode step (benchmarks/structured_outputs.py). Here each 32-bit word of the mask is
// two AVX-512 lane masks for a blend, so a row costs a few microseconds whatever it allows.
//
//   apply_bitmask_(logits [R, V] fp32, bitmask [B, ceil(V / 32)] int32, rows [K] int64,
//                  mask_rows [K] int64): for k < K, logits[rows[k]] is masked by bitmask[mask_rows[k]]
//
// Paths: AVX-512 masked stores (the avx512 build); a per-word select the compiler vectorizes
// (avx2: vpsrlvd + blend, 8 lanes; portable: plain C++).
//
// Bit j of word w stands for token 32 * w + j (xgrammar's layout). Tokens past V are ignored.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#define TESSERA_MASK_AVX512 1
#include <immintrin.h>
#endif

namespace {

void mask_row(float* row, const int32_t* words, int64_t vocab) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t num_words = (vocab + 31) / 32;
#ifdef TESSERA_MASK_AVX512
  const __m512 inf16 = _mm512_set1_ps(neg_inf);
  const int64_t full_words = vocab / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;  // all allowed: nothing to write
    float* p = row + 32 * w;
    // where a bit is 0, write -inf: a masked store of the complement
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>(~bits & 0xFFFF), inf16);
    _mm512_mask_storeu_ps(p + 16, static_cast<__mmask16>((~bits >> 16) & 0xFFFF), inf16);
  }
  for (int64_t t = 32 * full_words; t < vocab; ++t) {
    if (!((static_cast<uint32_t>(words[t / 32]) >> (t % 32)) & 1u)) row[t] = neg_inf;
  }
#else  // avx2 and portable builds: a 32-lane select per word, vectorized by the compiler
  for (int64_t w = 0; w < num_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;
    float* p = row + 32 * w;
    if (32 * w + 32 <= vocab) {
#pragma omp simd
      for (int j = 0; j < 32; ++j) p[j] = ((bits >> j) & 1u) ? p[j] : neg_inf;
    } else {
      for (int64_t t = 32 * w; t < vocab; ++t) {
        if (!((bits >> (t - 32 * w)) & 1u)) row[t] = neg_inf;
      }
    }
  }
#endif
  (void)num_words;
}

}  // namespace

void apply_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows,
                    torch::Tensor mask_rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 &&
                  logits.stride(1) == 1,
              "logits must be [R, V] float32 with a contiguous last dim");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 &&
                  bitmask.is_contiguous(),
              "bitmask must be a contiguous [B, W] int32 tensor");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && mask_rows.scalar_type() == torch::kInt64 &&
                  rows.numel() == mask_rows.numel(),
              "rows and mask_rows must be int64 of the same length");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(bitmask.size(1) * 32 >= vocab, "bitmask has too few words for the vocabulary");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* m = mask_rows.data_ptr<int64_t>();
  float* base = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  for (int64_t k = 0; k < rows.numel(); ++k) {
    TORCH_CHECK(r[k] >= 0 && r[k] < num_rows, "row index out of range");
    TORCH_CHECK(m[k] >= 0 && m[k] < bitmask.size(0), "mask row index out of range");
    mask_row(base + r[k] * logits.stride(0), bits + m[k] * bitmask.size(1), vocab);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_bitmask_", &apply_bitmask_, "mask logits in place by a token bitmask");
}
