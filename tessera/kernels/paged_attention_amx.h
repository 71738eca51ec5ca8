// The AMX path of paged_attention.cpp, for bf16 q over a bf16 cache where the CPU has AMX-BF16
// (Sapphire Rapids and later): the rows and partitions of attend_avx512 (whose states run()
// folds the same way), with the two products on tiles.
//
// Why: attend_avx512 spends ~50 cycles a token and kv head on vector arithmetic (dot products,
// their transposed sums, the softmax per head, widened V rows) even with its K/V in L2, and a
// prompt's rows each walk their context alone, so prefill attention ran at ~100 GFLOP/s. One
// tdpbf16ps does a 16 x 16 x 32 product.
//
// A call attends one partition (<= kPartition tokens) for a group of rows: its scores first,
// then the softmax with the partition's own max (no rescaling between tiles), then P x V with
// each output tile one sum over the partition's tiles. Up to 16 query heads are the columns
// ("lanes") of the products:
// - scores, transposed: S^T [16 tokens][lanes] = K rows (A: 16 rows of 32 dims, loaded in place
//   from the cache with the row stride) x q^T (B: the lanes' q as pair-rows). A lone row's lanes
//   span several kv heads: each kv head's product adds into the same C tile with B zero in the
//   other heads' columns, so a column only ever receives its own head's sums (the others add
//   exact zeros). A group of rows of one sequence (a prompt chunk: same table, same window
//   start) fills the lanes with up to 16 / G rows' heads of one kv head instead, and shares
//   every K tile, V pair and touch of the partition.
// - the softmax runs down the tokens with the lanes across a vector; a token past a row's end is
//   masked (the max skips it, P and l add exact zeros).
// - out: O [lanes][16 dims] = P (A: bf16 [lanes][32 tokens]) x V (B: pair-rows of two tokens
//   interleaved, one unpack each). The unpack leaves the dims of a B tile in a fixed permuted
//   order, undone with one permute per 16 dims.
// P is rounded to bf16 for the product, as transformers' eager attention does in bf16; l sums
// the fp32 P.
//
// Row independence: a row's result comes from its own q, its context and the fixed partitions;
// every tile product element is a dot product of one A row and one B column, the same bits
// whichever rows or heads are beside it. So a row is bitwise the same alone, in any batch, in a
// group of a prefill or as a decode. It is not the bits of attend_avx512: a process uses one path
// for every bf16 call (amx_ready decides once; TESSERA_DISABLE_AMX=1 picks the vector path).
#pragma once

#include "linear_amx.h"
#include "paged_attention_avx512.h"

namespace tessera_paged {

constexpr int64_t kLanes = 16;  // query heads of one lane block (tile columns)

// Rows that share a sequence (the same block table and window start): a prompt's tokens.
struct RowGroup {
  const int64_t* rows;    // the rows' indices in the call (q, out)
  const int64_t* ends;    // row i attends to tokens [t_begin, ends[i]) of this partition
  Scratch* const* state;  // row i's softmax state, written here
  int64_t count;          // 1 .. rows_per_group(G)
};

// Rows of one group: their query heads of one kv head fill the 16 lanes (5 rows at 3 heads a kv
// head). A lone row instead spreads its lanes over several kv heads.
inline int64_t rows_per_group(int64_t group) { return std::max<int64_t>(1, kLanes / group); }

#if defined(TESSERA_HAVE_AMX)

// Per-thread buffers of the AMX path, grown once per geometry.
struct AmxAttnBuffers {
  std::vector<at::BFloat16> q_pairs_raw, v_pairs_raw, k_rows_raw;
  at::BFloat16 *q_pairs = nullptr, *v_pairs = nullptr, *k_rows = nullptr;
  alignas(64) float st[kPartition * kLanes];         // scores, then P: [token][lane]
  alignas(64) float out[2 * kLanes * kLanes];        // two products of P and V: [lane][16 dims]
  alignas(64) at::BFloat16 p[kLanes * kPartition];  // P in bf16: [lane][token]

