// Paged attention for CPU: one query token per row b, attending to the first seq_lens[b] tokens of its
// sequence, K/V read in place through the block tables (no gather into a padded tensor). A row is a
// decode or one token of a prompt chunk (then seq_lens[b] = its position + 1, so the causal mask is
// the length); below, "sequence b" means row b and its block table. With a sliding window,
// `seq_starts[b]` is its first visible token: the partitions and blocks before it are skipped.
//
// Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
// contiguous. Token `pos` of sequence b lives in block block_tables[b][pos / block_size], row
// pos % block_size, so one K row of one kv head is head_dim contiguous values.
//
// A row's context is attended in partitions of kPartition tokens, each an online softmax of its own,
// folded in order (paged_attention_common.h says why, and why that keeps rows independent of the
// batch). Work item = a whole row when there are enough rows to keep the threads busy (its
// partitions folded on one thread), else one partition of a row (folded after the threads), and
// with fewer partitions than threads a slice of a partition's kv heads. Short of that an item
// covers all kv heads, so each token's K/V rows are one contiguous stretch of memory
// that the touch pass loads ahead (1.15-1.2x faster than one kv head per item at B=64, ctx 512, one
// thread; 1.4-1.7x at batch 1-6, where items were single kv heads before the partitions). All
// `group` query heads of a kv head are processed together, so every K/V row is read from memory
// once. Tokens are walked in tiles of kTile: scores for the tile, then one online-softmax update
// (running max m, running sum l, fp32 accumulator acc) per head. Work items are handed out through
// an atomic counter, because mixed sequence lengths make a static split uneven.
//
// The cache may hold another dtype than q/out (--kv-cache-dtype: bf16 K/V beside fp32 activations
// halves the bytes read); K/V rows are widened to fp32 on load, so the arithmetic is fp32 either way.
//
// Scores are computed 16 tokens at a time: 16 lane-wise partial dot products, then one transposed
// reduction (hsum16: 45 vector ops) into a vector of 16 scores, instead of 16 horizontal sums
// (~8 ops each plus a scalar store). That was the kernel's biggest cost: bf16 decode attention ran
// compute-bound at 14 GB/s.
//
// Two code paths with the same algorithm: AVX-512 (the avx512 build, -march=native;
// head_dim 32/64/96/128/256; vdpbf16ps for bf16 scores where available) and plain C++ the
// compiler vectorizes (paged_attention_scalar.h): the avx2 build (TESSERA_CPU_ISA, 8-lane FMA),
// the portable build, and other head sizes. Where the CPU has AMX, bf16 q over a bf16 cache takes
// a third (paged_attention_amx.h): both products on tiles, and a prompt chunk's rows (consecutive
// rows with one table and window start) attended in groups that share each K/V tile.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention_amx.h"
#include "paged_attention_avx2.h"
#include "paged_attention_avx512.h"
#include "paged_attention_common.h"
#include "paged_attention_fold.h"
#include "paged_attention_partitions.h"
#include "paged_attention_scalar.h"
#include "paged_kv_store.h"

namespace {

using namespace tessera_paged;

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

  check_tables(tables, lens, k_cache.size(0), geo);

  auto attend = attend_scalar<q_t, kv_t, index_t>;
#if defined(__AVX512F__)
  if (geo.group <= kMaxGroup) {
    with_head_chunks<16>(geo.head_dim, [&](auto nc) {
      attend = attend_avx512<decltype(nc)::value, q_t, kv_t, index_t>;
    });
  }
#elif defined(TESSERA_ATTN_AVX2)
  with_head_chunks<8>(geo.head_dim, [&](auto nc) {
    attend = attend_avx2<decltype(nc)::value, q_t, kv_t, index_t>;
  });
#endif
  // the AMX path (bf16 q and cache), which also attends a prompt's rows in groups
  using AttendRows = void (*)(const q_t*, const kv_t*, const kv_t*, const index_t*, int64_t,
                              const RowGroup&, float, bool, int64_t, const Geometry&);
  AttendRows attend_rows = nullptr;
#if defined(TESSERA_HAVE_AMX)
  if constexpr (std::is_same<q_t, at::BFloat16>::value && std::is_same<kv_t, at::BFloat16>::value) {
    if (geo.group <= kLanes && tessera_tiles::amx_ready()) {
      with_head_chunks<16>(geo.head_dim, [&](auto nc) {
        attend_rows = attend_amx_rows<decltype(nc)::value, index_t>;
        attend = attend_amx<decltype(nc)::value, index_t>;
      });
    }
  }
#endif
  const bool amx = attend_rows != nullptr;
  auto begin_worker = [amx] {
#if defined(TESSERA_HAVE_AMX)
    if (amx) amx_attn_configure();
#else
    (void)amx;
#endif
  };

