// y = x W^T for fp32 activations x [M, K] and weights W [N, K] kept in GGML-style blocks of
// 32 along K (quantized_linear.py writes them):
//   q8_0: qs int8 [N, K],      d fp16 [N, K/32]:            w = d * q
//   q4_1: qs uint8 [N, K/2],   d, m fp16 [N, K/32]:         w = d * q + m, q in 0..15;
//         byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
// Few rows (decode): each weight block is expanded to fp32 once and used for up to kTile rows
// of x, so a step reads the weight bytes once from DRAM. Output rows (N) are split over
// torch's intra-op threads. Accumulation is fp32 in the order: per block, 4 products of 8
// lanes summed, scaled by d, added to 8 lane accumulators; for q4_1 m * sum(x of the block)
// is added separately (sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one block as 4 x 8 floats (before the scale).
struct Block {
  __m256 w[4];
};

inline Block expand_q8_0(const int8_t* qs) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
  Block b;
  b.w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  b.w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  b.w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  b.w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  return b;
}

inline Block expand_q4_1(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  Block b;
  b.w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  b.w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  b.w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  b.w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  return b;
}

inline __m256 block_dot(const Block& b, const float* x) {
  __m256 t = _mm256_mul_ps(b.w[0], _mm256_loadu_ps(x));
  t = _mm256_fmadd_ps(b.w[1], _mm256_loadu_ps(x + 8), t);
  t = _mm256_fmadd_ps(b.w[2], _mm256_loadu_ps(x + 16), t);
  return _mm256_fmadd_ps(b.w[3], _mm256_loadu_ps(x + 24), t);
}

// Rows [r0, r0 + R) of x against output row n. xsum (q4_1 only) holds sum(x) per block.
template <int R, bool kQ4>
inline void output_row(const float* x, const float* xsum, float* y, int64_t r0, int64_t n,
                       int64_t K, int64_t N, const uint8_t* qs_row, const uint16_t* d_row,
                       const uint16_t* m_row) {
  const int64_t num_blocks = K / kBlock;
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.0f;
  }
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const Block b = kQ4 ? expand_q4_1(qs_row + blk * kBlock / 2)
                        : expand_q8_0(reinterpret_cast<const int8_t*>(qs_row) + blk * kBlock);
    const __m256 scale = _mm256_set1_ps(half_to_float(d_row[blk]));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(block_dot(b, x + (r0 + r) * K + blk * kBlock), scale, acc[r]);
    }
    if (kQ4) {
      const float m = half_to_float(m_row[blk]);
      for (int r = 0; r < R; ++r) offset[r] += m * xsum[(r0 + r) * num_blocks + blk];
    }
  }
  for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = horizontal_sum(acc[r]) + offset[r];
}

template <bool kQ4>
void output_rows(const float* x, const float* xsum, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n, const uint8_t* qs_row, const uint16_t* d_row, const uint16_t* m_row) {
  int64_t r0 = 0;
  for (; r0 + kTile <= M; r0 += kTile)
    output_row<kTile, kQ4>(x, xsum, y, r0, n, K, N, qs_row, d_row, m_row);
  switch (M - r0) {
    case 3: output_row<3, kQ4>(x, xsum, y, r0, n, K, N, qs_row, d_row, m_row); break;
    case 2: output_row<2, kQ4>(x, xsum, y, r0, n, K, N, qs_row, d_row, m_row); break;
    case 1: output_row<1, kQ4>(x, xsum, y, r0, n, K, N, qs_row, d_row, m_row); break;
    default: break;
  }
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                  int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  const int64_t N = qs.size(0), num_blocks = x.size(1) / kBlock;
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == num_blocks * bytes_per_block,
              "qs must be contiguous [N, ", num_blocks * bytes_per_block, "]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == N && d.size(1) == num_blocks,
              "scales must be contiguous fp16 [N, K/32]");
}

template <bool kQ4>
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                           const torch::Tensor* m) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), num_blocks = K / kBlock;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor xsum;
  if (kQ4) xsum = x.view({M, num_blocks, kBlock}).sum(-1).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* sp = kQ4 ? xsum.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const auto* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = kQ4 ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr;
  const int64_t row_bytes = qs.size(1);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      output_rows<kQ4>(xp, sp, yp, M, K, N, n, qp + n * row_bytes, dp + n * num_blocks,
                       kQ4 ? mp + n * num_blocks : nullptr);
    }
  });
  return y;
}

torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d) {
  check_inputs(x, qs, d, kBlock);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_0 qs must be int8");
  return block_linear<false>(x, qs, d, nullptr);
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                          const torch::Tensor& m) {
  check_inputs(x, qs, d, kBlock / 2);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8, "q4_1 qs must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == torch::kFloat16 && m.is_contiguous(),
              "q4_1 offsets must be contiguous fp16 like the scales");
  return block_linear<true>(x, qs, d, &m);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_0_linear", &q8_0_linear, "x [M, K] fp32 times q8_0 blocks [N, K] transposed");
  m.def("q4_1_linear", &q4_1_linear, "x [M, K] fp32 times q4_1 blocks [N, K] transposed");
}
