// Folding partitions' softmax states into one (paged_attention_common.h says why a row's context
// is attended in partitions). Included by paged_attention.cpp, in namespace tessera_paged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "paged_attention_avx512.h"  // exp16
#include "paged_attention_common.h"

namespace tessera_paged {

// (M, L, A) <- the softmax states of H heads over their tokens so far and over the next
// partition's (m, l, a) as one, each rescaled to the larger max: M, L [H], A [H][D]. One
// out-of-line function with explicit fmas, so both callers (one thread folding its row's
// partitions, the pass after the threads) round the same way. The exponentials of 16 heads at a
// time: one std::exp per head and partition was most of the partitions' cost in prefill.
__attribute__((noinline)) inline void fold_states(float* M, float* L, float* A, const float* m,
                                           const float* l, const float* a, int64_t H, int64_t D) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t h0 = 0; h0 < H; h0 += 16) {
    const int64_t n = std::min<int64_t>(16, H - h0);
    float ca[16], cb[16];
#if defined(__AVX512F__)
    const __mmask16 lanes = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 ninf = _mm512_set1_ps(kNegInf);
    const __m512 vM = _mm512_mask_loadu_ps(ninf, lanes, M + h0);
    const __m512 vm = _mm512_mask_loadu_ps(ninf, lanes, m + h0);
    const __m512 mx = _mm512_max_ps(vM, vm);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(lanes, mx, ninf, _CMP_NEQ_OQ);  // not both empty
    const __m512 va = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(vM, mx)));
    const __m512 vb = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(vm, mx)));
    const __m512 vl = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, L + h0), va,
                                      _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, l + h0), vb));
    _mm512_mask_storeu_ps(L + h0, lanes, vl);
    _mm512_mask_storeu_ps(M + h0, lanes, mx);
    _mm512_storeu_ps(ca, va);
    _mm512_storeu_ps(cb, vb);
#else
    for (int64_t j = 0; j < n; ++j) {
      const float mx = std::max(M[h0 + j], m[h0 + j]);
      const bool live = mx != kNegInf;  // not both empty
      ca[j] = live ? std::exp(M[h0 + j] - mx) : 0.f;
      cb[j] = live ? std::exp(m[h0 + j] - mx) : 0.f;
      L[h0 + j] = std::fma(L[h0 + j], ca[j], l[h0 + j] * cb[j]);
      M[h0 + j] = mx;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
      float* Ah = A + (h0 + j) * D;
      const float* ah = a + (h0 + j) * D;
      for (int64_t d = 0; d < D; ++d) Ah[d] = std::fma(Ah[d], ca[j], ah[d] * cb[j]);
    }
  }
}

// A row's partition state (sc.m, sc.l, sc.acc) into its fold arrays: copied for its first
// partition, folded after the ones before for the others.
inline void fold_partition(Scratch& sc, bool first, int64_t H, int64_t D) {
  if (first) {
    std::copy(sc.acc.begin(), sc.acc.begin() + H * D, sc.fold_acc.begin());
    std::copy(sc.m.begin(), sc.m.begin() + H, sc.fold_m.begin());
    std::copy(sc.l.begin(), sc.l.begin() + H, sc.fold_l.begin());
  } else {
    fold_states(sc.fold_m.data(), sc.fold_l.data(), sc.fold_acc.data(), sc.m.data(), sc.l.data(),
                sc.acc.data(), H, D);
  }
}

}  // namespace tessera_paged
