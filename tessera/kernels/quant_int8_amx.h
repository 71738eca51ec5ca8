// AMX-INT8 tiles for the integer path's interleaved kinds (quant_int8.h: Q4H = Q4_0, U4H = Q4_1,
// K4S = Q4_K, K5S = Q5_K, U8F = Q5_1, S8H = Q8_0, S8F2 = Q6_K), 16 rows of x at a time.
//
// Why: at 16 rows and more the VNNI loop is bound by its instructions, not by memory (decode at
// batch 64 spent 55 ms of a 95 ms bf16 step in the int8 linears, against 23 ms for the same
// weights on AMX's bf16 tiles). One tdpbsud does 16 x 16 x 32 products: a whole Q8 block of 16
// rows against 16 outputs, where the VNNI loop needs 256 instructions plus the broadcasts.
// Measured on one thread (Sapphire Rapids, the default model's four Q4_1 shapes x 30 layers):
// 1.4x the VNNI loop's speed at 16 and 64 rows, 1.6-1.8x at 256 and 2048 (fp32 and bf16 x).
// What bounds it is each block's round trip (product, tile store, 16 rows scaled in vectors):
// with the scaling removed it ran only 1.6x faster, and three products in flight instead of two
// changed nothing.
//
// Same bits as the VNNI loop. A tile computes each (row, output, block) integer sum exactly,
// the same integers vpdpbusd builds; the scales are then applied per lane with the VNNI loop's
// own operations in its order (fma(sum, d * dx), then fma(m, dx * sum(qx)) for the unsigned
// kinds), block after block. So a row's result does not depend on whether its call had 16 rows
// (tiles) or fewer (VNNI): rows past the last whole 16, and an odd last group of 8 outputs, run
// the VNNI loop, and the batch-invariance tests compare the two.
//
// Tiles (one K block of 32 per product, because each block has its own scales):
//   0, 3  C  int32 [16 rows][16 outputs]   (two, so one block's product overlaps the other's
//                                             scaling)
//   1, 4  A  int8  [16 rows][32 K]         the rows' Q8 codes, read in place (row stride K)
//   2, 5  B  [8 K quads][16 outputs x 4]  two groups' codes side by side, expanded from their
//                                         records once per call into this thread's scratch
//   6, 7  C  int32 [16 rows][16 outputs]   rows held to 16 bits (QRow's residual plane): the
//                                         residual codes' sums, a product of their own against
//                                         the same B, reloading A; kLoScale C + this, exact
// Signed codes (S8H, S8F2) use tdpbssd, unsigned codes (0..15, 0..31) tdpbsud: no sign trick
// needed. S8F2 (Q6_K) has a scale for each half of a block: each half is a product of its own,
// against a B tile whose other half's rows are zero, so its sum stays apart as in the VNNI loop.
#pragma once

#include "linear_amx.h"
#include "quant_int8.h"

#include <type_traits>

#if defined(TESSERA_HAVE_AMX) && defined(__AMX_INT8__) && defined(TESSERA_INT8_AVX2) && \
    defined(__AVX512DQ__)
#define TESSERA_HAVE_AMX_INT8 1

namespace tessera_int8 {

constexpr int64_t kTileRows = 16;             // rows of x a tile
constexpr int64_t kPairCols = 2 * kCols;      // outputs a tile: two interleaved groups
constexpr int64_t kBBlockBytes = 8 * 64;      // one block's B tile
#ifndef TESSERA_INT8_PAIR_MAJOR_ROWS
#define TESSERA_INT8_PAIR_MAJOR_ROWS 256
#endif
constexpr int64_t kPairMajorRows = TESSERA_INT8_PAIR_MAJOR_ROWS;  // see run_int8_groups_amx
#ifndef TESSERA_INT8_EXPANDED_BYTES
#define TESSERA_INT8_EXPANDED_BYTES (1 << 20)
#endif
constexpr int64_t kExpandedBytes = TESSERA_INT8_EXPANDED_BYTES;  // a thread's expanded B, in L2

inline void amx_int8_configure() {
  tessera_tiles::TileConfig cfg;
  for (int t : {0, 3, 6, 7}) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  for (int t : {1, 4}) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = kQK;
  }
  for (int t : {2, 5}) {
    cfg.rows[t] = kQK / 4;
    cfg.colsb[t] = 64;
  }
  tessera_tiles::load_tile_config(cfg);
}

