// The pieces both paths of paged_attention.cpp share: the geometry of a call, the row pointers of a
// tile, the per-thread scratch and the q/out conversions. Included by paged_attention.cpp and
// paged_attention_avx512.h, in namespace tessera_paged.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace tessera_paged {

constexpr int64_t kTile = 32;  // tokens per online-softmax update (two score vectors of 16)

// The vector paths' exp (exp16, exp8) for the softmax: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// degree-7 Taylor polynomial (relative error < 1e-8 before fp32 rounding; coefficients from r^7
// down, Horner's order), times 2^n; ln2 in two parts, the first exact in few bits.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpTaylor[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f,
                                 1.f / 6.f,    0.5f,        1.f,         1.f};

#ifndef TESSERA_ATTN_PARTITION
#define TESSERA_ATTN_PARTITION 128
#endif
// A row's context is attended in partitions of this many tokens, positions [p P, (p + 1) P): each
// partition is its own online softmax from a fresh state, and the partitions' states are folded in
// order (fold_states in paged_attention.cpp). Why: a decode batch of a few rows is a few work items, one per kv head at
// batch 1, three on two threads, so one thread waited and the other streamed its K/V alone; by
// partition there are enough items for both threads and their misses. The partitions are fixed by
// position, whatever the batch and whichever thread runs them, so a row's result does not depend
// on the batch: rows too many to split fold their partitions in the same order on one thread, and
// a context of at most P tokens is one partition, the plain online softmax.
constexpr int64_t kPartition = TESSERA_ATTN_PARTITION;
static_assert(kPartition % kTile == 0, "a partition is whole tiles");

// The head sizes the vector and AMX paths are compiled for: fn(std::integral_constant<int, C>)
// with C = head_dim / Lanes, the head's chunks of Lanes floats; false (fn not called) for other
// sizes, which take the portable path.
template <int Lanes, typename Fn>
inline bool with_head_chunks(int64_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 32: fn(std::integral_constant<int, 32 / Lanes>{}); return true;
    case 64: fn(std::integral_constant<int, 64 / Lanes>{}); return true;
    case 96: fn(std::integral_constant<int, 96 / Lanes>{}); return true;
    case 128: fn(std::integral_constant<int, 128 / Lanes>{}); return true;
    case 256: fn(std::integral_constant<int, 256 / Lanes>{}); return true;
    default: return false;
  }
}

inline int64_t num_partitions(int64_t seq_len) {
  return std::max<int64_t>(1, (seq_len + kPartition - 1) / kPartition);
}

struct Geometry {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_stride_b, q_stride_h, out_stride_b, out_stride_h;
  // sliding window: row b attends to tokens [starts[b], seq_lens[b]); nullptr = from 0
  const int64_t* starts = nullptr;
  // elements from one token's K (V) row to the next in the cache; 0: num_kv_heads x head_dim.
  // Set where a call attends a subset of the kv heads (heads_of), the cache keeping all of them.
  int64_t cache_row = 0;
  int64_t start(int64_t b) const { return starts == nullptr ? 0 : starts[b]; }
  int64_t row_stride() const { return cache_row > 0 ? cache_row : num_kv_heads * head_dim; }
};

// The geometry of kv heads [kv0, kv1) alone: their query heads and rows of the cache. With q and
// the caches advanced to kv head kv0 (q by kv0 x group heads, the caches by kv0 x head_dim), an
// attend call computes those heads exactly as in a call over all of them: each head's state is
// its own.
inline Geometry heads_of(const Geometry& geo, int64_t kv0, int64_t kv1) {
  Geometry sub = geo;
  sub.cache_row = geo.row_stride();
  sub.num_kv_heads = kv1 - kv0;
  sub.num_heads = (kv1 - kv0) * geo.group;
  return sub;
}

// A row's partitions are fixed by position, [p * kPartition, (p + 1) * kPartition), whatever its
// window: the first one it attends is the one holding its first visible token.
inline int64_t first_partition(int64_t start) { return start / kPartition; }

// Calls row(i, offset) for tokens [t0, t0 + n) of one sequence, offset being the element offset of
// token t0 + i (its first kv head) in either cache.
template <typename index_t, typename Row>
inline void for_each_row(const index_t* table, int64_t t0, int64_t n, const Geometry& geo,
                         Row row) {
  // One division per call, not per token (a 64-bit divide costs as much as a head's dot product).
  int64_t idx = t0 / geo.block_size, in_block = t0 % geo.block_size;
  const int64_t row_stride = geo.row_stride();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = static_cast<int64_t>(table[idx]);
    row(i, (block * geo.block_size + in_block) * row_stride);
    if (++in_block == geo.block_size) {
      in_block = 0;
      ++idx;
    }
  }
}

