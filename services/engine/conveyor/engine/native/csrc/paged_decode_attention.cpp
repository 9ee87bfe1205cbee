// Decode attention (one query token per sequence) read in place from the paged KV pool.
//
// Pool layout (attention/__init__.py): kv_cache [2, num_blocks, block_size, Hkv, D], fp32, fp16
// or bf16 (widened to fp32 as it is loaded; the cascade widens a shared 16-bit block once for its
// group). Queries and outputs are fp32 or bf16 (a bf16 model's), read into fp32 scratch and
// written back rounded; all arithmetic is fp32.
// Work items are (sequence, kv head) pairs, split into contiguous ranges over the intra-op
// threads. A thread walks its items block column by block column, so sequences that share
// physical blocks (a cached prefix) read each shared block back to back while it is in L1
// rather than once per sequence from DRAM.
// Per sequence: the G = H / Hkv query heads of the kv head, an online softmax per block.
//
// Two paths, chosen at run time (the library is built for AVX2 + FMA; the AVX-512 functions
// carry a target attribute, so one build runs on either kind of host):
//   AVX2     per item: G rows of scores over 8-lane dot products, then the values.
//   cascade  (AVX-512) per block column, the items of one kv head whose block and token range
//            are the same (requests sharing a cached prefix) form a group. A group of more
//            than 8 query rows takes the lane layout: 16 rows per zmm (a last 8 in a ymm),
//            scores as rows x keys with each key element broadcast (no horizontal sums),
//            softmax across the tokens' vectors, values accumulated 6 rows at a time, so
//            each key and value row is loaded once for all the group's rows; each row keeps
//            its own online softmax state. Smaller groups (a request's own blocks) take the
//            per-item code in 16 lanes (path 3, the default) or the AVX2 one (path 2, the
//            A/B baseline: as fast where zmm FMAs retire at half the ymm rate).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "paged_pool.h"
#include "softmax_math.h"

namespace {

using conveyor_native::cpu_has_avx512;
using conveyor_native::Pool;
using conveyor_native::exp_nonpositive;
using conveyor_native::exp_nonpositive512;
using conveyor_native::first_lanes16;
using conveyor_native::hmax;
using conveyor_native::horizontal_sum;
using conveyor_native::load16;
using conveyor_native::load8;
using conveyor_native::prefetch_row;
using conveyor_native::reduce4_512;
using conveyor_native::widen_rows;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// Softmax state of one (sequence, kv head): G running maxima, sums and outputs.
struct RowState {
  float* max;  // [G]
  float* sum;  // [G]
  float* acc;  // [G, D]
};

// scores[g][t] = q[g] . k[t] for the block's tokens t0..t1 (q already scaled).
template <int D, typename T>
void block_scores(const float* q, const T* k, int64_t token_stride, int64_t t0, int64_t t1,
                  int64_t G, int64_t bs, float* scores) {
  constexpr int C = D / 8;
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(q + g * D + 8 * c);
    float* s = scores + g * bs;
    int64_t t = t0;
    for (; t + 8 <= t1; t += 8) {  // eight independent FMA chains hide the FMA latency
      const T* k0 = k + t * token_stride;
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + g * D + 8 * c);
        for (int j = 0; j < 8; ++j)
          a[j] = _mm256_fmadd_ps(qc, load8(k0 + j * token_stride + 8 * c), a[j]);
      }
      _mm256_storeu_ps(s + t, hsum8(a));
    }
    for (; t + 4 <= t1; t += 4) {
      const T* k0 = k + t * token_stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int c = 0; c < C; ++c) {
        a0 = _mm256_fmadd_ps(qv[c], load8(k0 + 8 * c), a0);
        a1 = _mm256_fmadd_ps(qv[c], load8(k0 + token_stride + 8 * c), a1);
        a2 = _mm256_fmadd_ps(qv[c], load8(k0 + 2 * token_stride + 8 * c), a2);
        a3 = _mm256_fmadd_ps(qv[c], load8(k0 + 3 * token_stride + 8 * c), a3);
      }
      _mm_storeu_ps(s + t, hsum4(a0, a1, a2, a3));
    }
    for (; t < t1; ++t) {
      const T* k0 = k + t * token_stride;
      __m256 a = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) a = _mm256_fmadd_ps(qv[c], load8(k0 + 8 * c), a);
      s[t] = horizontal_sum(a);
    }
  }
}

// Fold one block's tokens t0..t1 into the state: scores become probabilities, the
// running outputs are rescaled by the new maxima and accumulate sum_t p[t] * v[t].
template <int D, typename T>
void block_update(const T* v, int64_t token_stride, int64_t t0, int64_t t1, int64_t G,
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
    float block_sum = horizontal_sum(vsum);
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
      const T* v0 = v + t * token_stride;
      for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(p, load8(v0 + 8 * c), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
  }
}

