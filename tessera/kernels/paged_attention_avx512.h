// The AVX-512 path of paged_attention.cpp (the algorithm of its header comment): head_dim = 16 * NC,
// the NC chunks of a row unrolled at compile time; vdpbf16ps for bf16 scores where available.
#pragma once

#include "paged_attention_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessera_paged {

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  // bf16 -> fp32 is a 16-bit left shift of the bit pattern.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for the softmax (x <= 0), kExpTaylor's polynomial (paged_attention_common.h), times 2^n
// via scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // below this e^x is ~0 in fp32 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// Transposed horizontal sum: lane i of the result is the sum of d[i]'s 16 lanes. A tree of pairwise
// shuffles and adds, within 128-bit lanes first, then across them.
inline __m512 hsum16(const __m512* d) {
  __m512 w[4];
  for (int g = 0; g < 4; ++g) {
    const __m512* x = d + 4 * g;
    // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    // per 128-bit lane: [a, b, c, d] partial sums of that lane
    w[g] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// vdpbf16ps for the scores when both q and the cache are bf16 (q -> bf16 is then exact, and
// bf16 x bf16 products are exact in fp32). With fp32 q and a bf16 cache, K is widened instead, so
// q keeps its precision.
template <typename q_t, typename kv_t>
constexpr bool use_dpbf16() {
#if defined(__AVX512BF16__)
  return std::is_same<q_t, at::BFloat16>::value && std::is_same<kv_t, at::BFloat16>::value;
#else
  return false;
#endif
}

// Scores of one query head (q: fp32 [D], qb: bf16 copy) against rows k[0..n) (n <= 16), lane i =
// q . k[i]; lanes past n are 0.
template <int NC, bool kDp, typename kv_t>
inline __m512 scores16(const float* q, const at::BFloat16* qb, const kv_t* const* kp, int64_t off,
                       int64_t n) {
  __m512 dots[16];
  if constexpr (kDp) {
#if defined(__AVX512BF16__)
    __m512bh qc[NC / 2];
    for (int c = 0; c < NC / 2; ++c) qc[c] = (__m512bh)_mm512_loadu_si512(qb + 32 * c);
    for (int64_t i = 0; i < 16; ++i) {
      __m512 d = _mm512_setzero_ps();
      if (i < n) {
        for (int c = 0; c < NC / 2; ++c)
          d = _mm512_dpbf16_ps(d, qc[c], (__m512bh)_mm512_loadu_si512(kp[i] + off + 32 * c));
      }
      dots[i] = d;
    }
#endif
  } else {
    (void)qb;
    __m512 qc[NC];
    for (int c = 0; c < NC; ++c) qc[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t i = 0; i < 16; ++i) {
      __m512 d = _mm512_setzero_ps();
      if (i < n) {
        for (int c = 0; c < NC; ++c) d = _mm512_fmadd_ps(qc[c], load16(kp[i] + off + 16 * c), d);
      }
      dots[i] = d;
    }
  }
  return hsum16(dots);
}

constexpr int64_t kMaxGroup = 16;  // query heads per kv head on the vector path

// vpermt2w indices that interleave two V rows' 32 dims: word 2 k of the result is word k of the
// first row (Hi: k + 16), word 2 k + 1 the second row's (index bit 5 picks the second operand).
alignas(64) constexpr int16_t kPairWordsLo[32] = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr int16_t kPairWordsHi[32] = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// acc[g] = acc[g] * corr[g] + sum_i p[g][i] V_i for the GG query heads of one kv head; p[g] is
// kTile apart (zeros past n), acc[g] head_dim apart, V_i = vp[i] + off.
// kDp (bf16 q and cache, vdpbf16ps): P rounded to bf16 for the product, as transformers' eager
// attention and the AMX path do in bf16, and two tokens a vdpbf16ps: each lane d adds
// p_i V_i[d] + p_i+1 V_i+1[d], the pair of V rows interleaved by one vpermt2w per 16 dims. Why:
// widening each V row to fp32 for one fma a token and head was the larger part of the arithmetic;
// on Zen 4 a 512-token prefill's attention took 0.7-0.86x the time this way, a decode 0.94-0.96x
// (docs/cpu_kernels.md).
template <int NC, int GG, bool kDp, typename kv_t>
inline void pv_group(const float* p, const float* corr, const kv_t* const* vp, int64_t off,
                     int64_t n, int64_t D, float* a) {
  __m512 acc[GG][NC];
  for (int g = 0; g < GG; ++g) {
    const __m512 vcorr = _mm512_set1_ps(corr[g]);
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(a + g * D + 16 * c), vcorr);
  }
  if constexpr (kDp) {
#if defined(__AVX512BF16__)
    // p of each head as bf16 pairs: element j = tokens 2 j, 2 j + 1 (a zero pads an odd n)
    alignas(64) int32_t pairs[GG][kTile / 2];
    for (int g = 0; g < GG; ++g) {
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + g * kTile + 16),
                                             _mm512_loadu_ps(p + g * kTile));
      _mm512_store_si512(pairs[g], (__m512i)b);
    }
    const __m512i lo = _mm512_load_si512(kPairWordsLo), hi = _mm512_load_si512(kPairWordsHi);
    for (int64_t i = 0; i < n; i += 2) {
      const kv_t* v0 = vp[i] + off;
      const kv_t* v1 = (i + 1 < n ? vp[i + 1] : vp[i]) + off;  // times p = 0 past n
      for (int h = 0; h < NC / 2; ++h) {
        const __m512i r0 = _mm512_loadu_si512(v0 + 32 * h), r1 = _mm512_loadu_si512(v1 + 32 * h);
        const __m512bh v_lo = (__m512bh)_mm512_permutex2var_epi16(r0, lo, r1);
        const __m512bh v_hi = (__m512bh)_mm512_permutex2var_epi16(r0, hi, r1);
        for (int g = 0; g < GG; ++g) {
          const __m512bh pg = (__m512bh)_mm512_set1_epi32(pairs[g][i / 2]);
          acc[g][2 * h] = _mm512_dpbf16_ps(acc[g][2 * h], pg, v_lo);
          acc[g][2 * h + 1] = _mm512_dpbf16_ps(acc[g][2 * h + 1], pg, v_hi);
        }
      }
    }
#endif
  } else {
    for (int64_t i = 0; i < n; ++i) {
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = load16(vp[i] + off + 16 * c);
      for (int g = 0; g < GG; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * kTile + i]);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(a + g * D + 16 * c, acc[g][c]);
}

