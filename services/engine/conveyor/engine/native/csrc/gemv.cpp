// y = x W^T + b for a few rows x [M, K] and a weight W [N, K] (row-major, the nn.Linear layout):
// the decode step's linears, which read every weight byte once and do 2 * M flops per weight, so
// they run at the speed the weights stream from DRAM.
//
// Two entry points: fp32_linear (fp32 x, W, b, y) and bf16_linear (bf16 x, W, b, y: a bf16
// model's linears, half the weight bytes). Both accumulate in fp32; bf16 outputs are rounded
// once, to nearest even. bf16 weights are streamed as they are and either multiplied in bf16
// pairs by vdpbf16ps (path AVX512-BF16: x stays bf16, 32 weights an instruction) or widened to
// fp32 as they are loaded, against x widened once (paths AVX-512 and AVX2, for CPUs without the
// bf16 dot product; the same FMA tiles as fp32 weights).
//
// The output columns are cut into tiles of kTileN weight rows (kTileN * K contiguous elements),
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
// Code paths, chosen at run time: AVX-512 (16 lanes, functions compiled with a target
// attribute, so the library itself needs only -mavx2 -mfma) when the CPU has avx512f, else
// AVX2 + FMA (8 lanes); for bf16 also AVX512-BF16 where the CPU has it. `isa` forces one:
// 0 auto, 1 AVX2, 2 AVX-512, 3 AVX512-BF16 (bf16_linear only).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "vector_io.h"

namespace {

using conveyor_native::cpu_has_avx512;
using conveyor_native::horizontal_sum;
using conveyor_native::kIsaAvx512;
using conveyor_native::kIsaAvx512Bf16;
using conveyor_native::load16;
using conveyor_native::load16_first;
using conveyor_native::load8;
using BF16 = at::BFloat16;

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

template <typename T>
inline const char* bytes(const T* p) {
  return reinterpret_cast<const char*>(p);
}

// Where a tile of NT weight rows of W streams from: kPrefetch bytes plus tiles_ahead tiles on.
template <int NT, typename W>
inline const char* prefetch_base(const W* w, int64_t K) {
  constexpr int64_t tiles_ahead = NT == kWideN ? 1 : kPrefetchTiles;
  // a wide tile (passes over it: its first reads DRAM, the others L1/L2) asks for the next
  // tile while it computes, so DRAM keeps streaming through the later passes
  return bytes(w) + (NT == kWideN ? 0 : kPrefetch) +
         tiles_ahead * NT * K * static_cast<int64_t>(sizeof(W));
}

constexpr bool kPrefetches = kPrefetch > 0 || kPrefetchTiles > 0;

// One output element; the four outputs of four weight rows for one row of x.
inline void put(float* y, float v) { *y = v; }
inline void put(BF16* y, float v) { *y = BF16(v); }
inline void put4(float* y, __m128 v) { _mm_storeu_ps(y, v); }
inline void put4(BF16* y, __m128 v) {
  alignas(16) float t[4];
  _mm_store_ps(t, v);
  for (int i = 0; i < 4; ++i) y[i] = BF16(t[i]);
}

// The NT x R tile's sums (acc[i][r]: weight row i, x row r) plus the bias into y.
template <int NT, int R, typename Y>
CONVEYOR_AVX512 inline void finish_tile(__m512 (&acc)[NT][R], Y* y, int64_t N,
                                        const float* bias) {
  if constexpr (NT == 4) {  // the four weight rows' sums of an x row at once
    const __m128 b = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
    for (int r = 0; r < R; ++r)
      put4(y + r * N, _mm_add_ps(conveyor_native::reduce4_512(acc[0][r], acc[1][r], acc[2][r],
                                                               acc[3][r]), b));
  } else {
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NT; ++i)
        put(y + r * N + i, _mm512_reduce_add_ps(acc[i][r]) + (bias ? bias[i] : 0.0f));
  }
}

// ---- AVX-512: FMAs on fp32 x, weights fp32 or bf16 (widened as loaded) --------------------

