// y = x W^T for fp32 activations x [M, K] and weights W [N, K] kept in GGML-style blocks of
// 32 along K (quantized_linear.py writes them):
//   q8_0: qs int8 [N, K],      d fp16 [N, K/32]:            w = d * q
//   q4_1: qs uint8 [N, K/2],   d, m fp16 [N, K/32]:         w = d * q + m, q in 0..15;
//         byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
// Few rows (decode): each weight block is expanded to fp32 once and used for up to a tile of
// rows of x, so a step reads the weight bytes once from DRAM. Output rows (N) are split over
// torch's intra-op threads.
//
// Two code paths, chosen at run time (`isa`: 0 auto, 1 AVX2, 2 AVX-512):
// - AVX-512 (functions compiled with a target attribute, so the library itself needs only
//   -mavx2 -mfma -mf16c): a block becomes 2 x 16 floats w = d * q (+ m) with one conversion
//   and one multiply-add per 16 weights; these are exactly the dequantized fp32 weights (d * q
//   is exact in fp32: q has at most 8 bits and d 11, so only the + m rounds, once, as in
//   dequantize()). Each (row of x, half block, one of 2 unrolled blocks) has its own
//   accumulator; up to 4 rows of x per pass over a weight row, a row's summation order the
//   same at any row count. The block scales are converted to fp32 64 at a time.
// - AVX2 + FMA + F16C: per block, 4 products of 8 lanes summed, scaled by d, added to 8 lane
//   accumulators; for q4_1 m * sum(x of the block) is added separately
//   (sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j); up to 4 rows of x per pass.
// Both sum in fp32 and differ from an exact product only by summation order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_isa.h"
#include "int8_activations.h"  // the int8 kernels bound below

namespace {

using conveyor_native::cpu_has_avx512;
using conveyor_native::horizontal_sum;

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;  // AVX2: rows of x per pass over a weight row

// ---- AVX2 ----------------------------------------------------------------------------

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

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

// ---- AVX-512 -------------------------------------------------------------------------


constexpr int kTile512 = 4;     // rows of x per pass over a weight row
// blocks unrolled, the same for every tile size, so that a row's sum does not depend on the
// rows beside it (a one-row step has 4 multiply-add chains, which keep up with this CPU's
// one 512-bit FMA a cycle)
constexpr int kUnroll512 = 2;
constexpr int64_t kChunk = 64;  // blocks whose fp16 scales are converted to fp32 at a time

// One block's 32 weights as 2 x 16 floats: weights 0..15 and 16..31.
struct Block512 {
  __m512 lo, hi;
};

CONVEYOR_AVX512 inline Block512 weights_q4_1_512(const uint8_t* qs, float d, float m) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
  return {_mm512_fmadd_ps(lo, vd, vm), _mm512_fmadd_ps(hi, vd, vm)};
}

CONVEYOR_AVX512 inline Block512 weights_q8_0_512(const int8_t* qs, float d) {
  const auto* p = reinterpret_cast<const __m128i*>(qs);
  const __m512 vd = _mm512_set1_ps(d);
  return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), vd),
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), vd)};
}

// count (<= kChunk) fp16 values to fp32; out has room for a whole last vector.
CONVEYOR_AVX512 inline void halves_to_floats(const uint16_t* in, float* out, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes = conveyor_native::first_lanes16(count - i);
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, in + i)));
  }
}

// Rows [0, R) of x (row stride K) against one weight row; U blocks unrolled, each (row,
// half block, unrolled block) with its own accumulator. Writes y[r * N] for each row r.
template <int R, int U, bool kQ4>
CONVEYOR_AVX512 void output_row_512(const float* x, float* y, int64_t K, int64_t N, const uint8_t* qs_row,
                           const uint16_t* d_row, const uint16_t* m_row) {
  constexpr int64_t kBytes = kQ4 ? kBlock / 2 : kBlock;
  const int64_t num_blocks = K / kBlock;
  __m512 acc[R][2 * U];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < 2 * U; ++a) acc[r][a] = _mm512_setzero_ps();
  alignas(64) float d[kChunk + 16], m[kChunk + 16];
  auto block = [&](int64_t blk, int64_t c0, int u) CONVEYOR_AVX512 {
    const Block512 w =
        kQ4 ? weights_q4_1_512(qs_row + blk * kBytes, d[blk - c0], m[blk - c0])
            : weights_q8_0_512(reinterpret_cast<const int8_t*>(qs_row) + blk * kBytes, d[blk - c0]);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + blk * kBlock;
      acc[r][2 * u] = _mm512_fmadd_ps(w.lo, _mm512_loadu_ps(xb), acc[r][2 * u]);
      acc[r][2 * u + 1] = _mm512_fmadd_ps(w.hi, _mm512_loadu_ps(xb + 16), acc[r][2 * u + 1]);
    }
  };
  for (int64_t c0 = 0; c0 < num_blocks; c0 += kChunk) {
    const int64_t c1 = std::min(num_blocks, c0 + kChunk);
    halves_to_floats(d_row + c0, d, c1 - c0);
    if (kQ4) halves_to_floats(m_row + c0, m, c1 - c0);
    int64_t blk = c0;
    for (; blk + U <= c1; blk += U)
      for (int u = 0; u < U; ++u) block(blk + u, c0, u);
    for (; blk < c1; ++blk) block(blk, c0, 0);
  }
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
    for (int a = 1; a < 2 * U; ++a) sum = _mm512_add_ps(sum, acc[r][a]);
    y[r * N] = _mm512_reduce_add_ps(sum);
  }
}

