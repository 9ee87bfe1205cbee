// A decoder layer's elementwise steps, each one pass over its rows (fp32 or bf16, CPU):
//
//   add_rms_norm_(residual, delta, weight, eps) -> out
//       residual += delta (in place); out = weight * (residual * rsqrt(mean(residual^2) + eps))
//   rms_norm(x, weight, eps) -> out       the same without the add
//   rotate_(x, cos, signed_sin)           x [T, H, D] rotated in place (rotate-half layout)
//   silu_and_mul(gate_up, isa) -> out     out [T, I] = silu(gate) * up of gate_up [T, 2I]
//
// The torch versions (model/fused_ops.py) run 4-9 ops with a temporary each; these run one
// loop, so a one-row decode step pays one call instead of ~12 per layer.
// Built with -ffp-contract=off: the add and the rotation's products and sums round as torch's
// separate ops do, bit for bit. Only the norm's sum of squares runs in another order (8 lanes,
// then a fold), which moves the result by an ulp or so.
//
// silu_and_mul computes g / (1 + exp(-g)) * u in torch's order, with its own vector exp
// (Cephes' range reduction and degree-6 polynomial, ~2 ulp; torch's is Sleef's, 1 ulp) and, in
// 16 lanes, the division as a reciprocal estimate refined by a Newton step (~2 ulp), so it
// is within ~1e-6 relative of torch's silu(gate) * up, not bit for bit. Two code paths chosen
// at run time: AVX-512 (functions compiled with a target attribute; the library itself needs
// only -mavx2 -mfma) where the CPU has avx512f, else AVX2 + FMA; `isa` forces one (0 auto,
// 1 AVX2, 2 AVX-512) so the tests run both here.
//
// bf16 rows (a bf16 model) are widened to fp32 as they are loaded and rounded back to bf16 (to
// nearest even) exactly where torch's bf16 ops round: the residual sum; the normalized row
// before the weight multiplies it, and the product (transformers' `weight * x.to(bf16)`); the
// rotated row; silu(gate), and its product with up. So the add and the rotation are torch's bit
// for bit, the norm and SwiGLU within an ulp of bf16 where the fp32 value before a rounding
// differs in its last bits (the sum of squares' order, the own exp).
//
// Every entry point takes and returns tensors only and runs with the GIL released (the
// engine's asyncio/gRPC thread runs meanwhile).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "cpu_isa.h"
#include "vector_io.h"

namespace {

using conveyor_native::cpu_has_avx512;
using conveyor_native::load16;
using conveyor_native::load8;
using conveyor_native::store16;
using conveyor_native::store8;
using BF16 = at::BFloat16;

constexpr int64_t kGrainRows = 16;  // rows per thread task: one row is far too little work

float sum_of_squares(const float* x, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += x[i + j] * x[i + j];
  }
  float total = 0;
  for (; i < n; ++i) total += x[i] * x[i];
  for (int j = 0; j < 8; ++j) total += lanes[j];
  return total;
}

void norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float scale = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * scale);
}

// [T, H] rows (contiguous within a row) of fp32 or bf16 on the CPU.
void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 ||
                                      t.scalar_type() == torch::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, H] with contiguous rows");
}

void check_same_dtype(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, " must have one dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

// ---- bf16 rows -------------------------------------------------------------------------

// v rounded to bf16 (to nearest even) and widened back: the value a bf16 tensor would hold.
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(conveyor_native::bf16_bits8(v), 16));
}
inline float round_bf16(float v) { return static_cast<float>(BF16(v)); }

// row += add, rounded to bf16 in place; returns the sum of squares of the new row.
float add_row_bf16(BF16* row, const BF16* add, int64_t n) {
  __m256 squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = conveyor_native::bf16_bits8(_mm256_add_ps(load8(row + i), load8(add + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                      _mm256_extracti128_si256(bits, 1)));
    const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));  // the stored value
    squares = _mm256_add_ps(squares, _mm256_mul_ps(x, x));
  }
  float total = conveyor_native::horizontal_sum(squares);
  for (; i < n; ++i) {
    const float x = round_bf16(static_cast<float>(row[i]) + static_cast<float>(add[i]));
    row[i] = BF16(x);
    total += x * x;
  }
  return total;
}

float sum_of_squares_bf16(const BF16* x, int64_t n) {
  __m256 squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    squares = _mm256_add_ps(squares, _mm256_mul_ps(v, v));
  }
  float total = conveyor_native::horizontal_sum(squares);
  for (; i < n; ++i) total += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return total;
}