  const int64_t num_threads = at::get_num_threads();
  const int64_t D = geo.head_dim, H = geo.num_heads;
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  // groups of a prompt's rows on the AMX path only: the vector path attends a row at a time
  const int64_t max_rows = amx ? rows_per_group(geo.group) : 1;
  const std::vector<int64_t> unit_first = work_units(tables, geo, max_rows);
  const int64_t num_units = static_cast<int64_t>(unit_first.size()) - 1;
  if (num_units >= 4 * num_threads) {
    // Enough units to balance the threads: an item is a unit, each row's partitions attended and
    // folded in order.
    const int64_t num_workers = std::min(num_threads, num_units);
    at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
      begin_worker();
      std::vector<Scratch> states(max_rows, Scratch(geo));
      const index_t* prev = nullptr;  // the table and length of this thread's previous row
      int64_t prev_len = 0;
      int64_t rows[kLanes], ends[kLanes], parts[kLanes];
      Scratch* state[kLanes];
      for (int64_t w = begin; w < end; ++w) {
        for (int64_t u = next.fetch_add(1); u < num_units; u = next.fetch_add(1)) {
          const int64_t b0 = unit_first[u], count = unit_first[u + 1] - b0;
          const index_t* table = tables + b0 * geo.max_blocks;
          const int64_t p0 = first_partition(geo.start(b0));
          int64_t max_parts = 0;
          for (int64_t i = 0; i < count; ++i) {
            rows[i] = b0 + i;
            state[i] = &states[i];
            parts[i] = num_partitions(lens[b0 + i]) - p0;
            max_parts = std::max(max_parts, parts[i]);
          }
          int64_t warm = 0;
          if (count == 1) {
            warm = warm_tokens<kv_t>(table, lens[b0], prev, prev_len, geo);
            prev = table;
            prev_len = lens[b0];
          } else {
            prev = nullptr;
          }
          for (int64_t p = 0; p < max_parts; ++p) {
            const int64_t t_begin = std::max(geo.start(b0), (p0 + p) * kPartition);
            for (int64_t i = 0; i < count; ++i)
              ends[i] = std::min(lens[rows[i]], (p0 + p + 1) * kPartition);
            if (count == 1) {
              attend(qp, kp, vp, table, t_begin, ends[0], b0, fscale, p == 0, warm, geo, states[0]);
            } else {
              attend_rows(qp, kp, vp, table, t_begin, RowGroup{rows, ends, state, count}, fscale,
                          p == 0, 0, geo);
            }
            // Each row's partitions folded in order. The last attend call may have covered
            // only some of the unit's rows (ends <= t_begin for the others, whose state it
            // reset): with more than one partition in the unit, every row's state goes to
            // its fold arrays.
            if (max_parts > 1)  // else the one partition's state is the row's
              for (int64_t i = 0; i < count; ++i)
                if (p < parts[i]) fold_partition(states[i], p == 0, H, D);
          }
          const bool folded = max_parts > 1;
          for (int64_t i = 0; i < count; ++i) {
            const Scratch& sc = states[i];
            for (int64_t h = 0; h < H; ++h)
              store_head(op, geo, rows[i], h, (folded ? sc.fold_acc : sc.acc).data() + h * D,
                         (folded ? sc.fold_l : sc.l)[h]);
          }
        }
      }
    });
    return;
  }
  // A few rows: an item is one partition of a row (paged_attention_partitions.h)
  attend_by_partition(attend, begin_worker, amx, qp, kp, vp, tables, lens, fscale, geo, op);
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

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              double scale, torch::Tensor out,
                              c10::optional<torch::Tensor> k_new, c10::optional<torch::Tensor> v_new,
                              c10::optional<torch::Tensor> slot_mapping,
                              c10::optional<torch::Tensor> seq_starts) {
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
  if (seq_starts.has_value() && seq_starts->defined()) {
    TORCH_CHECK(seq_starts->dim() == 1 && seq_starts->size(0) == q.size(0) &&
                    seq_starts->scalar_type() == torch::kInt64 && seq_starts->is_contiguous(),
                "seq_starts must be contiguous int64 [B]");
    geo.starts = seq_starts->data_ptr<int64_t>();
  }
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

// A decode layer's call on the fused projection's output: q, k, v are the column ranges
// [0, H D), [H D, (H + KVH) D), [(H + KVH) D, (H + 2 KVH) D) of qkv [T, (H + 2 KVH) D] (RoPE
// applied); the new K/V are stored at slot_mapping, then every row attends. Returns
// out [T, H D], the o-projection's input. Why: slicing q, k, v into head views, allocating out
// and flattening it again were seven torch calls a layer in Python (~15 us a layer at batch 1,
// ~0.45 ms of a 30-layer decode step), here views built in C++.
torch::Tensor paged_attention_qkv(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads,
                                  torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                  torch::Tensor slot_mapping,
                                  c10::optional<torch::Tensor> seq_starts) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, width] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 4, "caches must be [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "num_heads and num_kv_heads must be positive");
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "qkv width ", qkv.size(1), " is not (",
              num_heads, " + 2 * ", num_kv_heads, ") heads of ", D);
  const torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
  const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
  torch::Tensor out = torch::empty({T, q_size}, qkv.options());
  paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out.view({T, num_heads, D}),
                  k, v, slot_mapping, seq_starts);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Paged attention, one query token per row, reading K/V in place through the block tables "
        "(CPU); first stores k_new/v_new at slot_mapping when given",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("out"), py::arg("k_new") = py::none(),
        py::arg("v_new") = py::none(), py::arg("slot_mapping") = py::none(),
        py::arg("seq_starts") = py::none());
  m.def("paged_attention_qkv", &paged_attention_qkv,
        "Store k/v of the fused projection's output at slot_mapping, attend with its q; "
        "returns [T, num_heads * head_dim]",
        py::arg("qkv"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("slot_mapping"), py::arg("seq_starts") = py::none());
}
