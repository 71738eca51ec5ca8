// The integer path for GGUF weights (`--quantization gguf_int8`): llama.cpp's numeric form.
//
// Why: the exact path (quant_exact.h, quant_blocksum.h) turns every weight into a float before
// its product; at batch 1 that conversion, not memory, bounds the step on AVX2. Here each row of
// x is quantized once a call to Q8 blocks of 32 (int8 codes, one fp32 scale, the codes' sum), and
// each block's products run on integer instructions (vpdpbusd on AVX-512 VNNI, 256-bit;
// vpmaddubsw + vpmaddwd on AVX2; plain C++ in the portable build). The weights never leave
// their codes. `--quantization gguf_int8_a16` adds a second plane of codes, each block's
// rounding residual, and runs the same products on it (QRow in quant_int8_kinds.h): 16 bits of
// x, which keep the float model's greedy tokens.
//
// Every kind interleaves 8 output rows a record (quant_int8.py): 32-bit lane r of the products
// is output row r; 4 bytes of x broadcast against 4 codes of each of the 8 rows, 8 such
// instructions a block, give the block's exact integer sums of 8 outputs at once (S8F2: one sum
// a half of 16); the scales then apply once a block as vectors (8 d, 8 m). ~4x fewer instructions
// than one output a dot product.
//
// Row independence: a row's codes, scale and sums come from that row alone, and its outputs are
// one chain of fmas over its blocks in K order, whatever rows are batched with it (the integer
// sums are exact), so greedy results do not depend on the batch. Each build (ISA) has its own
// rounding order.
//
// The kinds and their records: quant_int8_kinds.h; the group loop of each build:
// quant_int8_avx2.h (AVX2, AVX-512 VNNI) and quant_int8_portable.h; AMX-INT8 tiles:
// quant_int8_amx.h.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "linear_tiles.h"
#include "quant_int8_avx2.h"
#include "quant_int8_kinds.h"
#include "quant_int8_pairs.h"
#include "quant_int8_portable.h"

