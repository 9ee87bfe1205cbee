// What the engine's C++ kernels share: the CPU features that pick their code paths, the
// 8-lane horizontal sum, the 16-lane sums of four vectors at once and tail masks. The libraries are
// built for AVX2 + FMA + F16C (loader.py's CPU_CFLAGS); their AVX-512 (and AVX512-BF16) functions
// carry target attributes and run only where cpu_has_avx512() (cpu_has_avx512_bf16()) says so,
// so one build (an image's) runs on any of these hosts.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>

// The target attribute of the kernels' AVX-512 functions (and of what they inline).
#define CONVEYOR_AVX512 \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))
// ... and of those that use the bf16 dot products (vdpbf16ps: Cooper Lake, Sapphire Rapids, Zen 4).
#define CONVEYOR_AVX512_BF16 \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace conveyor_native {

// The `isa` argument of the kernels: the widest path this CPU runs, or one forced (A/B, tests).
constexpr int64_t kIsaAuto = 0, kIsaAvx2 = 1, kIsaAvx512 = 2;

inline bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// The fp16 <-> fp32 conversions of an fp16 KV pool (every AVX2 CPU has them).
inline bool cpu_has_f16c() { return __builtin_cpu_supports("f16c"); }

// AVX-512 F, DQ, BW and VL (every AVX-512 CPU since Skylake-SP has the four).
inline bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

inline bool cpu_has_avx512_vnni() {
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
}

inline bool cpu_has_avx512_bf16() {
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// kIsaAuto, kIsaAvx2 or kIsaAvx512 -> the path that runs (kIsaAvx2 or kIsaAvx512); refuses a
// value out of range and a path this CPU lacks. `kernel` names the caller in the message.
inline int64_t resolve_isa(int64_t isa, const char* kernel) {
  TORCH_CHECK(isa >= kIsaAuto && isa <= kIsaAvx512,
              "isa must be 0 (auto), 1 (AVX2) or 2 (AVX-512), got ", isa);
  TORCH_CHECK(cpu_has_avx2(), kernel, " needs AVX2 and FMA; this CPU lacks them");
  if (isa == kIsaAuto) isa = cpu_has_avx512() ? kIsaAvx512 : kIsaAvx2;
  TORCH_CHECK(isa != kIsaAvx512 || cpu_has_avx512(),
              "AVX-512 asked for but this CPU lacks avx512f/dq/bw/vl");
  return isa;
}

inline std::string isa_name(int64_t isa, const char* kernel) {
  return resolve_isa(isa, kernel) == kIsaAvx512 ? "avx512" : "avx2";
}

// The bf16 kernels' paths: kIsaAvx512Bf16 multiplies bf16 pairs in vdpbf16ps; the others widen
// bf16 to fp32 and use FMAs (kIsaAvx512, kIsaAvx2).
constexpr int64_t kIsaAvx512Bf16 = 3;

// kIsaAuto .. kIsaAvx512Bf16 -> the path that runs: auto takes the widest this CPU has; a forced
// path this CPU lacks is refused.
inline int64_t resolve_bf16_isa(int64_t isa, const char* kernel) {
  TORCH_CHECK(isa >= kIsaAuto && isa <= kIsaAvx512Bf16,
              "isa must be 0 (auto), 1 (AVX2), 2 (AVX-512) or 3 (AVX512-BF16), got ", isa);
  if (isa == kIsaAuto && cpu_has_avx512_bf16()) return kIsaAvx512Bf16;
  if (isa != kIsaAvx512Bf16) return resolve_isa(isa, kernel);
  TORCH_CHECK(cpu_has_avx512_bf16(), "AVX512-BF16 asked for but this CPU lacks avx512bf16");
  return isa;
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The mask of a 16-lane vector's first n lanes (all 16 from n = 16 up): a masked tail.
inline __mmask16 first_lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// The sums of a, b, c, d (16 lanes each) in lanes 0..3.
CONVEYOR_AVX512 inline __m128 reduce4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 128-bit lanes: ab = [a0+a2, a1+a3, b0+b2, b1+b3], then abcd = [a, b, c, d] (4 floats each)
  const __m512 ab =
      _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd =
      _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 x =
      _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));  // each: its lane's sum
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), x));
}

}  // namespace conveyor_native
