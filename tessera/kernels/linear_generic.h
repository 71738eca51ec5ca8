// The avx2 and portable paths of the panel linears (linear.cpp, quant_linear.cpp's exact path):
// one fp32 micro-kernel on at::vec (kernel_vec.h), 8 lanes under -march=x86-64-v3, scalar loops
// in the portable build.
//
// Same panel layout as linear_tiles.h ([K][48] fp32 a panel), same rule: each output is one
// chain of fmas over K in order, whatever M is, so a row's result does not depend on the rows
// batched with it. The weights reach the tiles through `fill(k0, k1)`, which returns the fp32
// rows [k0, k1) of the panel: the packed panel itself (fp32), a converted copy (bf16), or GGUF
// blocks dequantized into an L1 buffer (quant_linear.cpp): the quantized bytes stay the only
// stream from memory, nothing is dequantized beyond the slice being multiplied.
//
// Register budget on AVX2 (16 ymm): up to 2 rows run the whole 48-wide panel (6 vectors a row:
// 12 accumulators + 1 weight + 1 broadcast); more rows run 4-row tiles over each 24-wide half
// (12 accumulators + 3 weights + 1 broadcast).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "kernel_vec.h"
#include "linear_tiles.h"

namespace tessera_generic {

using tessera_tiles::kPanel;
using tessera_vec::kLanes;
using tessera_vec::VecF;

constexpr int64_t kPanelVecs = kPanel / kLanes;
static_assert(kPanel % (2 * kLanes) == 0, "a panel splits into two halves of whole vectors");
constexpr int64_t kSlice = 64;  // K rows of a panel filled at a time when they are streamed

// acc[R][C] += x[R rows, k0:k1] * w[k0:k1, c0 : c0 + C * kLanes]; w is the panel's rows [k0, k1).
template <int R, int C>
inline void tile(const float* x, int64_t ldx, int64_t k0, int64_t k1, const float* w, int64_t c0,
                 VecF (&acc)[R][C]) {
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + (k - k0) * kPanel + c0;
    VecF wv[C];
    for (int c = 0; c < C; ++c) wv[c] = VecF::loadu(wk + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const VecF xb(x[r * ldx + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(xb, wv[c], acc[r][c]);
    }
  }
}

// y[r, c0 : c0 + C * kLanes] (the first n_valid - c0 of them) = acc[r] (+ bias), as T.
template <int R, int C, typename T>
inline void store_tile(const VecF (&acc)[R][C], T* y, int64_t ldy, int64_t c0, int64_t n_valid,
                       const float* bias) {
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const int64_t col = c0 + c * kLanes;
      if (col >= n_valid) break;
      VecF a = acc[r][c];
      if (bias != nullptr) a = a + VecF::loadu(bias + col);
      tessera_vec::store(y + r * ldy + col, a, n_valid - col);
    }
  }
}

// R rows of x against a whole panel, streaming its slices: fill(k0, k1) -> fp32 [k1 - k0][48].
template <int R, typename T, typename Fill>
void rows_streamed(const float* x, int64_t ldx, int64_t K, Fill& fill, T* y, int64_t ldy,
                   int64_t n_valid, const float* bias) {
  VecF acc[R][kPanelVecs];
  for (auto& row : acc)
    for (auto& a : row) a = VecF(0.f);
  for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
    const int64_t k1 = std::min(K, k0 + kSlice);
    tile<R, kPanelVecs>(x, ldx, k0, k1, fill(k0, k1), 0, acc);
  }
  store_tile<R, kPanelVecs>(acc, y, ldy, 0, n_valid, bias);
}

// R rows of x against a panel held whole in fp32 (w = [K][48]), a half at a time.
template <int R, typename T>
void rows_held(const float* x, int64_t ldx, int64_t K, const float* w, T* y, int64_t ldy,
               int64_t n_valid, const float* bias) {
  constexpr int C = kPanelVecs / 2;
  for (int64_t c0 = 0; c0 < kPanel; c0 += C * kLanes) {
    if (c0 >= n_valid) break;
    VecF acc[R][C];
    for (auto& row : acc)
      for (auto& a : row) a = VecF(0.f);
    tile<R, C>(x, ldx, 0, K, w, c0, acc);
    store_tile<R, C>(acc, y, ldy, c0, n_valid, bias);
  }
}

// Rows [0, M) of fp32 x against one panel. Up to 2 rows stream the panel through `fill` slice by
// slice; more rows fill the whole panel once (`fill(0, K)`, into L2) and run 4-row tiles over it.
template <typename T, typename Fill>
void rows_against_panel(const float* x, int64_t ldx, int64_t M, int64_t K, Fill&& fill, T* y,
                        int64_t ldy, int64_t n_valid, const float* bias) {
  if (M == 1) return rows_streamed<1>(x, ldx, K, fill, y, ldy, n_valid, bias);
  if (M == 2) return rows_streamed<2>(x, ldx, K, fill, y, ldy, n_valid, bias);
  const float* w = fill(0, K);
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) rows_held<4>(x + m * ldx, ldx, K, w, y + m * ldy, ldy, n_valid, bias);
  for (; m < M; ++m) rows_held<1>(x + m * ldx, ldx, K, w, y + m * ldy, ldy, n_valid, bias);
}

// Rows of x as fp32 (a copy for bf16; fp32 x is used in place): [M][K], row stride returned.
template <typename T>
const float* rows_as_f32(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t* ld_out) {
  if constexpr (std::is_same_v<T, float>) {
    *ld_out = ldx;
    return x;
  } else {
    float* buf = tessera_tiles::thread_scratch<float, tessera_tiles::Scratch::kPackedRows>(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) buf[m * K + k] = static_cast<float>(x[m * ldx + k]);
    *ld_out = K;
    return buf;
  }
}

// Rows per unit of work: a panel is filled once per unit, so large M takes big row blocks.
constexpr int64_t kRowsPerUnit = 64;

// y[M, N] = x[M, K] @ W^T (+ bias) over num_panels panels; make_fill(p) returns the panel's fill,
// called on the worker thread (its buffers are that thread's). Rows are independent of the batch.
template <typename T, typename MakeFill>
void linear_panels(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t num_panels, int64_t N,
                   T* y, int64_t ldy, const float* bias, MakeFill make_fill) {
  int64_t ld = 0;
  const float* xf = rows_as_f32(x, ldx, M, K, &ld);
  const int64_t rows = std::min(M, kRowsPerUnit);
  const int64_t num_row_blocks = (M + rows - 1) / rows;
  at::parallel_for(0, num_panels * num_row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = u / num_row_blocks, m0 = (u % num_row_blocks) * rows;
      const int64_t n0 = p * kPanel;
      auto fill = make_fill(p);
      rows_against_panel(xf + m0 * ld, ld, std::min(rows, M - m0), K, fill, y + m0 * ldy + n0,
                         ldy, N - n0, bias ? bias + n0 : nullptr);
    }
  });
}

}  // namespace tessera_generic