namespace tessera_int8 {

// Row n of a weight of kind F as gguf's values (the embedding lookup of a tied lm_head): code
// * d + m, or code * d for the signed kinds (d of the code's half for S8F2). code * d is exact
// (d has at most ~19 significant bits, the code 5), so the fma's one rounding equals
// dequantize_int8's mul + add.
template <typename F, typename T>
void int8_row(const uint8_t* w, int64_t K, int64_t n, T* out) {
  const int64_t nb = K / kQK;
  const int64_t r = n % kCols;
  const uint8_t* rec = w + (n / kCols) * nb * F::kRecord;
  for (int64_t b = 0; b < nb; ++b, rec += F::kRecord, out += kQK) {
    const float d = scale_of<F>(rec, b, static_cast<int>(r));
    float m = 0.f, d1 = d;  // the min (unsigned kinds); the second half's scale (Q6_K)
    if constexpr (!F::kSigned) m = min_at<F>(rec, b, static_cast<int>(r));
    if constexpr (F::kGroups == 2) d1 = scale_of<F>(rec, b, static_cast<int>(kCols + r));
    for (int t = 0; t < 8; ++t) {
      for (int i = 0; i < 4; ++i) {
        const float q = static_cast<float>(code_at<F>(rec, t, static_cast<int>(4 * r + i)));
        if constexpr (F::kSigned) {
          out[4 * t + i] = static_cast<T>(q * (t >= 4 ? d1 : d));
        } else {
          out[4 * t + i] = static_cast<T>(std::fma(q, d, m));
        }
      }
    }
  }
}

// The kind a super-block kind's records widen to: fp32 d and m a block, and the same codes
// (K4S's nibbles, or K5S's 5-bit codes a byte each).
template <typename F>
using WideOf = std::conditional_t<F::kHighBits, U8F, K4SWide>;

// A group's records of super-block kind F as WideOf<F> ones (the same fp32 scales, mins and
// codes, bit for bit).
template <typename F>
inline void widen_super(const uint8_t* w, int64_t nb, uint8_t* out) {
  using W = WideOf<F>;
  for (int64_t b = 0; b < nb; ++b, w += F::kRecord, out += W::kRecord) {
    float d[kCols], m[kCols];
    for (int r = 0; r < kCols; ++r) {
      d[r] = scale_of<F>(w, b, r);
      m[r] = min_at<F>(w, b, r);
    }
    std::memcpy(out, d, sizeof(d));
    std::memcpy(out + sizeof(d), m, sizeof(m));
    if constexpr (F::kHighBits) {
      for (int t = 0; t < 8; ++t)
        for (int p = 0; p < 32; ++p) out[W::kHead + 32 * t + p] = code_at<F>(w, t, p);
    } else {
      std::memcpy(out + W::kHead, w + F::kHead, F::kChunks * 32);
    }
  }
}

// Rows [m_begin, M) of x against the group of 8 output rows at wg (its records stay in L1),
// kXRows at a time: y[m][n0 + c] for the group's outputs below N.
template <typename F, typename T>
inline void group_rows(const uint8_t* wg, int64_t nb, const QRow* rows, int64_t m_begin, int64_t M,
                       T* y, int64_t ldy, int64_t n0, int64_t N, const float* bias) {
  if constexpr (F::kSuper) {
    // more than one pass: the scales (d sc, -dmin m) and K5S's codes decoded once for all of
    // them, not in every pass (K4S: AVX2 prefill ran 9-13% slower computing them each pass)
    if (M - m_begin > kXRows) {
      uint8_t* wide = tessera_tiles::thread_scratch<uint8_t, tessera_tiles::Scratch::kWideRecords>(
          nb * WideOf<F>::kRecord);
      widen_super<F>(wg, nb, wide);
      group_rows<WideOf<F>>(wide, nb, rows, m_begin, M, y, ldy, n0, N, bias);
      return;
    }
  }
  float out[kXRows][kCols];
  const int64_t cols = std::min(kCols, N - n0);
  auto store = [&](int64_t m, int nrows) {
    for (int r = 0; r < nrows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        y[(m + r) * ldy + n0 + c] = static_cast<T>(bias ? out[r][c] + bias[n0 + c] : out[r][c]);
  };
  int64_t m = m_begin;
  for (; m + kXRows <= M; m += kXRows) {
    dot_group<F, kXRows>(wg, nb, rows + m, out);
    store(m, kXRows);
  }
  for (; m < M; ++m) {
    dot_group<F, 1>(wg, nb, rows + m, out);
    store(m, 1);
  }
}

// Bytes of packed x a block of tiles of run_int8_pairs holds: they stay in L2 while the thread's
// pairs of groups meet them (L2 is 1 MiB a core on Zen 4).
constexpr int64_t kRowBlockBytes = 192 * 1024;

#if defined(TESSERA_INT8_PAIRS)
// Tiles [t0, t1) of x (packed, xt) against the pair of groups at wa, wb (outputs n0 .. n0 + 15):
// y rows 8 t0 .. min(M, 8 t1).
template <typename F, typename T>
void pair_tiles(const uint8_t* wa, const uint8_t* wb, int64_t nb, const TileBlock* xt, bool two,
                int64_t t0, int64_t t1, int64_t M, T* y, int64_t ldy, int64_t n0, int64_t N,
                const float* bias) {
  float out[kTileRows8][kPairCols16];
  const int64_t cols = std::min<int64_t>(kPairCols16, N - n0);
  for (int64_t t = t0; t < t1; ++t) {
    if (two) {
      dot_pair_tile<F, true>(wa, wb, nb, xt + t * nb, t == t0, out);
    } else {
      dot_pair_tile<F, false>(wa, wb, nb, xt + t * nb, t == t0, out);
    }
    const int64_t rows = std::min<int64_t>(kTileRows8, M - t * kTileRows8);
    for (int64_t r = 0; r < rows; ++r) {
      T* yr = y + (t * kTileRows8 + r) * ldy + n0;
      for (int64_t c = 0; c < cols; ++c)
        yr[c] = static_cast<T>(bias ? out[r][c] + bias[n0 + c] : out[r][c]);
    }
  }
}

// From how many rows run_int8_groups takes the pairs loop: a tile is 8 rows whatever M is, so
// below that it computes rows it drops. All 121 linears of the default model at M rows (Zen 4,
// two threads, best of 7, time against M = 4 on the group loop in the same process): the group
// loop +23% at M = 5, ~+45% at 6, ~+70% at 7; the pairs loop +35%, +38%, +42%.
constexpr int64_t kPairsMinRows = 6;

// run_int8_groups from kPairsMinRows rows on an AVX-512 VNNI build (quant_int8_pairs.h): x
// packed into tiles of 8 rows once, then each pair of groups meets a block of tiles at a time
// (the block's tiles stay in L2, as run_int8_groups' rows do); an odd last group takes
// group_rows.
template <typename F, typename T>
void run_int8_pairs(int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y, int64_t ldy,
                    const float* bias, const QRow* rows) {
  const int64_t nb = K / kQK, groups = (N + kCols - 1) / kCols, group_bytes = nb * F::kRecord;
  const int64_t tiles = (M + kTileRows8 - 1) / kTileRows8;
  TileBlock* xt = tessera_tiles::thread_scratch<TileBlock, tessera_tiles::Scratch::kXTiles>(
      tiles * nb);
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      pack_tile<F::kSigned>(rows + t * kTileRows8,
                            std::min<int64_t>(kTileRows8, M - t * kTileRows8), nb, xt + t * nb);
  });
  const bool two = rows[0].lo != nullptr;
  const int64_t block = std::max<int64_t>(
      1, kRowBlockBytes / static_cast<int64_t>(nb * sizeof(TileBlock)));  // tiles
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    using W = WideOf<F>;
    uint8_t* wide = nullptr;
    if constexpr (F::kSuper)
      wide = tessera_tiles::thread_scratch<uint8_t, tessera_tiles::Scratch::kWideRecords>(
          2 * nb * W::kRecord);
    for (int64_t t0 = 0; t0 < tiles; t0 += block) {
      const int64_t t1 = std::min(tiles, t0 + block);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t g = 2 * p;
        const uint8_t* wa = w + g * group_bytes;
        if (g + 1 == groups) {
          group_rows<F>(wa, nb, rows, t0 * kTileRows8, std::min(M, t1 * kTileRows8), y, ldy,
                        g * kCols, N, bias);
        } else if constexpr (F::kSuper) {
          widen_super<F>(wa, nb, wide);
          widen_super<F>(wa + group_bytes, nb, wide + nb * W::kRecord);
          pair_tiles<W>(wide, wide + nb * W::kRecord, nb, xt, two, t0, t1, M, y, ldy, g * kCols,
                        N, bias);
        } else {
          pair_tiles<F>(wa, wa + group_bytes, nb, xt, two, t0, t1, M, y, ldy, g * kCols, N,
                        bias);
        }
      }
    }
  });
}
#endif

// y[M, N] (row stride ldy) = x @ W^T (+ bias) for an interleaved kind: each group of 8 output
// rows meets every row of x (group_rows), or, from kPairsMinRows rows on an AVX-512 VNNI build,
// the pairs loop.
template <typename F, typename T>
void run_int8_groups(int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y, int64_t ldy,
                     const float* bias, const QRow* rows) {
#if defined(TESSERA_INT8_PAIRS)
  if (M >= kPairsMinRows) return run_int8_pairs<F>(M, K, w, N, y, ldy, bias, rows);
#endif
  const int64_t nb = K / kQK, groups = (N + kCols - 1) / kCols, group_bytes = nb * F::kRecord;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      group_rows<F>(w + g * group_bytes, nb, rows, 0, M, y, ldy, g * kCols, N, bias);
  });
}

}  // namespace tessera_int8
