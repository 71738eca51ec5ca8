// Paged attention for CPU: one query token per row b, attending to the first seq_lens[b] tokens of its
// sequence, K/V read in place through the block tables (no gather into a padded tensor). A row is a
// decode or one token of a prompt chunk (then seq_lens[b] = its position + 1, so the causal mask is
// the length); below, "sequence b" means row b and its block table.
//
// Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
// contiguous. Token `pos` of sequence b lives in block block_tables[b][pos / block_size], row
// pos % block_size, so one K row of one kv head is head_dim contiguous values.
//
// Work item = a sequence and a range of its kv heads: all of them when there are enough sequences
// to keep the threads busy (each token's K/V rows are then one contiguous stretch of memory;
// 1.15-1.2x faster than one kv head per item at B=64, ctx 512, one thread), else one kv head per
// item. All `group` query heads of a kv head are processed together, so every K/V row is read from
// memory once. Tokens are walked in tiles of kTile: scores for the tile, then one online-softmax
// update (running max m, running sum l, fp32 accumulator acc) per head. Work items are handed out
// through an atomic counter, because mixed sequence lengths make a static split uneven.
//
// The cache may hold another dtype than q/out (--kv-cache-dtype: bf16 K/V beside fp32 activations
// halves the bytes read); K/V rows are widened to fp32 on load, so the arithmetic is fp32 either way.
//
// Scores are computed 16 tokens at a time: 16 lane-wise partial dot products, then one transposed
// reduction (hsum16: 45 vector ops) into a vector of 16 scores, instead of 16 horizontal sums
// (~8 ops each plus a scalar store). That was the kernel's biggest cost: bf16 decode attention ran
// compute-bound at 14 GB/s.
//
// Two code paths with the same algorithm: AVX-512 (built with -march=native on a CPU that has it;
// head_dim 32/64/96/128/256; vdpbf16ps for bf16 scores where available) and portable scalar C++
// (anything else).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 32;  // tokens per online-softmax update (two score vectors of 16)

struct Geometry {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_stride_b, q_stride_h, out_stride_b, out_stride_h;
};

// Row pointers of kv head g (the item's first) for tokens [t0, t0 + n) of one sequence.
template <typename kv_t, typename index_t>
inline void tile_rows(const kv_t* k, const kv_t* v, const index_t* table, int64_t g, int64_t t0,
                      int64_t n, const Geometry& geo, const kv_t** kp, const kv_t** vp) {
  // One division per tile, not per token (a 64-bit divide costs as much as a head's dot product).
  int64_t idx = t0 / geo.block_size, in_block = t0 % geo.block_size;
  const int64_t row_stride = geo.num_kv_heads * geo.head_dim;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = static_cast<int64_t>(table[idx]);
    const int64_t offset = (block * geo.block_size + in_block) * row_stride + g * geo.head_dim;
    kp[i] = k + offset;
    vp[i] = v + offset;
    if (++in_block == geo.block_size) {
      in_block = 0;
      ++idx;
    }
  }
}

// Per-thread scratch, allocated once per worker; sized for all heads of a sequence, an item's heads
// (nh = nkv * group of them, starting at query head h0 = g0 * group) use the front.
struct Scratch {
  std::vector<float> q;    // [nh, head_dim] fp32
  std::vector<at::BFloat16> qb;  // the same as bf16, for vdpbf16ps
  std::vector<float> acc;  // [nh, head_dim]
  std::vector<float> s;    // [nh, kTile] scores, then probabilities
  std::vector<float> m, l;  // [nh]
  std::vector<float> corr;  // [nh] this tile's rescaling of acc
  explicit Scratch(const Geometry& geo)
      : q(geo.num_heads * geo.head_dim), qb(geo.num_heads * geo.head_dim),
        acc(geo.num_heads * geo.head_dim), s(geo.num_heads * kTile), m(geo.num_heads),
        l(geo.num_heads), corr(geo.num_heads) {}
};

