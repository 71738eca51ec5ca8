// The integer path's batch loop on AVX-512 VNNI (CPUs without AMX, such as Zen 4, or with it
// switched off): two groups of 8 output rows side by side in one 512-bit vector, against tiles of
// 8 rows of x packed so that the 4 bytes each vpdpbusd broadcasts come from one pointer.
//
// Why: the group loop of quant_int8_avx2.h runs 256-bit vpdpbusd on one group and up to 4 rows a
// pass, each row with pointers of its own (codes, residual, scale, sum): more than the registers,
// so the compiler kept them in vector registers and moved them back before each use. On a 2048-row
// prefill of the default model it ran at ~95 GOP/s a core on Zen 4. Here one instruction computes
// 16 outputs' products, its broadcast is an embedded operand read from a tile that advances a
// block at a time, and 8 rows share each block's decoded codes and scales.
//
// Bits: every output lane gets the operations of dot_group, in its order: the block's exact
// integer sum (kLoScale <c, q> + <c, lo>), converted once, times d dx, then + e dsum (unsigned
// kinds) or the second half's product (S8F2). So a row's result is the same whichever loop ran it,
// and whatever rows share its tile. Signed kinds: vpdpbusd multiplies unsigned by signed bytes,
// and AVX-512 has no vpsignb for the 256-bit loop's sign trick, so the codes are biased to
// c + 128 (0..255) and 128 times the row's code sum over the block (or half) is subtracted: the
// same exact integer.
#pragma once

#include "quant_int8_avx2.h"

#if defined(TESSERA_INT8_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
#define TESSERA_INT8_PAIRS 1

namespace tessera_int8 {

constexpr int kTileRows8 = 8;  // rows of x a tile
constexpr int kPairCols16 = 2 * kCols;

// One block (32 K positions) of a tile of 8 rows of x.
struct alignas(64) TileBlock {
  int32_t q[8][kTileRows8];   // [chunk j][row r]: row r's codes 4 j .. 4 j + 3
  int32_t lo[8][kTileRows8];  // the residual plane, the same way (two planes)
  float d[kTileRows8];        // QRow::d
  float dsum[kTileRows8];     // QRow::dsum
  // signed kinds: 128 times the row's integer code sum (kLoScale q + lo with two planes) over
  // chunks 0-3 and 4-7
  int32_t bias[2][kTileRows8];
};

// v[r] (8 rows of 8 dwords) transposed in place: v[j] lane r = the old v[r] lane j.
inline void transpose8x8_epi32(__m256i* v) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(v[i]), _mm256_castsi256_ps(v[i + 1]));
    t[i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(v[i]), _mm256_castsi256_ps(v[i + 1]));
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_castps_si256(_mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
    v[j + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
  }
}

// Rows rows[0, n) (n <= 8) of x as a tile of nb blocks; rows from n on are zeros (their outputs
// are computed and dropped). kSums: the code sums of the signed kinds' bias (else left unset).
template <bool kSums>
inline void pack_tile(const QRow* rows, int64_t n, int64_t nb, TileBlock* out) {
  const bool two = rows[0].lo != nullptr;
  for (int64_t b = 0; b < nb; ++b) {
    TileBlock& t = out[b];
    __m256i q[8], lo[8];
    for (int r = 0; r < kTileRows8; ++r) {
      const bool real = r < n;
      auto load = [&](const int8_t* p) {
        return real ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * kQK))
                    : _mm256_setzero_si256();
      };
      q[r] = load(rows[real ? r : 0].q);
      if (two) lo[r] = load(rows[real ? r : 0].lo);
      t.d[r] = real ? rows[r].d[b] : 0.f;
      t.dsum[r] = real ? rows[r].dsum[b] : 0.f;
      if constexpr (kSums) {
        int32_t sum[2] = {0, 0};
        if (real) {
          const int8_t* qr = rows[r].q + b * kQK;
          const int8_t* lr = two ? rows[r].lo + b * kQK : nullptr;
          for (int k = 0; k < kQK; ++k) sum[k / 16] += two ? kLoScale * qr[k] + lr[k] : qr[k];
        }
        t.bias[0][r] = 128 * sum[0];
        t.bias[1][r] = 128 * sum[1];
      }
    }
    transpose8x8_epi32(q);
    for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(t.q[j]), q[j]);
    if (two) {
      transpose8x8_epi32(lo);
      for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(t.lo[j]), lo[j]);
    }
  }
}

