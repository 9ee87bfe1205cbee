// y = x W^T + b for a few fp32 rows x [M, K] and an fp32 weight W [N, K] (row-major, the
// nn.Linear layout): the decode step's linears, which read every weight byte once and do
// 2 * M flops per weight, so they run at the speed the weights stream from DRAM.
//
// The output columns are cut into tiles of kTileN weight rows (kTileN * K contiguous floats),
// each weight load used for up to kMaxR rows of x (more rows re-read the tile from L1).
// Tiles are split over torch's intra-op threads in one contiguous run per thread
// (at::parallel_for), so each thread streams one long stretch of the weight, with a software
// prefetch kPrefetch bytes (plus kPrefetchTiles tiles) ahead. Accumulation is fp32: one
// vector accumulator per (weight row, x row), summed across lanes at the end; the K tail is
// a masked load. The defaults (1-row tiles, 4 KB ahead into L2, four accumulators for one
// row) were the quickest of the variants tried on the 2-core EPYC at 1-8 rows (4-row tiles
// with 1-2 tiles ahead, 0-4 KB ahead into L1 or L2 or non-temporal, one accumulator);
// -DFP32_GEMV_TILE_N / _PREFETCH / _PREFETCH_TILES build the others. On AVX-512, steps of
// more than 4 rows (up to cpu_linear.GEMV_MAX_ROWS) take wide tiles instead: kWideN weight
// rows x kWideR rows of x a pass, the next tile prefetched into L2 during this one's passes
// (a -DFP32_GEMV_TILE_N=4 build gives its few-row tiles that prefetch too).
//
// Two code paths, chosen at run time: AVX-512 (16 lanes, functions compiled with a target
// attribute, so the library itself needs only -mavx2 -mfma) when the CPU has avx512f, else
// AVX2 + FMA (8 lanes). `isa` forces one: 0 auto, 1 AVX2, 2 AVX-512.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_isa.h"

namespace {

using conveyor_native::cpu_has_avx512;
using conveyor_native::horizontal_sum;

#ifndef FP32_GEMV_TILE_N
#define FP32_GEMV_TILE_N 1
#endif
#ifndef FP32_GEMV_PREFETCH
#define FP32_GEMV_PREFETCH 4096
#endif
#ifndef FP32_GEMV_PREFETCH_TILES
#define FP32_GEMV_PREFETCH_TILES 0
#endif
constexpr int64_t kTileN = FP32_GEMV_TILE_N;
// each weight stream prefetches this far ahead: kPrefetchTiles tiles plus kPrefetch bytes
constexpr int64_t kPrefetch = FP32_GEMV_PREFETCH;
constexpr int64_t kPrefetchTiles = FP32_GEMV_PREFETCH_TILES;
constexpr _mm_hint kHint = _MM_HINT_T1;  // into L2: measured quicker than L1 (T0) or NTA
constexpr int kMaxR512 = 4;
constexpr int kMaxR256 = 2;
// Steps of more than kMaxR512 rows (AVX-512): tiles of kWideN weight rows, each pass over a
// tile taking kWideR rows of x (24 accumulators; the tile is re-read from L1/L2 per pass).
constexpr int kWideN = 4;
constexpr int kWideR = 6;


// ---- AVX-512 -------------------------------------------------------------------------

template <int NT, int R>
CONVEYOR_AVX512 inline void tile_512(const float* w, int64_t K, const float* x, int64_t M, float* y,
                            int64_t N, const float* bias) {
  // a wide tile (passes over it: its first reads DRAM, the others L1/L2) asks for the next
  // tile while it computes, so DRAM keeps streaming through the later passes
  constexpr int64_t tiles_ahead = NT == kWideN ? 1 : kPrefetchTiles;
  const char* ahead = reinterpret_cast<const char*>(w) + (NT == kWideN ? 0 : kPrefetch) +
                      tiles_ahead * NT * K * static_cast<int64_t>(sizeof(float));
  __m512 acc[NT][R];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      if (kPrefetch > 0 || tiles_ahead > 0)
        _mm_prefetch(ahead + (i * K + k) * sizeof(float), kHint);
      const __m512 wv = _mm512_loadu_ps(w + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = conveyor_native::first_lanes16(K - k);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  if constexpr (NT == 4) {  // the four weight rows' sums of an x row at once
    const __m128 b = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(y + r * N,
                    _mm_add_ps(conveyor_native::reduce4_512(acc[0][r], acc[1][r], acc[2][r],
                                                            acc[3][r]), b));
  } else {
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NT; ++i)
        y[r * N + i] = _mm512_reduce_add_ps(acc[i][r]) + (bias ? bias[i] : 0.0f);
  }
}

// One weight row against one x row (the single-stream decode case): four accumulators, so
// the loop is not held to one FMA latency per 64 bytes.
template <>
CONVEYOR_AVX512 inline void tile_512<1, 1>(const float* w, int64_t K, const float* x, int64_t M, float* y,
                                  int64_t N, const float* bias) {
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetch;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + (k + 16 * line) * 4, kHint);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k + 16 <= K; k += 16)
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
  if (k < K) {
    const __mmask16 mask = conveyor_native::first_lanes16(K - k);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + k), _mm512_maskz_loadu_ps(mask, x + k),
                         a1);
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
  y[0] = _mm512_reduce_add_ps(sum) + (bias ? bias[0] : 0.0f);
}

// The last `rest` (< R + 1) rows of x against NT weight rows, in one tile.
template <int NT, int R>
CONVEYOR_AVX512 inline void rest_512(const float* w, int64_t K, const float* x, int64_t M,
                                     float* y, int64_t N, const float* bias, int64_t rest) {
  if constexpr (R >= 1) {
    if (rest == R)
      tile_512<NT, R>(w, K, x, M, y, N, bias);
    else
      rest_512<NT, R - 1>(w, K, x, M, y, N, bias, rest);
  }
}

