// Batched LoRA on the CPU (Punica's SGMV, S-LoRA's MBGMM): one call per projection and layer adds
// every adapter segment's delta to the base output in place,
//
//   for each segment (start, end, slot), for each target t of the projection:
//     y[start:end, out_t] += (x[start:end] @ A[slot, t]^T) @ B[slot, t]^T       (scaling in B)
//
// Why by hand: as torch calls, each segment of each projection of each layer cost four calls
// (slice, shrink, expand, add), ~2,000 calls a step with four adapters; here it is 120 calls,
// one per projection and layer, and the segments' loop runs in C++.
//
// Layout (a bank of `L` slots, fp32 whatever the compute dtype; tessera/model/lora_layers.py):
//   a      [L, K, T * R]   A^T: target t's A [rank, K] in columns [t * R, t * R + rank[slot, t])
//   bt     [L, R * N]      target t's B^T [R, N_t] (row stride N_t) from R * out_offsets[t]:
//                          the targets' out ranges side by side, no block-diagonal zeros
//   ranks  [L, T]          int64; 0: the adapter leaves the target out (nothing is read)
//   out_offsets [T + 1]    target t writes columns [out_offsets[t], out_offsets[t + 1])
// Only the slots named by the step's segments are read: the shrink runs every column up to the
// slot's last targeted one in one pass over x (q|k|v together, as vLLM merges them), the
// expand only the ranks' rows of each target.
//
// Batch invariance: a row's delta is computed by the same chain of operations whatever else is in
// the batch: each shrink output is one fp32 chain of fmas over K in order, each expand output
// one over the rank in order (no horizontal sums); the tiles only decide how many rows share a
// weight load. So mixing adapters in a step changes no bit of any row.
//
// Written once on at::vec (kernel_vec.h): 16 lanes in the avx512 build, 8 in avx2, scalar loops
// in the portable build.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernel_vec.h"

