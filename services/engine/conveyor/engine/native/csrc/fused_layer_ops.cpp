// A decoder layer's elementwise steps, each one pass over its rows (fp32, CPU):
//
//   add_rms_norm_(residual, delta, weight, eps) -> out
//       residual += delta (in place); out = weight * (residual * rsqrt(mean(residual^2) + eps))
//   rms_norm(x, weight, eps) -> out       the same without the add
//   rotate_(x, cos, signed_sin)           x [T, H, D] rotated in place (rotate-half layout)
//
// The torch versions (model/fused_ops.py) run 4-9 ops with a temporary each; these run one
// loop, so a one-row decode step pays one call instead of ~12 per layer.
// Built with -ffp-contract=off: the add and the rotation's products and sums round as torch's
// separate ops do, bit for bit. Only the norm's sum of squares runs in another order (8 lanes,
// then a fold), which moves the result by an ulp or so.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

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

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32,
              name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, H] with contiguous rows");
}

torch::Tensor add_rms_norm_(torch::Tensor residual, const torch::Tensor& delta,
                            const torch::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual and delta differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "bad weight");
  auto out = torch::empty(residual.sizes(), residual.options());
  const int64_t n = residual.size(1);
  float* r = residual.data_ptr<float>();
  const float* d = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t rs = residual.stride(0), ds = delta.stride(0);
  const float e = static_cast<float>(eps);
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
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "bad weight");
  auto out = torch::empty(x.sizes(), x.options());
  const int64_t n = x.size(1), xs = x.stride(0);
  const float* src = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(src + t * xs, w, o + t * n, n, e);
  });
  return out;
}

// x [T, H, D] (last dim contiguous, any row and head strides); cos, signed_sin [T, 1, D]
// views of the rotary table (cos | cos and -sin | sin halves, rotary_embedding.py).
void rotate_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 3 &&
              x.stride(2) == 1, "x must be a float32 CPU [T, H, D] tensor, D contiguous");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.stride(2) == 1 &&
              signed_sin.scalar_type() == torch::kFloat32 && signed_sin.stride(2) == 1,
              "cos and signed_sin must be float32 [T, 1, D] with D contiguous");
  const int64_t heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(2) == 2 * half, "cos does not match x");
  float* base = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0),
                ss = signed_sin.stride(0);
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * cs;            // cos of the first half (= of the second)
      const float* st = s + t * ss + half;     // +sin, the second half of signed_sin
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = base + t * xs0 + h * xs1;
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * ct[i] + b * (-st[i]);
          x2[i] = b * ct[i] + a * st[i];
        }
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta; RMSNorm(residual) * weight");
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight");
  m.def("rotate_", &rotate_, "rotary embedding in place, rotate-half layout");
}
