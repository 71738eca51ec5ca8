// The portable path of paged_attention.cpp (any CPU, any head size; also the AVX2 and AVX-512
// builds for head sizes without a tuned kernel, paged_attention_avx2.h and _avx512.h): the same
// algorithm in plain C++ whose inner loops the compiler vectorizes for the build's ISA (`omp
// simd`: SSE2/NEON in the portable build). The K/V rows are widened from bf16 on load like the
// vector paths (F16C is not needed: bf16 is a shift).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "paged_attention_common.h"

namespace tessera_paged {

// The softmax state of row b's heads over tokens [t_begin, t_end), as attend_avx512 (without its
// touch pass, so warm_end is unused).
template <typename q_t, typename kv_t, typename index_t>
void attend_scalar(const q_t* q, const kv_t* k, const kv_t* v, const index_t* table,
                   int64_t t_begin, int64_t t_end, int64_t b, float scale, bool load_query,
                   int64_t /*warm_end*/, const Geometry& geo, Scratch& sc) {
  const int64_t D = geo.head_dim, G = geo.group, nh = geo.num_heads;
  const kv_t* kp[kTile];
  const kv_t* vp[kTile];
  if (load_query) load_q(q, geo, b, scale, sc);
  reset_state(sc, nh, D);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t n = std::min(kTile, t_end - t0);
    tile_rows(k, v, table, t0, n, geo, kp, vp);
    for (int64_t j = 0; j < nh; ++j) {
      float* s = sc.s.data() + j * kTile;
      const float* qj = sc.q.data() + j * D;
      const int64_t off = (j / G) * D;  // this head's kv head within the token's row
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        float dot = 0.f;
        // a vector reduction under -fopenmp (8 lanes in the avx2 build): the order is fixed by
        // D and the ISA, never by the batch, so rows stay independent of it
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qj[d] * static_cast<float>(kp[i][off + d]);
        s[i] = dot;
        tile_max = std::max(tile_max, dot);
      }
      const float m_new = rescale_head(sc, j, D, tile_max);
      float* a = sc.acc.data() + j * D;
      for (int64_t i = 0; i < n; ++i) {
        const float p = std::exp(s[i] - m_new);
        sc.l[j] += p;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vp[i][off + d]);
      }
    }
  }
}

}  // namespace tessera_paged