// One block of groups ga and gb as a B tile: row t holds K positions 4t..4t+3, bytes 4c..4c+3
// output c (outputs 0-7 from ga, 8-15 from gb). A byte-code chunk t is already row t of its group;
// a nibble chunk t holds row t (low nibbles) and row t + 4 (high nibbles).
template <typename F>
inline void expand_block(const uint8_t* ga, const uint8_t* gb, uint8_t* out) {
  if constexpr (F::kGroups == 2) {  // two tiles: rows 0-3 (K 0..15) with 4-7 zero, then the other half
    std::memset(out, 0, 2 * kBBlockBytes);
    for (int t = 0; t < 8; ++t) {
      uint8_t* row = out + (t < 4 ? 0 : kBBlockBytes) + 64 * t;
      std::memcpy(row, ga + F::kHead + 32 * t, 32);
      std::memcpy(row + 32, gb + F::kHead + 32 * t, 32);
    }
    return;
  }
  const uint8_t* ca = ga + F::kHead;
  const uint8_t* cb = gb + F::kHead;
  auto load = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  auto store = [](uint8_t* p, __m256i v) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(p), v);
  };
  if constexpr (!F::kNibbles) {  // chunk t is row t already
    for (int t = 0; t < 8; ++t) {
      store(out + 64 * t, load(ca + 32 * t));
      store(out + 64 * t + 32, load(cb + 32 * t));
    }
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    __m256i a[8], b[8];
    for (int t = 0; t < 4; ++t) {
      const __m256i ra = load(ca + 32 * t), rb = load(cb + 32 * t);
      a[t] = _mm256_and_si256(ra, low);
      b[t] = _mm256_and_si256(rb, low);
      a[t + 4] = _mm256_and_si256(_mm256_srli_epi16(ra, 4), low);
      b[t + 4] = _mm256_and_si256(_mm256_srli_epi16(rb, 4), low);
    }
    if constexpr (F::kHighBits) {
      add_high_bits(ga + F::kHighOffset, a);
      add_high_bits(gb + F::kHighOffset, b);
    }
    for (int t = 0; t < 8; ++t) {
      store(out + 64 * t, a[t]);
      store(out + 64 * t + 32, b[t]);
    }
  }
}

// The 16 outputs' scales d and second scales e (block_scales8) of block b's records ga, gb.
template <typename F>
inline void block_scales16(const uint8_t* ga, const uint8_t* gb, int64_t b, __m512* d,
                           __m512* e) {
  __m256 da, ea, db, eb, sda = _mm256_setzero_ps(), sma = sda, sdb = sda, smb = sda;
  if constexpr (F::kSuper) {
    const int64_t back = (b % F::kSuperBlocks) * F::kRecord;
    load_super8<F>(ga - back, &sda, &sma);
    load_super8<F>(gb - back, &sdb, &smb);
  }
  block_scales8<F>(ga, sda, sma, &da, &ea);
  block_scales8<F>(gb, sdb, smb, &db, &eb);
  *d = _mm512_insertf32x8(_mm512_castps256_ps512(da), db, 1);
  *e = _mm512_insertf32x8(_mm512_castps256_ps512(ea), eb, 1);
}

