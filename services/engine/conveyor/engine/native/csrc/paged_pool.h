// What the paged attention kernels share: the pool's view (fp32 or fp16 elements), loading its
// rows as fp32, the checks of their common arguments (the query, the output, the pool, the block
// tables' blocks) and the store of new K/V rows.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_isa.h"

namespace conveyor_native {

// kv_cache [2, num_blocks, block_size, Hkv, D] of T: float, or at::Half (CONVEYOR_ENGINE_
// KV_CACHE_DTYPE=float16: half the bytes a step reads, each element widened on load).
template <typename T>
struct Pool {
  const T* keys;
  const T* values;
  int64_t block_stride;  // elements per block of one half (block_size * Hkv * D)
  int64_t token_stride;  // elements per token (Hkv * D)
  int64_t block_size;
};

// Eight pool elements from p as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Sixteen pool elements from p as fp32 (AVX-512 code only).
CONVEYOR_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
CONVEYOR_AVX512 inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// D fp16 elements from src as fp32 at dst.
template <int D>
inline void widen_row(const at::Half* src, float* dst) {
  for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
}

// Rows t0..t1 of D elements, token_stride apart from src, as fp32 rows D apart at dst (kernels
// that broadcast single key elements widen an fp16 block once rather than per element).
template <int D>
inline void widen_rows(const at::Half* src, int64_t token_stride, int64_t t0, int64_t t1,
                       float* dst) {
  for (int64_t t = t0; t < t1; ++t) widen_row<D>(src + t * token_stride, dst + t * D);
}

// Cache lines from p to p + n elements, asked for ahead of their use.
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t e = 0; e < n; e += kLine)
    _mm_prefetch(reinterpret_cast<const char*>(p + e), _MM_HINT_T0);
}

inline bool is_pool_dtype(const torch::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf;
}

// query [N, H, D] fp32 with contiguous heads (its rows may be strided: a view of the qkv
// projection's output), out [N, H, D] contiguous fp32; the pool contiguous fp32 or fp16 with
// the query's D and a number of kv heads that divides H.
inline void check_pool(const torch::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
              is_pool_dtype(kv_cache),
              "kv_cache must be a contiguous float32 or float16 [2, blocks, block_size, Hkv, D] "
              "tensor");
  TORCH_CHECK(kv_cache.scalar_type() != at::kHalf || cpu_has_f16c(),
              "a float16 kv_cache needs the F16C conversions, which this CPU lacks");
}

inline void check_attention_tensors(const torch::Tensor& out, const torch::Tensor& query,
                                    const torch::Tensor& kv_cache) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1 &&
              (query.size(1) == 1 || query.stride(1) == query.size(2)) &&
              (query.size(0) <= 1 || query.stride(0) >= query.size(1) * query.size(2)),
              "query must be a float32 [N, H, D] tensor with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
              out.scalar_type() == at::kFloat, "out must be a contiguous float32 like query");
  check_pool(kv_cache);
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "kv_cache head_dim differs from the query's");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0,
              "query heads must be a multiple of kv heads");
}

// Floats from one query row to the next.
inline int64_t row_stride(const torch::Tensor& rows) {
  return rows.size(0) <= 1 ? rows.size(1) * rows.size(2) : rows.stride(0);
}

template <typename T>
Pool<T> pool_of(const torch::Tensor& kv_cache) {
  const T* base = kv_cache.data_ptr<T>();
  return Pool<T>{base, base + kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                 kv_cache.size(2)};
}

// f(T{}) with T the pool's element type (float or at::Half).
template <typename F>
decltype(auto) with_pool_type(const torch::Tensor& kv_cache, F&& f) {
  if (kv_cache.scalar_type() == at::kHalf) return f(at::Half{});
  return f(float{});
}

// f(T{}, std::integral_constant<int, D>{}) with T the pool's element type and D its head_dim,
// one of the head sizes the kernels are instantiated for (native_kernel.HEAD_DIMS).
template <typename F>
void with_pool_shape(const torch::Tensor& kv_cache, F&& f) {
  const int64_t head_dim = kv_cache.size(4);
  with_pool_type(kv_cache, [&](auto element) {
    switch (head_dim) {
      case 32: return f(element, std::integral_constant<int, 32>{});
      case 64: return f(element, std::integral_constant<int, 64>{});
      case 128: return f(element, std::integral_constant<int, 128>{});
      default: TORCH_CHECK(false, "head_dim ", head_dim, " is not one of 32, 64, 128");
    }
  });
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

// n fp32 values from src into dst (float: copied; at::Half: rounded to nearest even, as torch's
// .to(torch.float16)); n is a multiple of 8.
inline void store_row(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, int64_t n, at::Half* dst) {
  for (int64_t e = 0; e < n; e += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + e),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Write key and value rows [T, Hkv, D] (heads contiguous, rows possibly strided) into the pool
// at slot_mapping [T] (slot = block * block_size + offset); a negative slot (padding) is skipped.
inline void store_kv(torch::Tensor kv_cache, const torch::Tensor& key, const torch::Tensor& value,
                     const torch::Tensor& slot_mapping) {
  check_pool(kv_cache);
  const int64_t num_tokens = slot_mapping.size(0), hkv = kv_cache.size(3), d = kv_cache.size(4);
  TORCH_CHECK(hkv * d % 8 == 0, "kv heads x head_dim must be a multiple of 8");
  for (const auto* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == hkv &&
                t->size(2) == d && t->scalar_type() == at::kFloat && t->stride(2) == 1 &&
                (hkv == 1 || t->stride(1) == d), "key and value must be float32 [T, Hkv, D] "
                "with the pool's Hkv and D, heads contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
              slot_mapping.scalar_type() == at::kLong, "slot_mapping must be contiguous int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is past the pool's ", num_slots, " slots");
  const int64_t row = hkv * d, key_stride = row_stride(key), value_stride = row_stride(value);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  with_pool_type(kv_cache, [&](auto element) {
    using T = decltype(element);
    const Pool<T> pool = pool_of<T>(kv_cache);
    T* keys = const_cast<T*>(pool.keys);
    T* values = const_cast<T*>(pool.values);
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (slots[t] < 0) continue;
      const int64_t at = slots[t] / pool.block_size * pool.block_stride +
                         slots[t] % pool.block_size * pool.token_stride;
      store_row(k + t * key_stride, row, keys + at);
      store_row(v + t * value_stride, row, values + at);
    }
  });
}

}  // namespace conveyor_native
