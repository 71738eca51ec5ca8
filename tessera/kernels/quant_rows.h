// Rows of a packed weight, dequantized: the quantized embedding lookup (quant_linear.cpp's
// dequantize_rows_out). Plain scalar code, on any CPU: an embedding reads T rows of K, not a panel.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>

#include "quant_formats.h"

namespace tessera_quant {

// Row `n` of a packed weight of format F, dequantized to gguf's values (q * d + m: q * d is exact,
// so this is the one rounding of dequantize_packed's mul + add) into `out` [K].
// `positions` [block * 48]: code_positions of the layout, a nibble (4-bit) or byte index.
template <typename F, typename T>
void dequantize_row(const uint8_t* packed, int64_t K, int64_t n, const int32_t* positions, T* out) {
  const int64_t nb = K / F::kBlock, lane = n % kPanel;
  const uint8_t* rec = packed + (n / kPanel) * nb * F::kRecord;
  for (int64_t b = 0; b < nb; ++b, rec += F::kRecord) {
    const auto* scales = reinterpret_cast<const typename F::Scale*>(rec + F::kCodeBytes);
    const float d = static_cast<float>(scales[lane]);
    const float m = F::kHasMin ? static_cast<float>(scales[kPanel + lane]) : 0.f;
    for (int64_t k = 0; k < F::kBlock; ++k) {
      const int32_t pos = positions[k * kPanel + lane];
      const float q = F::kBits == 4 ? static_cast<float>((rec[pos >> 1] >> (4 * (pos & 1))) & 15)
                                    : static_cast<float>(static_cast<int8_t>(rec[pos]));
      out[b * F::kBlock + k] = static_cast<T>(F::kHasMin ? std::fma(q, d, m) : q * d);
    }
  }
}

template <typename F, typename T>
void dequantize_ids(const uint8_t* packed, int64_t K, const int64_t* ids, int64_t count,
                    const int32_t* positions, T* out) {
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) dequantize_row<F, T>(packed, K, ids[t], positions, out + t * K);
  });
}

template <typename T>
void dequantize_ids_fmt(int64_t fmt, const uint8_t* packed, int64_t K, const int64_t* ids, int64_t n,
                        const int32_t* positions, T* out) {
  with_format(fmt, [&](auto f) { dequantize_ids<decltype(f), T>(packed, K, ids, n, positions, out); });
}

}  // namespace tessera_quant