namespace {

using tessera_vec::kLanes;
using tessera_vec::VecF;

constexpr int64_t kRows = 4;                  // rows of x per tile
constexpr int kShrinkVecs = 3;                // vectors of shrink output per tile
constexpr int kCols = 2;                       // vectors of output per expand tile

// t[r][c0 : c0 + CV * kLanes] (columns below n) = x[r, :] @ a[:, c0 : ...] for the RR rows of
// a tile; a is [K, lda] (A^T: ranks along the lanes). Each output is one chain of fmas over K in
// order.
template <int RR, int CV>
inline void shrink_tile(const float* x, int64_t ldx, const float* a, int64_t K, int64_t lda,
                        int64_t n, int64_t c0, float* t, int64_t ldt) {
  VecF acc[RR][CV];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < CV; ++c) acc[r][c] = VecF(0.f);
  const int64_t n_last = n - (c0 + (CV - 1) * kLanes);  // valid lanes of the last vector
  for (int64_t k = 0; k < K; ++k) {
    const float* ak = a + k * lda + c0;
    VecF av[CV];
    for (int c = 0; c < CV - 1; ++c) av[c] = VecF::loadu(ak + c * kLanes);
    av[CV - 1] = tessera_vec::load(ak + (CV - 1) * kLanes, n_last);
    for (int r = 0; r < RR; ++r) {
      const VecF xb(x[r * ldx + k]);
      for (int c = 0; c < CV; ++c) acc[r][c] = at::vec::fmadd(xb, av[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RR; ++r) {
    for (int c = 0; c < CV - 1; ++c) acc[r][c].store(t + r * ldt + c0 + c * kLanes);
    tessera_vec::store(t + r * ldt + c0 + (CV - 1) * kLanes, acc[r][CV - 1], n_last);
  }
}

// Shrink: t[r][0:n] = x[r] @ a[:, 0:n] for the RR rows of a tile: every target of a fused
// projection in one pass over x (q|k|v: 48 columns at rank 16, three vectors at 16 lanes).
template <int RR>
void shrink(const float* x, int64_t ldx, const float* a, int64_t K, int64_t lda, int64_t n,
            float* t, int64_t ldt) {
  for (int64_t c0 = 0; c0 < n; c0 += kShrinkVecs * kLanes) {
    const int64_t vecs = std::min<int64_t>(kShrinkVecs, (n - c0 + kLanes - 1) / kLanes);
    switch (vecs) {
      case 3: shrink_tile<RR, 3>(x, ldx, a, K, lda, n, c0, t, ldt); break;
      case 2: shrink_tile<RR, 2>(x, ldx, a, K, lda, n, c0, t, ldt); break;
      default: shrink_tile<RR, 1>(x, ldx, a, K, lda, n, c0, t, ldt); break;
    }
  }
}

// Expand: y[r, 0:width] += t[r][0:rank] @ bt[0:rank, 0:width] (bt rows of stride width).
template <int RR, typename T>
void expand(const float* t, int64_t ldt, int64_t rank, const float* bt, int64_t width, T* y,
            int64_t ldy) {
  for (int64_t c0 = 0; c0 < width; c0 += kCols * kLanes) {
    VecF acc[RR][kCols];
    for (int r = 0; r < RR; ++r)
      for (int c = 0; c < kCols; ++c) acc[r][c] = VecF(0.f);
    for (int64_t j = 0; j < rank; ++j) {
      VecF bv[kCols];
      for (int c = 0; c < kCols; ++c) {
        const int64_t col = c0 + c * kLanes;
        bv[c] = col < width ? tessera_vec::load(bt + j * width + col, width - col) : VecF(0.f);
      }
      for (int r = 0; r < RR; ++r) {
        const VecF tb(t[r * ldt + j]);
        for (int c = 0; c < kCols; ++c) acc[r][c] = at::vec::fmadd(tb, bv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < RR; ++r) {
      for (int c = 0; c < kCols; ++c) {
        const int64_t col = c0 + c * kLanes;
        if (col >= width) break;
        T* yp = y + r * ldy + col;
        tessera_vec::store(yp, tessera_vec::load(yp, width - col) + acc[r][c], width - col);
      }
    }
  }
}

struct Bank {
  const float* a;
  const float* bt;
  const int64_t* ranks;
  const int64_t* out_offsets;
  int64_t num_targets, max_rank, K, N;
};

// One tile: rows [m0, m0 + RR) of one segment, under `slot`; `xf` and `t` are this thread's.
template <int RR, typename T>
void tile(const T* x, int64_t ldx, T* y, int64_t ldy, int64_t m0, int64_t slot, const Bank& bank,
          float* xf, float* t) {
  const float* xr;
  int64_t ldxr;
  if constexpr (std::is_same_v<T, float>) {
    xr = x + m0 * ldx;
    ldxr = ldx;
  } else {  // bf16 rows widened once, shared by every target's shrink
    for (int r = 0; r < RR; ++r) {
      const T* row = x + (m0 + r) * ldx;
      for (int64_t k = 0; k < bank.K; ++k) xf[r * bank.K + k] = static_cast<float>(row[k]);
    }
    xr = xf;
    ldxr = bank.K;
  }
  const int64_t C = bank.num_targets * bank.max_rank;
  const int64_t* ranks = bank.ranks + slot * bank.num_targets;
  // the used columns: up to the last targeted one (a slot that leaves out v_proj stops at k)
  int64_t used = 0;
  for (int64_t tg = 0; tg < bank.num_targets; ++tg)
    if (ranks[tg] > 0) used = tg * bank.max_rank + ranks[tg];
  shrink<RR>(xr, ldxr, bank.a + slot * bank.K * C, bank.K, C, used, t, C);
  for (int64_t tg = 0; tg < bank.num_targets; ++tg) {
    const int64_t rank = ranks[tg];
    if (rank == 0) continue;
    const int64_t o0 = bank.out_offsets[tg], width = bank.out_offsets[tg + 1] - o0;
    const float* bt = bank.bt + slot * bank.max_rank * bank.N + bank.max_rank * o0;
    expand<RR>(t + tg * bank.max_rank, C, rank, bt, width, y + m0 * ldy + o0, ldy);
  }
}

template <typename T>
void run(const torch::Tensor& y, const torch::Tensor& x, const std::vector<int64_t>& tiles,
         const Bank& bank) {
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) / 3;
  const int64_t ldt = bank.num_targets * bank.max_rank;
  at::parallel_for(0, num_tiles, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(std::is_same_v<T, float> ? 0 : kRows * bank.K);
    std::vector<float> t(kRows * ldt);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = tiles[3 * i], rows = tiles[3 * i + 1], slot = tiles[3 * i + 2];
      switch (rows) {
        case 4: tile<4>(xp, ldx, yp, ldy, m0, slot, bank, xf.data(), t.data()); break;
        case 3: tile<3>(xp, ldx, yp, ldy, m0, slot, bank, xf.data(), t.data()); break;
        case 2: tile<2>(xp, ldx, yp, ldy, m0, slot, bank, xf.data(), t.data()); break;
        default: tile<1>(xp, ldx, yp, ldy, m0, slot, bank, xf.data(), t.data()); break;
      }
    }
  });
}

}  // namespace

// y [M, N] += each segment's LoRA delta (see the header). segments: int64 [S, 3] (start, end,
// slot), disjoint row ranges; rows in no segment are not touched.
void lora_add_(torch::Tensor y, torch::Tensor x, torch::Tensor segments, torch::Tensor a,
               torch::Tensor bt, torch::Tensor ranks, torch::Tensor out_offsets) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with a contiguous last dim");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0),
              "y must be [M, N] with a contiguous last dim, M as x");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y dtypes differ");
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && bt.scalar_type() == torch::kFloat32 &&
                  a.is_contiguous() && bt.is_contiguous(),
              "the bank's a and bt must be contiguous float32");
  TORCH_CHECK(ranks.scalar_type() == torch::kInt64 && ranks.is_contiguous() && ranks.dim() == 2,
              "ranks must be contiguous int64 [L, T]");
  TORCH_CHECK(out_offsets.scalar_type() == torch::kInt64 && out_offsets.is_contiguous(),
              "out_offsets must be contiguous int64");
  TORCH_CHECK(segments.scalar_type() == torch::kInt64 && segments.is_contiguous() &&
                  segments.dim() == 2 && segments.size(1) == 3,
              "segments must be contiguous int64 [S, 3]");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t L = ranks.size(0), T = ranks.size(1);
  TORCH_CHECK(T > 0 && out_offsets.numel() == T + 1, "out_offsets must hold T + 1 offsets");
  TORCH_CHECK(a.dim() == 3 && a.size(0) == L && a.size(1) == K && a.size(2) % T == 0,
              "a must be [L, K, T * R] with K as x");
  const int64_t R = a.size(2) / T;
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == L && bt.size(1) == R * N,
              "bt must be [L, R * N] with N as y");
  const int64_t* off = out_offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] >= 0 && off[T] <= N, "out_offsets outside [0, N]");
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(off[t] <= off[t + 1], "out_offsets must not fall");
  const int64_t* rk = ranks.data_ptr<int64_t>();
  // the tiles of every segment: (first row, rows, slot); indices checked here, once
  const int64_t S = segments.size(0);
  const int64_t* seg = segments.data_ptr<int64_t>();
  std::vector<int64_t> tiles;
  tiles.reserve(3 * (M / kRows + S + 1));
  int64_t prev_end = 0;  // in order and disjoint: no two threads write one row
  for (int64_t s = 0; s < S; ++s) {
    const int64_t start = seg[3 * s], end = seg[3 * s + 1], slot = seg[3 * s + 2];
    TORCH_CHECK(prev_end <= start && start <= end && end <= M,
                "segments must be disjoint row ranges in order within [0, M)");
    prev_end = end;
    TORCH_CHECK(0 <= slot && slot < L, "segment slot outside the bank");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(0 <= rk[slot * T + t] && rk[slot * T + t] <= R, "rank outside [0, R]");
    for (int64_t m0 = start; m0 < end; m0 += kRows) {
      tiles.push_back(m0);
      tiles.push_back(std::min(kRows, end - m0));
      tiles.push_back(slot);
    }
  }
  if (tiles.empty()) return;
  const Bank bank{a.data_ptr<float>(), bt.data_ptr<float>(), rk, off, T, R, K, N};
  if (x.scalar_type() == torch::kFloat32) {
    run<float>(y, x, tiles, bank);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
    run<c10::BFloat16>(y, x, tiles, bank);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_add_", &lora_add_, "y += each segment's LoRA delta, shrink then expand, in place");
}