// ---------------------------------------------------------------------------------------------
// The per-item code in 16 lanes (AVX-512): block_scores and block_update with zmm, for the
// groups the cascade leaves to one item (a request's own blocks). Same arithmetic in another
// order of sums; a key or value row's D elements are D / 16 loads. The item's G query rows
// go in tiles of up to kTileRows<D> rows that share each key and value load (a 16-bit pool's
// row is widened once for the tile, not once per query head).

// Query rows a tile holds: its value accumulators, rows x D / 16, stay within 16 registers.
template <int D>
constexpr int kTileRows = D <= 64 ? 4 : (D == 128 ? 2 : 1);

// s[r * bs + j] = q[r] . k[j] for the tile's R rows and J (1, 4 or 8) tokens from k0: R x J
// independent FMA chains, each key chunk loaded (widened) once for the R rows.
template <int D, int R, int J, typename T>
CONVEYOR_AVX512 inline void tile_token_scores512(const float* q, const T* k0,
                                                 int64_t token_stride, int64_t bs, float* s) {
  __m512 a[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) a[r][j] = _mm512_setzero_ps();
  for (int c = 0; c < D / 16; ++c)
    for (int j = 0; j < J; ++j) {
      const __m512 kc = load16(k0 + j * token_stride + 16 * c);
      for (int r = 0; r < R; ++r)
        a[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + 16 * c), kc, a[r][j]);
    }
  for (int r = 0; r < R; ++r) {
    if constexpr (J == 1) {
      s[r * bs] = _mm512_reduce_add_ps(a[r][0]);
    } else {
      for (int j = 0; j < J; j += 4)
        _mm_storeu_ps(s + r * bs + j, reduce4_512(a[r][j], a[r][j + 1], a[r][j + 2], a[r][j + 3]));
    }
  }
}

// scores[r][t] = q[r] . k[t] for the tile's R rows and the block's tokens t0..t1: 8 tokens at a
// time while the tile has at most 2 rows (enough chains to hide the FMA latency), else 4; then
// one by one.
template <int D, int R, typename T>
CONVEYOR_AVX512 void tile_scores512(const float* q, const T* k, int64_t token_stride, int64_t t0,
                                    int64_t t1, int64_t bs, float* scores) {
  constexpr int J = R <= 2 ? 8 : 4;
  int64_t t = t0;
  for (; t + J <= t1; t += J)
    tile_token_scores512<D, R, J>(q, k + t * token_stride, token_stride, bs, scores + t);
  for (; t < t1; ++t)
    tile_token_scores512<D, R, 1>(q, k + t * token_stride, token_stride, bs, scores + t);
}

// One row's block softmax: its scores s[t0..t1] become exp(s - new max) in place, masked 16 at a
// time; its running max and sum move on. Returns the correction its output takes (0 for the
// first block; 1, with no exp, while the running maximum holds).
CONVEYOR_AVX512 inline float row_softmax512(float* s, int64_t t0, int64_t t1, float& row_max,
                                            float& row_sum) {
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t t = t0; t < t1; t += 16) {
    const __mmask16 m = first_lanes16(t1 - t);
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), m, s + t));
  }
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(vmax));
  const float correction = new_max == row_max ? 1.0f : std::exp(row_max - new_max);
  row_max = new_max;
  const __m512 m = _mm512_set1_ps(new_max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; t += 16) {
    const __mmask16 k = first_lanes16(t1 - t);
    const __m512 p = exp_nonpositive512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    vsum = _mm512_mask_add_ps(vsum, k, vsum, p);
    _mm512_mask_storeu_ps(s + t, k, p);
  }
  row_sum = row_sum * correction + _mm512_reduce_add_ps(vsum);
  return correction;
}

