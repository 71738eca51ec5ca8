// Dense tiles of the CPU linear kernels, shared by linear.cpp (fp32/bf16 weights) and
// quant_linear.cpp (GGUF blocks): one home for the panel layout and the per-row reduction order.
//
// Layout: W is packed into panels of kPanel (48) output features. fp32: [N/48][K][48]; bf16:
// [N/48][K/2][48][2] (pairs along K, the operand layout of vdpbf16ps). Each output is one dot
// product accumulated in K order in fp32, whatever M is: a row's result does not depend on the
// rows batched with it. quant_linear.cpp relies on it: it dequantizes GGUF blocks into exactly
// these panels (in registers, or into a buffer for many rows) and accumulates in the same order,
// so its results equal these tiles' on the dequantized weights, bit for bit.
//
// Both kernel sources are hashed into each build key (build.py `depends`), so editing this header
// rebuilds both.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessera_tiles {

#ifndef TESSERA_LINEAR_VECS
#define TESSERA_LINEAR_VECS 3
#endif
#ifndef TESSERA_LINEAR_ROWS
#define TESSERA_LINEAR_ROWS 8
#endif
constexpr int kVecs = TESSERA_LINEAR_VECS;     // 16-lane vectors per panel
constexpr int64_t kPanel = 16 * kVecs;         // output features per panel
constexpr int64_t kMaxRows = TESSERA_LINEAR_ROWS;  // rows per micro-tile: kVecs * rows accumulators
// 3 x 8 measured best of 2x12, 3x8, 4x6 on Zen4 (fewer x broadcasts per FMA than 2x12, and 48-wide
// panels still split evenly over two threads for the default model's shapes).
constexpr int64_t kRowsPerBlock = 96;  // rows of x kept in L2 while the panels stream past them
static_assert(kRowsPerBlock % kMaxRows == 0, "row blocks must hold whole micro-tiles");

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

#if defined(__AVX512F__)

inline __mmask16 lanes(int64_t n_valid, int v) {
  const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, n_valid - 16 * v));
  return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

// One row of a tile's result: bias (padded to the panel width) added in fp32, then stored.
inline void store_row(float* y, int64_t n_valid, __m512* acc, const float* bias) {
  for (int v = 0; v < kVecs; ++v) {
    __m512 a = acc[v];
    if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + 16 * v));
    _mm512_mask_storeu_ps(y + 16 * v, lanes(n_valid, v), a);
  }
}

// R rows of x, packed [K][R], against one fp32 panel [K][kPanel].
template <int R>
void tile_f32(const float* x, const float* panel, int64_t K, float* y, int64_t ldy,
              int64_t n_valid, const float* bias) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    __m512 wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[k * R + r]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, acc[r], bias);
}

#if defined(__AVX512BF16__)
inline void store_row(at::BFloat16* y, int64_t n_valid, __m512* acc, const float* bias) {
  for (int v = 0; v < kVecs; ++v) {
    __m512 a = acc[v];
    if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + 16 * v));
    _mm256_mask_storeu_epi16(y + 16 * v, lanes(n_valid, v), (__m256i)_mm512_cvtneps_pbh(a));
  }
}

// R rows of x, packed [K/2][R][2], against one bf16 panel [K/2][kPanel][2].
template <int R>
void tile_bf16(const at::BFloat16* x, const at::BFloat16* panel, int64_t K,
               at::BFloat16* y, int64_t ldy, int64_t n_valid, const float* bias) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t K2 = K / 2;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const at::BFloat16* w = panel + k2 * 2 * kPanel;
    __m512bh wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (k2 * R + r) * 2, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, acc[r], bias);
}
#endif  // __AVX512BF16__

// Table of tile functions indexed by row count 1..kMaxRows (entry 0 unused).
struct F32Tile {
  template <int R>
  static constexpr auto fn = tile_f32<R>;
};
#if defined(__AVX512BF16__)
struct Bf16Tile {
  template <int R>
  static constexpr auto fn = tile_bf16<R>;
};
#endif
template <typename Fn, typename Tile, size_t... R>
std::array<Fn, kMaxRows + 1> make_tiles_impl(std::index_sequence<R...>) {
  return {nullptr, Tile::template fn<static_cast<int>(R) + 1>...};
}
template <typename Fn, typename Tile>
std::array<Fn, kMaxRows + 1> make_tiles() {
  return make_tiles_impl<Fn, Tile>(std::make_index_sequence<kMaxRows>{});
}

// Rows of x regrouped in tiles of kMaxRows (the last one shorter), each tile [K/P][R][P] with
// P = 1 (fp32) or 2 (bf16 pairs): the R values a k-step broadcasts share one cache line, so the
// weight stream passing through L1 does not evict them.
template <typename T, int P>
void pack_rows(const T* x, int64_t ldx, int64_t M, int64_t K, T* out) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t R = std::min<int64_t>(kMaxRows, M - m0);
    T* tile = out + m0 * K;
    for (int64_t r = 0; r < R; ++r) {
      const T* row = x + (m0 + r) * ldx;
      for (int64_t g = 0; g < K / P; ++g)
        for (int p = 0; p < P; ++p) tile[(g * R + r) * P + p] = row[g * P + p];
    }
  }
}

// Rows [0, M) of packed x (M a multiple of kMaxRows unless it is the last run) against a panel.
template <typename T, typename TileFn>
void rows_against_panel(const T* xp, int64_t M, const T* panel, int64_t K, T* y, int64_t ldy,
                        int64_t n_valid, const float* bias, TileFn tiles[]) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int64_t r = std::min<int64_t>(kMaxRows, M - m);
    tiles[r](xp + m * K, panel, K, y + m * ldy, ldy, n_valid, bias);
  }
}

#endif  // __AVX512F__

}  // namespace tessera_tiles
