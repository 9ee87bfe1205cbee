// What the paged attention kernels share: the pool's view and the checks of their common
// arguments (the query, the output, the pool, the block tables' blocks).
#pragma once

#include <torch/extension.h>

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

// query [N, H, D] and out like it, contiguous fp32; the pool contiguous fp32 with the query's D
// and a number of kv heads that divides H.
inline void check_attention_tensors(const torch::Tensor& out, const torch::Tensor& query,
                                    const torch::Tensor& kv_cache) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && query.scalar_type() == at::kFloat,
              "query must be a contiguous float32 [N, H, D] tensor");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
              out.scalar_type() == at::kFloat, "out must be a contiguous float32 like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
              kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be a contiguous float32 [2, blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "kv_cache head_dim differs from the query's");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0,
              "query heads must be a multiple of kv heads");
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

}  // namespace conveyor_native