// out = weight * bf16(x * scale), rounded to bf16 (transformers' RMSNorm in bf16).
void norm_row_bf16(const BF16* x, const BF16* weight, BF16* out, int64_t n, float squares,
                   float eps) {
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(load8(weight + i), round_bf16(_mm256_mul_ps(load8(x + i), s))));
  for (; i < n; ++i)
    out[i] = BF16(static_cast<float>(weight[i]) * round_bf16(static_cast<float>(x[i]) * scale));
}

torch::Tensor add_rms_norm_(torch::Tensor residual, const torch::Tensor& delta,
                            const torch::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  check_same_dtype(residual, delta, "residual and delta");
  check_same_dtype(residual, weight, "residual and weight");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual and delta differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "bad weight");
  auto out = torch::empty(residual.sizes(), residual.options());
  const int64_t n = residual.size(1);
  const int64_t rs = residual.stride(0), ds = delta.stride(0);
  const float e = static_cast<float>(eps);
  if (residual.scalar_type() == torch::kBFloat16) {
    BF16* r = residual.data_ptr<BF16>();
    const BF16* d = delta.data_ptr<BF16>();
    const BF16* w = weight.data_ptr<BF16>();
    BF16* o = out.data_ptr<BF16>();
    at::parallel_for(0, residual.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float squares = add_row_bf16(r + t * rs, d + t * ds, n);
        norm_row_bf16(r + t * rs, w, o + t * n, n, squares, e);
      }
    });
    return out;
  }
  float* r = residual.data_ptr<float>();
  const float* d = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, residual.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = r + t * rs;
      const float* add = d + t * ds;
      for (int64_t i = 0; i < n; ++i) row[i] = row[i] + add[i];
      norm_row(row, w, o + t * n, n, e);
    }
  });
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_same_dtype(x, weight, "x and weight");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "bad weight");
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t n = x.size(1), xs = x.stride(0);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kBFloat16) {
    const BF16* src = x.data_ptr<BF16>();
    const BF16* w = weight.data_ptr<BF16>();
    BF16* o = out.data_ptr<BF16>();
    at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        norm_row_bf16(src + t * xs, w, o + t * n, n, sum_of_squares_bf16(src + t * xs, n), e);
    });
    return out;
  }
  const float* src = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(src + t * xs, w, o + t * n, n, e);
  });
  return out;
}

// One head's halves x1, x2 (each `half` long) rotated in place by cos (ct) and sin (st).
void rotate_head(float* x1, float* x2, const float* ct, const float* st, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x1[i], b = x2[i];
    x1[i] = a * ct[i] + b * (-st[i]);
    x2[i] = b * ct[i] + a * st[i];
  }
}

// The same for a bf16 head: computed in fp32, each result rounded once to bf16.
void rotate_head(BF16* x1, BF16* x2, const float* ct, const float* st, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load8(x1 + i), b = load8(x2 + i), c = _mm256_loadu_ps(ct + i);
    const __m256 s = _mm256_loadu_ps(st + i);
    const __m256 minus_s = _mm256_xor_ps(s, _mm256_set1_ps(-0.0f));  // -s, as torch's -sin
    store8(x1 + i, _mm256_add_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, minus_s)));
    store8(x2 + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
  }
  for (; i < half; ++i) {
    const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
    x1[i] = BF16(a * ct[i] + b * (-st[i]));
    x2[i] = BF16(b * ct[i] + a * st[i]);
  }
}

// x [T, H, D] (last dim contiguous, any row and head strides; fp32 or bf16); cos, signed_sin
// [T, 1, D] fp32 views of the rotary table (cos | cos and -sin | sin halves,
// rotary_embedding.py).
void rotate_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 ||
                                      x.scalar_type() == torch::kBFloat16) &&
              x.dim() == 3 && x.stride(2) == 1,
              "x must be a float32 or bfloat16 CPU [T, H, D] tensor, D contiguous");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.stride(2) == 1 &&
              signed_sin.scalar_type() == torch::kFloat32 && signed_sin.stride(2) == 1,
              "cos and signed_sin must be float32 [T, 1, D] with D contiguous");
  const int64_t heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(2) == 2 * half, "cos does not match x");
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0),
                ss = signed_sin.stride(0);
  auto rotate_rows = [&](auto* base) {
    at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = c + t * cs;            // cos of the first half (= of the second)
        const float* st = s + t * ss + half;     // +sin, the second half of signed_sin
        for (int64_t h = 0; h < heads; ++h) {
          auto* x1 = base + t * xs0 + h * xs1;
          rotate_head(x1, x1 + half, ct, st, half);
        }
      }
    });
  };
  if (x.scalar_type() == torch::kBFloat16)
    rotate_rows(x.data_ptr<BF16>());
  else
    rotate_rows(x.data_ptr<float>());
}

