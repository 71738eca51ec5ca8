// The step's new K/V rows stored at their cache slots: the `k_new`/`v_new` of paged_attention.cpp.
#pragma once

#include <torch/extension.h>

#include <cstring>
#include <type_traits>

namespace tessera_paged {

// The step's new K/V rows [T, num_kv_heads, head_dim] (last dim contiguous: views into the fused
// qkv output) stored at their flat cache slots, converted to the cache's dtype as torch's cast does
// (c10::BFloat16 rounds to nearest even). Done here, before attending, so a layer makes one call
// instead of this one plus two index_copy_ (18-20 us a layer at batch 1, 24 us at batch 16: a
// microbenchmark of write_kv alone).
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

}  // namespace tessera_paged
