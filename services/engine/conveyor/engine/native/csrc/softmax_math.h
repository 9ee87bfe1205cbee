// What the attention kernels' online softmax shares: e^x for x <= 0 (8 and 16 lanes) and the
// 8-lane maximum.
#pragma once

#include <immintrin.h>

#include "cpu_isa.h"

namespace conveyor_native {

// e^x for x <= 0 (softmax after the max is subtracted): 2^n * p(r), x = n ln2 + r,
// |r| <= ln2 / 2, p the degree-7 Taylor polynomial (relative error < 2e-8 before rounding).
// x below -87 (a masked score, -inf) gives e^-87, not 0.
constexpr float kLog2e = 1.44269504f, kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;
constexpr float kExpPoly[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                              1.0f / 6,    0.5f,       1.0f,       1.0f};  // highest first

inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// e^x for x <= 0, as exp_nonpositive (same reduction and polynomial), 16 lanes.
CONVEYOR_AVX512 inline __m512 exp_nonpositive512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

}  // namespace conveyor_native
