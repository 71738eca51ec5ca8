// The few-rows path of paged_attention.cpp's run(): with too few rows to keep the threads busy
// row by row, an item is one partition of a row (or, with fewer partitions than threads, a slice of
// its kv heads), and a pass after the threads folds each row's partitions in order, as one thread
// folds its row's partitions on the many-rows path. Included by paged_attention.cpp, in namespace
// tessera_paged.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "paged_attention_common.h"
#include "paged_attention_fold.h"

namespace tessera_paged {

// Each item leaves its state (m, l, acc) in `partial`, then the fold pass; `attend` and
// `begin_worker` are run()'s (the build's attend function, the AMX set-up of a worker thread).
template <typename q_t, typename kv_t, typename index_t, typename Attend, typename BeginWorker>
void attend_by_partition(Attend attend, BeginWorker begin_worker, bool amx, const q_t* qp,
                         const kv_t* kp, const kv_t* vp, const index_t* tables,
                         const int64_t* lens, float fscale, const Geometry& geo, q_t* op) {
  const int64_t num_threads = at::get_num_threads();
  const int64_t D = geo.head_dim, H = geo.num_heads;
  std::atomic<int64_t> next{0};
  std::vector<int64_t> first(geo.num_seqs + 1, 0);  // row b's partitions: [first[b], first[b+1])
  for (int64_t b = 0; b < geo.num_seqs; ++b)
    first[b + 1] = first[b] + num_partitions(lens[b]) - first_partition(geo.start(b));
  const int64_t stride = H * (D + 2);  // per partition: m [H], l [H], acc [H][D]
  std::vector<float> partial(first[geo.num_seqs] * stride);
  const int64_t num_parts = first[geo.num_seqs];
  // Fewer partitions than threads (batch-1 decode up to kPartition tokens: one): each partition
  // split into slices of its kv heads, so that every thread has one. A head's softmax state is
  // its own, so the split changes no bit of any head's result. Not on the AMX path, whose tiles
  // span a row's kv heads. Measured (`benchmarks/attention.py --baseline`, 1B Llama geometry,
  // fp32, Zen 4): one partition 0.83-0.92x the time; splitting where every thread had a
  // partition already (two or three partitions, or batch 2) was 1.2-1.35x slower.
  const int64_t slices =
      amx ? 1 : std::min(geo.num_kv_heads, (num_threads + num_parts - 1) / num_parts);
  const int64_t num_items = num_parts * slices;
  const int64_t num_workers = std::min(num_threads, num_items);
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    begin_worker();
    Scratch sc(geo);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
        const int64_t part = item / slices;  // row b's partition part - first[b]
        const int64_t slice = item % slices;
        const int64_t kv0 = slice * geo.num_kv_heads / slices;
        const int64_t kv1 = (slice + 1) * geo.num_kv_heads / slices;
        const int64_t b = std::upper_bound(first.begin(), first.end(), part) - first.begin() - 1;
        const int64_t p = first_partition(geo.start(b)) + part - first[b];
        const int64_t t_begin = std::max(geo.start(b), p * kPartition);
        const int64_t t_end = std::min(lens[b], (p + 1) * kPartition);
        const int64_t h0 = kv0 * geo.group, nh = (kv1 - kv0) * geo.group;
        attend(qp + h0 * geo.q_stride_h, kp + kv0 * D, vp + kv0 * D, tables + b * geo.max_blocks,
               t_begin, t_end, b, fscale, true, 0, heads_of(geo, kv0, kv1), sc);
        float* rec = partial.data() + part * stride;
        std::copy(sc.m.begin(), sc.m.begin() + nh, rec + h0);
        std::copy(sc.l.begin(), sc.l.begin() + nh, rec + H + h0);
        std::copy(sc.acc.begin(), sc.acc.begin() + nh * D, rec + 2 * H + h0 * D);
      }
    }
  });
  at::parallel_for(0, geo.num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(stride);  // m [H], l [H], acc [H][D], as a partition's record
    float *m = state.data(), *l = m + H, *acc = l + H;
    for (int64_t b = begin; b < end; ++b) {
      const float* rec = partial.data() + first[b] * stride;
      std::copy(rec, rec + stride, state.begin());
      for (int64_t part = first[b] + 1; part < first[b + 1]; ++part) {
        const float* r = partial.data() + part * stride;
        fold_states(m, l, acc, r, r + H, r + 2 * H, H, D);
      }
      for (int64_t h = 0; h < H; ++h) store_head(op, geo, b, h, acc + h * D, l[h]);
    }
  });
}

}  // namespace tessera_paged