template <typename q_t>
inline void load_q(const q_t* q, const Geometry& geo, int64_t b, int64_t h0, int64_t nh,
                   float scale, Scratch& sc) {
  for (int64_t j = 0; j < nh; ++j) {
    const q_t* qh = q + b * geo.q_stride_b + (h0 + j) * geo.q_stride_h;
    for (int64_t d = 0; d < geo.head_dim; ++d)
      sc.q[j * geo.head_dim + d] = static_cast<float>(qh[d]) * scale;
  }
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
}

template <typename q_t>
inline void store_out(q_t* out, const Geometry& geo, int64_t b, int64_t h0, int64_t nh,
                      const Scratch& sc) {
  for (int64_t j = 0; j < nh; ++j) {
    q_t* oh = out + b * geo.out_stride_b + (h0 + j) * geo.out_stride_h;
    // l > 0 whenever the sequence has at least one token; an empty context gives zeros.
    const float inv = sc.l[j] > 0.f ? 1.f / sc.l[j] : 0.f;
    for (int64_t d = 0; d < geo.head_dim; ++d)
      oh[d] = static_cast<q_t>(sc.acc[j * geo.head_dim + d] * inv);
  }
}

// Online-softmax step for head j of the portable path: raise its running max to cover the tile
// (tile_max), rescale l and acc to the new max, and return it.
inline float rescale_head(Scratch& sc, int64_t j, int64_t head_dim, float tile_max) {
  const float m_new = std::max(sc.m[j], tile_max);
  const float corr = std::exp(sc.m[j] - m_new);  // exp(-inf) = 0 on the first tile
  sc.l[j] *= corr;
  float* a = sc.acc.data() + j * head_dim;
  for (int64_t d = 0; d < head_dim; ++d) a[d] *= corr;
  sc.m[j] = m_new;
  return m_new;
}

// ---------------------------------------------------------------------------------------------
// Portable path.
template <typename q_t, typename kv_t, typename index_t>
void attend_scalar(const q_t* q, const kv_t* k, const kv_t* v, const index_t* table,
                   int64_t seq_len, int64_t b, int64_t g0, int64_t nkv, float scale,
                   const Geometry& geo, Scratch& sc, q_t* out) {
  const int64_t D = geo.head_dim, G = geo.group, h0 = g0 * G, nh = nkv * G;
  const kv_t* kp[kTile];
  const kv_t* vp[kTile];
  load_q(q, geo, b, h0, nh, scale, sc);
  for (int64_t t0 = 0; t0 < seq_len; t0 += kTile) {
    const int64_t n = std::min(kTile, seq_len - t0);
    tile_rows(k, v, table, g0, t0, n, geo, kp, vp);
    for (int64_t j = 0; j < nh; ++j) {
      float* s = sc.s.data() + j * kTile;
      const float* qj = sc.q.data() + j * D;
      const int64_t off = (j / G) * D;  // this head's kv row, relative to the item's first
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qj[d] * static_cast<float>(kp[i][off + d]);
        s[i] = dot;
        tile_max = std::max(tile_max, dot);
      }
      const float m_new = rescale_head(sc, j, D, tile_max);
      float* a = sc.acc.data() + j * D;
      for (int64_t i = 0; i < n; ++i) {
        const float p = std::exp(s[i] - m_new);
        sc.l[j] += p;
        for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vp[i][off + d]);
      }
    }
  }
  store_out(out, geo, b, h0, nh, sc);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path: head_dim = 16 * NC, the NC chunks of a row unrolled at compile time.
#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  // bf16 -> fp32 is a 16-bit left shift of the bit pattern.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for the softmax (x <= 0): x = n*ln2 + r, |r| <= ln2/2, e^r by its degree-7 Taylor
// polynomial (relative error < 1e-8 before fp32 rounding), times 2^n via scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // below this e^x is ~0 in fp32 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
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

