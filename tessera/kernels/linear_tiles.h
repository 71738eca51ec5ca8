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
#include <memory>
#include <utility>
#include <vector>

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

// What a thread's scratch buffer holds. Each use has its own buffer, because the calling thread
// is also one of its parallel region's workers: its packed rows must outlive its own tiles'
// partial sums and dequantized panels.
enum class Scratch {
  kPackedRows, kBlockSums, kPartialSums, kDequantPanel, kWideRecords, kXTiles
};

// This thread's buffer for `use`, at least `elems` long: grown when needed, never shrunk and
// never zeroed (every use writes before it reads), so a step's ~120 linear calls allocate nothing.
// A std::vector per call zeroed its packed rows first, up to 12 MB a call (2048 rows of K = 1536
// in fp32) on one thread, and above glibc's mmap threshold faulted in fresh pages as well. The
// packed rows stay allocated at the largest call's size: 12.6 MB at the default token budget.
template <typename T, Scratch use>
T* thread_scratch(int64_t elems) {
  thread_local std::unique_ptr<T[]> buf;
  thread_local int64_t capacity = 0;
  if (capacity < elems) {
    buf.reset(new T[elems]);  // default-initialised: no pass over the memory
    capacity = elems;
  }
  return buf.get();
}

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

#if defined(__AVX512BF16__)
inline void store_row(at::BFloat16* y, int64_t n_valid, __m512* acc, const float* bias) {
  for (int v = 0; v < kVecs; ++v) {
    __m512 a = acc[v];
    if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + 16 * v));
    _mm256_mask_storeu_epi16(y + 16 * v, lanes(n_valid, v), (__m256i)_mm512_cvtneps_pbh(a));
  }
}
#endif

// Where a tile's K range sits in the whole reduction. A tile that covers all of K starts from
// zero and stores y; a slice of K (see rows_against_slice) resumes the fp32 partial sums its
// previous slice left in `partial` ([R][kPanel]) and leaves them there again, until the last slice
// stores y. Storing and reloading fp32 is exact, so a sliced reduction is the same sequence of
// fmas in K order as an unsliced one: bit for bit the same result.
struct Span {
  float* partial;  // [R][kPanel] fp32, or nullptr when the tile covers all of K
  bool first, last;
};

template <int R>
inline void begin_acc(__m512 (&acc)[R][kVecs], const Span& s) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v)
      acc[r][v] = s.first ? _mm512_setzero_ps() : _mm512_loadu_ps(s.partial + r * kPanel + 16 * v);
}

template <int R, typename T>
inline void end_acc(__m512 (&acc)[R][kVecs], const Span& s, T* y, int64_t ldy, int64_t n_valid,
                    const float* bias) {
  if (s.last) {
    for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, acc[r], bias);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(s.partial + r * kPanel + 16 * v, acc[r][v]);
}

// Prefetch distance (K positions) of a single tile streaming a whole panel from memory.
constexpr int64_t kPrefetchK = 16;

// R rows of x, packed [nk][R], against nk K-positions of one fp32 panel [nk][kPanel].
// `prefetch`, when set, is the weight row to pull into L1 at each k (the next slice, or ahead).
template <int R>
void tile_f32(const float* x, const float* panel, int64_t nk, const Span& span, float* y,
              int64_t ldy, int64_t n_valid, const float* bias, const float* prefetch) {
  __m512 acc[R][kVecs];
  begin_acc<R>(acc, span);
  for (int64_t k = 0; k < nk; ++k) {
    const float* w = panel + k * kPanel;
    if (prefetch != nullptr)
      for (int v = 0; v < kVecs; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kPanel + 16 * v), _MM_HINT_T0);
    __m512 wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[k * R + r]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  end_acc<R>(acc, span, y, ldy, n_valid, bias);
}

#if defined(__AVX512BF16__)

// R rows of x, packed [nk/2][R][2], against nk (even) K-positions of a bf16 panel [nk/2][kPanel][2].
template <int R>
void tile_bf16(const at::BFloat16* x, const at::BFloat16* panel, int64_t nk, const Span& span,
               at::BFloat16* y, int64_t ldy, int64_t n_valid, const float* bias,
               const at::BFloat16* prefetch) {
  __m512 acc[R][kVecs];
  begin_acc<R>(acc, span);
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);
  for (int64_t k2 = 0; k2 < nk / 2; ++k2) {
    const at::BFloat16* w = panel + k2 * 2 * kPanel;
    if (prefetch != nullptr)
      for (int v = 0; v < kVecs; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + k2 * 2 * kPanel + 32 * v), _MM_HINT_T0);
    __m512bh wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xpairs[k2 * R + r]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  end_acc<R>(acc, span, y, ldy, n_valid, bias);
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