// acc[r] = acc[r] * correction[r] + sum_t p[r][t] * v[t] for the tile's R rows (p = scores, bs
// floats a row): each value chunk loaded (widened) once for the R rows, accumulated in two sets
// of chains (even and odd tokens) where R x D / 16 chains alone would wait on the FMA latency.
template <int D, int R, typename T>
CONVEYOR_AVX512 void tile_values512(const T* v, int64_t token_stride, int64_t t0, int64_t t1,
                                    int64_t bs, const float* p, const float* correction,
                                    float* acc) {
  constexpr int C = D / 16;
  constexpr int S = R * C <= 8 ? 2 : 1;  // accumulator sets
  __m512 a[S][R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      a[0][r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c),
                                 _mm512_set1_ps(correction[r]));
      if constexpr (S == 2) a[1][r][c] = _mm512_setzero_ps();
    }
  int64_t t = t0;
  for (; t + S <= t1; t += S)
    for (int u = 0; u < S; ++u) {
      const T* v0 = v + (t + u) * token_stride;
      for (int c = 0; c < C; ++c) {
        const __m512 vc = load16(v0 + 16 * c);
        for (int r = 0; r < R; ++r)
          a[u][r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * bs + t + u]), vc, a[u][r][c]);
      }
    }
  for (; t < t1; ++t) {
    const T* v0 = v + t * token_stride;
    for (int c = 0; c < C; ++c) {
      const __m512 vc = load16(v0 + 16 * c);
      for (int r = 0; r < R; ++r)
        a[0][r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * bs + t]), vc, a[0][r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if constexpr (S == 2) a[0][r][c] = _mm512_add_ps(a[0][r][c], a[1][r][c]);
      _mm512_storeu_ps(acc + r * D + 16 * c, a[0][r][c]);
    }
}

// One tile of R rows (query q, state st, scores at `scores`, bs floats a row) over one block.
template <int D, int R, typename T>
CONVEYOR_AVX512 void tile_block512(const float* q, const T* k, const T* v, int64_t token_stride,
                                   int64_t t0, int64_t t1, int64_t bs, float* scores,
                                   RowState st) {
  tile_scores512<D, R>(q, k, token_stride, t0, t1, bs, scores);
  float correction[R];
  for (int r = 0; r < R; ++r)
    correction[r] = row_softmax512(scores + r * bs, t0, t1, st.max[r], st.sum[r]);
  tile_values512<D, R>(v, token_stride, t0, t1, bs, scores, correction, st.acc);
}

// block_scores + block_update in 16 lanes: the item's G rows in tiles of up to kTileRows<D>.
template <int D, typename T>
CONVEYOR_AVX512 void item_block512(const float* q, const T* k, const T* v, int64_t token_stride,
                                   int64_t t0, int64_t t1, int64_t G, int64_t bs, float* scores,
                                   RowState st) {
  for (int64_t g = 0; g < G;) {
    const int64_t r = std::min<int64_t>(G - g, kTileRows<D>);
    const RowState tile{st.max + g, st.sum + g, st.acc + g * D};
    const float* qg = q + g * D;
    switch (r) {
      case 4: tile_block512<D, kTileRows<D> >= 4 ? 4 : 1>(qg, k, v, token_stride, t0, t1, bs,
                                                          scores, tile); break;
      case 3: tile_block512<D, kTileRows<D> >= 3 ? 3 : 1>(qg, k, v, token_stride, t0, t1, bs,
                                                          scores, tile); break;
      case 2: tile_block512<D, kTileRows<D> >= 2 ? 2 : 1>(qg, k, v, token_stride, t0, t1, bs,
                                                          scores, tile); break;
      default: tile_block512<D, 1>(qg, k, v, token_stride, t0, t1, bs, scores, tile); break;
    }
    g += r;
  }
}

// Ask for one head's K and V rows of a block (tokens t0..t1) ahead of their use.
template <int D, typename T>
inline void prefetch_block(const Pool<T>& pool, int64_t offset, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_row(pool.keys + offset + t * pool.token_stride, D);
    prefetch_row(pool.values + offset + t * pool.token_stride, D);
  }
}

// Q: the queries' and outputs' element type (float, or at::BFloat16 for a bf16 model; read
// into fp32 scratch, written back rounded).
template <typename Q>
struct Batch {
  const Q* query;            // [N, H, D], rows query_stride elements apart
  Q* out;                    // [N, H, D]
  const int32_t* tables;     // [N, W]
  const int64_t* seq_lens;   // [N]
  int64_t table_width, num_heads, num_kv_heads, sliding_window;
  float scale;
  int64_t query_stride;
};