template <int NT, int R, typename W, typename Y>
CONVEYOR_AVX512 inline void tile_512(const W* w, int64_t K, const float* x, Y* y, int64_t N,
                                     const float* bias) {
  const char* ahead = prefetch_base<NT>(w, K);
  __m512 acc[NT][R];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      if (kPrefetches && (k * sizeof(W)) % 64 == 0)  // a line's first element
        _mm_prefetch(ahead + (i * K + k) * sizeof(W), kHint);
      const __m512 wv = load16(w + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = conveyor_native::first_lanes16(K - k);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      const __m512 wv = load16_first(w + i * K + k, mask);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  finish_tile<NT, R>(acc, y, N, bias);
}

// One weight row against one x row (the single-stream decode case): four accumulators, so
// the loop is not held to one FMA latency per 64 elements.
template <typename W, typename Y>
CONVEYOR_AVX512 inline void tile_512_single(const W* w, int64_t K, const float* x, Y* y,
                                            const float* bias) {
  constexpr int kLines = 64 * sizeof(W) / 64;  // cache lines per 64 weights
  const char* ahead = bytes(w) + kPrefetch;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int line = 0; line < kLines; ++line) _mm_prefetch(ahead + k * sizeof(W) + 64 * line, kHint);
    a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(load16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(load16(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(load16(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k + 16 <= K; k += 16)
    a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
  if (k < K) {
    const __mmask16 mask = conveyor_native::first_lanes16(K - k);
    a1 = _mm512_fmadd_ps(load16_first(w + k, mask), _mm512_maskz_loadu_ps(mask, x + k), a1);
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
  put(y, _mm512_reduce_add_ps(sum) + (bias ? bias[0] : 0.0f));
}

// ---- AVX512-BF16: bf16 pairs multiplied and summed into fp32 by vdpbf16ps -----------------

inline __mmask32 first_lanes32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
}

CONVEYOR_AVX512_BF16 inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

template <int NT, int R>
CONVEYOR_AVX512_BF16 inline void tile_dp(const BF16* w, int64_t K, const BF16* x, BF16* y,
                                         int64_t N, const float* bias) {
  const char* ahead = prefetch_base<NT>(w, K);
  __m512 acc[NT][R];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // 32 bf16 = one cache line
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      if (kPrefetches) _mm_prefetch(ahead + (i * K + k) * sizeof(BF16), kHint);
      const __m512i wv = _mm512_loadu_si512(w + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = dot_pairs(acc[i][r], wv, xv[r]);
    }
  }
  if (k < K) {
    const __mmask32 mask = first_lanes32(K - k);
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_epi16(mask, x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = dot_pairs(acc[i][r], wv, xv[r]);
    }
  }
  finish_tile<NT, R>(acc, y, N, bias);
}

CONVEYOR_AVX512_BF16 inline void tile_dp_single(const BF16* w, int64_t K, const BF16* x, BF16* y,
                                                const float* bias) {
  const char* ahead = bytes(w) + kPrefetch;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + k * sizeof(BF16) + 64 * line, kHint);
    a0 = dot_pairs(a0, _mm512_loadu_si512(w + k), _mm512_loadu_si512(x + k));
    a1 = dot_pairs(a1, _mm512_loadu_si512(w + k + 32), _mm512_loadu_si512(x + k + 32));
    a2 = dot_pairs(a2, _mm512_loadu_si512(w + k + 64), _mm512_loadu_si512(x + k + 64));
    a3 = dot_pairs(a3, _mm512_loadu_si512(w + k + 96), _mm512_loadu_si512(x + k + 96));
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = first_lanes32(K - k);
    a0 = dot_pairs(a0, _mm512_maskz_loadu_epi16(mask, w + k), _mm512_maskz_loadu_epi16(mask, x + k));
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
  put(y, _mm512_reduce_add_ps(sum) + (bias ? bias[0] : 0.0f));
}

// ---- the walk over rows and columns, for either 16-lane tile ----------------------------

// Tile<NT, R> runs NT weight rows against R rows of x; Single runs one against one.
struct Fma512 {
  template <int NT, int R, typename W, typename X, typename Y>
  CONVEYOR_AVX512 static void tile(const W* w, int64_t K, const X* x, Y* y, int64_t N,
                                   const float* bias) {
    if constexpr (NT == 1 && R == 1)
      tile_512_single(w, K, x, y, bias);
    else
      tile_512<NT, R>(w, K, x, y, N, bias);
  }
};

struct Dot512 {
  template <int NT, int R, typename W, typename X, typename Y>
  CONVEYOR_AVX512_BF16 static void tile(const W* w, int64_t K, const X* x, Y* y, int64_t N,
                                        const float* bias) {
    if constexpr (NT == 1 && R == 1)
      tile_dp_single(w, K, x, y, bias);
    else
      tile_dp<NT, R>(w, K, x, y, N, bias);
  }
};

// The last `rest` (< R + 1) rows of x against NT weight rows, in one tile.
template <typename Tile, int NT, int R, typename W, typename X, typename Y>
inline void rest_rows(const W* w, int64_t K, const X* x, Y* y, int64_t N, const float* bias,
                      int64_t rest) {
  if constexpr (R >= 1) {
    if (rest == R)
      Tile::template tile<NT, R>(w, K, x, y, N, bias);
    else
      rest_rows<Tile, NT, R - 1>(w, K, x, y, N, bias, rest);
  }
}

// NT weight rows against every row of x, R rows a pass, the rest in one more.
template <typename Tile, int NT, int R, typename W, typename X, typename Y>
inline void all_rows(const W* w, int64_t K, const X* x, int64_t M, Y* y, int64_t N,
                     const float* bias) {
  int64_t r = 0;
  for (; r + R <= M; r += R) Tile::template tile<NT, R>(w, K, x + r * K, y + r * N, N, bias);
  rest_rows<Tile, NT, R - 1>(w, K, x + r * K, y + r * N, N, bias, M - r);
}

// Output columns n0..n1 of every row: wide tiles for steps of more than kMaxR512 rows.
template <typename Tile, typename W, typename X, typename Y>
void columns_16(const W* w, int64_t K, const X* x, int64_t M, Y* y, int64_t N, const float* bias,
                int64_t n0, int64_t n1) {
  auto b = [&](int64_t n) { return bias ? bias + n : nullptr; };
  int64_t n = n0;
  if (M > kMaxR512)
    for (; n + kWideN <= n1; n += kWideN)
      all_rows<Tile, kWideN, kWideR>(w + n * K, K, x, M, y + n, N, b(n));
  for (; n + kTileN <= n1; n += kTileN)
    all_rows<Tile, kTileN, kMaxR512>(w + n * K, K, x, M, y + n, N, b(n));
  for (; n < n1; ++n) all_rows<Tile, 1, kMaxR512>(w + n * K, K, x, M, y + n, N, b(n));
}

// ---- AVX2 + FMA: fp32 x, weights fp32 or bf16 (widened as loaded) ------------------------

inline __m256i tail_mask(int64_t left) {
  alignas(32) static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                               0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones + 8 - left));
}

