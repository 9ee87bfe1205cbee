// What the paged attention kernels share: the pool's view (fp32, fp16 or bf16 elements), the
// element types a step may pair (queries fp32 or bf16), the checks of their common arguments
// (the query, the output, the pool, the block tables' blocks) and the store of new K/V rows.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_isa.h"
#include "vector_io.h"

namespace conveyor_native {

// kv_cache [2, num_blocks, block_size, Hkv, D] of T: float (an fp32 model), at::BFloat16 (a bf16
// model), or at::Half (CONVEYOR_ENGINE_KV_CACHE_DTYPE=float16: half the bytes a step reads);
// 16-bit elements are widened to fp32 as they are loaded (vector_io.h).
template <typename T>
struct Pool {
  const T* keys;
  const T* values;
  int64_t block_stride;  // elements per block of one half (block_size * Hkv * D)
  int64_t token_stride;  // elements per token (Hkv * D)
  int64_t block_size;
};

// D 16-bit elements from src as fp32 at dst.
template <int D, typename T>
inline void widen_row(const T* src, float* dst) {
  for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
}

// Rows t0..t1 of D elements, token_stride apart from src, as fp32 rows D apart at dst (kernels
// that broadcast single key elements widen a 16-bit block once rather than per element).
template <int D, typename T>
inline void widen_rows(const T* src, int64_t token_stride, int64_t t0, int64_t t1,
                       float* dst) {
  for (int64_t t = t0; t < t1; ++t) widen_row<D>(src + t * token_stride, dst + t * D);
}

// Cache lines from p to p + n elements, asked for ahead of their use. An asm statement, not
// _mm_prefetch: GCC 12 dropped the builtin's prefetches of rows longer than one line from the
// decode kernel (none were emitted for 64-element fp32 or bf16 rows), so the pool was streamed
// unasked.
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t e = 0; e < n; e += kLine)
    asm volatile("prefetcht0 %0" : : "m"(*reinterpret_cast<const char*>(p + e)));
}

inline bool is_pool_dtype(const torch::Tensor& kv_cache) {
  const auto t = kv_cache.scalar_type();
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// The element types a step pairs: queries, keys and values (the model's dtype) fp32 over an fp32
// or fp16 pool, bf16 over a bf16 or fp16 pool.
inline bool pairs_with(at::ScalarType rows, at::ScalarType pool) {
  return pool == at::kHalf || pool == rows;
}

// query [N, H, D] fp32 or bf16 with contiguous heads (its rows may be strided: a view of the qkv
// projection's output), out [N, H, D] contiguous of the query's dtype; the pool contiguous fp32,
// fp16 or bf16 (paired with the query's dtype as pairs_with says) with the query's D and a
// number of kv heads that divides H.
inline void check_pool(const torch::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
              is_pool_dtype(kv_cache),
              "kv_cache must be a contiguous float32, float16 or bfloat16 "
              "[2, blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(kv_cache.scalar_type() != at::kHalf || cpu_has_f16c(),
              "a float16 kv_cache needs the F16C conversions, which this CPU lacks");
}

inline void check_pairing(at::ScalarType rows, const torch::Tensor& kv_cache) {
  TORCH_CHECK(rows == at::kFloat || rows == at::kBFloat16,
              "queries, keys and values must be float32 or bfloat16, got ", rows);
  TORCH_CHECK(pairs_with(rows, kv_cache.scalar_type()), "a ", kv_cache.scalar_type(),
              " kv_cache does not pair with ", rows, " queries, keys and values (float32 over "
              "float32 or float16, bfloat16 over bfloat16 or float16)");
}

inline void check_attention_tensors(const torch::Tensor& out, const torch::Tensor& query,
                                    const torch::Tensor& kv_cache) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 &&
              (query.size(1) == 1 || query.stride(1) == query.size(2)) &&
              (query.size(0) <= 1 || query.stride(0) >= query.size(1) * query.size(2)),
              "query must be a [N, H, D] tensor with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
              out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor like query, of its dtype");
  check_pool(kv_cache);
  check_pairing(query.scalar_type(), kv_cache);
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

// f(Q{}, T{}) with Q the rows' element type (float or at::BFloat16) and T the pool's, for the
// pairs check_pairing allows.
template <typename F>
decltype(auto) with_element_types(at::ScalarType rows, const torch::Tensor& kv_cache, F&& f) {
  const bool half = kv_cache.scalar_type() == at::kHalf;
  if (rows == at::kBFloat16)
    return half ? f(at::BFloat16{}, at::Half{}) : f(at::BFloat16{}, at::BFloat16{});
  return half ? f(float{}, at::Half{}) : f(float{}, float{});
}

// f(Q{}, T{}, std::integral_constant<int, D>{}) with Q and T as with_element_types gives them
// and D the pool's head_dim, one of the head sizes the kernels are instantiated for
// (native_kernel.HEAD_DIMS).
template <typename F>
void with_pool_shape(const torch::Tensor& query, const torch::Tensor& kv_cache, F&& f) {
  const int64_t head_dim = kv_cache.size(4);
  with_element_types(query.scalar_type(), kv_cache, [&](auto rows, auto element) {
    switch (head_dim) {
      case 32: return f(rows, element, std::integral_constant<int, 32>{});
      case 64: return f(rows, element, std::integral_constant<int, 64>{});
      case 128: return f(rows, element, std::integral_constant<int, 128>{});
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

// Write key and value rows [T, Hkv, D] (fp32 or bf16, heads contiguous, rows possibly strided)
// into the pool at slot_mapping [T] (slot = block * block_size + offset): copied where the types
// match, else rounded to the pool's type as torch's .to() rounds; a negative slot (padding) is
// skipped.
inline void store_kv(torch::Tensor kv_cache, const torch::Tensor& key, const torch::Tensor& value,
                     const torch::Tensor& slot_mapping) {
  check_pool(kv_cache);
  const int64_t num_tokens = slot_mapping.size(0), hkv = kv_cache.size(3), d = kv_cache.size(4);
  TORCH_CHECK(hkv * d % 8 == 0, "kv heads x head_dim must be a multiple of 8");
  for (const auto* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == hkv &&
                t->size(2) == d && t->scalar_type() == key.scalar_type() && t->stride(2) == 1 &&
                (hkv == 1 || t->stride(1) == d), "key and value must be [T, Hkv, D] of one "
                "dtype with the pool's Hkv and D, heads contiguous");
  check_pairing(key.scalar_type(), kv_cache);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
              slot_mapping.scalar_type() == at::kLong, "slot_mapping must be contiguous int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is past the pool's ", num_slots, " slots");
  const int64_t row = hkv * d, key_stride = row_stride(key), value_stride = row_stride(value);
  with_element_types(key.scalar_type(), kv_cache, [&](auto rows, auto element) {
    using Q = decltype(rows);
    using T = decltype(element);
    const Q* k = static_cast<const Q*>(key.data_ptr());
    const Q* v = static_cast<const Q*>(value.data_ptr());
    const Pool<T> pool = pool_of<T>(kv_cache);
    T* keys = const_cast<T*>(pool.keys);
    T* values = const_cast<T*>(pool.values);
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (slots[t] < 0) continue;
      const int64_t at = slots[t] / pool.block_size * pool.block_stride +
                         slots[t] % pool.block_size * pool.token_stride;
      convert(k + t * key_stride, row, keys + at);
      convert(v + t * value_stride, row, values + at);
    }
  });
}

}  // namespace conveyor_native