// acc[r] += block b's sums (c, [16][16] int32) times the scales d (and the mins e, unsigned
// kinds), for 16 rows: the VNNI loop's operations (dot_group), lane by lane. With the residual
// plane's sums c_lo (kLo), the block's sum is kLoScale c + c_lo: one fma forms it exactly (both
// converted exactly, |c| < 2^24) and rounds it once, as the VNNI loop converts its int32 sum.
// dx, dsum: the first row's entries for this block (QRow), rows nb apart.
template <typename F, bool kLo>
__attribute__((always_inline)) inline void scale_block(const int32_t* c, const int32_t* c_lo,
                                                       __m512 d, __m512 e, const float* dx,
                                                       const float* dsum, int64_t nb,
                                                       __m512* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
    if constexpr (kLo)
      s = _mm512_fmadd_ps(s, _mm512_set1_ps(static_cast<float>(kLoScale)),
                          _mm512_cvtepi32_ps(_mm512_load_si512(c_lo + 16 * r)));
    acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb])), acc[r]);
  }
  if constexpr (!F::kSigned) {
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r)
      acc[r] = _mm512_fmadd_ps(e, _mm512_set1_ps(dsum[r * nb]), acc[r]);
  }
}

// Block product on tile set S (C = 3 S, A = 3 S + 1, B = 3 S + 2): the block's 16 rows of codes
// (row stride K) against its B tile; with the residual codes lo, their product too, in C tile
// 6 + S. GCC's tile intrinsics paste their operands into the instruction's text, so the tile
// numbers are literals.
template <typename F, int S, bool kLo>
__attribute__((always_inline)) inline void block_product(const int8_t* a, const int8_t* lo,
                                                         int64_t K, const uint8_t* bt) {
  if constexpr (S == 0) {
    _tile_zero(0);
    _tile_loadd(1, a, K);
    _tile_loadd(2, bt, 64);
    if constexpr (F::kSigned) _tile_dpbssd(0, 1, 2); else _tile_dpbsud(0, 1, 2);
    if constexpr (kLo) {
      _tile_zero(6);
      _tile_loadd(1, lo, K);
      if constexpr (F::kSigned) _tile_dpbssd(6, 1, 2); else _tile_dpbsud(6, 1, 2);
    }
  } else {
    _tile_zero(3);
    _tile_loadd(4, a, K);
    _tile_loadd(5, bt, 64);
    if constexpr (F::kSigned) _tile_dpbssd(3, 4, 5); else _tile_dpbsud(3, 4, 5);
    if constexpr (kLo) {
      _tile_zero(7);
      _tile_loadd(4, lo, K);
      if constexpr (F::kSigned) _tile_dpbssd(7, 4, 5); else _tile_dpbsud(7, 4, 5);
    }
  }
}

// The two groups at ga, gb (nb block records each) made ready for the tiles, once a call: their
// B tiles (nb * kGroups of them, into bbuf, 64-byte aligned) and every unit's scales d and e
// (into sbuf, 32 floats a unit; S8F2's second half has its scales as d). A unit u is block
// u / kGroups (its half u % kGroups).
template <typename F>
void expand_pair(const uint8_t* ga, const uint8_t* gb, int64_t nb, uint8_t* bbuf, float* sbuf) {
  constexpr int64_t G = F::kGroups;
  for (int64_t b = 0; b < nb; ++b) {
    expand_block<F>(ga + b * F::kRecord, gb + b * F::kRecord, bbuf + b * G * kBBlockBytes);
    __m512 d, e;
    block_scales16<F>(ga + b * F::kRecord, gb + b * F::kRecord, b, &d, &e);
    for (int64_t h = 0; h < G; ++h) {
      _mm512_storeu_ps(sbuf + 32 * (b * G + h), h ? e : d);
      _mm512_storeu_ps(sbuf + 32 * (b * G + h) + 16, e);
    }
  }
}