// The first n (< 8) elements from p as fp32, the rest 0.
inline __m256 load8_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
inline __m256 load8_first(const BF16* p, int64_t n) {
  alignas(32) float t[8] = {};
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(t);
}

template <int NT, int R, typename W, typename Y>
inline void tile_256(const W* w, int64_t K, const float* x, Y* y, int64_t N, const float* bias) {
  const char* ahead = prefetch_base<NT>(w, K);
  __m256 acc[NT][R];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int i = 0; i < NT; ++i) {
      if (kPrefetches && (k * sizeof(W)) % 64 == 0)
        _mm_prefetch(ahead + (i * K + k) * sizeof(W), kHint);
      const __m256 wv = load8(w + i * K + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  if (k < K) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = load8_first(x + r * K + k, K - k);
    for (int i = 0; i < NT; ++i) {
      const __m256 wv = load8_first(w + i * K + k, K - k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NT; ++i)
      put(y + r * N + i, horizontal_sum(acc[i][r]) + (bias ? bias[i] : 0.0f));
}

template <int NT, typename W, typename Y>
inline void rows_256(const W* w, int64_t K, const float* x, int64_t M, Y* y, int64_t N,
                     const float* bias) {
  int64_t r = 0;
  for (; r + kMaxR256 <= M; r += kMaxR256)
    tile_256<NT, kMaxR256>(w, K, x + r * K, y + r * N, N, bias);
  if (M - r == 1) tile_256<NT, 1>(w, K, x + r * K, y + r * N, N, bias);
}

template <typename W, typename Y>
void columns_8(const W* w, int64_t K, const float* x, int64_t M, Y* y, int64_t N,
               const float* bias, int64_t n0, int64_t n1) {
  auto b = [&](int64_t n) { return bias ? bias + n : nullptr; };
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) rows_256<kTileN>(w + n * K, K, x, M, y + n, N, b(n));
  for (; n < n1; ++n) rows_256<1>(w + n * K, K, x, M, y + n, N, b(n));
}

// ---- entry points --------------------------------------------------------------------

constexpr const char* kKernel = "the GEMV";

// x [..., K], weight [N, K] row-major and bias [N] on the CPU, all of `dtype` (named `name`).
void check_linear(const torch::Tensor& input, const torch::Tensor& w,
                  const c10::optional<torch::Tensor>& bias, at::ScalarType dtype,
                  const char* name) {
  TORCH_CHECK(input.device().is_cpu() && w.device().is_cpu(), "the GEMV runs on CPU tensors");
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == dtype, "x must be a [..., K] ", name,
              " tensor, got ", input.scalar_type(), " ", input.sizes());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.is_contiguous(),
              "weight must be a contiguous (row-major) ", name, " [N, K] tensor, got ",
              w.scalar_type(), " ", w.sizes(), w.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(input.size(-1) == w.size(1), "x has ", input.size(-1),
              " features but the weight ", w.size(1));
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == dtype && bias->device().is_cpu(),
                "bias must be a contiguous ", name, " [", w.size(0), "] tensor, got ",
                bias->sizes());
}