// Work items begin..end, item = request * Hkv + kv head, walked block column by block
// column: the items of one request read one block's heads back to back (contiguous
// memory), and requests that share the block at a column read it while it is in L1.
template <int D, typename T, typename Q>
void attend_items(const Pool<T>& pool, const Batch<Q>& batch, int64_t begin, int64_t end) {
  const int64_t Hkv = batch.num_kv_heads, G = batch.num_heads / Hkv, n = end - begin;
  const int64_t bs = pool.block_size;
  std::vector<float> q(n * G * D), acc(n * G * D, 0.0f), max(n * G, kNegInf), sum(n * G, 0.0f);
  std::vector<float> scores(G * bs);
  int64_t max_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = (begin + i) / Hkv, h = (begin + i) % Hkv;
    max_blocks = std::max(max_blocks, (batch.seq_lens[b] + bs - 1) / bs);
    const Q* src = batch.query + b * batch.query_stride + h * G * D;
    for (int64_t j = 0; j < G * D; ++j)
      q[i * G * D + j] = static_cast<float>(src[j]) * batch.scale;
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
    Q* dst = batch.out + (b * batch.num_heads + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / sum[i * G + g];
      for (int64_t d = 0; d < D; ++d)
        dst[g * D + d] = static_cast<Q>(acc[(i * G + g) * D + d] * inv);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The cascade (AVX-512).

// A group: the query rows of the items whose block at a column is the same (block id, kv
// head, token range). Row j is grp.row[j] of the thread's rows: its query q[row * D] (scaled),
// its state max[row], sum[row], acc[row * D]. Item i holds rows i * G .. i * G + G - 1.
struct Group {
  const int32_t* row;
  int64_t num_rows;
  const float* q;
  float* acc;
  float* max;
  float* sum;
};

// The lane layout's scratch: the group's queries transposed, qt[d * rp + j] = q[row j][d]
// (rp: the rows rounded up to 8, padding 0), kept while the kv head's next group has the same
// rows (a shared prefix: every column); the scores st[t * rp + j] (then probabilities); the
// rows' max, sum and output corrections gathered. One per kv head, whose groups alternate.
struct LaneScratch {
  std::vector<float> qt, st, max, sum, correction;
  std::vector<float> keys, values;  // a 16-bit pool's block widened: [block_size][D] each
  std::vector<int32_t> rows;  // the rows qt holds
};

constexpr int64_t kLaneRows = 8;  // groups of more rows take the lane layout

template <int D>
void transpose_queries(const Group& grp, int64_t rp, LaneScratch& ls) {
  if (ls.rows.size() == static_cast<size_t>(grp.num_rows) &&
      std::equal(ls.rows.begin(), ls.rows.end(), grp.row))
    return;
  ls.rows.assign(grp.row, grp.row + grp.num_rows);
  ls.qt.assign(D * rp, 0.0f);
  for (int64_t j = 0; j < grp.num_rows; ++j) {
    const float* q = grp.q + grp.row[j] * D;
    for (int64_t d = 0; d < D; ++d) ls.qt[d * rp + j] = q[d];
  }
}

// st[t][rows lane0 ..] = the scores of NL (1, 2) * 16 rows (zmm) and, with HALF, 8 more
// (ymm) for the block's tokens t0..t1, 4 tokens at a time (a token past t1 repeats the last
// one; st has room for 4 rows past the block): rows in the lanes, each key element broadcast,
// no horizontal sums. Accumulators are named, not an array, and the function is not inlined:
// GCC 12 otherwise keeps them in memory and the pointers in vector registers.
template <int D, int NL, bool HALF>
__attribute__((noinline)) CONVEYOR_AVX512 void scores_lanes512(
    const float* qt, int64_t rp, int64_t lane0, const float* k, int64_t token_stride,
    int64_t t0, int64_t t1, float* st) {
  static_assert(NL == 1 || NL == 2, "one or two zmm blocks of rows");
  for (int64_t t = t0; t < t1; t += 4) {
    const float* k0 = k + t * token_stride;
    const float* k1 = k + std::min(t + 1, t1 - 1) * token_stride;
    const float* k2 = k + std::min(t + 2, t1 - 1) * token_stride;
    const float* k3 = k + std::min(t + 3, t1 - 1) * token_stride;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // rows 0..15, tokens 0..3
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                   // rows 16..31
    __m256 h0 = _mm256_setzero_ps(), h1 = h0, h2 = h0, h3 = h0;  // the 8 rows after them
    const float* qd = qt + lane0;
    for (int d = 0; d < D; ++d, qd += rp) {
      const __m512 k0d = _mm512_set1_ps(k0[d]), k1d = _mm512_set1_ps(k1[d]);
      const __m512 k2d = _mm512_set1_ps(k2[d]), k3d = _mm512_set1_ps(k3[d]);
      const __m512 q0 = _mm512_loadu_ps(qd);
      a0 = _mm512_fmadd_ps(q0, k0d, a0);
      a1 = _mm512_fmadd_ps(q0, k1d, a1);
      a2 = _mm512_fmadd_ps(q0, k2d, a2);
      a3 = _mm512_fmadd_ps(q0, k3d, a3);
      if constexpr (NL == 2) {
        const __m512 q1 = _mm512_loadu_ps(qd + 16);
        b0 = _mm512_fmadd_ps(q1, k0d, b0);
        b1 = _mm512_fmadd_ps(q1, k1d, b1);
        b2 = _mm512_fmadd_ps(q1, k2d, b2);
        b3 = _mm512_fmadd_ps(q1, k3d, b3);
      }
      if constexpr (HALF) {
        const __m256 q8 = _mm256_loadu_ps(qd + 16 * NL);
        h0 = _mm256_fmadd_ps(q8, _mm512_castps512_ps256(k0d), h0);
        h1 = _mm256_fmadd_ps(q8, _mm512_castps512_ps256(k1d), h1);
        h2 = _mm256_fmadd_ps(q8, _mm512_castps512_ps256(k2d), h2);
        h3 = _mm256_fmadd_ps(q8, _mm512_castps512_ps256(k3d), h3);
      }
    }
    float* s = st + t * rp + lane0;
    _mm512_storeu_ps(s, a0);
    _mm512_storeu_ps(s + rp, a1);
    _mm512_storeu_ps(s + 2 * rp, a2);
    _mm512_storeu_ps(s + 3 * rp, a3);
    if constexpr (NL == 2) {
      _mm512_storeu_ps(s + 16, b0);
      _mm512_storeu_ps(s + rp + 16, b1);
      _mm512_storeu_ps(s + 2 * rp + 16, b2);
      _mm512_storeu_ps(s + 3 * rp + 16, b3);
    }
    if constexpr (HALF) {
      _mm256_storeu_ps(s + 16 * NL, h0);
      _mm256_storeu_ps(s + rp + 16 * NL, h1);
      _mm256_storeu_ps(s + 2 * rp + 16 * NL, h2);
      _mm256_storeu_ps(s + 3 * rp + 16 * NL, h3);
    }
  }
}

// The online softmax in the lane layout: 16 rows per vector (the last 8 masked where rp
// ends there), the block's maximum and sum taken across its tokens' vectors.
CONVEYOR_AVX512 void softmax_lanes512(const Group& grp, int64_t rp, int64_t t0, int64_t t1,
                                      LaneScratch& ls) {
  ls.max.assign(rp, 0.0f);
  ls.sum.assign(rp, 0.0f);
  ls.correction.resize(rp);
  for (int64_t j = 0; j < grp.num_rows; ++j) {
    ls.max[j] = grp.max[grp.row[j]];
    ls.sum[j] = grp.sum[grp.row[j]];
  }
  float* st = ls.st.data();
  for (int64_t l = 0; l < rp; l += 16) {
    const __mmask16 m = rp - l >= 16 ? 0xFFFF : 0x00FF;
    const __m512 old_max = _mm512_maskz_loadu_ps(m, ls.max.data() + l);
    __m512 block_max = _mm512_set1_ps(kNegInf);
    for (int64_t t = t0; t < t1; ++t)
      block_max = _mm512_max_ps(block_max, _mm512_maskz_loadu_ps(m, st + t * rp + l));
    const __m512 new_max = _mm512_max_ps(old_max, block_max);
    // e^-87 (not 0) for the first block, where sum and output are still 0; 1 while it holds
    const __m512 correction = exp_nonpositive512(_mm512_sub_ps(old_max, new_max));
    __m512 block_sum = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      const __m512 s = _mm512_maskz_loadu_ps(m, st + t * rp + l);
      const __m512 p = exp_nonpositive512(_mm512_sub_ps(s, new_max));
      block_sum = _mm512_add_ps(block_sum, p);
      _mm512_mask_storeu_ps(st + t * rp + l, m, p);
    }
    const __m512 sum = _mm512_maskz_loadu_ps(m, ls.sum.data() + l);
    _mm512_mask_storeu_ps(ls.max.data() + l, m, new_max);
    _mm512_mask_storeu_ps(ls.sum.data() + l, m, _mm512_fmadd_ps(sum, correction, block_sum));
    _mm512_mask_storeu_ps(ls.correction.data() + l, m, correction);
  }
  for (int64_t j = 0; j < grp.num_rows; ++j) {
    grp.max[grp.row[j]] = ls.max[j];
    grp.sum[grp.row[j]] = ls.sum[j];
  }
}

// acc[row j] = acc[row j] * correction[j] + sum_t p[t][j] * v[t] for RT rows j0.. of the
// lane layout (p = st, rp floats a token), their outputs held in registers over the block.
template <int D, int RT>
CONVEYOR_AVX512 void values_tile512(const Group& grp, const LaneScratch& ls, int64_t rp,
                                    int64_t j0, const float* v, int64_t token_stride,
                                    int64_t t0, int64_t t1) {
  constexpr int C = D / 16;
  __m512 a[RT][C];
  for (int r = 0; r < RT; ++r) {
    const float* acc = grp.acc + grp.row[j0 + r] * D;
    const __m512 corr = _mm512_set1_ps(ls.correction[j0 + r]);
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), corr);
  }
  const float* p = ls.st.data() + j0;
  for (int64_t t = t0; t < t1; ++t) {
    const float* vt = v + t * token_stride;
    __m512 pt[RT];
    for (int r = 0; r < RT; ++r) pt[r] = _mm512_set1_ps(p[t * rp + r]);
    for (int c = 0; c < C; ++c) {
      const __m512 vc = _mm512_loadu_ps(vt + 16 * c);
      for (int r = 0; r < RT; ++r) a[r][c] = _mm512_fmadd_ps(pt[r], vc, a[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    float* acc = grp.acc + grp.row[j0 + r] * D;
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[r][c]);
  }
}

// Rows values_tile512 holds in registers: 24 accumulators (D 32 / 64 / 128: 8 / 6 / 3 rows).
template <int D>
constexpr int kValueRows = D == 32 ? 8 : 24 / (D / 16);

// tile<RT>(j0) over num_rows rows, RT = MaxRT while that many are left, then the rest at once.
template <int MaxRT, typename Tile>
inline void for_row_tiles(int64_t num_rows, Tile&& tile) {
  int64_t j = 0;
  for (; j + MaxRT <= num_rows; j += MaxRT) tile(std::integral_constant<int, MaxRT>{}, j);
  if constexpr (MaxRT > 1) {
    if (j < num_rows)
      for_row_tiles<MaxRT - 1>(num_rows - j, [&](auto rt, int64_t jj) { tile(rt, j + jj); });
  }
}

// Fold one block (tokens t0..t1 at offset) into every row of a group of more than kLaneRows
// rows: 16 rows per zmm (8 per ymm for a last half), each key and value loaded once for all
// (an fp16 block widened into the scratch first, once for the whole group).
template <int D, typename T>
CONVEYOR_AVX512 void group_lanes512(const Pool<T>& pool, const Group& grp, int64_t offset,
                                    int64_t t0, int64_t t1, LaneScratch& ls) {
  const float* k;
  const float* v;
  int64_t ts;
  if constexpr (std::is_same_v<T, float>) {
    k = pool.keys + offset;
    v = pool.values + offset;
    ts = pool.token_stride;
  } else {
    ls.keys.resize(pool.block_size * D);
    ls.values.resize(pool.block_size * D);
    widen_rows<D>(pool.keys + offset, pool.token_stride, t0, t1, ls.keys.data());
    widen_rows<D>(pool.values + offset, pool.token_stride, t0, t1, ls.values.data());
    k = ls.keys.data();
    v = ls.values.data();
    ts = D;
  }
  int64_t full = grp.num_rows / 16;  // zmm lane blocks; a rest of over 8 rows takes another
  const bool half = grp.num_rows % 16 > 0 && grp.num_rows % 16 <= 8;
  if (grp.num_rows % 16 > 8) ++full;
  const int64_t rp = 16 * full + (half ? 8 : 0);
  transpose_queries<D>(grp, rp, ls);
  ls.st.resize((pool.block_size + 4) * rp);
  float* st = ls.st.data();
  const float* qt = ls.qt.data();
  int64_t l = 0;
  for (; l + 2 < full || (l + 2 == full && !half); l += 2)
    scores_lanes512<D, 2, false>(qt, rp, 16 * l, k, ts, t0, t1, st);
  if (l + 1 == full && half)
    scores_lanes512<D, 1, true>(qt, rp, 16 * l, k, ts, t0, t1, st);
  else if (l + 1 == full)
    scores_lanes512<D, 1, false>(qt, rp, 16 * l, k, ts, t0, t1, st);
  else if (l + 2 == full)  // two and a half (more than 8 rows: at least one zmm block)
    scores_lanes512<D, 2, true>(qt, rp, 16 * l, k, ts, t0, t1, st);
  softmax_lanes512(grp, rp, t0, t1, ls);
  for_row_tiles<kValueRows<D>>(grp.num_rows, [&](auto rt, int64_t j0) {
    values_tile512<D, decltype(rt)::value>(grp, ls, rp, j0, v, ts, t0, t1);
  });
}

// One item's block at a column: which block, where its head's rows start, which tokens count.
struct Span {
  int32_t block = -1;  // -1: the item has no tokens at this column
  int64_t offset = 0, t0 = 0, t1 = 0;
  bool same_as(const Span& o) const { return block == o.block && t0 == o.t0 && t1 == o.t1; }
};

template <int D, typename T, typename Q>
Span span_at(const Pool<T>& pool, const Batch<Q>& batch, int64_t item, int64_t col) {
  const int64_t Hkv = batch.num_kv_heads, b = item / Hkv, h = item % Hkv;
  const int64_t len = batch.seq_lens[b], bs = pool.block_size;
  const int64_t first =
      batch.sliding_window > 0 ? std::max<int64_t>(0, len - batch.sliding_window) : 0;
  Span sp;
  if (col * bs >= len || (col + 1) * bs <= first) return sp;
  sp.block = batch.tables[b * batch.table_width + col];
  sp.offset = sp.block * pool.block_stride + h * D;
  sp.t0 = std::max<int64_t>(0, first - col * bs);
  sp.t1 = std::min(bs, len - col * bs);
  return sp;
}

// Work items begin..end as attend_items, with the cascade. Per column the items of one kv
// head whose spans are the same form a group (each compared with the last kRecentLeaders
// groups of its head, so grouping stays O(items)); groups are walked in the order of their
// first item. A group of more than kLaneRows rows (3 or more requests sharing the block at
// G = 3) takes the lane layout; smaller ones take the per-item code: in 16 lanes with
// zmm_items, else the AVX2 code (as fast on a CPU that retires half as many zmm as ymm FMAs,
// as an earlier Zen 5 VM did; where zmm FMAs run at the ymm rate the 16-lane code is faster).
template <int D, typename T, typename Q>
CONVEYOR_AVX512 void attend_items_cascade(const Pool<T>& pool, const Batch<Q>& batch,
                                          int64_t begin, int64_t end, bool zmm_items) {
  constexpr int kRecentLeaders = 4;
  const int64_t Hkv = batch.num_kv_heads, G = batch.num_heads / Hkv, n = end - begin;
  const int64_t bs = pool.block_size;
  std::vector<float> q(n * G * D), acc(n * G * D, 0.0f), max(n * G, kNegInf), sum(n * G, 0.0f);
  std::vector<float> scores(G * bs);
  std::vector<Span> spans(n);
  std::vector<int64_t> next(n), tail(n), leaders, recent(Hkv * kRecentLeaders);
  std::vector<int32_t> rows(n * G);
  std::vector<LaneScratch> lanes(Hkv);
  int64_t max_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = (begin + i) / Hkv, h = (begin + i) % Hkv;
    max_blocks = std::max(max_blocks, (batch.seq_lens[b] + bs - 1) / bs);
    const Q* src = batch.query + b * batch.query_stride + h * G * D;
    for (int64_t j = 0; j < G * D; ++j)
      q[i * G * D + j] = static_cast<float>(src[j]) * batch.scale;
  }
  for (int64_t col = 0; col < max_blocks; ++col) {
    leaders.clear();
    std::fill(recent.begin(), recent.end(), -1);
    for (int64_t i = 0; i < n; ++i) {
      spans[i] = span_at<D>(pool, batch, begin + i, col);
      if (spans[i].block < 0) continue;
      next[i] = -1;
      int64_t* mine = recent.data() + (begin + i) % Hkv * kRecentLeaders;
      int64_t leader = -1;
      for (int r = 0; r < kRecentLeaders && mine[r] >= 0 && leader < 0; ++r)
        if (spans[mine[r]].same_as(spans[i])) leader = mine[r];
      if (leader >= 0) {
        next[tail[leader]] = i;
        tail[leader] = i;
        continue;
      }
      tail[i] = i;
      leaders.push_back(i);
      std::copy_backward(mine, mine + kRecentLeaders - 1, mine + kRecentLeaders);
      mine[0] = i;
    }
    for (size_t l = 0; l < leaders.size(); ++l) {
      const Span& sp = spans[leaders[l]];
      // the next group's block (the first of the next column after the last group) is
      // fetched while this one computes
      const Span nx = l + 1 < leaders.size() ? spans[leaders[l + 1]]
                                             : span_at<D>(pool, batch, begin, col + 1);
      if (nx.block >= 0) prefetch_block<D>(pool, nx.offset, nx.t0, nx.t1);
      int64_t num_rows = 0;
      for (int64_t i = leaders[l]; i >= 0; i = next[i])
        for (int64_t g = 0; g < G; ++g) rows[num_rows++] = static_cast<int32_t>(i * G + g);
      if (num_rows > kLaneRows) {
        const Group grp{rows.data(), num_rows, q.data(), acc.data(), max.data(), sum.data()};
        LaneScratch& scratch = lanes[(begin + leaders[l]) % Hkv];
        group_lanes512<D>(pool, grp, sp.offset, sp.t0, sp.t1, scratch);
        continue;
      }
      for (int64_t j = 0; j < num_rows; j += G) {
        const int64_t first_row = rows[j];
        const float* qi = q.data() + first_row * D;
        const RowState state{max.data() + first_row, sum.data() + first_row,
                             acc.data() + first_row * D};
        if (zmm_items) {
          item_block512<D>(qi, pool.keys + sp.offset, pool.values + sp.offset, pool.token_stride,
                           sp.t0, sp.t1, G, bs, scores.data(), state);
        } else {
          block_scores<D>(qi, pool.keys + sp.offset, pool.token_stride, sp.t0, sp.t1, G, bs,
                          scores.data());
          block_update<D>(pool.values + sp.offset, pool.token_stride, sp.t0, sp.t1, G, bs,
                          scores.data(), state);
        }
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = (begin + i) / Hkv, h = (begin + i) % Hkv;
    Q* dst = batch.out + (b * batch.num_heads + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / sum[i * G + g];
      for (int64_t d = 0; d < D; ++d)
        dst[g * D + d] = static_cast<Q>(acc[(i * G + g) * D + d] * inv);
    }
  }
}

// Kernel paths (the `path` argument): the best this CPU runs, or one forced (A/B, tests).
// kAvx512Cascade: the cascade with the AVX2 per-item code; kAvx512: with the 16-lane one.
enum Path : int64_t { kAuto = 0, kAvx2 = 1, kAvx512Cascade = 2, kAvx512 = 3 };

template <int D, typename T, typename Q>
void attend(const Pool<T>& pool, const Batch<Q>& batch, int64_t num_seqs, int64_t path) {
  at::parallel_for(0, num_seqs * batch.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    if (path == kAvx2)
      attend_items<D>(pool, batch, begin, end);
    else
      attend_items_cascade<D>(pool, batch, begin, end, path == kAvx512);
  });
}

}  // namespace

