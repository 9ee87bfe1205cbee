// What the paged attention kernels share: the pool's view and the checks of their common
// arguments (the query, the output, the pool, the block tables' blocks).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

namespace conveyor_native {

// kv_cache [2, num_blocks, block_size, Hkv, D], fp32 (attention/__init__.py).
struct Pool {
  const float* keys;
  const float* values;
  int64_t block_stride;  // floats per block of one half (block_size * Hkv * D)
  int64_t token_stride;  // floats per token (Hkv * D)
  int64_t block_size;
};

// query [N, H, D] fp32 with contiguous heads (its rows may be strided: a view of the qkv
// projection's output), out [N, H, D] contiguous fp32; the pool contiguous fp32 with the
// query's D and a number of kv heads that divides H.
inline void check_attention_tensors(const torch::Tensor& out, const torch::Tensor& query,
                                    const torch::Tensor& kv_cache) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1 &&
              (query.size(1) == 1 || query.stride(1) == query.size(2)) &&
              (query.size(0) <= 1 || query.stride(0) >= query.size(1) * query.size(2)),
              "query must be a float32 [N, H, D] tensor with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
              out.scalar_type() == at::kFloat, "out must be a contiguous float32 like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
              kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be a contiguous float32 [2, blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "kv_cache head_dim differs from the query's");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0,
              "query heads must be a multiple of kv heads");
}

// Floats from one query row to the next.
inline int64_t row_stride(const torch::Tensor& rows) {
  return rows.size(0) <= 1 ? rows.size(1) * rows.size(2) : rows.stride(0);
}

inline Pool pool_of(const torch::Tensor& kv_cache) {
  const float* base = kv_cache.data_ptr<float>();
  return Pool{base, base + kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
              kv_cache.size(2)};
}

// Every block of row `row` of tables [R, width] holding tokens 0..len - 1 is a block of the pool.
inline void check_blocks(const int32_t* tables, int64_t width, int64_t row, int64_t len,
                         const torch::Tensor& kv_cache) {
  const int64_t block_size = kv_cache.size(2), num_blocks = kv_cache.size(1);
  for (int64_t col = 0; col * block_size < len; ++col) {
    const int32_t block = tables[row * width + col];
    TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", row, ", ", col, "] = ",
                block, " is not a block of the pool (", num_blocks, " blocks)");
  }
}

// Write key and value rows [T, Hkv, D] (heads contiguous, rows possibly strided) into the pool
// at slot_mapping [T] (slot = block * block_size + offset); a negative slot (padding) is skipped.
inline void store_kv(torch::Tensor kv_cache, const torch::Tensor& key, const torch::Tensor& value,
                     const torch::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
              kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be a contiguous float32 [2, blocks, block_size, Hkv, D] tensor");
  const int64_t num_tokens = slot_mapping.size(0), hkv = kv_cache.size(3), d = kv_cache.size(4);
  for (const auto* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == hkv &&
                t->size(2) == d && t->scalar_type() == at::kFloat && t->stride(2) == 1 &&
                (hkv == 1 || t->stride(1) == d), "key and value must be float32 [T, Hkv, D] like the pool's, "
                "heads contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
              slot_mapping.scalar_type() == at::kLong, "slot_mapping must be contiguous int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is past the pool's ", num_slots, " slots");
  const Pool pool = pool_of(kv_cache);
  const int64_t row = hkv * d, key_stride = row_stride(key), value_stride = row_stride(value);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* keys = const_cast<float*>(pool.keys);
  float* values = const_cast<float*>(pool.values);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    const int64_t at = slots[t] / pool.block_size * pool.block_stride +
                       slots[t] % pool.block_size * pool.token_stride;
    std::copy(k + t * key_stride, k + t * key_stride + row, keys + at);
    std::copy(v + t * value_stride, v + t * value_stride + row, values + at);
  }
}

}  // namespace conveyor_native