// Rows [m_begin, m_end) (multiples of 16) of x's codes q ([M][K], row stride K; with kLo, the
// residual plane's lo the same way) against one expanded pair of groups (expand_pair):
// y[m][n0 + c] for c < cols. `prefetch_codes`: the rows' codes are not in L1 (the first pair
// they meet).
template <typename F, bool kLo, typename T>
void tile_pair(const uint8_t* bbuf, const float* sbuf, int64_t nb, const int8_t* q,
               const int8_t* lo, int64_t K, const float* dx, const float* dsum, int64_t m_begin,
               int64_t m_end, T* y, int64_t ldy, int64_t n0, int64_t cols, const float* bias,
               bool prefetch_codes) {
  constexpr int64_t G = F::kGroups;
  const int64_t units = nb * G;
  // three buffers of C: unit u's tiles are stored while u + 1's product runs, and scaled one
  // unit later still, so no load waits on a tile store just issued
  alignas(64) int32_t c[3][kTileRows * kPairCols], c_lo[3][kTileRows * kPairCols];
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kTileRows) {
    // the 16 rows' accumulators stay in registers: every helper below is inlined
    __m512 acc[kTileRows];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const int8_t* qg = q + m0 * K;
    const int8_t* lg = kLo ? lo + m0 * K : nullptr;
    const float* dxg = dx + m0 * nb;
    const float* dsg = dsum + m0 * nb;
    auto scale = [&](int64_t u) __attribute__((always_inline)) {
      const float* su = sbuf + 32 * u;
      scale_block<F, kLo>(c[u % 3], c_lo[u % 3], _mm512_loadu_ps(su), _mm512_loadu_ps(su + 16),
                          dxg + u / G, dsg + u / G, nb, acc);
    };
    // unit u's C tiles (set u % 2) into buffer u % 3
    auto store = [&](int64_t u) __attribute__((always_inline)) {
      if (u & 1) {
        _tile_stored(3, c[u % 3], 64);
        if constexpr (kLo) _tile_stored(7, c_lo[u % 3], 64);
      } else {
        _tile_stored(0, c[u % 3], 64);
        if constexpr (kLo) _tile_stored(6, c_lo[u % 3], 64);
      }
    };
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* bt = bbuf + u * kBBlockBytes;
      const int8_t* au = qg + u / G * kQK;
      const int8_t* lu = kLo ? lg + u / G * kQK : nullptr;
      // the rows' next cache line of codes into L1 ahead of its tile loads, which otherwise wait
      // on L2 for 16 lines each (pair by pair, a tile's codes are not in L1)
      if (prefetch_codes && u % (2 * G) == 0 && (u / G + 2) * kQK < K) {
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(au + r * K + 2 * kQK), _MM_HINT_T0);
          if constexpr (kLo)
            _mm_prefetch(reinterpret_cast<const char*>(lu + r * K + 2 * kQK), _MM_HINT_T0);
        }
      }
      if (u & 1) {
        block_product<F, 1, kLo>(au, lu, K, bt);
      } else {
        block_product<F, 0, kLo>(au, lu, K, bt);
      }
      if (u >= 1) store(u - 1);
      if (u >= 2) scale(u - 2);
    }
    store(units - 1);
    if (units >= 2) scale(units - 2);
    scale(units - 1);
    const __mmask16 valid = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 vbias = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < kTileRows; ++r) {
      const __m512 v = bias ? _mm512_add_ps(acc[r], vbias) : acc[r];
      T* yr = y + (m0 + r) * ldy + n0;
      if constexpr (std::is_same<T, float>::value) {
        _mm512_mask_storeu_ps(yr, valid, v);
      } else {  // c10's rounding to bf16
        alignas(64) float out[kPairCols];
        _mm512_store_ps(out, v);
        for (int64_t i = 0; i < cols; ++i) yr[i] = static_cast<T>(out[i]);
      }
    }
  }
}

