// Decode attention (one query token per sequence) read in place from the paged KV pool.
//
// Pool layout (attention/__init__.py): kv_cache [2, num_blocks, block_size, Hkv, D], fp32.
// Work items are (sequence, kv head) pairs, split into contiguous ranges over the intra-op
// threads. A thread walks its items block column by block column, so sequences that share
// physical blocks (a cached prefix) read each shared block back to back while it is in L1
// rather than once per sequence from DRAM.
// Per sequence: the G = H / Hkv query heads of the kv head, an online softmax per block.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x for x <= 0 (softmax after the max is subtracted): 2^n * p(r), x = n ln2 + r,
// |r| <= ln2 / 2, p the degree-7 Taylor polynomial (relative error < 2e-8 before rounding).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The four horizontal sums of a, b, c, d as one vector.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// The eight horizontal sums of a[0..7] as one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

struct Pool {
  const float* keys;
  const float* values;
  int64_t block_stride;  // floats per block of one half (block_size * Hkv * D)
  int64_t token_stride;  // floats per token (Hkv * D)
  int64_t block_size;
};

// Softmax state of one (sequence, kv head): G running maxima, sums and outputs.
struct RowState {
  float* max;  // [G]
  float* sum;  // [G]
  float* acc;  // [G, D]
};

// scores[g][t] = q[g] . k[t] for the block's tokens t0..t1 (q already scaled).
template <int D>
void block_scores(const float* q, const float* k, int64_t token_stride, int64_t t0, int64_t t1,
                  int64_t G, int64_t bs, float* scores) {
  constexpr int C = D / 8;
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(q + g * D + 8 * c);
    float* s = scores + g * bs;
    int64_t t = t0;
    for (; t + 8 <= t1; t += 8) {  // eight independent FMA chains hide the FMA latency
      const float* k0 = k + t * token_stride;
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + g * D + 8 * c);
        for (int j = 0; j < 8; ++j)
          a[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + j * token_stride + 8 * c), a[j]);
      }
      _mm256_storeu_ps(s + t, hsum8(a));
    }
    for (; t + 4 <= t1; t += 4) {
      const float* k0 = k + t * token_stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int c = 0; c < C; ++c) {
        a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a0);
        a1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + token_stride + 8 * c), a1);
        a2 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 2 * token_stride + 8 * c), a2);
        a3 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 3 * token_stride + 8 * c), a3);
      }
      _mm_storeu_ps(s + t, hsum4(a0, a1, a2, a3));
    }
    for (; t < t1; ++t) {
      const float* k0 = k + t * token_stride;
      __m256 a = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a);
      s[t] = hsum(a);
    }
  }
}

// Fold one block's tokens t0..t1 into the state: scores become probabilities, the
// running outputs are rescaled by the new maxima and accumulate sum_t p[t] * v[t].
template <int D>
void block_update(const float* v, int64_t token_stride, int64_t t0, int64_t t1, int64_t G,
                  int64_t bs, float* scores, RowState st) {
  constexpr int C = D / 8;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * bs;
    __m256 vmax = _mm256_set1_ps(kNegInf);
    int64_t t = t0;
    for (; t + 8 <= t1; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    float block_max = hmax(vmax);
    for (; t < t1; ++t) block_max = std::max(block_max, s[t]);
    const float new_max = std::max(st.max[g], block_max);
    // 0 for the first block; 1 (no exp) while the running maximum holds
    const float correction = new_max == st.max[g] ? 1.0f : std::exp(st.max[g] - new_max);
    st.max[g] = new_max;
    const __m256 m = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    for (t = t0; t + 8 <= t1; t += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
      vsum = _mm256_add_ps(vsum, p);
      _mm256_storeu_ps(s + t, p);
    }
    float block_sum = hsum(vsum);
    if (t < t1) {
      alignas(32) float tail[8];
      for (int i = 0; i < 8; ++i) tail[i] = t + i < t1 ? s[t + i] - new_max : kNegInf;
      _mm256_store_ps(tail, exp_nonpositive(_mm256_load_ps(tail)));
      for (int64_t i = 0; t + i < t1; ++i) {
        s[t + i] = tail[i];
        block_sum += tail[i];
      }
    }
    st.sum[g] = st.sum[g] * correction + block_sum;
    float* acc = st.acc + g * D;
    __m256 a[C];
    const __m256 corr = _mm256_set1_ps(correction);
    for (int c = 0; c < C; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), corr);
    for (t = t0; t < t1; ++t) {
      const __m256 p = _mm256_set1_ps(s[t]);
      const float* v0 = v + t * token_stride;
      for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v0 + 8 * c), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
  }
}

// Ask for one head's K and V rows of a block (tokens t0..t1) ahead of their use.
template <int D>
inline void prefetch_block(const Pool& pool, int64_t offset, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* k = pool.keys + offset + t * pool.token_stride;
    const float* v = pool.values + offset + t * pool.token_stride;
    for (int line = 0; line < D; line += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(k + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + line), _MM_HINT_T0);
    }
  }
}

struct Batch {
  const float* query;        // [N, H, D]
  float* out;                // [N, H, D]
  const int32_t* tables;     // [N, W]
  const int64_t* seq_lens;   // [N]
  int64_t table_width, num_heads, num_kv_heads, sliding_window;
  float scale;
};