// acc[g] = acc[g] * corr[g] + sum_i p[g][i] V_i for the GG query heads of one kv head; p[g] is
// kTile apart, acc[g] head_dim apart, V_i = vp[i] + off.
template <int NC, int GG, typename kv_t>
inline void pv_group(const float* p, const float* corr, const kv_t* const* vp, int64_t off,
                     int64_t n, int64_t D, float* a) {
  __m512 acc[GG][NC];
  for (int g = 0; g < GG; ++g) {
    const __m512 vcorr = _mm512_set1_ps(corr[g]);
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(a + g * D + 16 * c), vcorr);
  }
  for (int64_t i = 0; i < n; ++i) {
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(vp[i] + off + 16 * c);
    for (int g = 0; g < GG; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * kTile + i]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GG; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(a + g * D + 16 * c, acc[g][c]);
}

template <int NC, typename q_t, typename kv_t, typename index_t>
void attend_avx512(const q_t* q, const kv_t* k, const kv_t* v, const index_t* table,
                   int64_t seq_len, int64_t b, int64_t g0, int64_t nkv, float scale,
                   const Geometry& geo, Scratch& sc, q_t* out) {
  static_assert(NC % 2 == 0, "vdpbf16ps takes head_dim in chunks of 32");
  constexpr bool kDp = use_dpbf16<q_t, kv_t>();
  const int64_t D = geo.head_dim, G = geo.group, h0 = g0 * G, nh = nkv * G;
  const kv_t* kp[kTile];
  const kv_t* vp[kTile];
  load_q(q, geo, b, h0, nh, 1.f, sc);  // unscaled: the scale is applied to the scores
  if constexpr (kDp) {
    for (int64_t x = 0; x < nh * D; ++x) sc.qb[x] = static_cast<at::BFloat16>(sc.q[x]);  // exact
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = 0; t0 < seq_len; t0 += kTile) {
    const int64_t n = std::min(kTile, seq_len - t0);
    tile_rows(k, v, table, g0, t0, n, geo, kp, vp);
    const __mmask16 lo = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __mmask16 hi = n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1);
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
      const float corr = std::exp(sc.m[j] - m_new);  // exp(-inf) = 0 on the first tile
      sc.m[j] = m_new;
      const __m512 p0 = _mm512_maskz_mov_ps(lo, exp16(_mm512_sub_ps(s0, _mm512_set1_ps(m_new))));
      const __m512 p1 = _mm512_maskz_mov_ps(hi, exp16(_mm512_sub_ps(s1, _mm512_set1_ps(m_new))));
      sc.l[j] = sc.l[j] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      float* s = sc.s.data() + j * kTile;
      _mm512_storeu_ps(s, p0);
      _mm512_storeu_ps(s + 16, p1);
      sc.corr[j] = corr;
    }
    // acc_j = acc_j * corr_j + sum_i p_ij V_i, a kv head's whole query group at a time: each V row
    // is loaded (and widened from bf16) once for the group, its accumulators held in registers.
    for (int64_t kv = 0; kv < nkv; ++kv) {
      const int64_t j0 = kv * G;
      float* a = sc.acc.data() + j0 * D;
      const float* p = sc.s.data() + j0 * kTile;
      const float* corr = sc.corr.data() + j0;
      switch (G * NC <= 16 ? G : 0) {
        case 1: pv_group<NC, 1>(p, corr, vp, kv * D, n, D, a); break;
        case 2: pv_group<NC, 2>(p, corr, vp, kv * D, n, D, a); break;
        case 3: pv_group<NC, 3>(p, corr, vp, kv * D, n, D, a); break;
        case 4: pv_group<NC, 4>(p, corr, vp, kv * D, n, D, a); break;
        default:  // groups too large for the registers: one head at a time
          for (int64_t g = 0; g < G; ++g) pv_group<NC, 1>(p + g * kTile, corr + g, vp, kv * D, n, D, a + g * D);
      }
    }
  }
  store_out(out, geo, b, h0, nh, sc);
}
#endif

