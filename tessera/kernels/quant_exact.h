// fp32 activations on GGUF blocks: exact dequantization. The dequantized value of every weight
// is computed exactly as gguf's reference does (q * d + m, where q * d is exact in fp32, so one
// fma rounds once, as its mul + add does). Those values are fed, in the same K order and with the
// same instructions, to the accumulators of the dense tiles in linear_tiles.h. So the result
// equals the dense kernel on gguf-dequantized weights bit for bit, whatever M is: a row does not
// depend on the rows batched with it, and --quantization gguf gives the tokens of none.
//
// Two ways through a panel for fp32, with the same result:
// - registers (few rows): each block is dequantized in registers and used by every row at once;
// - dense (many rows, prefill): the panel is dequantized once into an L2-resident fp32/bf16 dense
//   panel and the dense tiles run over it, at the dense matmul's rate.
// The row count where "dense" starts is chosen by measurement (quant_linear.py, benchmarks/linear.py).
//
// dequant_panel also feeds the AMX path (quant_linear.cpp, run_amx).
#pragma once

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "linear_tiles.h"
#include "quant_formats.h"

namespace tessera_quant {

#if defined(__AVX512F__)

// The fp32 weights of K-positions 2j (w0) and 2j + 1 (w1) of a block, outputs 16v..16v+15.
template <typename F>
inline void dequant_pair(const uint8_t* rec, int j, int v, __m512 sc, __m512 mn, __m512& w0,
                         __m512& w1) {
  if constexpr (F::kBits == 4) {
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * kPanel + 16 * v)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    w0 = _mm512_fmadd_ps(lo, sc, mn);  // q * d is exact: one rounding, as gguf's q * d + m
    w1 = _mm512_fmadd_ps(hi, sc, mn);
  } else {
    const uint8_t* c = rec + 2 * j * kPanel + 16 * v;
    const __m512i b0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    const __m512i b1 =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kPanel)));
    if constexpr (F::kHasMin) {  // codes 0..31: q * d exact, one rounding as gguf's
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b0), sc, mn);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b1), sc, mn);
    } else {
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(b0), sc);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(b1), sc);
    }
  }
}

template <typename F>
inline void block_scales(const uint8_t* rec, __m512* sc, __m512* mn) {
  const uint8_t* sp = rec + F::kCodeBytes;
  for (int v = 0; v < kVecs; ++v) {
    sc[v] = load_scales<typename F::Scale>(sp, v);
    mn[v] = F::kHasMin ? load_scales<typename F::Scale>(sp + F::kScaleBytes, v) : _mm512_setzero_ps();
  }
}

#if defined(__AVX512BF16__)
// (w0, w1) fp32 -> bf16 pairs per output lane: the operand layout of vdpbf16ps and of the dense
// bf16 panels ([K/2][kPanel][2]). Rounds to nearest even, as torch's fp32 -> bf16 cast.
inline __m512i bf16_pairs(__m512 w0, __m512 w1) {
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}
#endif  // __AVX512BF16__

// R rows of fp32 x, packed as linear_tiles.h pack_rows does ([K][R]), against one quantized panel
// (natural layout): each block is dequantized in registers and used by every row, with the
// accumulation of tile_f32 on the dequantized panel.
template <typename F, int R>
void qtile(const float* x, const uint8_t* panel, int64_t K, float* y, int64_t ldy, int64_t n_valid,
           const float* bias) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < K / F::kBlock; ++blk) {
    const uint8_t* rec = panel + blk * F::kRecord;
    prefetch_ahead<F>(rec);
    __m512 sc[kVecs], mn[kVecs];
    block_scales<F>(rec, sc, mn);
    for (int j = 0; j < F::kBlock / 2; ++j) {
      __m512 w0[kVecs], w1[kVecs];
      for (int v = 0; v < kVecs; ++v) dequant_pair<F>(rec, j, v, sc[v], mn[v], w0[v], w1[v]);
      const int64_t k = blk * F::kBlock + 2 * j;  // the K position of w0
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[k * R + r]);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, w0[v], acc[r][v]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[(k + 1) * R + r]);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, w1[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, acc[r], bias);
}