// Work items begin..end, item = request * Hkv + kv head, walked block column by block
// column: the items of one request read one block's heads back to back (contiguous
// memory), and requests that share the block at a column read it while it is in L1.
template <int D>
void attend_items(const Pool& pool, const Batch& batch, int64_t begin, int64_t end) {
  const int64_t Hkv = batch.num_kv_heads, G = batch.num_heads / Hkv, n = end - begin;
  const int64_t bs = pool.block_size;
  std::vector<float> q(n * G * D), acc(n * G * D, 0.0f), max(n * G, kNegInf), sum(n * G, 0.0f);
  std::vector<float> scores(G * bs);
  int64_t max_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = (begin + i) / Hkv, h = (begin + i) % Hkv;
    max_blocks = std::max(max_blocks, (batch.seq_lens[b] + bs - 1) / bs);
    const float* src = batch.query + (b * batch.num_heads + h * G) * D;
    for (int64_t j = 0; j < G * D; ++j) q[i * G * D + j] = src[j] * batch.scale;
  }
  // Where item i's block at column col is, and its tokens t0..t1 (false: none to read).
  auto locate = [&](int64_t i, int64_t col, int64_t& offset, int64_t& t0, int64_t& t1) {
    const int64_t b = (begin + i) / Hkv, h = (begin + i) % Hkv, len = batch.seq_lens[b];
    const int64_t first =
        batch.sliding_window > 0 ? std::max<int64_t>(0, len - batch.sliding_window) : 0;
    if (col * bs >= len || (col + 1) * bs <= first) return false;
    offset = batch.tables[b * batch.table_width + col] * pool.block_stride + h * D;
    t0 = std::max<int64_t>(0, first - col * bs);
    t1 = std::min(bs, len - col * bs);
    return true;
  };
  int64_t offset, t0, t1, next_offset, next_t0, next_t1;
  for (int64_t col = 0; col < max_blocks; ++col) {
    for (int64_t i = 0; i < n; ++i) {
      if (!locate(i, col, offset, t0, t1)) continue;
      // The next item's block (the one after it in this walk), fetched while this one computes.
      if (i + 1 < n ? locate(i + 1, col, next_offset, next_t0, next_t1)
                    : col + 1 < max_blocks && locate(0, col + 1, next_offset, next_t0, next_t1))
        prefetch_block<D>(pool, next_offset, next_t0, next_t1);
      block_scores<D>(q.data() + i * G * D, pool.keys + offset, pool.token_stride, t0, t1, G, bs,
                      scores.data());
      block_update<D>(pool.values + offset, pool.token_stride, t0, t1, G, bs, scores.data(),
                      RowState{max.data() + i * G, sum.data() + i * G, acc.data() + i * G * D});
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = (begin + i) / Hkv, h = (begin + i) % Hkv;
    float* dst = batch.out + (b * batch.num_heads + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / sum[i * G + g];
      for (int64_t d = 0; d < D; ++d) dst[g * D + d] = acc[(i * G + g) * D + d] * inv;
    }
  }
}

template <int D>
void attend(const Pool& pool, const Batch& batch, int64_t num_seqs) {
  at::parallel_for(0, num_seqs * batch.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    attend_items<D>(pool, batch, begin, end);
  });
}

}  // namespace

// out[n] = softmax(q[n] K^T * scale) V over the first seq_lens[n] tokens of sequence n's
// blocks (the last sliding_window of them when sliding_window > 0).
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                            int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && query.scalar_type() == at::kFloat,
              "query must be a contiguous float32 [N, H, D] tensor");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
              out.scalar_type() == at::kFloat, "out must be a contiguous float32 like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
              kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be a contiguous float32 [2, blocks, block_size, Hkv, D] tensor");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "kv_cache head_dim differs from the query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
              block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt,
              "block_tables must be a contiguous int32 [N, W] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs && seq_lens.is_contiguous() &&
              seq_lens.scalar_type() == at::kLong, "seq_lens must be a contiguous int64 [N]");
  const int64_t block_size = kv_cache.size(2);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t n = 0; n < num_seqs; ++n) {
    TORCH_CHECK(lens[n] >= 1 && lens[n] <= block_tables.size(1) * block_size,
                "seq_lens[", n, "] = ", lens[n], " is outside 1..", block_tables.size(1) * block_size);
    for (int64_t col = 0; col * block_size < lens[n]; ++col) {
      const int32_t block = tables[n * block_tables.size(1) + col];
      TORCH_CHECK(block >= 0 && block < kv_cache.size(1), "block_tables[", n, ", ", col, "] = ",
                  block, " is not a block of the pool (", kv_cache.size(1), " blocks)");
    }
  }
  const float* base = kv_cache.data_ptr<float>();
  const int64_t half = kv_cache.stride(0);
  const Pool pool{base, base + half, kv_cache.stride(1), kv_cache.stride(2), block_size};
  const Batch batch{query.data_ptr<float>(), out.data_ptr<float>(),
                    tables, lens, block_tables.size(1), num_heads,
                    num_kv_heads, sliding_window, static_cast<float>(scale)};
  switch (head_dim) {
    case 32: return attend<32>(pool, batch, num_seqs);
    case 64: return attend<64>(pool, batch, num_seqs);
    case 128: return attend<128>(pool, batch, num_seqs);
    default: TORCH_CHECK(false, "head_dim ", head_dim, " is not one of 32, 64, 128");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention read in place from the paged KV pool (fp32, AVX2+FMA)");
}