template <typename q_t, typename kv_t, typename index_t>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
         torch::Tensor& out, const Geometry& geo) {
  const q_t* qp = q.data_ptr<q_t>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  const index_t* tables = block_tables.data_ptr<index_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  q_t* op = out.data_ptr<q_t>();
  const int64_t num_blocks = k_cache.size(0);

  // Validate every block the kernel will touch: a bad index would read outside the cache.
  for (int64_t b = 0; b < geo.num_seqs; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= geo.max_blocks * geo.block_size, "seq_lens[", b,
                "] = ", lens[b], " does not fit in ", geo.max_blocks, " blocks of ",
                geo.block_size);
    const int64_t used = (lens[b] + geo.block_size - 1) / geo.block_size;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t blk = static_cast<int64_t>(tables[b * geo.max_blocks + i]);
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", b, "][", i, "] = ", blk,
                  " is outside the cache (", num_blocks, " blocks)");
    }
  }

  auto attend = attend_scalar<q_t, kv_t, index_t>;
#if defined(__AVX512F__)
  if (geo.group <= kMaxGroup) {
    switch (geo.head_dim) {
      case 32: attend = attend_avx512<2, q_t, kv_t, index_t>; break;
      case 64: attend = attend_avx512<4, q_t, kv_t, index_t>; break;
      case 96: attend = attend_avx512<6, q_t, kv_t, index_t>; break;
      case 128: attend = attend_avx512<8, q_t, kv_t, index_t>; break;
      case 256: attend = attend_avx512<16, q_t, kv_t, index_t>; break;
      default: break;  // other head sizes: portable path
    }
  }
#endif

  // Whole sequences per item when there are enough of them to balance the threads.
  const int64_t num_threads = at::get_num_threads();
  const int64_t nkv = geo.num_seqs >= 4 * num_threads ? geo.num_kv_heads : 1;
  const int64_t items_per_seq = geo.num_kv_heads / nkv;
  const int64_t num_items = geo.num_seqs * items_per_seq;
  const int64_t num_workers = std::min(num_threads, num_items);
  std::atomic<int64_t> next{0};
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(geo);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
        const int64_t b = item / items_per_seq, g0 = (item % items_per_seq) * nkv;
        attend(qp, kp, vp, tables + b * geo.max_blocks, lens[b], b, g0, nkv, fscale, geo, sc, op);
      }
    }
  });
}

template <typename q_t, typename kv_t>
void run_index(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& bt, const torch::Tensor& seq_lens, double scale,
               torch::Tensor& out, const Geometry& geo) {
  if (bt.scalar_type() == torch::kInt64)
    run<q_t, kv_t, int64_t>(q, k_cache, v_cache, bt, seq_lens, scale, out, geo);
  else
    run<q_t, kv_t, int32_t>(q, k_cache, v_cache, bt, seq_lens, scale, out, geo);
}

// The step's new K/V rows [T, num_kv_heads, head_dim] (last dim contiguous: views into the fused
// qkv output) stored at their flat cache slots, converted to the cache's dtype as torch's cast does
// (c10::BFloat16 rounds to nearest even). Done here, before attending, so a layer makes one call
// instead of this one plus two index_copy_ (~25 us a layer at batch 1, benchmarks/step_profile.py).
template <typename src_t, typename kv_t>
void store_rows(const torch::Tensor& src, const int64_t* slots, torch::Tensor& cache) {
  const src_t* s = src.data_ptr<src_t>();
  kv_t* c = cache.data_ptr<kv_t>();
  const int64_t num_tokens = src.size(0), heads = src.size(1), dim = src.size(2);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const src_t* row = s + t * src.stride(0) + h * src.stride(1);
      kv_t* dst = c + (slots[t] * heads + h) * dim;
      if constexpr (std::is_same_v<src_t, kv_t>) {
        std::memcpy(dst, row, dim * sizeof(kv_t));
      } else {
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<kv_t>(static_cast<float>(row[d]));
      }
    }
}

template <typename kv_t>
void store_rows_from(const torch::Tensor& src, const int64_t* slots, torch::Tensor& cache) {
  if (src.scalar_type() == torch::kFloat32) store_rows<float, kv_t>(src, slots, cache);
  else store_rows<at::BFloat16, kv_t>(src, slots, cache);
}

