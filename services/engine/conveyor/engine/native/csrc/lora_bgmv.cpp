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
// Rows are sorted by slot and taken in groups of up to 4 of one slot (lora_bgmv_tiles.inc), so
// each load of the adapter's A and B serves the group's rows; groups are split across torch's
// intra-op threads. fp32 or bf16 tensors (all one dtype): bf16 is widened to fp32 as loaded,
// the products summed in fp32, and y rounded to bf16 once, after the row's whole delta is added
// (as torch's addmm_ rounds once). Sums run in 8 or 16 lanes, so the result is within fp32 rounding of torch's,
// not bit for bit. Two code paths chosen at run time: AVX-512 (target attributes) where the CPU
// has it, else AVX2 + FMA; `isa` forces one (0 auto, 1 AVX2, 2 AVX-512) so the tests run both.
// The GIL is released.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "vector_io.h"

namespace {

using BF16 = at::BFloat16;

constexpr int kGroupRows = 4;  // rows of one slot computed together (they share A and B loads)

struct Shape {
  int64_t in, out, max_rank;
  std::vector<int64_t> slice_outs;
};

namespace avx2 {
using Vec = __m256;
constexpr int kLanes = 8, kShrinkRows = 2;
inline Vec vzero() { return _mm256_setzero_ps(); }
template <typename T>
inline Vec vload(const T* p) { return conveyor_native::load8(p); }
template <typename T>
inline void vstore(T* p, Vec v) { conveyor_native::store8(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vset1(float f) { return _mm256_set1_ps(f); }
inline float vsum(Vec v) { return conveyor_native::horizontal_sum(v); }
#define LORA_TARGET
#include "lora_bgmv_tiles.inc"
#undef LORA_TARGET
}  // namespace avx2

namespace avx512 {
using Vec = __m512;
constexpr int kLanes = 16, kShrinkRows = 4;
CONVEYOR_AVX512 inline Vec vzero() { return _mm512_setzero_ps(); }
template <typename T>
CONVEYOR_AVX512 inline Vec vload(const T* p) { return conveyor_native::load16(p); }
template <typename T>
CONVEYOR_AVX512 inline void vstore(T* p, Vec v) { conveyor_native::store16(p, v); }
CONVEYOR_AVX512 inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
CONVEYOR_AVX512 inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
CONVEYOR_AVX512 inline Vec vset1(float f) { return _mm512_set1_ps(f); }
CONVEYOR_AVX512 inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#define LORA_TARGET CONVEYOR_AVX512
#include "lora_bgmv_tiles.inc"
#undef LORA_TARGET
}  // namespace avx512

// The rows of each slot in groups of up to kGroupRows: (slot, first row index in `order`,
// count), `order` the rows sorted by slot (base rows left out).
struct Groups {
  std::vector<int64_t> order;
  std::vector<std::array<int64_t, 3>> groups;
};

Groups group_rows(const int64_t* slots, int64_t num_rows, int64_t num_slots) {
  Groups out;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    const int64_t first = static_cast<int64_t>(out.order.size());
    for (int64_t t = 0; t < num_rows; ++t)
      if (slots[t] == slot) out.order.push_back(t);
    const int64_t end = static_cast<int64_t>(out.order.size());
    for (int64_t g = first; g < end; g += kGroupRows)
      out.groups.push_back({slot, g, std::min<int64_t>(kGroupRows, end - g)});
  }
  return out;
}

template <typename T, bool kWide, int G>
void run_group(const float* xf, T* const* y, const T* a, const T* b, int64_t rank,
               const Shape& s, float* h) {
  if constexpr (kWide) {
    avx512::apply_group<T, G>(xf, y, a, b, rank, s, h);
  } else {
    avx2::apply_group<T, G>(xf, y, a, b, rank, s, h);
  }
}

template <typename T, bool kWide>
void apply_rows(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a,
                const torch::Tensor& b, const int64_t* slots, const int64_t* ranks,
                int64_t num_slots, const Shape& s) {
  const T* x_data = x.data_ptr<T>();
  T* y_data = y.data_ptr<T>();
  const T* a_data = a.data_ptr<T>();
  const T* b_data = b.data_ptr<T>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const int64_t width = static_cast<int64_t>(s.slice_outs.size()) * s.max_rank;
  const Groups rows = group_rows(slots, x.size(0), num_slots);
  at::parallel_for(0, static_cast<int64_t>(rows.groups.size()), 1, [&](int64_t begin,
                                                                      int64_t end) {
    std::vector<float> scratch(kGroupRows * (s.in + s.max_rank));
    float* xf = scratch.data();
    float* h = xf + kGroupRows * s.in;
    for (int64_t i = begin; i < end; ++i) {
      const auto [slot, first, count] = rows.groups[i];
      T* y_rows[kGroupRows];
      for (int64_t g = 0; g < count; ++g) {
        const int64_t t = rows.order[first + g];
        conveyor_native::widen(x_data + t * x_stride, s.in, xf + g * s.in);
        y_rows[g] = y_data + t * y_stride;
      }
      const T* a_slot = a_data + slot * width * s.in;
      const T* b_slot = b_data + slot * width * s.out;
      const int64_t rank = ranks[slot];
      switch (count) {
        case 1: run_group<T, kWide, 1>(xf, y_rows, a_slot, b_slot, rank, s, h); break;
        case 2: run_group<T, kWide, 2>(xf, y_rows, a_slot, b_slot, rank, s, h); break;
        case 3: run_group<T, kWide, 3>(xf, y_rows, a_slot, b_slot, rank, s, h); break;
        default: run_group<T, kWide, 4>(xf, y_rows, a_slot, b_slot, rank, s, h); break;
      }
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
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == torch::kInt64 &&
                  slots.is_contiguous() &&
                  slots.dim() == 1 && slots.size(0) == x.size(0),
              "slots must be int64 [T] on the CPU, one per row of x");
  TORCH_CHECK(ranks.device().is_cpu() && ranks.scalar_type() == torch::kInt64 &&
                  ranks.is_contiguous(),
              "ranks must be int64 [S] on the CPU");
  TORCH_CHECK(!slice_outs.empty() && max_rank > 0, "need slice_outs and max_rank > 0");
  Shape s{x.size(1), y.size(1), max_rank, slice_outs};
  const int64_t width = static_cast<int64_t>(slice_outs.size()) * max_rank;
  int64_t total_out = 0;
  for (int64_t slice_out : slice_outs) total_out += slice_out;
  TORCH_CHECK(y.size(0) == x.size(0) && total_out == s.out, "y must be [T, sum(slice_outs)]");
  TORCH_CHECK(a.size(1) == s.in && b.size(1) == s.out && a.size(0) == b.size(0) &&
                  a.size(0) % width == 0 && ranks.size(0) == a.size(0) / width,
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
  const bool wide = conveyor_native::resolve_isa(isa, "lora_bgmv") == conveyor_native::kIsaAvx512;
  if (dtype == torch::kFloat32) {
    wide ? apply_rows<float, true>(y, x, a, b, slot_data, rank_data, num_slots, s)
         : apply_rows<float, false>(y, x, a, b, slot_data, rank_data, num_slots, s);
  } else {
    wide ? apply_rows<BF16, true>(y, x, a, b, slot_data, rank_data, num_slots, s)
         : apply_rows<BF16, false>(y, x, a, b, slot_data, rank_data, num_slots, s);
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