// Blocks [b0, b1) of a panel dequantized into the dense panel layout of T (fp32 [k][kPanel],
// bf16 [k/2][kPanel][2]): the weights the register tiles compute with, so the dense tiles over
// this buffer give the same sums.
template <typename F, typename T>
void dequant_panel(const uint8_t* panel, int64_t b0, int64_t b1, T* out) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* rec = panel + blk * F::kRecord;
    prefetch_ahead<F>(rec);
    __m512 sc[kVecs], mn[kVecs];
    block_scales<F>(rec, sc, mn);
    for (int j = 0; j < F::kBlock / 2; ++j) {
      T* o = out + ((blk - b0) * F::kBlock + 2 * j) * kPanel;  // K position 2j, either layout
      for (int v = 0; v < kVecs; ++v) {
        __m512 w0, w1;
        dequant_pair<F>(rec, j, v, sc[v], mn[v], w0, w1);
        if constexpr (std::is_same_v<T, float>) {
          _mm512_storeu_ps(o + 16 * v, w0);
          _mm512_storeu_ps(o + kPanel + 16 * v, w1);
        } else {
#if defined(__AVX512BF16__)
          _mm512_storeu_si512(o + 32 * v, bf16_pairs(w0, w1));
#endif
        }
      }
    }
  }
}

template <typename F>
struct QTile {
  template <int R>
  static constexpr auto fn = qtile<F, R>;
};

// fp32 x against every panel (natural layout); see the header comment for the two ways through a panel.
template <typename F>
void run_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
             int64_t num_panels, int64_t N, float* y, int64_t ldy, const float* bias,
             int64_t dense_min_rows) {
  using T = float;
  using Fn = void (*)(const T*, const uint8_t*, int64_t, T*, int64_t, int64_t, const float*);
  using DenseFn = void (*)(const T*, const T*, int64_t, const Span&, T*, int64_t, int64_t,
                           const float*, const T*);
  static const auto qtiles = make_tiles<Fn, QTile<F>>();
  static const auto dense_tiles = make_tiles<DenseFn, F32Tile>();
  const T* xp = x;
  if (M > 1 || ldx != K) {  // M == 1 with a contiguous row is already in the packed layout
    T* const packed_x = thread_scratch<T, Scratch::kPackedRows>(M * K);
    pack_rows<T, 1>(x, ldx, M, K, packed_x);
    xp = packed_x;
  }
  const bool dense = dense_min_rows > 0 && M >= dense_min_rows;
  const int64_t rows_per_block = std::min(M, kRowsPerBlock);
  const int64_t num_row_blocks = (M + rows_per_block - 1) / rows_per_block;
  const int64_t units = num_row_blocks * num_panels;
  // Dense way, one row block: each K slice of the panel is dequantized into L1 once and every row
  // tile runs over it. Several row blocks (prefill): the whole panel is dequantized once per thread
  // into an L2 buffer and each row block runs over that.
  const bool whole_panel = dense && num_row_blocks > 1;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    T* const buf = dense ? thread_scratch<T, Scratch::kDequantPanel>(
                               whole_panel ? K * kPanel : kSliceK * kPanel)
                         : nullptr;
    int64_t buf_panel = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = u / num_row_blocks, rb = u % num_row_blocks;
      const int64_t m0 = rb * rows_per_block;
      const int64_t rows = std::min(rows_per_block, M - m0);
      const int64_t n0 = p * kPanel;
      const uint8_t* panel = packed + p * (K / F::kBlock) * F::kRecord;
      T* y0 = y + m0 * ldy + n0;
      const float* b0 = bias ? bias + n0 : nullptr;
      if (!dense) {
        for (int64_t m = 0; m < rows; m += kMaxRows) {
          const int64_t r = std::min<int64_t>(kMaxRows, rows - m);
          qtiles[r](xp + (m0 + m) * K, panel, K, y0 + m * ldy, ldy, N - n0, b0);
        }
        continue;
      }
      if (whole_panel) {
        if (buf_panel != p) {  // units are panel-major: a thread dequantizes each panel once
          dequant_panel<F>(panel, 0, K / F::kBlock, buf);
          buf_panel = p;
        }
        rows_against_panel(xp + m0 * K, rows, buf, K, y0, ldy, N - n0, b0,
                           dense_tiles.data());
        continue;
      }
      float* partial = partial_sums(rows);
      for (int64_t k0 = 0; k0 < K; k0 += kSliceK) {
        const int64_t k1 = std::min(K, k0 + kSliceK);
        dequant_panel<F>(panel, k0 / F::kBlock, k1 / F::kBlock, buf);
        rows_against_slice(xp + m0 * K, rows, K, k0, k1, buf, partial, y0, ldy, N - n0,
                           b0, dense_tiles.data(), static_cast<const T*>(nullptr));
      }
    }
  });
}

#endif  // __AVX512F__

}  // namespace tessera_quant
