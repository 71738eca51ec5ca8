// bf16 activations on GGUF blocks: the block-sum form. A block's weights are q * d + m, so a row's dot product
// over the block is d * sum(x q) + m * sum(x). The codes themselves are exact bf16 numbers, so
// vdpbf16ps runs on x against the codes, with no dequantization per weight at all: 4-bit codes
// become the bf16 number 128 + q by OR-ing the nibble under the exponent bits of 128 (one shift
// and one ternary-logic op for 32 weights, against ten ops to dequantize, round and interleave
// them), and the 128 comes back out with m' = m - 128 d: d * sum(x (128 + q)) + m' * sum(x).
// One code path serves every M, so rows are independent as before. The products are exact and
// the weights are never rounded to bf16, so this is closer to the fp32 reference than the dense
// bf16 kernel on dequantized weights (which rounds every weight to bf16): the two no longer agree
// bit for bit.
#pragma once

#include <ATen/Parallel.h>

#include <utility>
#include <vector>

#include "quant_formats.h"

namespace tessera_quant {

#if defined(__AVX512BF16__)
// body(std::integral_constant<int, J>{}) for J = 0..N-1: a code pair's index as a compile-time
// constant, so the 4-bit shift below is an immediate.
template <typename Body, int... J>
inline void unroll_impl(Body&& body, std::integer_sequence<int, J...>) {
  (body(std::integral_constant<int, J>{}), ...);
}
template <int N, typename Body>
inline void unroll(Body&& body) {
  unroll_impl(body, std::make_integer_sequence<int, N>{});
}

// The codes of K positions 2J, 2J + 1 of a block, outputs 16t..16t+15, as the bf16 operand of
// vdpbf16ps (one 32-bit lane an output, its two K positions side by side), from the pairs layout:
//   4-bit: 16-bit word 2L + p of the 64 bytes at (J / 4, t) (load_codes) holds, in nibble J % 4,
//          the code of K 2J + p, output 16t + L; it becomes the bf16 number 128 + q (0x4300 | q);
//   8-bit: bytes 32t.. of pair J hold lanes 2L + p in that order; int8 -> fp32 -> bf16 is exact.
template <typename F>
constexpr int kPairsPerLoad = F::kBits == 4 ? 4 : 1;  // 4-bit: one 64-byte load serves 4 pairs

// The 4-bit codes of pairs 4G..4G+3, outputs 16t..16t+15 (unused for 8-bit).
template <typename F, int G>
inline __m512i load_codes(const uint8_t* rec, int t) {
  if constexpr (F::kBits == 4) return _mm512_loadu_si512(rec + (G * kVecs + t) * 64);
  return _mm512_setzero_si512();
}

template <typename F, int J>
inline __m512bh code_pairs(const uint8_t* rec, __m512i z, int t) {
  if constexpr (F::kBits == 4) {
    if constexpr (J % 4 != 0) z = _mm512_srli_epi16(z, 4 * (J % 4));
    // (z & 0x000F) | 0x4300 per 16-bit word
    return (__m512bh)_mm512_ternarylogic_epi32(z, _mm512_set1_epi16(0x000F),
                                               _mm512_set1_epi16(0x4300), 0xEA);
  } else {
    const __m128i* c = reinterpret_cast<const __m128i*>(rec + J * 2 * kPanel + 32 * t);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1)));
    return _mm512_cvtne2ps_pbh(b, a);
  }
}

// R rows of bf16 x (pack_rows: [K/2][R] pairs) against one panel in the block-sum form (see the
// header). `xsum` [R][K / kBlock]: each row's fp32 sum over each block (formats with a min).
template <typename F, int R>
void qtile_blocksum(const at::BFloat16* x, const float* xsum, const uint8_t* panel, int64_t K,
                    at::BFloat16* y, int64_t ldy, int64_t n_valid, const float* bias) {
  static_assert(F::kBits == 8 || F::kHasMin, "the 4-bit form takes the 128 back out with the min");
  const int64_t nb = K / F::kBlock;
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);
  __m512 total[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) total[r][v] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = panel + blk * F::kRecord;
    prefetch_ahead<F>(rec);
    __m512 acc[R][kVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
    const int32_t* xb = xpairs + blk * (F::kBlock / 2) * R;
    constexpr int kLoads = F::kBlock / 2 / kPairsPerLoad<F>;
    unroll<kLoads>([&](auto g) {
      __m512i z[kVecs];
      for (int v = 0; v < kVecs; ++v) z[v] = load_codes<F, g>(rec, v);
      unroll<kPairsPerLoad<F>>([&](auto s) {
        constexpr int j = decltype(g)::value * kPairsPerLoad<F> + decltype(s)::value;
        __m512bh w[kVecs];
        for (int v = 0; v < kVecs; ++v) w[v] = code_pairs<F, j>(rec, z[v], v);
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(xb[j * R + r]);
          for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, w[v]);
        }
      });
    });
    const uint8_t* sp = rec + F::kCodeBytes;
    for (int v = 0; v < kVecs; ++v) {
      const __m512 d = load_scales<typename F::Scale>(sp, v);
      for (int r = 0; r < R; ++r) total[r][v] = _mm512_fmadd_ps(acc[r][v], d, total[r][v]);
      if constexpr (F::kHasMin) {
        const __m512 m = load_scales<typename F::Scale>(sp + F::kScaleBytes, v);
        // 4-bit codes came in as 128 + q: m - 128 d; 8-bit codes (0..31) as themselves
        const __m512 mb =
            F::kBits == 4 ? _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, m) : m;
        for (int r = 0; r < R; ++r)
          total[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * nb + blk]), mb, total[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, total[r], bias);
}

