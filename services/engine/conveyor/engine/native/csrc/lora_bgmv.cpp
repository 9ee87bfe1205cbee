// LoRA adapters applied per row on the CPU (punica's BGMV): y[t] += x[t] @ A_s^T @ B_s for the
// slot s of row t, in one call per projection whatever the mix of adapters in the step.
//
//   lora_bgmv_(y [T, out], x [T, in], a [S*W, in], b [S*W, out], slots [T] int64,
//              ranks [S] int64, max_rank, slice_outs [n] int64, isa)
//
// The slot layout is lora/adapter.py's: slot s holds W = n x max_rank rows of `a` and `b`;
// fused slice i (q, k, v of qkv_proj; gate, up of gate_up_proj) owns rows i*max_rank ..
// i*max_rank + ranks[s] - 1 of the slot and, in `b`, only its own output columns (a block
// diagonal: column offsets are the running sum of slice_outs). So each row reads only its own
// adapter's rank rows and each slice's own columns: n x rank x in + rank x out multiply-adds,
// where the torch path (two dense GEMMs over the step's slots) also computes the zero padding
// past the rank, the other slices' zero columns and the other slots. Rows of slot -1 (the
// base model) are skipped.
//
// fp32 or bf16 tensors (all one dtype): bf16 is widened to fp32 as loaded, the products summed
// in fp32, and y rounded to bf16 once, after the row's whole delta is added (as torch's addmm_
// rounds once). Sums run in 8 or 16 lanes, so the result is within fp32 rounding of torch's,
// not bit for bit. Two code paths chosen at run time: AVX-512 (target attributes) where the CPU
// has it, else AVX2 + FMA; `isa` forces one (0 auto, 1 AVX2, 2 AVX-512) so the tests run both.
// Rows are split across torch's intra-op threads; the GIL is released.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "vector_io.h"

namespace {

using conveyor_native::horizontal_sum;
using conveyor_native::kIsaAvx512;
using conveyor_native::load16;
using conveyor_native::load8;
using conveyor_native::store16;
using conveyor_native::store8;
using BF16 = at::BFloat16;

constexpr int64_t kGrainRows = 2;  // a row is ~10-100k multiply-adds

// ---- 8 lanes (AVX2 + FMA) -----------------------------------------------------------------

template <typename T>
float dot_8(const float* x, const T* a, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(load8(x + i), load8(a + i), s0);
    s1 = _mm256_fmadd_ps(load8(x + i + 8), load8(a + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load8(x + i), load8(a + i), s0);
  float total = horizontal_sum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) total += x[i] * static_cast<float>(a[i]);
  return total;
}

template <typename T>
void axpy_8(float h, const T* b, float* acc, int64_t n) {
  const __m256 hv = _mm256_set1_ps(h);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(acc + i, _mm256_fmadd_ps(hv, load8(b + i), load8(acc + i)));
  for (; i < n; ++i) acc[i] += h * static_cast<float>(b[i]);
}

template <typename T>
void add_into_8(T* y, const float* acc, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, _mm256_add_ps(load8(y + i), load8(acc + i)));
  for (; i < n; ++i) y[i] = static_cast<T>(static_cast<float>(y[i]) + acc[i]);
}

// ---- 16 lanes (AVX-512) -------------------------------------------------------------------

