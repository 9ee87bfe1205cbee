// The int8 activations of the int8 block kernels (rows8_i8_linear.cpp): each block of 32
// activations rounded once per call to int8 with its own scale, as llama.cpp's Q8_1 does
// (dx = max|x| / 127, xq = round(x / dx), and the block's fp32 sum of x for q4_1's offset term).
// A block's dot is then integer: y = sum_b d_b dx_b sum_j q_bj xq_bj (+ sum_b m_b sum_j x_bj),
// the exact product with the rounded activations up to fp32 summation, and off the exact product
// with x by at most sum_b (dx_b / 2) sum_j |w_bj| (the rounding of x).
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

#include "cpu_isa.h"

// The target attribute of the int8 kernels' AVX-512 VNNI functions.
#define VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))

namespace conveyor_native {

constexpr int64_t kI8Block = 32;  // activations per scale

// x [M, K] -> xq int8 [M, K], dx and sx fp32 [M, K / 32].
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t num_blocks = K / kI8Block;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      float* dxr = dx + r * num_blocks + b;
      float* sxr = sx + r * num_blocks + b;
      const float* p = x + r * K + b * kI8Block;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
      __m256 amax = _mm256_andnot_ps(sign, v[0]);
      for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float d = _mm_cvtss_f32(m4) / 127.0f;
      const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + b * kI8Block),
                          _mm256_permutevar8x32_epi32(packed, order));
      *dxr = d;
      *sxr = horizontal_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
  }
}

// The rounded activations of x [M, K] (K a multiple of 32): xq int8 [M, K], and per block the
// scale dx and the fp32 sum sx, each [M, K / 32] (scales[0] and scales[1]).
struct Int8Rows {
  torch::Tensor xq, scales;
  int64_t stride;

  explicit Int8Rows(const torch::Tensor& x)
      : xq(torch::empty(x.sizes(), x.options().dtype(torch::kInt8))),
        scales(torch::empty({2, x.size(0), x.size(1) / kI8Block}, x.options())),
        stride(scales.size(2)) {
    quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), xq.data_ptr<int8_t>(), dx(), sx());
  }
  float* dx() const { return scales.data_ptr<float>(); }
  float* sx() const { return dx() + xq.size(0) * stride; }
  const int8_t* data() const { return xq.data_ptr<int8_t>(); }
};

// rows8_i8_linear.cpp: x [M, K] times block weights packed 8 output rows at a time, with int8
// activations (isa: 0 auto, 1 AVX2, 2 AVX-512 VNNI).
torch::Tensor q4_1_linear_i8(const torch::Tensor& x, const torch::Tensor& qs8,
                             const torch::Tensor& dm8, int64_t isa);
torch::Tensor q8_0_linear_i8(const torch::Tensor& x, const torch::Tensor& qs8,
                             const torch::Tensor& d8, int64_t isa);
bool cpu_has_vnni();  // AVX-512 VNNI (with avx512f/bw/vl/dq)

}  // namespace conveyor_native
