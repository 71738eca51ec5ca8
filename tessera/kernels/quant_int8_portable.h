// The integer path's group loop in plain C++ (the portable build: aarch64, or no AVX2): the
// same integer sums as quant_int8_avx2.h, one output at a time.
#pragma once

#include "quant_int8_kinds.h"

#if !defined(TESSERA_INT8_AVX2)

namespace tessera_int8 {

template <typename F, int R>
inline void dot_group(const uint8_t* w, int64_t nb, const QRow* xr, float (*out)[kCols]) {
  float acc[R][kCols] = {};
  for (int64_t b = 0; b < nb; ++b, w += F::kRecord) {
    int32_t q[kCols][32];  // row c's codes in K order
    for (int t = 0; t < 8; ++t)
      for (int c = 0; c < kCols; ++c)
        for (int i = 0; i < 4; ++i) q[c][4 * t + i] = code_at<F>(w, t, 4 * c + i);
    for (int r = 0; r < R; ++r) {
      const int8_t* qx = xr[r].q + b * kQK;
      const int8_t* lo = xr[r].lo ? xr[r].lo + b * kQK : nullptr;
      const float dx = xr[r].d[b];
      for (int c = 0; c < kCols; ++c) {
        for (int g = 0; g < F::kGroups; ++g) {  // Q6_K: a sum and a scale a half of 16
          constexpr int n = 32 / F::kGroups;
          int32_t s = 0;
          for (int k = g * n; k < (g + 1) * n; ++k) s += q[c][k] * qx[k];
          if (lo) {  // the residual plane (QRow)
            int32_t s_lo = 0;
            for (int k = g * n; k < (g + 1) * n; ++k) s_lo += q[c][k] * lo[k];
            s = kLoScale * s + s_lo;
          }
          acc[r][c] = std::fma(static_cast<float>(s), scale_of<F>(w, b, g * kCols + c) * dx,
                               acc[r][c]);
        }
        if constexpr (!F::kSigned) {
          acc[r][c] = std::fma(min_at<F>(w, b, c), xr[r].dsum[b], acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) out[r][c] = acc[r][c];
}

constexpr int kXRows = 4;

}  // namespace tessera_int8

#endif