// Row pointers (all kv heads of a token) for tokens [t0, t0 + n) of one sequence.
template <typename kv_t, typename index_t>
inline void tile_rows(const kv_t* k, const kv_t* v, const index_t* table, int64_t t0, int64_t n,
                      const Geometry& geo, const kv_t** kp, const kv_t** vp) {
  for_each_row(table, t0, n, geo, [&](int64_t i, int64_t offset) {
    kp[i] = k + offset;
    vp[i] = v + offset;
  });
}

#ifndef TESSERA_ATTN_TOUCH_BYTES
#define TESSERA_ATTN_TOUCH_BYTES (96 * 1024)
#endif
// Decode attention streams each sequence's K/V once, from DRAM in a real engine (30 layers' caches
// do not fit in L3). With its loads spread through the arithmetic it ran at 13-20 GB/s, against
// 55 GB/s for the same step on a cache-hot KV and ~40 GB/s for a two-stream torch.dot here (Zen 5),
// and _mm_prefetch ahead of the tile changed nothing (one tile, four, a whole sequence; T0 and T1
// hints). What works is a pass of plain loads, one byte a cache line, over the next stretch of K/V
// rows (about this many bytes, so they stay in L2) before attending to it: nothing waits on those
// loads, so the core keeps many misses in flight. 1.1-1.4x at 30 layers, batch 16-64
// (benchmarks/attention.py --layers 30); 96 KiB measured as good as 192 and 512.
constexpr int64_t kTouchBytes = TESSERA_ATTN_TOUCH_BYTES;

// Tiles per touch pass over the K and V rows (nkv kv heads) of kTile tokens.
template <typename kv_t>
inline int64_t touch_tiles(int64_t nkv, int64_t head_dim) {
  const int64_t tile_bytes = 2 * kTile * nkv * head_dim * static_cast<int64_t>(sizeof(kv_t));
  return std::max<int64_t>(1, kTouchBytes / tile_bytes);
}

#ifndef TESSERA_ATTN_WARM_BYTES
#define TESSERA_ATTN_WARM_BYTES (512 * 1024)
#endif
// The rows of a prompt are consecutive rows of one call, and each attends to the same K/V as the
// one before it plus a token. A thread that has just attended to a sequence's first n tokens
// holds their K/V in its L2 (while they are at most this many bytes, half of Zen 4's and Zen 5's
// 1 MiB), and touching them again for the next row cost ~17% of a W1-shaped prefill call
// (perf, 7 prompts of 100-450 tokens).
constexpr int64_t kWarmBytes = TESSERA_ATTN_WARM_BYTES;

// Tokens [0, n) of row b's sequence that the thread's previous row (table `prev`, prev_len tokens)
// has just read: the leading blocks the two tables share, up to prev_len; 0 when those K/V rows
// would not all stay in L2.
template <typename kv_t, typename index_t>
inline int64_t warm_tokens(const index_t* table, int64_t len, const index_t* prev, int64_t prev_len,
                           const Geometry& geo) {
  if (prev == nullptr) return 0;
  const int64_t row_bytes = 2 * geo.num_kv_heads * geo.head_dim * static_cast<int64_t>(sizeof(kv_t));
  if (prev_len * row_bytes > kWarmBytes) return 0;
  const int64_t n = std::min(len, prev_len);
  const int64_t blocks = (n + geo.block_size - 1) / geo.block_size;
  int64_t same = 0;
  while (same < blocks && table[same] == prev[same]) ++same;
  return std::min(n, same * geo.block_size);
}

// Load one byte of every cache line of the K and V rows of tokens [t0, t0 + n) of one sequence,
// so that the tiles attended next find them in L2.
template <typename kv_t, typename index_t>
inline void touch_rows(const kv_t* k, const kv_t* v, const index_t* table, int64_t t0, int64_t n,
                       const Geometry& geo) {
  const int64_t row_bytes = geo.num_kv_heads * geo.head_dim * static_cast<int64_t>(sizeof(kv_t));
  for_each_row(table, t0, n, geo, [&](int64_t, int64_t offset) {
    const volatile char* kr = reinterpret_cast<const volatile char*>(k + offset);
    const volatile char* vr = reinterpret_cast<const volatile char*>(v + offset);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      (void)kr[b];
      (void)vr[b];
    }
  });
}