// NT weight rows against every row of x, R rows a pass, the rest in one more.
template <int NT, int R>
CONVEYOR_AVX512 inline void rows_512(const float* w, int64_t K, const float* x, int64_t M, float* y,
                            int64_t N, const float* bias) {
  int64_t r = 0;
  for (; r + R <= M; r += R) tile_512<NT, R>(w, K, x + r * K, M, y + r * N, N, bias);
  rest_512<NT, R - 1>(w, K, x + r * K, M, y + r * N, N, bias, M - r);
}

CONVEYOR_AVX512 void columns_512(const float* w, int64_t K, const float* x, int64_t M, float* y,
                        int64_t N, const float* bias, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M > kMaxR512)
    for (; n + kWideN <= n1; n += kWideN)
      rows_512<kWideN, kWideR>(w + n * K, K, x, M, y + n, N, bias ? bias + n : nullptr);
  for (; n + kTileN <= n1; n += kTileN)
    rows_512<kTileN, kMaxR512>(w + n * K, K, x, M, y + n, N, bias ? bias + n : nullptr);
  for (; n < n1; ++n)
    rows_512<1, kMaxR512>(w + n * K, K, x, M, y + n, N, bias ? bias + n : nullptr);
}

// ---- AVX2 + FMA ----------------------------------------------------------------------

inline __m256i tail_mask(int64_t left) {
  alignas(32) static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                               0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones + 8 - left));
}

template <int NT, int R>
inline void tile_256(const float* w, int64_t K, const float* x, int64_t M, float* y, int64_t N,
                     const float* bias) {
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetch +
                      kPrefetchTiles * NT * K * static_cast<int64_t>(sizeof(float));
  __m256 acc[NT][R];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      if ((kPrefetch > 0 || kPrefetchTiles > 0) && (k & 15) == 0)
        _mm_prefetch(ahead + (i * K + k) * sizeof(float), kHint);
      const __m256 wv = _mm256_loadu_ps(w + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  if (k < K) {
    const __m256i mask = tail_mask(K - k);
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_maskload_ps(x + r * K + k, mask);
    for (int i = 0; i < NT; ++i) {
      const __m256 wv = _mm256_maskload_ps(w + i * K + k, mask);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NT; ++i)
      y[r * N + i] = horizontal_sum(acc[i][r]) + (bias ? bias[i] : 0.0f);
}

template <int NT>
inline void rows_256(const float* w, int64_t K, const float* x, int64_t M, float* y, int64_t N,
                     const float* bias) {
  int64_t r = 0;
  for (; r + kMaxR256 <= M; r += kMaxR256)
    tile_256<NT, kMaxR256>(w, K, x + r * K, M, y + r * N, N, bias);
  if (M - r == 1) tile_256<NT, 1>(w, K, x + r * K, M, y + r * N, N, bias);
}

void columns_256(const float* w, int64_t K, const float* x, int64_t M, float* y, int64_t N,
                 const float* bias, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN)
    rows_256<kTileN>(w + n * K, K, x, M, y + n, N, bias ? bias + n : nullptr);
  for (; n < n1; ++n) rows_256<1>(w + n * K, K, x, M, y + n, N, bias ? bias + n : nullptr);
}

// ---- entry points --------------------------------------------------------------------

constexpr const char* kKernel = "the fp32 GEMV";

int64_t resolve_isa(int64_t isa) { return conveyor_native::resolve_isa(isa, kKernel); }

torch::Tensor fp32_linear(const torch::Tensor& input, const torch::Tensor& w,
                          const c10::optional<torch::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(input.device().is_cpu() && w.device().is_cpu(), "fp32_linear runs on CPU tensors");
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == torch::kFloat32,
              "x must be an fp32 [..., K] tensor, got ", input.scalar_type(), " ",
              input.sizes());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "weight must be a contiguous (row-major) fp32 [N, K] tensor, got ",
              w.scalar_type(), " ", w.sizes(), w.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(input.size(-1) == w.size(1), "x has ", input.size(-1),
              " features but the weight ", w.size(1));
  const torch::Tensor x = input.contiguous();
  const int64_t K = w.size(1), N = w.size(0), M = K == 0 ? 0 : x.numel() / K;
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = N;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == torch::kFloat32 && bias->device().is_cpu(),
                "bias must be a contiguous fp32 [", N, "] tensor, got ", bias->sizes());
    bp = bias->data_ptr<float>();
  }
  const bool wide = resolve_isa(isa) == 2;
  auto y = torch::empty(out_shape, x.options());
  if (y.numel() == 0) return y;
  if (K == 0) return bp ? y.copy_(bias->expand_as(y)) : y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  // one contiguous run of tiles per thread; small layers (under ~64 KB) stay on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * kTileN));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kTileN, n1 = std::min(N, t1 * kTileN);
    if (wide)
      columns_512(wp, K, xp, M, yp, N, bp, n0, n1);
    else
      columns_256(wp, K, xp, M, yp, N, bp, n0, n1);
  });
  return y;
}

std::string isa_name(int64_t isa) { return conveyor_native::isa_name(isa, kKernel); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Tensors only inside: the GIL is released while it runs, as ATen's ops do.
  m.def("fp32_linear", &fp32_linear, "y = x W^T + b for fp32 x [..., K], W [N, K] row-major",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("isa") = 0, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("isa_name", &isa_name, "the code path isa (0 auto, 1 AVX2, 2 AVX-512) runs here",
        pybind11::arg("isa") = 0);
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU has avx512f/dq/bw/vl");
}