// run_int8_groups on AMX tiles: every whole 16 rows of x against each pair of groups; the rows
// after them and an odd last group through the VNNI loop (group_rows). False, having done
// nothing, when tiles do not serve (fewer than 16 rows, AMX off or refused).
template <typename F, typename T>
bool run_int8_groups_amx(int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y, int64_t ldy,
                         const float* bias, const QRow* rows) {
  if (M < kTileRows || !tessera_tiles::amx_ready()) return false;
  constexpr int64_t G = F::kGroups;
  const int64_t nb = K / kQK, groups = (N + kCols - 1) / kCols, group_bytes = nb * F::kRecord;
  const int64_t m_tiles = M / kTileRows * kTileRows;
  const int64_t pairs = groups / 2;
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    amx_int8_configure();  // tile state is per thread
    const int64_t mine = std::max<int64_t>(0, std::min(end, pairs) - begin);  // whole pairs
    const int64_t pair_bytes = nb * G * kBBlockBytes, pair_scales = 32 * nb * G;
    const bool pair_major = m_tiles <= kPairMajorRows;
    // expanded pairs held at once: one pair by pair, else as many as fit kExpandedBytes
    const int64_t slots = pair_major ? 1
                                     : std::clamp<int64_t>(kExpandedBytes / pair_bytes, 1,
                                                           std::max<int64_t>(mine, 1));
    uint8_t* bbuf = tessera_tiles::thread_scratch<uint8_t, tessera_tiles::Scratch::kDequantPanel>(
        slots * pair_bytes + 64);
    bbuf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bbuf) + 63) & ~uintptr_t{63});
    float* sbuf = tessera_tiles::thread_scratch<float, tessera_tiles::Scratch::kWideRecords>(
        slots * pair_scales);
    // pair p of the thread's, expanded into slot `slot` of bbuf and sbuf
    auto expand = [&](int64_t p, int64_t slot) {
      const uint8_t* ga = w + 2 * (begin + p) * group_bytes;
      expand_pair<F>(ga, ga + group_bytes, nb, bbuf + slot * pair_bytes,
                     sbuf + slot * pair_scales);
    };
    const QRow& x = rows[0];  // every row's codes and factors are one array each
    auto tile = [&](int64_t m0, int64_t m1, int64_t p, int64_t slot, bool prefetch_codes) {
      const int64_t n0 = 2 * (begin + p) * kCols;
      const int64_t cols = std::min(kPairCols, N - n0);
      const uint8_t* bp = bbuf + slot * pair_bytes;
      const float* sp = sbuf + slot * pair_scales;
      if (x.lo) {
        tile_pair<F, true>(bp, sp, nb, x.q, x.lo, K, x.d, x.dsum, m0, m1, y, ldy, n0, cols, bias,
                           prefetch_codes);
      } else {
        tile_pair<F, false>(bp, sp, nb, x.q, x.lo, K, x.d, x.dsum, m0, m1, y, ldy, n0, cols, bias,
                            prefetch_codes);
      }
    };
    // The same tiles in either order (the same bits). Up to kPairMajorRows rows (decode
    // batches), each pair is expanded just before every 16 rows meet it, its B tiles in L1.
    // More rows (prefill): a run of pairs expanded first (into L2), then each 16 rows meet all
    // of them in turn, their codes in L1: an M = 1648 prefill's linears ran 1.35x (one plane)
    // and 1.48x (two) faster than pair by pair, where each pair re-read every row's codes.
    if (pair_major) {
      for (int64_t p = 0; p < mine; ++p) {
        expand(p, 0);  // one slot, reused: it stays in L1
        tile(0, m_tiles, p, 0, true);
      }
    } else {
      for (int64_t p0 = 0; p0 < mine; p0 += slots) {
        const int64_t p1 = std::min(mine, p0 + slots);
        for (int64_t p = p0; p < p1; ++p) expand(p, p - p0);
        for (int64_t m0 = 0; m0 < m_tiles; m0 += kTileRows)
          for (int64_t p = p0; p < p1; ++p) tile(m0, m0 + kTileRows, p, p - p0, p == p0);
      }
    }
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t g = 2 * pair;
      if (g + 1 < groups) {
        const uint8_t* ga = w + g * group_bytes;
        group_rows<F>(ga, nb, rows, m_tiles, M, y, ldy, g * kCols, N, bias);
        group_rows<F>(ga + group_bytes, nb, rows, m_tiles, M, y, ldy, (g + 1) * kCols, N, bias);
      } else {
        group_rows<F>(w + g * group_bytes, nb, rows, 0, M, y, ldy, g * kCols, N, bias);
      }
    }
    _tile_release();
  });
  return true;
}

}  // namespace tessera_int8

#endif