// ---- SwiGLU ----------------------------------------------------------------------------

constexpr int64_t kGrainElements = 16384;  // per thread task: ~10 rows of the 1536-wide MLP

// exp(x) for x in [kExpLo, kExpHi] (the caller clamps): x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by Cephes' expf polynomial, times 2^n built in the exponent bits.
constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.3365447504f;
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f,
                kP3 = 4.1665795894E-2f, kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;

float silu_mul_scalar(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 inline __m256 exp_256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(g) as the output type holds it before the multiply: fp32 as it is; bf16 rounded (torch's
// silu on a bf16 tensor rounds its result, and mul_ then rounds again).
inline __m256 as_stored(__m256 v, const float*) { return v; }
inline __m256 as_stored(__m256 v, const BF16*) { return round_bf16(v); }
inline float as_stored(float v, const float*) { return v; }
inline float as_stored(float v, const BF16*) { return round_bf16(v); }

// out = silu(g) * u over one row of n (fp32 or bf16: widened as loaded, rounded as stored).
template <typename T>
AVX2 void silu_mul_row_256(const T* g, const T* u, T* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = load8(g + i);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp_256(_mm256_sub_ps(zero, gv))));
    store8(out + i, _mm256_mul_ps(as_stored(s, out), load8(u + i)));
  }
  for (; i < n; ++i)
    out[i] = static_cast<T>(as_stored(silu_mul_scalar(static_cast<float>(g[i]), 1.0f), out) *
                            static_cast<float>(u[i]));
}

CONVEYOR_AVX512 inline __m512 exp_512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

CONVEYOR_AVX512 inline __m512 as_stored(__m512 v, const float*) { return v; }
CONVEYOR_AVX512 inline __m512 as_stored(__m512 v, const BF16*) {
  const __m512i wide = _mm512_cvtepu16_epi32(conveyor_native::bf16_bits16(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 1 / d: the 14-bit estimate and one Newton step (~2 ulp; a division's throughput is what
// bounded SwiGLU over long rows).
CONVEYOR_AVX512 inline __m512 reciprocal_512(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

// silu_mul_row_256 in 16 lanes; the last n % 16 elements through the 8-lane code.
template <typename T>
CONVEYOR_AVX512 void silu_mul_row_512(const T* g, const T* u, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = load16(g + i);
    const __m512 e = exp_512(_mm512_sub_ps(zero, gv));
    const __m512 s = _mm512_mul_ps(gv, reciprocal_512(_mm512_add_ps(one, e)));
    store16(out + i, _mm512_mul_ps(as_stored(s, out), load16(u + i)));
  }
  if (i < n) silu_mul_row_256(g + i, u + i, out + i, n - i);
}

int64_t resolve_isa(int64_t isa) { return conveyor_native::resolve_isa(isa, "silu_and_mul"); }

std::string isa_name(int64_t isa) { return conveyor_native::isa_name(isa, "silu_and_mul"); }

// out [rows, n] = silu(gate) * up of each row of gate_up (gate the first n columns), in
// threads of `grain` rows; T float or bf16.
template <typename T>
void silu_and_mul_rows(const T* src, int64_t stride, T* o, int64_t rows, int64_t n, bool wide) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = src + t * stride;
      if (wide)
        silu_mul_row_512(g, g + n, o + t * n, n);
      else
        silu_mul_row_256(g, g + n, o + t * n, n);
    }
  });
}

// gate_up [T, 2I] (rows contiguous, any row stride): gate = columns [0, I), up = [I, 2I).
torch::Tensor silu_and_mul(const torch::Tensor& gate_up, int64_t isa) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width, got ",
              gate_up.size(1));
  const bool wide = resolve_isa(isa) == 2;
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  if (gate_up.scalar_type() == torch::kBFloat16)
    silu_and_mul_rows(gate_up.data_ptr<BF16>(), stride, out.data_ptr<BF16>(), rows, n, wide);
  else
    silu_and_mul_rows(gate_up.data_ptr<float>(), stride, out.data_ptr<float>(), rows, n, wide);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta; RMSNorm(residual) * weight",
        release_gil());
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight", release_gil());
  m.def("rotate_", &rotate_, "rotary embedding in place, rotate-half layout", release_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of gate_up [T, 2I] -> [T, I]",
        pybind11::arg("gate_up"), pybind11::arg("isa") = 0, release_gil());
  m.def("isa_name", &isa_name, "the code path an isa value resolves to", release_gil());
}
