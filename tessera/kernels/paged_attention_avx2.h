// The AVX2 path of paged_attention.cpp: attend_avx512's algorithm in 8-lane vectors (head_dim =
// 8 * NC). Why its own intrinsics: the plain C++ path (paged_attention_scalar.h) reduced every
// score horizontally and took a scalar exp per token, and ran a 512-token prefill at 11 GFLOP/s
// against 87 for the AVX-512 path on the same machine (`benchmarks/attention.py --prompt-len
// 512`): half of an AVX2 prefill's time.
#pragma once

#include "paged_attention_common.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define TESSERA_ATTN_AVX2 1

namespace tessera_paged {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  // bf16 -> fp32 is a 16-bit left shift of the bit pattern
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// exp(x) for the softmax (x <= 0), kExpTaylor's polynomial (paged_attention_common.h), times 2^n
// built in the exponent bits (n >= -126 after the clamp: a normal float).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i n_bits = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(n_bits, 23)));
}

// Transposed horizontal sum: lane i of the result is the sum of d[i]'s 8 lanes (two rounds of
// hadd within 128-bit halves, then the halves added across).
inline __m256 hsum8(const __m256* d) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hadd8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scores of one query head q [D] against rows k[0..n) (n <= 8): lane i = q . k[i]; lanes past n
// are 0.
template <int NC, typename kv_t>
inline __m256 scores8(const float* q, const kv_t* const* kp, int64_t off, int64_t n) {
  __m256 dots[8];
  for (int64_t i = 0; i < 8; ++i) {
    __m256 d = _mm256_setzero_ps();
    if (i < n) {
      for (int c = 0; c < NC; ++c)
        d = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), load8(kp[i] + off + 8 * c), d);
    }
    dots[i] = d;
  }
  return hsum8(dots);
}

// acc[g] = acc[g] * corr[g] + sum_i p[g][i] V_i for the G query heads of one kv head, one 8-lane
// chunk of head_dim at a time (AVX2's 16 registers hold a chunk's accumulators for the group);
// p[g] is kTile apart, acc[g] D apart, V_i = vp[i] + off.
template <int NC, typename kv_t>
inline void pv_group8(const float* p, const float* corr, const kv_t* const* vp, int64_t off,
                      int64_t n, int64_t G, int64_t D, float* a) {
  constexpr int64_t kRegs = 4;  // query heads a pass
  for (int64_t g0 = 0; g0 < G; g0 += kRegs) {
    const int64_t gn = std::min(kRegs, G - g0);
    for (int c = 0; c < NC; ++c) {
      __m256 acc[kRegs];
      for (int64_t g = 0; g < gn; ++g)
        acc[g] = _mm256_mul_ps(_mm256_loadu_ps(a + (g0 + g) * D + 8 * c),
                               _mm256_set1_ps(corr[g0 + g]));
      for (int64_t i = 0; i < n; ++i) {
        const __m256 v = load8(vp[i] + off + 8 * c);
        for (int64_t g = 0; g < gn; ++g)
          acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + (g0 + g) * kTile + i), v, acc[g]);
      }
      for (int64_t g = 0; g < gn; ++g) _mm256_storeu_ps(a + (g0 + g) * D + 8 * c, acc[g]);
    }
  }
}

// attend_avx512 in 8-lane vectors: the softmax state (sc.m, sc.l, sc.acc) of row b's query heads
// over tokens [t_begin, t_end) of its sequence.
template <int NC, typename q_t, typename kv_t, typename index_t>
void attend_avx2(const q_t* q, const kv_t* k, const kv_t* v, const index_t* table,
                 int64_t t_begin, int64_t t_end, int64_t b, float scale, bool load_query,
                 int64_t warm_end, const Geometry& geo, Scratch& sc) {
  static_assert(kTile == 32, "a tile is four score vectors");
  const int64_t D = geo.head_dim, G = geo.group, nkv = geo.num_kv_heads, nh = geo.num_heads;
  const kv_t* kp[kTile];
  const kv_t* vp[kTile];
  if (load_query) load_q(q, geo, b, 1.f, sc);  // unscaled: the scale is applied to the scores
  reset_state(sc, nh, D);
  const int64_t touch_span = touch_tiles<kv_t>(nkv, D) * kTile;
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t n = std::min(kTile, t_end - t0);
    tile_rows(k, v, table, t0, n, geo, kp, vp);
    if ((t0 - t_begin) % touch_span == 0) {
      const int64_t from = std::max(t0, warm_end), to = std::min(t0 + touch_span, t_end);
      if (from < to) touch_rows(k, v, table, from, to - from, geo);
    }
    __m256 live[4];  // lanes of tokens < n
    for (int u = 0; u < 4; ++u)
      live[u] = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - 8 * u)), iota));
    __m256 prev_max = _mm256_setzero_ps(), new_max = _mm256_setzero_ps();
    __m256 psum = _mm256_setzero_ps();
    for (int64_t j = 0; j < nh; ++j) {
      const float* qj = sc.q.data() + j * D;
      const int64_t off = (j / G) * D;
      __m256 s[4];
      __m256 mx = ninf;
      for (int u = 0; u < 4; ++u) {
        s[u] = ninf;
        if (8 * u < n) {
          const __m256 r = _mm256_mul_ps(scores8<NC>(qj, kp + 8 * u, off, n - 8 * u), vscale);
          s[u] = _mm256_blendv_ps(ninf, r, live[u]);
        }
        mx = _mm256_max_ps(mx, s[u]);
      }
      const float m_new = std::max(sc.m[j], hmax8(mx));
      const __m256 lane =
          _mm256_castsi256_ps(_mm256_cmpeq_epi32(iota, _mm256_set1_epi32(static_cast<int>(j % 8))));
      prev_max = _mm256_blendv_ps(prev_max, _mm256_set1_ps(sc.m[j]), lane);
      new_max = _mm256_blendv_ps(new_max, _mm256_set1_ps(m_new), lane);
      sc.m[j] = m_new;
      const __m256 vm = _mm256_set1_ps(m_new);
      float* ps = sc.s.data() + j * kTile;
      __m256 sum = _mm256_setzero_ps();
      for (int u = 0; u < 4; ++u) {
        const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(s[u], vm)), live[u]);
        sum = _mm256_add_ps(sum, p);
        _mm256_storeu_ps(ps + 8 * u, p);
      }
      psum = _mm256_blendv_ps(psum, _mm256_set1_ps(hadd8(sum)), lane);
      if (j % 8 == 7 || j + 1 == nh) {  // the chunk's rescaling, as in attend_avx512
        const int64_t j0 = j - j % 8;
        const __m256i done =  // lanes of heads j0..j
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(j % 8 + 1)), iota);
        const __m256 corr = exp8(_mm256_sub_ps(prev_max, new_max));
        const __m256 l =
            _mm256_add_ps(_mm256_mul_ps(_mm256_maskload_ps(sc.l.data() + j0, done), corr), psum);
        _mm256_maskstore_ps(sc.corr.data() + j0, done, corr);
        _mm256_maskstore_ps(sc.l.data() + j0, done, l);
      }
    }
    for (int64_t kv = 0; kv < nkv; ++kv) {
      const int64_t j0 = kv * G;
      pv_group8<NC>(sc.s.data() + j0 * kTile, sc.corr.data() + j0, vp, kv * D, n, G, D,
                    sc.acc.data() + j0 * D);
    }
  }
}

}  // namespace tessera_paged

#endif
