// y = x W^T for the int8-activation formats (q4_1_int8's decoder layers, q8_0_int8's
// vocabulary projection): fp32 activations x [M, K] rounded to int8 per block of 32
// (int8_activations.h), block weights packed 8 output rows at a time so that one 32-byte
// vector holds 4 weights of each of 8 rows, one row per int32 lane.
//
// Layout (quantized_linear.py writes it; N padded to a multiple of 8), for group g (rows
// 8g..8g+7) and block b:
//   q4_1: qs8 uint8 [N / 8, K / 32 * 128]: 4 vectors; byte 4j + t of vector p holds row 8g+j's
//         weight 4p + t of the block in its low nibble and 16 + 4p + t in its high one (the
//         GGUF's byte order of a row, regrouped: its block bytes 4p..4p+3);
//         dm8 fp16 [N / 8, K / 32 * 16]: the 8 rows' scales d, then their offsets m.
//   q8_0: qs8 int8 [N / 8, K / 32 * 256]: 8 vectors; byte 4j + t of vector p is row 8g+j's
//         weight 4p + t; d8 fp16 [N / 8, K / 32 * 8]: the 8 rows' scales.
// A block then costs, for all 8 rows at once: the vector loads (q4_1: 4 masks and shifts into
// 8 vectors of u8; q8_0: |q| and x with q's sign, as u8 x s8 needs), and 8 multiply-adds of
// u8 x s8 quadruples into int32 lanes (AVX-512 VNNI vpdpbusd, or AVX2 maddubs + madd) against
// the block's activations broadcast 4 at a time. The lanes are already the 8 rows' dots, so no
// horizontal sums: one conversion and one or two fused multiply-adds (d * dx * dot, and
// q4_1's m * sum(x)) per block and row of x. The row-at-a-time kernel this replaced reduced
// each block's 8 lanes with a tree of hadds: 1.4x slower at one row of x, 1.9x at 8
// (docs/performance.md).
//
// Each row of x is summed in the same order whatever M is (passes of up to 4 rows, the same
// code per row), so a request's output does not depend on the step's other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_isa.h"
#include "int8_activations.h"

namespace conveyor_native {
namespace {

constexpr int64_t kBlock = kI8Block;
constexpr int64_t kRows = 8;  // weight rows a vector's lanes hold
constexpr int kTile = 4;      // rows of x per pass over a group's weights
// How far ahead of the block in use the weights are prefetched into L1: 16 blocks (2 KB of
// q4_1) read the decoder layers 1.1-1.2x faster than none at one row of x; 8 and 32 in between.
constexpr int64_t kPrefetchBlocks = 16;

// q4_1: w = d * q + m, q in 0..15 two to a byte.
struct Q4_1Rows8 {
  static constexpr int64_t kBlockBytes = 16 * kRows;
  static constexpr int64_t kScales = 2 * kRows;  // d, then m
  static constexpr bool kOffsets = true;
  static inline void load(const uint8_t* qs, __m256i (&w)[8]) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; ++p) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      w[p] = _mm256_and_si256(bytes, low_nibbles);
      w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
    }
  }
  static inline __m256i activations(const uint8_t*, int, __m256i x) { return x; }
};

// q8_0: w = d * q, q int8 in [-127, 127]: |q| as u8 against x with q's sign.
struct Q8_0Rows8 {
  static constexpr int64_t kBlockBytes = 32 * kRows;
  static constexpr int64_t kScales = kRows;
  static constexpr bool kOffsets = false;
  static inline void load(const uint8_t* qs, __m256i (&w)[8]) {
    for (int p = 0; p < 8; ++p)
      w[p] = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p)));
  }
  static inline __m256i activations(const uint8_t* qs, int p, __m256i x) {
    return _mm256_sign_epi8(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p)));
  }
};

namespace avx2 {

inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
  // w <= 127 and |x| <= 127: a pair's sum fits maddubs's int16 without saturating
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x),
                                                 _mm256_set1_epi16(1)));
}

#define ROWS8_TARGET
#include "rows8_i8_tiles.inc"
#undef ROWS8_TARGET

}  // namespace avx2

namespace vnni {

VNNI inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(acc, w, x);
}

#define ROWS8_TARGET VNNI
#include "rows8_i8_tiles.inc"
#undef ROWS8_TARGET

}  // namespace vnni

template <typename Format>
void check_packed(const torch::Tensor& x, const torch::Tensor& qs8, const torch::Tensor& dm8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  const int64_t num_blocks = x.size(1) / kBlock;
  TORCH_CHECK(qs8.dim() == 2 && qs8.element_size() == 1 && qs8.is_contiguous() &&
                  qs8.size(1) == num_blocks * Format::kBlockBytes,
              "packed weights must be contiguous bytes [N / 8, ", num_blocks * Format::kBlockBytes,
              "]");
  TORCH_CHECK(dm8.dim() == 2 && dm8.scalar_type() == torch::kFloat16 && dm8.is_contiguous() &&
                  dm8.size(0) == qs8.size(0) && dm8.size(1) == num_blocks * Format::kScales,
              "packed scales must be contiguous fp16 [N / 8, ", num_blocks * Format::kScales, "]");
}

// isa 0 (auto: VNNI where the CPU has it), 1 (AVX2) or 2 (AVX-512 VNNI) -> whether VNNI runs.
bool resolve_vnni(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "isa must be 0 (auto), 1 (AVX2) or 2 (AVX-512), got ", isa);
  TORCH_CHECK(isa != 2 || cpu_has_avx512_vnni(),
              "AVX-512 VNNI asked for but this CPU lacks avx512vnni");
  return isa == 2 || (isa == 0 && cpu_has_avx512_vnni());
}

template <typename Format>
torch::Tensor rows8_linear(const torch::Tensor& x, const torch::Tensor& qs8,
                           const torch::Tensor& dm8, int64_t isa) {
  check_packed<Format>(x, qs8, dm8);
  const bool use_vnni = resolve_vnni(isa);
  const int64_t K = x.size(1), N = qs8.size(0) * kRows;
  const Int8Rows rounded(x);
  auto y = torch::empty({x.size(0), N}, x.options());
  const auto* qs = reinterpret_cast<const uint8_t*>(qs8.data_ptr());
  const auto* dm = reinterpret_cast<const uint16_t*>(dm8.data_ptr());
  float* yp = y.data_ptr<float>();
  // groups of 8 rows over torch's intra-op threads; a layer under ~32 KB stays on one
  const int64_t grain = std::max<int64_t>(1, 32768 / (K / kBlock * Format::kBlockBytes));
  at::parallel_for(0, qs8.size(0), grain, [&](int64_t g0, int64_t g1) {
    if (use_vnni)
      vnni::groups<Format>(rounded, K, qs, dm, yp, N, g0, g1);
    else
      avx2::groups<Format>(rounded, K, qs, dm, yp, N, g0, g1);
  });
  return y;
}

}  // namespace

torch::Tensor q4_1_linear_i8(const torch::Tensor& x, const torch::Tensor& qs8,
                             const torch::Tensor& dm8, int64_t isa) {
  return rows8_linear<Q4_1Rows8>(x, qs8, dm8, isa);
}

torch::Tensor q8_0_linear_i8(const torch::Tensor& x, const torch::Tensor& qs8,
                             const torch::Tensor& d8, int64_t isa) {
  return rows8_linear<Q8_0Rows8>(x, qs8, d8, isa);
}

bool cpu_has_vnni() { return cpu_has_avx512_vnni(); }

}  // namespace conveyor_native
