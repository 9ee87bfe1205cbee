// Loading float, fp16 and bf16 elements as fp32 vectors and storing fp32 vectors back as any of
// the three: what the kernels share so that one body serves an fp32 model, a bf16 model and a
// 16-bit KV pool. All arithmetic stays fp32; 16-bit elements are widened as they are loaded.
//
// Rounding to bf16 is torch's (c10::BFloat16's round_to_nearest_even, bit for bit: ties to
// even, NaN to 0x7FC0, overflow to inf), in integer ops, so no AVX512-BF16 is needed and the
// AVX2 and AVX-512 paths round alike. Rounding to fp16 is F16C's, which is torch's too.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_isa.h"

namespace conveyor_native {

// ---- 8 lanes (AVX2 + F16C) --------------------------------------------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the high half of an fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The bf16 bit patterns of v's lanes (round to nearest even, NaN 0x7FC0) in the low 16 bits of
// each 32-bit lane.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i b = bf16_bits8(v);  // each lane < 2^16: the unsigned pack keeps it
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// n elements from src into dst as fp32 ([float, Half, BFloat16] -> float), n any.
template <typename T>
inline void widen(const T* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n fp32 values into dst as T (rounded where T is narrower), n any.
template <typename T>
inline void narrow(const float* src, int64_t n, T* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// n elements of type S from src into dst as type T: a copy when the types are the same, else
// widened to fp32 and rounded to T (what torch's .to(T) gives).
template <typename S, typename T>
inline void convert(const S* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i));
    for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
  }
}

// ---- 16 lanes (AVX-512 code only) ---------------------------------------------------------

CONVEYOR_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
CONVEYOR_AVX512 inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
CONVEYOR_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The first n (< 16) lanes from p, the rest 0.
CONVEYOR_AVX512 inline __m512 load16_first(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
CONVEYOR_AVX512 inline __m512 load16_first(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

CONVEYOR_AVX512 inline __m256i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

CONVEYOR_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
CONVEYOR_AVX512 inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits16(v));
}
CONVEYOR_AVX512 inline void store16_first(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
CONVEYOR_AVX512 inline void store16_first(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, bf16_bits16(v));
}

}  // namespace conveyor_native