void write_new_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot_mapping,
                  torch::Tensor& k_cache, torch::Tensor& v_cache) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_cache.size(2) &&
                  k.size(2) == k_cache.size(3),
              "new k/v must be [T, num_kv_heads, head_dim] matching the cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "new k/v rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16),
              "new k/v: float32 or bfloat16, the same for both");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is outside the cache (", num_slots, " slots)");
  if (k_cache.scalar_type() == torch::kFloat32) {
    store_rows_from<float>(k, slots, k_cache);
    store_rows_from<float>(v, slots, v_cache);
  } else {
    store_rows_from<at::BFloat16>(k, slots, k_cache);
    store_rows_from<at::BFloat16>(v, slots, v_cache);
  }
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              double scale, torch::Tensor out,
                              c10::optional<torch::Tensor> k_new, c10::optional<torch::Tensor> v_new,
                              c10::optional<torch::Tensor> slot_mapping) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "expected q/out [B, H, D] and caches [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const auto dtype = q.scalar_type();
  const auto kv_dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "paged_attention: q float32 or bfloat16 only, got ", dtype);
  TORCH_CHECK(kv_dtype == torch::kFloat32 || kv_dtype == torch::kBFloat16,
              "paged_attention: caches float32 or bfloat16 only, got ", kv_dtype);
  TORCH_CHECK(v_cache.scalar_type() == kv_dtype, "k_cache and v_cache differ in dtype");
  TORCH_CHECK(out.scalar_type() == dtype, "out must have q's dtype");
  TORCH_CHECK(q.sizes() == out.sizes(), "out must have q's shape");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out rows must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.size(0) == q.size(0),
              "block_tables must be contiguous [B, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) &&
                  seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [B]");
  Geometry geo;
  geo.num_seqs = q.size(0);
  geo.num_heads = q.size(1);
  geo.head_dim = q.size(2);
  geo.block_size = k_cache.size(1);
  geo.num_kv_heads = k_cache.size(2);
  geo.max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == geo.head_dim, "cache head_dim differs from q's");
  TORCH_CHECK(geo.num_heads % geo.num_kv_heads == 0, "num_heads must be a multiple of kv heads");
  geo.group = geo.num_heads / geo.num_kv_heads;
  geo.q_stride_b = q.stride(0);
  geo.q_stride_h = q.stride(1);
  geo.out_stride_b = out.stride(0);
  geo.out_stride_h = out.stride(1);
  const bool writes = k_new.has_value() && k_new->defined();
  TORCH_CHECK(writes == (v_new.has_value() && v_new->defined()) &&
                  writes == (slot_mapping.has_value() && slot_mapping->defined()),
              "k_new, v_new and slot_mapping come together");
  if (writes) write_new_kv(*k_new, *v_new, *slot_mapping, k_cache, v_cache);
  if (geo.num_seqs == 0) return out;

  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 ||
                  block_tables.scalar_type() == torch::kInt32,
              "block_tables: int64 or int32");
  const auto& bt = block_tables;
  const bool kv32 = kv_dtype == torch::kFloat32;
  if (dtype == torch::kFloat32) {
    if (kv32) run_index<float, float>(q, k_cache, v_cache, bt, seq_lens, scale, out, geo);
    else run_index<float, at::BFloat16>(q, k_cache, v_cache, bt, seq_lens, scale, out, geo);
  } else {
    if (kv32) run_index<at::BFloat16, float>(q, k_cache, v_cache, bt, seq_lens, scale, out, geo);
    else run_index<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, bt, seq_lens, scale, out, geo);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Paged attention, one query token per row, reading K/V in place through the block tables "
        "(CPU); first stores k_new/v_new at slot_mapping when given",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("out"), py::arg("k_new") = py::none(),
        py::arg("v_new") = py::none(), py::arg("slot_mapping") = py::none());
}