template <typename T>
CONVEYOR_AVX512 float dot_16(const float* x, const T* a, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(load16(x + i), load16(a + i), s0);
    s1 = _mm512_fmadd_ps(load16(x + i + 16), load16(a + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(load16(x + i), load16(a + i), s0);
  float total = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  for (; i < n; ++i) total += x[i] * static_cast<float>(a[i]);
  return total;
}

template <typename T>
CONVEYOR_AVX512 void axpy_16(float h, const T* b, float* acc, int64_t n) {
  const __m512 hv = _mm512_set1_ps(h);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store16(acc + i, _mm512_fmadd_ps(hv, load16(b + i), load16(acc + i)));
  }
  for (; i < n; ++i) acc[i] += h * static_cast<float>(b[i]);
}

template <typename T>
CONVEYOR_AVX512 void add_into_16(T* y, const float* acc, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(y + i, _mm512_add_ps(load16(y + i), load16(acc + i)));
  for (; i < n; ++i) y[i] = static_cast<T>(static_cast<float>(y[i]) + acc[i]);
}

// ---- one row ------------------------------------------------------------------------------

struct Shape {
  int64_t in, out, width, max_rank;
  std::vector<int64_t> slice_outs;
};

// y_row += x_row @ A^T @ B over the slot's `rank` rows per slice; xf, h, acc: scratch of
// in, rank and out floats.
template <typename T, bool kWide>
void apply_row(const T* x_row, T* y_row, const T* a, const T* b, int64_t rank,
               const Shape& s, float* xf, float* h, float* acc) {
  conveyor_native::widen(x_row, s.in, xf);
  std::fill(acc, acc + s.out, 0.0f);
  int64_t column = 0;
  for (size_t slice = 0; slice < s.slice_outs.size(); ++slice) {
    const int64_t first = static_cast<int64_t>(slice) * s.max_rank;
    const int64_t width = s.slice_outs[slice];
    for (int64_t j = 0; j < rank; ++j) {
      const T* a_row = a + (first + j) * s.in;
      h[j] = kWide ? dot_16(xf, a_row, s.in) : dot_8(xf, a_row, s.in);
    }
    for (int64_t j = 0; j < rank; ++j) {
      const T* b_row = b + (first + j) * s.out + column;
      if (kWide) {
        axpy_16(h[j], b_row, acc + column, width);
      } else {
        axpy_8(h[j], b_row, acc + column, width);
      }
    }
    column += width;
  }
  if (kWide) {
    add_into_16(y_row, acc, s.out);
  } else {
    add_into_8(y_row, acc, s.out);
  }
}

template <typename T, bool kWide>
void apply_rows(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a,
                const torch::Tensor& b, const int64_t* slots, const int64_t* ranks,
                const Shape& s) {
  const T* x_data = x.data_ptr<T>();
  T* y_data = y.data_ptr<T>();
  const T* a_data = a.data_ptr<T>();
  const T* b_data = b.data_ptr<T>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(s.in + s.max_rank + s.out);
    float* xf = scratch.data();
    float* h = xf + s.in;
    float* acc = h + s.max_rank;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      apply_row<T, kWide>(x_data + t * x_stride, y_data + t * y_stride,
                          a_data + slot * s.width * s.in, b_data + slot * s.width * s.out,
                          ranks[slot], s, xf, h, acc);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name,
              " must be a CPU tensor of the model's dtype (float32 or bfloat16)");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void lora_bgmv_(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& a,
                const torch::Tensor& b, const torch::Tensor& slots, const torch::Tensor& ranks,
                int64_t max_rank, const std::vector<int64_t>& slice_outs, int64_t isa) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "x must be float32 or bfloat16");
  check_rows(x, "x", dtype);
  check_rows(y, "y", dtype);
  check_rows(a, "a", dtype);
  check_rows(b, "b", dtype);
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "a and b must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() &&
                  slots.dim() == 1 && slots.size(0) == x.size(0),
              "slots must be int64 [T], one per row of x");
  TORCH_CHECK(ranks.scalar_type() == torch::kInt64 && ranks.is_contiguous(),
              "ranks must be int64 [S]");
  TORCH_CHECK(!slice_outs.empty() && max_rank > 0, "need slice_outs and max_rank > 0");
  Shape s{x.size(1), y.size(1), static_cast<int64_t>(slice_outs.size()) * max_rank, max_rank,
          slice_outs};
  int64_t total_out = 0;
  for (int64_t width : slice_outs) total_out += width;
  TORCH_CHECK(y.size(0) == x.size(0) && total_out == s.out, "y must be [T, sum(slice_outs)]");
  TORCH_CHECK(a.size(1) == s.in && b.size(1) == s.out && a.size(0) == b.size(0) &&
                  a.size(0) % s.width == 0 && ranks.size(0) == a.size(0) / s.width,
              "a [S*W, in] and b [S*W, out] must hold ranks.size(0) slots of W = "
              "len(slice_outs) * max_rank rows");
  const int64_t num_slots = ranks.size(0);
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const int64_t* rank_data = ranks.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(slot_data[t] >= -1 && slot_data[t] < num_slots, "slot ", slot_data[t],
                " of row ", t, " is out of range");
  }
  for (int64_t i = 0; i < num_slots; ++i) {
    TORCH_CHECK(rank_data[i] >= 0 && rank_data[i] <= max_rank, "rank of slot ", i,
                " must be 0..max_rank");
  }
  const bool wide = conveyor_native::resolve_isa(isa, "lora_bgmv") == kIsaAvx512;
  if (dtype == torch::kFloat32) {
    wide ? apply_rows<float, true>(y, x, a, b, slot_data, rank_data, s)
         : apply_rows<float, false>(y, x, a, b, slot_data, rank_data, s);
  } else {
    wide ? apply_rows<BF16, true>(y, x, a, b, slot_data, rank_data, s)
         : apply_rows<BF16, false>(y, x, a, b, slot_data, rank_data, s);
  }
}

std::string isa_name(int64_t isa) { return conveyor_native::isa_name(isa, "lora_bgmv"); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("lora_bgmv_", &lora_bgmv_, "y[t] += x[t] @ A_slot^T @ B_slot per row (in place)",
        pybind11::arg("y"), pybind11::arg("x"), pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("slots"), pybind11::arg("ranks"), pybind11::arg("max_rank"),
        pybind11::arg("slice_outs"), pybind11::arg("isa") = 0, release_gil());
  m.def("isa_name", &isa_name, "the code path an isa value resolves to", release_gil());
}