// Every block the kernel will touch lies in the cache (`num_blocks` of them), and every row's
// length and window start fit its table: a bad index would read outside the cache.
template <typename index_t>
void check_tables(const index_t* tables, const int64_t* lens, int64_t num_blocks,
                  const Geometry& geo) {
  for (int64_t b = 0; b < geo.num_seqs; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= geo.max_blocks * geo.block_size, "seq_lens[", b,
                "] = ", lens[b], " does not fit in ", geo.max_blocks, " blocks of ",
                geo.block_size);
    TORCH_CHECK(geo.start(b) >= 0 && (geo.start(b) < lens[b] || geo.start(b) == 0),
                "seq_starts[", b, "] = ", geo.start(b), " is not within seq_lens ", lens[b]);
    const int64_t used = (lens[b] + geo.block_size - 1) / geo.block_size;
    // blocks before the window are never read (the block manager may have released them)
    for (int64_t i = geo.start(b) / geo.block_size; i < used; ++i) {
      const int64_t blk = static_cast<int64_t>(tables[b * geo.max_blocks + i]);
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", b, "][", i, "] = ", blk,
                  " is outside the cache (", num_blocks, " blocks)");
    }
  }
}

// Work units of a call, [units[u], units[u + 1]): single rows, or up to `max_rows` consecutive
// rows that share their table and window start (a prompt chunk's tokens) to attend together.
template <typename index_t>
std::vector<int64_t> work_units(const index_t* tables, const Geometry& geo, int64_t max_rows) {
  std::vector<int64_t> units;
  for (int64_t b = 0; b < geo.num_seqs;) {
    units.push_back(b);
    const index_t* table = tables + b * geo.max_blocks;
    int64_t e = b + 1;
    while (e < geo.num_seqs && e - b < max_rows && geo.start(e) == geo.start(b) &&
           std::equal(table, table + geo.max_blocks, tables + e * geo.max_blocks))
      ++e;
    b = e;
  }
  units.push_back(geo.num_seqs);
  return units;
}

// Per-thread scratch, allocated once per worker: the state of one row's heads (nh of them).
struct Scratch {
  std::vector<float> q;    // [nh, head_dim] fp32
  std::vector<at::BFloat16> qb;  // the same as bf16, for vdpbf16ps
  std::vector<float> acc;  // [nh, head_dim]
  std::vector<float> s;    // [nh, kTile] scores, then probabilities
  std::vector<float> m, l;  // [nh]
  std::vector<float> corr;  // [nh] this tile's rescaling of acc
  std::vector<float> fold_acc, fold_m, fold_l;  // the partitions so far of a row's item, folded
  explicit Scratch(const Geometry& geo)
      : q(geo.num_heads * geo.head_dim), qb(geo.num_heads * geo.head_dim),
        acc(geo.num_heads * geo.head_dim), s(geo.num_heads * kTile), m(geo.num_heads),
        l(geo.num_heads), corr(geo.num_heads), fold_acc(geo.num_heads * geo.head_dim),
        fold_m(geo.num_heads), fold_l(geo.num_heads) {}
};

template <typename q_t>
inline void load_q(const q_t* q, const Geometry& geo, int64_t b, float scale, Scratch& sc) {
  for (int64_t j = 0; j < geo.num_heads; ++j) {
    const q_t* qh = q + b * geo.q_stride_b + j * geo.q_stride_h;
    for (int64_t d = 0; d < geo.head_dim; ++d)
      sc.q[j * geo.head_dim + d] = static_cast<float>(qh[d]) * scale;
  }
}

// A fresh softmax state for the front nh heads: no tokens yet.
inline void reset_state(Scratch& sc, int64_t nh, int64_t head_dim) {
  std::fill(sc.acc.begin(), sc.acc.begin() + nh * head_dim, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + nh, -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.begin() + nh, 0.f);
}

// Head h of row b's output from its softmax state: acc / l.
template <typename q_t>
inline void store_head(q_t* out, const Geometry& geo, int64_t b, int64_t h, const float* acc,
                       float l) {
  q_t* oh = out + b * geo.out_stride_b + h * geo.out_stride_h;
  // l > 0 whenever the sequence has at least one token; an empty context gives zeros.
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = 0; d < geo.head_dim; ++d) oh[d] = static_cast<q_t>(acc[d] * inv);
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

}  // namespace tessera_paged