// Units [u0, u0 + 16) of 8 rows of 32-bit units (fp32 values, or bf16 pairs) into out[k * 8 + r],
// unit k of row r: three rounds that each interleave rows i and i + 4 (lanes 0-7, then 8-15, of
// both). With an element's index written as the bits of (row, unit), one round rotates them left
// by one, so three rounds turn (row, unit) into (unit, row). 24 permutes, 8 loads and 8 stores for
// 128 values, where the scalar regrouping stored one value at a time: it cost 26 us a call at
// M = 64, K = 576 in fp32 (65 us at K = 1536), on one thread while the other waited.
inline void transpose_8x16(const uint32_t* const rows[8], int64_t u0, uint32_t* out) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  __m512i v[8];
  for (int r = 0; r < 8; ++r) v[r] = _mm512_loadu_si512(rows[r] + u0);
  for (int round = 0; round < 3; ++round) {
    __m512i w[8];
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = _mm512_permutex2var_epi32(v[i], lo, v[i + 4]);
      w[2 * i + 1] = _mm512_permutex2var_epi32(v[i], hi, v[i + 4]);
    }
    for (int r = 0; r < 8; ++r) v[r] = w[r];
  }
  for (int r = 0; r < 8; ++r) _mm512_storeu_si512(out + 16 * r, v[r]);
}

// Rows of x regrouped in tiles of kMaxRows (the last one shorter), each tile [K/P][R][P] with
// P = 1 (fp32) or 2 (bf16 pairs): the R values a k-step broadcasts share one cache line, so the
// weight stream passing through L1 does not evict them. Whole 8-row tiles move 16 units at a
// time (transpose_8x16); the rest value by value. Either way a plain copy: the same bytes.
template <typename T, int P>
void pack_rows(const T* x, int64_t ldx, int64_t M, int64_t K, T* out) {
  static_assert(sizeof(T) * P == 4, "a unit (value or pair) is 32 bits");
  const int64_t units = K / P;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t R = std::min<int64_t>(kMaxRows, M - m0);
    T* tile = out + m0 * K;
    int64_t g0 = 0;  // units below g0 are already in place
    if (R == 8) {
      const uint32_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = reinterpret_cast<const uint32_t*>(x + (m0 + r) * ldx);
      uint32_t* out32 = reinterpret_cast<uint32_t*>(tile);
      for (; g0 + 16 <= units; g0 += 16) transpose_8x16(rows, g0, out32 + g0 * 8);
    }
    for (int64_t r = 0; r < R; ++r) {
      const T* row = x + (m0 + r) * ldx;
      for (int64_t g = g0; g < units; ++g)
        for (int p = 0; p < P; ++p) tile[(g * R + r) * P + p] = row[g * P + p];
    }
  }
}

// K positions per slice when several row tiles share a panel: a slice of the panel (12 KB in
// fp32) is loaded from memory once, by the first tile, which also prefetches the next slice, and
// every other tile reads it from L1. Without slicing each 8-row tile streamed the whole panel
// again (from L2 at best), so M = 16-64 paid the weight stream M/8 times.
#ifndef TESSERA_LINEAR_SLICE_K
#define TESSERA_LINEAR_SLICE_K 64
#endif
constexpr int64_t kSliceK = TESSERA_LINEAR_SLICE_K;
static_assert(kSliceK % 32 == 0, "a slice holds whole bf16 pairs and vectors");

// The fp32 partial sums of every row tile of a row block between K slices: [rows][kPanel].
inline float* partial_sums(int64_t rows) {
  return thread_scratch<float, Scratch::kPartialSums>(rows * kPanel);
}

// Rows [0, M) of packed x (tiles of kMaxRows, see pack_rows) against K positions [k0, k1) of a
// panel, given as `w` = that slice ([k1 - k0] rows of the panel layout). `K` is x's full width.
template <typename T, typename TileFn>
void rows_against_slice(const T* xp, int64_t M, int64_t K, int64_t k0, int64_t k1, const T* w,
                        float* partial, T* y, int64_t ldy, int64_t n_valid, const float* bias,
                        TileFn tiles[], const T* prefetch) {
  const Span span{partial, k0 == 0, k1 == K};
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int64_t r = std::min<int64_t>(kMaxRows, M - m);
    Span s = span;
    if (s.partial != nullptr) s.partial += m * kPanel;
    tiles[r](xp + m * K + k0 * r, w, k1 - k0, s, y + m * ldy, ldy, n_valid, bias,
             m == 0 ? prefetch : nullptr);
  }
}

// Rows [0, M) of packed x against a whole dense panel: one tile streams it (prefetching ahead),
// or, for more rows than a tile holds, slice by slice with every tile against each slice.
template <typename T, typename TileFn>
void rows_against_panel(const T* xp, int64_t M, const T* panel, int64_t K, T* y, int64_t ldy,
                        int64_t n_valid, const float* bias, TileFn tiles[]) {
  if (M <= kMaxRows) {
    tiles[M](xp, panel, K, Span{nullptr, true, true}, y, ldy, n_valid, bias,
             panel + kPrefetchK * kPanel);
    return;
  }
  float* partial = partial_sums(M);
  for (int64_t k0 = 0; k0 < K; k0 += kSliceK) {
    const int64_t k1 = std::min(K, k0 + kSliceK);
    rows_against_slice(xp, M, K, k0, k1, panel + k0 * kPanel, partial, y, ldy, n_valid, bias,
                       tiles, panel + k1 * kPanel);
  }
}

#endif  // __AVX512F__

}  // namespace tessera_tiles