  static at::BFloat16* grow(std::vector<at::BFloat16>& raw, int64_t elems) {
    if (static_cast<int64_t>(raw.size()) < elems + tessera_tiles::kAlignElems)
      raw.assign(elems + tessera_tiles::kAlignElems, at::BFloat16(0.f));
    return tessera_tiles::align64(raw.data());
  }
};

inline AmxAttnBuffers& amx_buffers() {
  static thread_local AmxAttnBuffers buffers;
  return buffers;
}

// Every tile 16 rows of 64 bytes. Scores: C in 0, 1, 6, 7 (four half tiles of tokens), K rows in
// 2 and 5 (alternating), q pairs in 3. Out: P in 0-3 (one a 32-token tile), V pairs in 4 and 5, C
// in 6 and 7. P rows past the block's lanes are zeros and their sums never read. Tile state is
// per thread and other kernels configure their own: every worker of a call configures first.
// The configuration is a static: built on the stack just before ldtilecfg, GCC 12 dropped its
// stores where the call was not inlined (it does not see the instruction read them), and
// ldtilecfg faulted on the half-written bytes.
inline void amx_attn_configure() {
  static const tessera_tiles::TileConfig cfg = [] {
    tessera_tiles::TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

constexpr int64_t kPairTile = 16 * 32;  // elements of one B tile (16 pair-rows of 32)

// V pairs of one 32-token tile for every kv head: [kv head][NC tiles of 16 dims][16 pair-rows]
// [32], pair-row r = tokens 2 r and 2 r + 1 interleaved; tokens past n are zeros (P is 0 there,
// and a stale cache row may hold anything).
template <int NC>
inline void pack_v_pairs(const at::BFloat16* const* vp, int64_t n, int64_t nkv, at::BFloat16* out) {
  constexpr int64_t D = 16 * NC;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t kv = 0; kv < nkv; ++kv) {
    for (int64_t r = 0; r < kTile / 2; ++r) {
      const int64_t t = 2 * r;
      for (int e = 0; e < NC / 2; ++e) {
        const __m512i a = t < n ? _mm512_loadu_si512(vp[t] + kv * D + 32 * e) : zero;
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(vp[t + 1] + kv * D + 32 * e) : zero;
        at::BFloat16* tile = out + (kv * NC + 2 * e) * kPairTile + r * 32;
        _mm512_store_si512(tile, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(tile + kPairTile, _mm512_unpackhi_epi16(a, b));
      }
    }
  }
}

// _tile_* take tile numbers as literals (they are pasted into the instruction), hence macros.
// One K half tile (16 token rows at k, `stride` bytes apart) into tile KT, times the q pairs in
// tile 3, added to tile C.
#define TESSERA_SCORE_HALF(C, KT, k, stride) \
  do {                                       \
    _tile_loadd(KT, k, stride);              \
    _tile_dpbf16ps(C, KT, 3);                \
  } while (0)
// Output tiles e2 and e2 + 1 of one kv head, one 32-token tile's share: P (tile P) x V pairs.
#define TESSERA_PV_STEP(P, v0, v1) \
  do {                             \
    _tile_loadd(4, v0, 64);        \
    _tile_dpbf16ps(6, P, 4);       \
    _tile_loadd(5, v1, 64);        \
    _tile_dpbf16ps(7, P, 5);       \
  } while (0)

// The softmax states of a group's rows over one partition's tokens [t_begin, ends[i]), as
// attend_avx512 leaves them (m, l, acc in natural dim order; a row with no token here gets
// m = -inf and must not be folded). A partition is at most kPartition tokens, so its scores are
// all computed first: the max is the partition's own (no rescaling between tiles), and each
// output tile is one sum over the partition's tiles in TMUL. The rows of a group share every K
// tile, V pair and touch of their sequence; each lane's arithmetic is that of its row alone
// (tokens past a row's end are masked: the max skips them, P and l add exact zeros there).
template <int NC, typename index_t>
void attend_amx_rows(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                     const index_t* table, int64_t t_begin, const RowGroup& group, float scale,
                     bool load_query, int64_t warm_end, const Geometry& geo) {
  static_assert(NC % 2 == 0, "tiles take head_dim in steps of 32");
  constexpr int64_t D = 16 * NC, kSteps = NC / 2;
  constexpr int64_t kTiles = kPartition / kTile;
  static_assert(kTiles <= 4, "P of a partition takes tiles 0-3");
  const int64_t G = geo.group, nkv = geo.num_kv_heads, nh = geo.num_heads, R = group.count;
  const int64_t row = nkv * D;  // elements of one token's row (all kv heads)
  // kv heads a lane block spans: several for a lone row, one for a group of rows
  const int64_t kv_per_block = R > 1 ? 1 : std::max<int64_t>(1, std::min(nkv, kLanes / G));
  const int64_t num_blocks = (nkv + kv_per_block - 1) / kv_per_block;
  AmxAttnBuffers& buf = amx_buffers();
  const int64_t q_elems = num_blocks * kv_per_block * kSteps * kPairTile;
  buf.q_pairs = AmxAttnBuffers::grow(buf.q_pairs_raw, q_elems);
  buf.v_pairs = AmxAttnBuffers::grow(buf.v_pairs_raw, kTiles * nkv * NC * kPairTile);
  buf.k_rows = AmxAttnBuffers::grow(buf.k_rows_raw, kPartition * row);
  // q pairs [block][kv head in block][step][pair-row r][2 lane + x] = q[lane's row and head]
  // [32 step + 2 r + x] where the lane's head reads that kv head, else 0; lane = (row in group x
  // kv heads in block + kv head in block) x G + head in its kv head's group
  auto q_tile = [&](int64_t block, int64_t hb, int64_t step) {
    return buf.q_pairs + ((block * kv_per_block + hb) * kSteps + step) * kPairTile;
  };
  if (load_query) {
    std::memset(static_cast<void*>(buf.q_pairs), 0, q_elems * sizeof(at::BFloat16));
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kv = h / G, block = kv / kv_per_block, hb = kv % kv_per_block;
        const int64_t lane = (i * kv_per_block + hb) * G + h % G;
        const at::BFloat16* qh = q + group.rows[i] * geo.q_stride_b + h * geo.q_stride_h;
        for (int64_t step = 0; step < kSteps; ++step) {
          at::BFloat16* tile = q_tile(block, hb, step);
          for (int64_t r = 0; r < 16; ++r) {
            tile[r * 32 + 2 * lane] = qh[32 * step + 2 * r];
            tile[r * 32 + 2 * lane + 1] = qh[32 * step + 2 * r + 1];
          }
        }
      }
    }
  }
  int64_t n = 0;  // tokens of the partition some row attends to
  for (int64_t i = 0; i < R; ++i) {
    reset_state(*group.state[i], nh, D);
    n = std::max(n, group.ends[i] - t_begin);
  }
  if (n <= 0) return;  // no tokens: the states of none
  TORCH_CHECK(n <= kPartition, "attend_amx_rows: one partition at a time");
  const int64_t t_end = t_begin + n;
  if (warm_end < t_end) {  // the partition's rows into L2 (paged_attention_common.h)
    const int64_t from = std::max(t_begin, warm_end);
    touch_rows(k, v, table, from, t_end - from, geo);
  }
  // V pairs of every tile, and where each 16-token half's K rows are: in place when they are one
  // block's consecutive rows (blocks of a multiple of 16, the half starting on a multiple of 16),
  // else copied (rows past n zero, so no read leaves the sequence's blocks)
  const int64_t num_tiles = (n + kTile - 1) / kTile, num_halves = (n + 15) / 16;
  const at::BFloat16* k_half[2 * kTiles];
  {
    const at::BFloat16* kp[kTile];
    const at::BFloat16* vp[kTile];
    for (int64_t i = 0; i < num_tiles; ++i) {
      const int64_t t0 = t_begin + i * kTile, cnt = std::min(kTile, t_end - t0);
      tile_rows(k, v, table, t0, cnt, geo, kp, vp);
      pack_v_pairs<NC>(vp, cnt, nkv, buf.v_pairs + i * nkv * NC * kPairTile);
      for (int64_t s = 0; s < 2 && 16 * s < cnt; ++s) {
        const int64_t lo = 16 * s, rows = std::min<int64_t>(16, cnt - lo);
        if (rows == 16 && geo.block_size % 16 == 0 && (t0 + lo) % 16 == 0) {
          k_half[2 * i + s] = kp[lo];
        } else {
          at::BFloat16* dst = buf.k_rows + (i * kTile + lo) * row;
          for (int64_t r = 0; r < 16; ++r) {
            if (r < rows) std::memcpy(dst + r * row, kp[lo + r], row * sizeof(at::BFloat16));
            else std::memset(static_cast<void*>(dst + r * row), 0, row * sizeof(at::BFloat16));
          }
          k_half[2 * i + s] = dst;
        }
      }
    }
  }
  const int64_t k_stride = row * static_cast<int64_t>(sizeof(at::BFloat16));
  constexpr int64_t kCStride = kLanes * sizeof(float);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i gather_idx = _mm512_mullo_epi32(
      _mm512_set1_epi32(kLanes),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  // the unpack's order (lo: dims 8 L + 0..3 of each 128-bit lane L, hi: 8 L + 4..7) undone
  const __m512i first_dims =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i last_dims =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  float* st = buf.st;
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t kv0 = block * kv_per_block, nkb = std::min(kv_per_block, nkv - kv0);
    const int64_t lanes_per_row = nkb * G, lanes = R * lanes_per_row;
    // tokens each lane attends to in this partition
    alignas(64) int32_t lane_tokens[kLanes] = {};
    for (int64_t j = 0; j < lanes; ++j)
      lane_tokens[j] = static_cast<int32_t>(group.ends[j / lanes_per_row] - t_begin);
    const __m512i lane_n = _mm512_load_si512(lane_tokens);
    // scores S^T [token][lane], four half tiles at a time
    for (int64_t c0 = 0; c0 < num_halves; c0 += 4) {
      const int64_t cnt = std::min<int64_t>(4, num_halves - c0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t hb = 0; hb < nkb; ++hb) {
        for (int64_t step = 0; step < kSteps; ++step) {
          _tile_loadd(3, q_tile(block, hb, step), 64);
          const int64_t off = (kv0 + hb) * D + 32 * step;
          TESSERA_SCORE_HALF(0, 2, k_half[c0] + off, k_stride);
          if (cnt > 1) TESSERA_SCORE_HALF(1, 5, k_half[c0 + 1] + off, k_stride);
          if (cnt > 2) TESSERA_SCORE_HALF(6, 2, k_half[c0 + 2] + off, k_stride);
          if (cnt > 3) TESSERA_SCORE_HALF(7, 5, k_half[c0 + 3] + off, k_stride);
        }
      }
      float* sc0 = st + c0 * 16 * kLanes;
      _tile_stored(0, sc0, kCStride);
      if (cnt > 1) _tile_stored(1, sc0 + 16 * kLanes, kCStride);
      if (cnt > 2) _tile_stored(6, sc0 + 32 * kLanes, kCStride);
      if (cnt > 3) _tile_stored(7, sc0 + 48 * kLanes, kCStride);
    }
    // the softmax, one lane a (row, head); token t counts for the lanes with t < lane_n
    __m512 m = ninf;
    for (int64_t t = 0; t < n; ++t) {
      const __mmask16 valid = _mm512_cmpgt_epi32_mask(lane_n, _mm512_set1_epi32(t));
      const __m512 s = _mm512_mul_ps(_mm512_load_ps(st + t * kLanes), vscale);
      _mm512_store_ps(st + t * kLanes, s);
      m = _mm512_mask_max_ps(m, valid, m, s);
    }
    __m512 l = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __mmask16 valid = _mm512_cmpgt_epi32_mask(lane_n, _mm512_set1_epi32(t));
      const __m512 p =
          _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_load_ps(st + t * kLanes), m)));
      l = _mm512_add_ps(l, p);
      _mm512_store_ps(st + t * kLanes, p);
    }
    for (int64_t t = n; t < num_tiles * kTile; ++t)
      _mm512_store_ps(st + t * kLanes, _mm512_setzero_ps());
    alignas(64) float m_lane[kLanes], l_lane[kLanes];
    _mm512_store_ps(m_lane, m);
    _mm512_store_ps(l_lane, l);
    for (int64_t j = 0; j < lanes; ++j) {  // lane j: row j / lanes_per_row, its block's heads
      Scratch& sc = *group.state[j / lanes_per_row];
      sc.m[kv0 * G + j % lanes_per_row] = m_lane[j];
      sc.l[kv0 * G + j % lanes_per_row] = l_lane[j];
    }
    for (int64_t j = 0; j < lanes; ++j) {  // P [lane][token] in bf16
      for (int64_t i = 0; i < num_tiles; ++i) {
        const float* s0 = st + i * kTile * kLanes + j;
        const __m512 p0 = _mm512_i32gather_ps(gather_idx, s0, 4);
        const __m512 p1 = _mm512_i32gather_ps(gather_idx, s0 + 16 * kLanes, 4);
        _mm512_store_si512(buf.p + j * kPartition + i * kTile,
                           (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
    }
    for (int64_t j = lanes; j < kLanes; ++j)  // rows of no lane: zeros
      std::memset(static_cast<void*>(buf.p + j * kPartition), 0, kPartition * sizeof(at::BFloat16));
    // out = P x V, each output tile one sum over the partition's tiles
    constexpr int64_t kPStride = kPartition * sizeof(at::BFloat16);
    _tile_loadd(0, buf.p, kPStride);
    if (num_tiles > 1) _tile_loadd(1, buf.p + kTile, kPStride);
    if (num_tiles > 2) _tile_loadd(2, buf.p + 2 * kTile, kPStride);
    if (num_tiles > 3) _tile_loadd(3, buf.p + 3 * kTile, kPStride);
    for (int64_t hb = 0; hb < nkb; ++hb) {
      const int64_t kv = kv0 + hb;
      for (int64_t e2 = 0; e2 < NC; e2 += 2) {
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t i = 0; i < num_tiles; ++i) {
          const at::BFloat16* v0 = buf.v_pairs + ((i * nkv + kv) * NC + e2) * kPairTile;
          switch (i) {
            case 0: TESSERA_PV_STEP(0, v0, v0 + kPairTile); break;
            case 1: TESSERA_PV_STEP(1, v0, v0 + kPairTile); break;
            case 2: TESSERA_PV_STEP(2, v0, v0 + kPairTile); break;
            default: TESSERA_PV_STEP(3, v0, v0 + kPairTile); break;
          }
        }
        _tile_stored(6, buf.out, kCStride);
        _tile_stored(7, buf.out + kLanes * kLanes, kCStride);
        for (int64_t i = 0; i < R; ++i) {
          Scratch& sc = *group.state[i];
          for (int64_t g = 0; g < G; ++g) {  // dims 32 e .. 32 e + 31 back in order
            const int64_t j = (i * nkb + hb) * G + g, h = kv * G + g;
            float* a = sc.acc.data() + h * D + 16 * e2;
            const __m512 lo = _mm512_load_ps(buf.out + j * kLanes);
            const __m512 hi = _mm512_load_ps(buf.out + kLanes * kLanes + j * kLanes);
            _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo, first_dims, hi));
            _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo, last_dims, hi));
          }
        }
      }
    }
  }
}

// One row's partition through the group kernel: attend_avx512's signature, so run() can pick it.
template <int NC, typename index_t>
void attend_amx(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                const index_t* table, int64_t t_begin, int64_t t_end, int64_t b, float scale,
                bool load_query, int64_t warm_end, const Geometry& geo, Scratch& sc) {
  Scratch* state = &sc;
  const RowGroup one{&b, &t_end, &state, 1};
  attend_amx_rows<NC, index_t>(q, k, v, table, t_begin, one, scale, load_query, warm_end, geo);
}

#undef TESSERA_SCORE_HALF
#undef TESSERA_PV_STEP

#endif  // TESSERA_HAVE_AMX

}  // namespace tessera_paged