// out[n] = softmax(q[n] K^T * scale) V over the first seq_lens[n] tokens of sequence n's
// blocks (the last sliding_window of them when sliding_window > 0). path: kAuto (AVX-512,
// the cascade and 16-lane per-item code, where the CPU has it, else AVX2), or one forced.
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                            int64_t sliding_window, int64_t path) {
  TORCH_CHECK(path >= kAuto && path <= kAvx512, "path ", path, " is not one of 0..3");
  if (path == kAuto) path = cpu_has_avx512() ? kAvx512 : kAvx2;
  TORCH_CHECK(path == kAvx2 || cpu_has_avx512(), "path ", path, " needs AVX-512 (F, DQ, BW, "
              "VL), which this CPU lacks");
  conveyor_native::check_attention_tensors(out, query, kv_cache);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t num_kv_heads = kv_cache.size(3);
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
    conveyor_native::check_blocks(tables, block_tables.size(1), n, lens[n], kv_cache);
  }
  conveyor_native::with_pool_shape(query, kv_cache, [&](auto rows, auto element, auto dim) {
    using Q = decltype(rows);
    using T = decltype(element);
    constexpr int D = decltype(dim)::value;
    const Batch<Q> batch{static_cast<const Q*>(query.data_ptr()), static_cast<Q*>(out.data_ptr()),
                         tables, lens, block_tables.size(1), num_heads,
                         num_kv_heads, sliding_window, static_cast<float>(scale),
                         conveyor_native::row_stride(query)};
    attend<D>(conveyor_native::pool_of<T>(kv_cache), batch, num_seqs, path);
  });
}

// paged_prefill_attention.cpp
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens,
                             torch::Tensor query_starts, torch::Tensor query_lens, double scale,
                             int64_t sliding_window, int64_t isa);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention read in place from the paged KV pool (fp32, fp16 or bf16; path 0 auto, "
        "1 AVX2, 2 AVX-512 shared-block cascade with AVX2 per-item code, 3 AVX-512 throughout)",
        // tensors only inside: the GIL is released while it runs, as ATen's ops do
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Prefill attention (chunks of query tokens, causal over the request's context) read in "
        "place from the paged KV pool (fp32, fp16 or bf16; isa 0 auto, 1 AVX2, 2 AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("store_kv", &conveyor_native::store_kv,
        "Write fp32 or bf16 key and value rows [T, Hkv, D] into the paged pool at slot_mapping "
        "(rounded to nearest even where the pool is narrower)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_avx512", &cpu_has_avx512, "Whether this CPU runs the AVX-512 paths");
}
