// The CPU's fp32 multiply-add rate with N threads running at once: each of torch's intra-op
// threads runs kChains independent vector FMA chains for `iterations` rounds. With all threads
// busy together this is the arithmetic ceiling of a step that uses them (two vCPUs that share
// one core's FMA units, as a contended VM's can, read one core's rate, not twice it).
// pybind11 and c10's checks, not <torch/extension.h>: a first build in 16 s instead of 45 (Zen 3)
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <tuple>

namespace {

constexpr int kChains = 12;  // more than FMA latency x issue width on current x86 cores

// One thread's chains, 8 lanes (AVX2) or 16 (AVX-512; a target attribute, run only where the
// CPU has it). The two bodies are the same loop at two widths: a template over the vector type
// would be instantiated without the AVX-512 attribute and call its intrinsics out of line.
float chains256(int64_t iterations) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(1.0f + 1e-7f * i);
  const __m256 scale = _mm256_set1_ps(0.9999999f), bias = _mm256_set1_ps(1e-7f);
  for (int64_t k = 0; k < iterations; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], scale, bias);
  float sum = 0.0f;
  for (int i = 0; i < kChains; ++i) sum += _mm256_cvtss_f32(acc[i]);
  return sum;
}

__attribute__((target("avx512f,avx2,fma"))) float chains512(int64_t iterations) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + 1e-7f * i);
  const __m512 scale = _mm512_set1_ps(0.9999999f), bias = _mm512_set1_ps(1e-7f);
  for (int64_t k = 0; k < iterations; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], scale, bias);
  float sum = 0.0f;
  for (int i = 0; i < kChains; ++i) sum += _mm512_cvtss_f32(acc[i]);
  return sum;
}

// (seconds, flops) of `threads` threads each running the chains `iterations` times in `lanes`
// (8: AVX2; 16: AVX-512, where the CPU has it).
std::tuple<double, double> fma_loop(int64_t iterations, int64_t threads, int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "lanes must be 8 or 16, got ", lanes);
  TORCH_CHECK(lanes == 8 || __builtin_cpu_supports("avx512f"), "this CPU lacks AVX-512");
  TORCH_CHECK(threads >= 1 && threads <= at::get_num_threads(), "threads must be in 1..",
              at::get_num_threads(), " (torch's intra-op threads), got ", threads);
  std::atomic<float> sink{0.0f};
  std::atomic<int64_t> ran{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      sink = sink + (lanes == 16 ? chains512(iterations) : chains256(iterations));
      ++ran;
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  TORCH_CHECK(sink.load() != 12345.0f);  // keeps the chains
  return {seconds, 2.0 * lanes * kChains * static_cast<double>(iterations) * ran.load()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fma_loop", &fma_loop, "(seconds, flops) of fp32 FMA chains on `threads` threads at once",
        pybind11::arg("iterations"), pybind11::arg("threads"), pybind11::arg("lanes"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("chains_per_thread", []() { return kChains; });
}