// The output [..., N] of x [..., K] through weight [N, K]: empty, for the caller to fill.
torch::Tensor output_for(const torch::Tensor& input, const torch::Tensor& w) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = w.size(0);
  return torch::empty(shape, input.options());
}

// cols(n0, n1) over the output columns, one contiguous run of tiles per thread; small layers
// (under ~64 KB of weights) stay on one thread.
template <typename F>
void over_columns(int64_t N, int64_t row_bytes, F&& cols) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_bytes * kTileN));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    cols(t0 * kTileN, std::min(N, t1 * kTileN));
  });
}

torch::Tensor fp32_linear(const torch::Tensor& input, const torch::Tensor& w,
                          const c10::optional<torch::Tensor>& bias, int64_t isa) {
  check_linear(input, w, bias, torch::kFloat32, "fp32");
  const bool wide = conveyor_native::resolve_isa(isa, kKernel) == kIsaAvx512;
  const torch::Tensor x = input.contiguous();
  const int64_t K = w.size(1), N = w.size(0), M = K == 0 ? 0 : x.numel() / K;
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  auto y = output_for(input, w);
  if (y.numel() == 0) return y;
  if (K == 0) return bp ? y.copy_(bias->expand_as(y)) : y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_columns(N, K * sizeof(float), [&](int64_t n0, int64_t n1) {
    if (wide)
      columns_16<Fma512>(wp, K, xp, M, yp, N, bp, n0, n1);
    else
      columns_8(wp, K, xp, M, yp, N, bp, n0, n1);
  });
  return y;
}

torch::Tensor bf16_linear(const torch::Tensor& input, const torch::Tensor& w,
                          const c10::optional<torch::Tensor>& bias, int64_t isa) {
  check_linear(input, w, bias, torch::kBFloat16, "bf16");
  const int64_t path = conveyor_native::resolve_bf16_isa(isa, kKernel);
  const torch::Tensor x = input.contiguous();
  const int64_t K = w.size(1), N = w.size(0), M = K == 0 ? 0 : x.numel() / K;
  auto y = output_for(input, w);
  if (y.numel() == 0) return y;
  if (K == 0) return bias.has_value() && bias->defined() ? y.copy_(bias->expand_as(y)) : y.zero_();
  std::vector<float> b32;  // the bias widened once: the tiles add it in fp32
  if (bias.has_value() && bias->defined()) {
    b32.resize(N);
    conveyor_native::widen(bias->data_ptr<BF16>(), N, b32.data());
  }
  const float* bp = b32.empty() ? nullptr : b32.data();
  const BF16* xp = x.data_ptr<BF16>();
  const BF16* wp = w.data_ptr<BF16>();
  BF16* yp = y.data_ptr<BF16>();
  if (path == kIsaAvx512Bf16) {
    over_columns(N, K * sizeof(BF16), [&](int64_t n0, int64_t n1) {
      columns_16<Dot512>(wp, K, xp, M, yp, N, bp, n0, n1);
    });
    return y;
  }
  std::vector<float> x32(M * K);  // the FMA tiles multiply fp32 x: widened once
  conveyor_native::widen(xp, M * K, x32.data());
  over_columns(N, K * sizeof(BF16), [&](int64_t n0, int64_t n1) {
    if (path == kIsaAvx512)
      columns_16<Fma512>(wp, K, x32.data(), M, yp, N, bp, n0, n1);
    else
      columns_8(wp, K, x32.data(), M, yp, N, bp, n0, n1);
  });
  return y;
}

std::string isa_name(int64_t isa) { return conveyor_native::isa_name(isa, kKernel); }

std::string bf16_isa_name(int64_t isa) {
  const int64_t path = conveyor_native::resolve_bf16_isa(isa, kKernel);
  return path == kIsaAvx512Bf16 ? "avx512-bf16" : path == kIsaAvx512 ? "avx512" : "avx2";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Tensors only inside: the GIL is released while they run, as ATen's ops do.
  m.def("fp32_linear", &fp32_linear, "y = x W^T + b for fp32 x [..., K], W [N, K] row-major",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("isa") = 0, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("bf16_linear", &bf16_linear,
        "y = x W^T + b for bf16 x [..., K], W [N, K] row-major (fp32 sums, y rounded to bf16)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("isa") = 0, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("isa_name", &isa_name, "the code path isa (0 auto, 1 AVX2, 2 AVX-512) runs here",
        pybind11::arg("isa") = 0);
  m.def("bf16_isa_name", &bf16_isa_name,
        "the code path bf16_linear's isa (0 auto, 1 AVX2, 2 AVX-512, 3 AVX512-BF16) runs here",
        pybind11::arg("isa") = 0);
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU has avx512f/dq/bw/vl");
}