// The softmax state (sc.m, sc.l, sc.acc) of row b's query heads over tokens [t_begin, t_end) of
// its sequence. `load_query`: convert the row's q into sc first (false: the row's next partition,
// whose q is there already). `warm_end`: this thread has just read tokens [0, warm_end) of the
// sequence (warm_tokens), so the touch pass starts after them.
template <int NC, typename q_t, typename kv_t, typename index_t>
void attend_avx512(const q_t* q, const kv_t* k, const kv_t* v, const index_t* table,
                   int64_t t_begin, int64_t t_end, int64_t b, float scale, bool load_query,
                   int64_t warm_end, const Geometry& geo, Scratch& sc) {
  static_assert(NC % 2 == 0, "vdpbf16ps takes head_dim in chunks of 32");
  constexpr bool kDp = use_dpbf16<q_t, kv_t>();
  const int64_t D = geo.head_dim, G = geo.group, nkv = geo.num_kv_heads, nh = geo.num_heads;
  const kv_t* kp[kTile];
  const kv_t* vp[kTile];
  if (load_query) {
    load_q(q, geo, b, 1.f, sc);  // unscaled: the scale is applied to the scores
    if constexpr (kDp) {
      for (int64_t x = 0; x < nh * D; ++x) sc.qb[x] = static_cast<at::BFloat16>(sc.q[x]);  // exact
    }
  }
  reset_state(sc, nh, D);
  const int64_t touch_span = touch_tiles<kv_t>(nkv, D) * kTile;  // tokens per touch pass
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t n = std::min(kTile, t_end - t0);
    tile_rows(k, v, table, t0, n, geo, kp, vp);
    // the next rows into L2 (paged_attention_common.h)
    if ((t0 - t_begin) % touch_span == 0) {
      const int64_t from = std::max(t0, warm_end), to = std::min(t0 + touch_span, t_end);
      if (from < to) touch_rows(k, v, table, from, to - from, geo);
    }
    const __mmask16 lo = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __mmask16 hi = n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1);
    // Lane j % 16 of these: head j's previous and new max and its tile sum, for the rescaling of
    // 16 heads at once (one exp16, below). Why: a std::exp per head and tile was a libm call in
    // this loop (~1% of a W1 run), and the heads' state went through memory around it; built in
    // registers, decode attention took 0.95-0.99x the time, a 512-token prefill's 0.93-0.95x
    // (Zen 4), 0.85-0.93x and 0.88-0.99x on the AVX2 path. Values through sc.corr/sc.l instead
    // were 1.05x slower: a vector load of 16 lanes cannot forward the scalar stores just made.
    // exp16(-inf - m) on the first tile is its floor e^-87, which multiplies an l and acc of 0.
    __m512 prev_max = _mm512_setzero_ps(), new_max = _mm512_setzero_ps();
    __m512 psum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nh; ++j) {
      // Scores, 16 tokens a vector. The group's heads read the same K rows one after the other:
      // from DRAM for the first, from L1 for the rest (a tile's rows of one kv head are 2-4 KiB).
      const float* qj = sc.q.data() + j * D;
      const at::BFloat16* qbj = sc.qb.data() + j * D;
      const int64_t off = (j / G) * D;
      const __m512 r0 = scores16<NC, kDp>(qj, qbj, kp, off, std::min<int64_t>(n, 16));
      const __m512 s0 = _mm512_mask_mul_ps(ninf, lo, r0, vscale);
      __m512 s1 = ninf;
      if (n > 16) s1 = _mm512_mask_mul_ps(ninf, hi, scores16<NC, kDp>(qj, qbj, kp + 16, off, n - 16), vscale);
      const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      const float m_new = std::max(sc.m[j], tile_max);
      const __mmask16 lane = __mmask16(1u << (j % 16));
      prev_max = _mm512_mask_mov_ps(prev_max, lane, _mm512_set1_ps(sc.m[j]));
      new_max = _mm512_mask_mov_ps(new_max, lane, _mm512_set1_ps(m_new));
      sc.m[j] = m_new;
      const __m512 p0 = _mm512_maskz_mov_ps(lo, exp16(_mm512_sub_ps(s0, _mm512_set1_ps(m_new))));
      const __m512 p1 = _mm512_maskz_mov_ps(hi, exp16(_mm512_sub_ps(s1, _mm512_set1_ps(m_new))));
      const float tile_sum = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      psum = _mm512_mask_mov_ps(psum, lane, _mm512_set1_ps(tile_sum));
      float* s = sc.s.data() + j * kTile;
      _mm512_storeu_ps(s, p0);
      _mm512_storeu_ps(s + 16, p1);
      if (j % 16 == 15 || j + 1 == nh) {
        const int64_t j0 = j - j % 16;
        const __mmask16 done = __mmask16((2u << (j % 16)) - 1);  // lanes of heads j0..j
        const __m512 corr = exp16(_mm512_sub_ps(prev_max, new_max));
        const __m512 l =
            _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(done, sc.l.data() + j0), corr), psum);
        _mm512_mask_storeu_ps(sc.corr.data() + j0, done, corr);
        _mm512_mask_storeu_ps(sc.l.data() + j0, done, l);
      }
    }
    // acc_j = acc_j * corr_j + sum_i p_ij V_i, a kv head's whole query group at a time: each V row
    // is loaded (and widened from bf16) once for the group, its accumulators held in registers.
    for (int64_t kv = 0; kv < nkv; ++kv) {
      const int64_t j0 = kv * G;
      float* a = sc.acc.data() + j0 * D;
      const float* p = sc.s.data() + j0 * kTile;
      const float* corr = sc.corr.data() + j0;
      switch (G * NC <= 16 ? G : 0) {
        case 1: pv_group<NC, 1, kDp>(p, corr, vp, kv * D, n, D, a); break;
        case 2: pv_group<NC, 2, kDp>(p, corr, vp, kv * D, n, D, a); break;
        case 3: pv_group<NC, 3, kDp>(p, corr, vp, kv * D, n, D, a); break;
        case 4: pv_group<NC, 4, kDp>(p, corr, vp, kv * D, n, D, a); break;
        default:  // groups too large for the registers: one head at a time
          for (int64_t g = 0; g < G; ++g)
            pv_group<NC, 1, kDp>(p + g * kTile, corr + g, vp, kv * D, n, D, a + g * D);
      }
    }
  }
}

#endif  // __AVX512F__

}  // namespace tessera_paged