// A bf16 row's fp32 sum over each block of kBlock (32) K positions: the sum(x) of the block-sum
// form, in one fixed order (two 16-lane halves added, then reduced), whatever the batch.
template <typename F>
inline void block_sums(const at::BFloat16* row, int64_t nb, float* out) {
  static_assert(F::kBlock == 32, "blocks with a min are 32 wide");
  const auto widen = [](const at::BFloat16* p) {  // 16 bf16 -> fp32: the bits, shifted up
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  for (int64_t b = 0; b < nb; ++b)
    out[b] = _mm512_reduce_add_ps(_mm512_add_ps(widen(row + 32 * b), widen(row + 32 * b + 16)));
}

#ifndef TESSERA_PANEL_GROUP_BYTES
#define TESSERA_PANEL_GROUP_BYTES (512 * 1024)
#endif
// Weight bytes a thread keeps in L2 while every row block of a large-M call runs against them
// (half of Zen 4's and Zen 5's 1 MiB L2 per core; x's row block of 96 rows takes 110-295 KiB).
constexpr int64_t kPanelGroupBytes = TESSERA_PANEL_GROUP_BYTES;

template <typename F>
struct BlockSumTile {
  template <int R>
  static constexpr auto fn = qtile_blocksum<F, R>;
};

// bf16 x [M, K] against every panel (pairs layout), in the block-sum form: one way for every M.
// Measured against exact dequantization (registers below 16 rows, dense panels above), 30 layers
// of the default model's Q4_1 shapes (benchmarks/quant_linear.py): 0.62x the time at M = 1, 0.67x
// at 8, 0.72x at 16, 0.87x at 64, the same at 512.
template <typename F>
void run_blocksum(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
                  int64_t num_panels, int64_t N, at::BFloat16* y, int64_t ldy, const float* bias) {
  using Fn = void (*)(const at::BFloat16*, const float*, const uint8_t*, int64_t, at::BFloat16*,
                      int64_t, int64_t, const float*);
  static const auto tiles = make_tiles<Fn, BlockSumTile<F>>();
  const int64_t nb = K / F::kBlock;
  at::BFloat16* const xp = thread_scratch<at::BFloat16, Scratch::kPackedRows>(M * K);
  // [M][nb]: each row's sum over each block (formats with a min)
  float* const xsum = F::kHasMin ? thread_scratch<float, Scratch::kBlockSums>(M * nb) : nullptr;
  // Packing and block sums go row tile by row tile, split over the threads from two tiles up.
  // As one thread's scalar loop they cost 2-11% of the call at M = 8-512 (alternated in-process
  // against it: 0.94x at M = 8, 0.93x at 16, 0.89x at 64, 0.92x at 512).
  const int64_t num_tiles = (M + kMaxRows - 1) / kMaxRows;
  const auto prepare = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * kMaxRows, rows = std::min<int64_t>(kMaxRows, M - m0);
      pack_rows<at::BFloat16, 2>(x + m0 * ldx, ldx, rows, K, xp + m0 * K);
      if constexpr (F::kHasMin)
        for (int64_t m = m0; m < m0 + rows; ++m) block_sums<F>(x + m * ldx, nb, xsum + m * nb);
    }
  };
  if (num_tiles < 2) prepare(0, num_tiles);
  else at::parallel_for(0, num_tiles, 1, prepare);
  const int64_t rows_per_block = std::min(M, kRowsPerBlock);
  const int64_t num_row_blocks = (M + rows_per_block - 1) / rows_per_block;
  const int64_t panel_bytes = nb * F::kRecord;
  const int64_t group = std::max<int64_t>(1, kPanelGroupBytes / panel_bytes);
  const auto unit = [&](int64_t p, int64_t rb) {
    const int64_t m0 = rb * rows_per_block;
    const int64_t rows = std::min(rows_per_block, M - m0), n0 = p * kPanel;
    const uint8_t* panel = packed + p * panel_bytes;
    for (int64_t m = m0; m < m0 + rows; m += kMaxRows) {
      const int64_t r = std::min<int64_t>(kMaxRows, m0 + rows - m);
      tiles[r](xp + m * K, xsum == nullptr ? nullptr : xsum + m * nb, panel, K,
               y + m * ldy + n0, ldy, N - n0, bias ? bias + n0 : nullptr);
    }
  };
  // Units (panel, row block) are numbered panel-major, and each thread gets a contiguous range:
  // its own share of the weights. It walks that share a group of panels at a time (about
  // kPanelGroupBytes, kept in L2), every row block against the group, so x streams from L3 once
  // a group and not once a panel. There is nothing to dequantize here, so a panel costs nothing
  // to revisit; the order changes no result (every unit writes its own outputs).
  at::parallel_for(0, num_row_blocks * num_panels, 1, [&](int64_t begin, int64_t end) {
    const int64_t p_end = (end - 1) / num_row_blocks + 1;
    for (int64_t g0 = begin / num_row_blocks; g0 < p_end; g0 += group)
      for (int64_t rb = 0; rb < num_row_blocks; ++rb)
        for (int64_t p = g0; p < std::min(p_end, g0 + group); ++p) {
          const int64_t u = p * num_row_blocks + rb;
          if (u >= begin && u < end) unit(p, rb);
        }
  });
}
#endif  // __AVX512BF16__

}  // namespace tessera_quant