template <bool kQ4>
CONVEYOR_AVX512 void output_rows_512(const float* x, float* y, int64_t M, int64_t K, int64_t N,
                            const uint8_t* qs_row, const uint16_t* d_row, const uint16_t* m_row) {
  int64_t r0 = 0;
  auto rows = [&](auto R) CONVEYOR_AVX512 {
    output_row_512<decltype(R)::value, kUnroll512, kQ4>(x + r0 * K, y + r0 * N, K, N, qs_row,
                                                        d_row, m_row);
  };
  using std::integral_constant;
  for (; r0 + kTile512 <= M; r0 += kTile512) rows(integral_constant<int, kTile512>{});
  switch (M - r0) {
    case 3: rows(integral_constant<int, 3>{}); break;
    case 2: rows(integral_constant<int, 2>{}); break;
    case 1: rows(integral_constant<int, 1>{}); break;
    default: break;
  }
}

// ---- entry points --------------------------------------------------------------------

constexpr const char* kKernel = "the block kernels";

int64_t resolve_isa(int64_t isa) { return conveyor_native::resolve_isa(isa, kKernel); }

std::string isa_name(int64_t isa) { return conveyor_native::isa_name(isa, kKernel); }

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

// fn(n, qs_row, d_row, m_row) for every weight row n (m_row null for q8_0), the rows split
// over torch's intra-op threads.
void check_q8_0(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d) {
  check_inputs(x, qs, d, kBlock);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8, "q8_0 qs must be int8");
}

void check_q4_1(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                const torch::Tensor& m) {
  check_inputs(x, qs, d, kBlock / 2);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8, "q4_1 qs must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == torch::kFloat16 && m.is_contiguous(),
              "q4_1 offsets must be contiguous fp16 like the scales");
}

template <typename Fn>
void for_each_weight_row(const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor* m,
                         const Fn& fn) {
  const auto* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = m ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr;
  const int64_t row_bytes = qs.size(1), num_blocks = d.size(1);
  at::parallel_for(0, qs.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      fn(n, qp + n * row_bytes, dp + n * num_blocks, mp ? mp + n * num_blocks : nullptr);
  });
}

template <bool kQ4>
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                           const torch::Tensor* m, int64_t isa) {
  const bool wide = resolve_isa(isa) == 2;
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), num_blocks = K / kBlock;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor xsum;  // AVX2 q4_1: sum(x) per block for the offset term
  if (kQ4 && !wide) xsum = x.view({M, num_blocks, kBlock}).sum(-1).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* sp = xsum.defined() ? xsum.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for_each_weight_row(qs, d, m, [&](int64_t n, const uint8_t* qs_row, const uint16_t* d_row,
                                    const uint16_t* m_row) {
    if (wide)
      output_rows_512<kQ4>(xp, yp + n, M, K, N, qs_row, d_row, m_row);
    else
      output_rows<kQ4>(xp, sp, yp, M, K, N, n, qs_row, d_row, m_row);
  });
  return y;
}

torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                          int64_t isa) {
  check_q8_0(x, qs, d);
  return block_linear<false>(x, qs, d, nullptr, isa);
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                          const torch::Tensor& m, int64_t isa) {
  check_q4_1(x, qs, d, m);
  return block_linear<true>(x, qs, d, &m, isa);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch tensors only: the GIL is released while they run, as ATen's ops do.
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("q8_0_linear", &q8_0_linear, "x [M, K] fp32 times q8_0 blocks [N, K] transposed",
        pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("d"), pybind11::arg("isa") = 0,
        release_gil());
  m.def("q4_1_linear", &q4_1_linear, "x [M, K] fp32 times q4_1 blocks [N, K] transposed",
        pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("d"), pybind11::arg("m"),
        pybind11::arg("isa") = 0, release_gil());
  m.def("q8_0_linear_i8", &conveyor_native::q8_0_linear_i8,
        "x times q8_0 weights packed 8 rows at a time (rows8_i8_linear.cpp), each block of 32 "
        "activations rounded to int8 (integer dots)",
        pybind11::arg("x"), pybind11::arg("qs8"), pybind11::arg("d8"), pybind11::arg("isa") = 0,
        release_gil());
  m.def("q4_1_linear_i8", &conveyor_native::q4_1_linear_i8,
        "x times q4_1 weights packed 8 rows at a time (rows8_i8_linear.cpp), each block of 32 "
        "activations rounded to int8 (integer dots)",
        pybind11::arg("x"), pybind11::arg("qs8"), pybind11::arg("dm8"), pybind11::arg("isa") = 0,
        release_gil());
  m.def("has_vnni", &conveyor_native::cpu_has_vnni,
        "whether this CPU has AVX-512 VNNI (with avx512f/bw/vl/dq)");
  m.def("isa_name", &isa_name, "the code path isa (0 auto, 1 AVX2, 2 AVX-512) runs here",
        pybind11::arg("isa") = 0);
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU has avx512f/bw/vl/dq");
}