inline __m512 join8(__m256 a, __m256 b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

// kLoScale <c, q> + <c, lo> over chunks [J0, J1) of row r of a tile block, for 16 outputs (the
// codes of signed kinds biased, see above; the bias is not yet taken off).
template <bool kLo, int J0, int J1>
inline __m512i tile_sums16(const __m512i* codes, const TileBlock* t, int r) {
  __m512i s2[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int j = J0; j < J1; ++j)
    s2[j & 1] = _mm512_dpbusd_epi32(s2[j & 1], codes[j], _mm512_set1_epi32(t->q[j][r]));
  const __m512i s = _mm512_add_epi32(s2[0], s2[1]);
  if constexpr (!kLo) {
    return s;
  } else {
    __m512i l = _mm512_setzero_si512();
    for (int j = J0; j < J1; ++j)
      l = _mm512_dpbusd_epi32(l, codes[j], _mm512_set1_epi32(t->lo[j][r]));
    return _mm512_add_epi32(_mm512_mullo_epi32(s, _mm512_set1_epi32(kLoScale)), l);
  }
}

// out[r][c] = <output c of the pair (group a's 8, then group b's), x row r> for the 8 rows of the
// tile xt (nb blocks). `prefetch`: the records come from memory (the first tile a pair meets).
template <typename F, bool kLo>
inline void dot_pair_tile(const uint8_t* wa, const uint8_t* wb, int64_t nb, const TileBlock* xt,
                          bool prefetch, float (*out)[kPairCols16]) {
  static_assert(!F::kSuper, "super-block kinds come widened (WideOf)");
  __m512 acc[kTileRows8];
  for (int r = 0; r < kTileRows8; ++r) acc[r] = _mm512_setzero_ps();
  const __m256 none = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, wa += F::kRecord, wb += F::kRecord, ++xt) {
    if (prefetch) {
      prefetch_ahead<F::kRecord>(wa);
      prefetch_ahead<F::kRecord>(wb);
    }
    __m256 da, ea, db, eb;
    block_scales8<F>(wa, none, none, &da, &ea);
    block_scales8<F>(wb, none, none, &db, &eb);
    const __m512 d = join8(da, db), e = join8(ea, eb);
    __m256i ca[8], cb[8];
    load_codes8<F>(wa, ca);
    load_codes8<F>(wb, cb);
    __m512i codes[8];
    for (int j = 0; j < 8; ++j) {
      codes[j] = _mm512_inserti64x4(_mm512_castsi256_si512(ca[j]), cb[j], 1);
      if constexpr (F::kSigned) codes[j] = _mm512_xor_si512(codes[j], _mm512_set1_epi8(-128));
    }
    // unrolled, so the 8 accumulators stay in registers (a loop kept them on the stack: a
    // store and a reload each row and block)
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows8; ++r) {
      const __m512 ddx = _mm512_mul_ps(d, _mm512_set1_ps(xt->d[r]));
      if constexpr (F::kGroups == 2) {  // S8F2: a sum and a scale a half
        const __m512i s0 = _mm512_sub_epi32(tile_sums16<kLo, 0, 4>(codes, xt, r),
                                            _mm512_set1_epi32(xt->bias[0][r]));
        const __m512i s1 = _mm512_sub_epi32(tile_sums16<kLo, 4, 8>(codes, xt, r),
                                            _mm512_set1_epi32(xt->bias[1][r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), ddx, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1),
                                 _mm512_mul_ps(e, _mm512_set1_ps(xt->d[r])), acc[r]);
        continue;
      }
      __m512i s = tile_sums16<kLo, 0, 8>(codes, xt, r);
      if constexpr (F::kSigned) {
        s = _mm512_sub_epi32(s, _mm512_set1_epi32(xt->bias[0][r] + xt->bias[1][r]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), ddx, acc[r]);
      if constexpr (!F::kSigned) {
        acc[r] = _mm512_fmadd_ps(e, _mm512_set1_ps(xt->dsum[r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < kTileRows8; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

}  // namespace tessera_int8

#endif
