// Prefill attention (chunks of several query tokens per sequence) read in place from the paged
// KV pool: a flash-style kernel, causal within the sequence's context (a cached prefix and the
// earlier chunks included), with an optional sliding window.
//
// Pool layout (attention/__init__.py): kv_cache [2, num_blocks, block_size, Hkv, D], fp32 or
// fp16 (a chunk's fp16 key and value rows are widened into the thread's scratch once per tile).
// A work item is (request, kv head, tile of kTilePositions query positions): its rows are the
// tile's positions times the G = H / Hkv query heads of the kv head, so each key and value row
// loaded serves all G heads and all positions of the tile. Rows sit in the lanes (8 per ymm):
//   scores   st[t][row] = q[row] . k[t] for a chunk of 16 keys, each key element broadcast
//            against the tile's transposed queries (no horizontal sums);
//   softmax  online, per row, reduced across the chunk's token vectors (vertical max and sum);
//            a chunk that crosses the causal edge (or the window's) is masked per element,
//            the chunks past a tile's last position are never read;
//   values   out[row] += sum_t p[t][row] * v[t], 3 rows x 32 dims held in registers.
// Items are spread over the intra-op threads by their cost (rows x keys), longest first, so
// the long causal tiles at the end of a prompt do not all land on one thread.
// AVX2 + FMA only: the 512-bit FMA retires at half the 256-bit rate on the Zen cores this was
// measured on, so an AVX-512 variant would buy fewer instructions, not more FLOPs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "paged_pool.h"
#include "softmax_math.h"

namespace {

using conveyor_native::exp_nonpositive;
using conveyor_native::Pool;
using conveyor_native::widen_row;

constexpr int64_t kTilePositions = 16;  // query positions per work item
constexpr int kKeyChunk = 16;  // keys per softmax step (32 measured slower, 16 and 32 mixed too)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Batch {
  const float* query;           // [T, H, D], rows query_stride floats apart
  float* out;                   // [T, H, D]
  const int32_t* tables;        // [R, W]
  const int64_t* seq_lens;      // [R] context after this step
  const int64_t* query_starts;  // [R] row of query of the request's first new token
  const int64_t* query_lens;    // [R]
  int64_t table_width, num_heads, num_kv_heads, sliding_window;
  float scale;
  int64_t query_stride;
};

struct Item {
  int64_t request, head, first, last;  // query indices first..last - 1 within the chunk
  int64_t cost;
};

// The tile's rows: row j is query index first + j / G, head g = j % G. rp = rows rounded up
// to 8; padding rows have zero queries and the last row's position, and are never stored.
struct Tile {
  int64_t rows, rp;
  int64_t first_pos, last_pos;  // positions of the tile's first and last query
  int64_t key_begin, key_end;   // keys read: [key_begin, key_end)
};

// Per-thread scratch, sized for the largest tile.
struct Scratch {
  std::vector<float> qt;           // [D][rp] queries (scaled), transposed
  std::vector<float> st;           // [kKeyChunk][rp] scores, then probabilities
  std::vector<float> max, sum, correction;  // [rp]
  std::vector<int32_t> pos;        // [rp] query position of each row
  std::vector<float> acc;          // [rows][D] running outputs
  std::vector<float> keys, values;  // [kKeyChunk][D] a chunk's rows widened (fp16 pool)
};

// st[t * rp + lane0 ..] for the chunk's tokens (key pointers k[0..KC)), NR row vectors
// from lane0, four tokens at a time; accumulators named so GCC keeps them in registers.
template <int D, int NR, int KC>
__attribute__((noinline)) void scores_rows(const float* qt, int64_t rp, int64_t lane0,
                                           const float* const* k, float* st) {
  static_assert(NR >= 1 && NR <= 3, "one to three ymm of rows");
  for (int t = 0; t < KC; t += 4) {
    const float *k0 = k[t], *k1 = k[t + 1], *k2 = k[t + 2], *k3 = k[t + 3];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // rows 0..7, tokens 0..3
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                   // rows 8..15
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;                   // rows 16..23
    const float* qd = qt + lane0;
    for (int d = 0; d < D; ++d, qd += rp) {
      const __m256 k0d = _mm256_broadcast_ss(k0 + d), k1d = _mm256_broadcast_ss(k1 + d);
      const __m256 k2d = _mm256_broadcast_ss(k2 + d), k3d = _mm256_broadcast_ss(k3 + d);
      const __m256 q0 = _mm256_loadu_ps(qd);
      a0 = _mm256_fmadd_ps(q0, k0d, a0);
      a1 = _mm256_fmadd_ps(q0, k1d, a1);
      a2 = _mm256_fmadd_ps(q0, k2d, a2);
      a3 = _mm256_fmadd_ps(q0, k3d, a3);
      if constexpr (NR >= 2) {
        const __m256 q1 = _mm256_loadu_ps(qd + 8);
        b0 = _mm256_fmadd_ps(q1, k0d, b0);
        b1 = _mm256_fmadd_ps(q1, k1d, b1);
        b2 = _mm256_fmadd_ps(q1, k2d, b2);
        b3 = _mm256_fmadd_ps(q1, k3d, b3);
      }
      if constexpr (NR >= 3) {
        const __m256 q2 = _mm256_loadu_ps(qd + 16);
        c0 = _mm256_fmadd_ps(q2, k0d, c0);
        c1 = _mm256_fmadd_ps(q2, k1d, c1);
        c2 = _mm256_fmadd_ps(q2, k2d, c2);
        c3 = _mm256_fmadd_ps(q2, k3d, c3);
      }
    }
    float* s = st + t * rp + lane0;
    _mm256_storeu_ps(s, a0);
    _mm256_storeu_ps(s + rp, a1);
    _mm256_storeu_ps(s + 2 * rp, a2);
    _mm256_storeu_ps(s + 3 * rp, a3);
    if constexpr (NR >= 2) {
      _mm256_storeu_ps(s + 8, b0);
      _mm256_storeu_ps(s + rp + 8, b1);
      _mm256_storeu_ps(s + 2 * rp + 8, b2);
      _mm256_storeu_ps(s + 3 * rp + 8, b3);
    }
    if constexpr (NR >= 3) {
      _mm256_storeu_ps(s + 16, c0);
      _mm256_storeu_ps(s + rp + 16, c1);
      _mm256_storeu_ps(s + 2 * rp + 16, c2);
      _mm256_storeu_ps(s + 3 * rp + 16, c3);
    }
  }
}

template <int D, int KC>
void chunk_scores(const Scratch& sc, int64_t rp, const float* const* k, float* st) {
  int64_t l = 0;
  for (; l + 24 <= rp; l += 24) scores_rows<D, 3, KC>(sc.qt.data(), rp, l, k, st);
  if (rp - l == 16) scores_rows<D, 2, KC>(sc.qt.data(), rp, l, k, st);
  if (rp - l == 8) scores_rows<D, 1, KC>(sc.qt.data(), rp, l, k, st);
}

// Scores of keys at positions k0 + t that a row may not see become -inf: after the row's
// position (causal; the repeated tokens past the keys read are after every row's), or at or
// before its position - window.
template <int KC>
void mask_chunk(const Scratch& sc, int64_t rp, int64_t k0, int64_t window, float* st) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  for (int t = 0; t < KC; ++t) {
    const int64_t kpos = k0 + t;
    const __m256i key = _mm256_set1_epi32(static_cast<int32_t>(kpos));
    for (int64_t l = 0; l < rp; l += 8) {
      const __m256i pos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc.pos.data() + l));
      __m256i hidden = _mm256_cmpgt_epi32(key, pos);  // kpos > pos
      if (window > 0)  // kpos <= pos - window
        hidden = _mm256_or_si256(hidden, _mm256_cmpgt_epi32(
            _mm256_sub_epi32(pos, _mm256_set1_epi32(static_cast<int32_t>(window - 1))), key));
      float* s = st + t * rp + l;
      _mm256_storeu_ps(s, _mm256_blendv_ps(_mm256_loadu_ps(s), neg_inf,
                                           _mm256_castsi256_ps(hidden)));
    }
  }
}

// The online softmax over one chunk, rows in the lanes: new maxima, probabilities in place of
// the scores, sums, and each row's output correction e^(old max - new max).
template <int KC>
void softmax_chunk(Scratch& sc, int64_t rp, float* st) {
  for (int64_t l = 0; l < rp; l += 8) {
    const __m256 old_max = _mm256_loadu_ps(sc.max.data() + l);
    __m256 block_max = _mm256_loadu_ps(st + l);
    for (int t = 1; t < KC; ++t) block_max = _mm256_max_ps(block_max, _mm256_loadu_ps(st + t * rp + l));
    // max starts at -FLT_MAX (finite): a row with every key so far masked keeps a finite
    // maximum, so s - max is -inf (e^-87), never NaN
    const __m256 new_max = _mm256_max_ps(old_max, block_max);
    const __m256 correction = exp_nonpositive(_mm256_sub_ps(old_max, new_max));
    __m256 block_sum = _mm256_setzero_ps();
    for (int t = 0; t < KC; ++t) {
      float* s = st + t * rp + l;
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s), new_max));
      block_sum = _mm256_add_ps(block_sum, p);
      _mm256_storeu_ps(s, p);
    }
    const __m256 sum = _mm256_loadu_ps(sc.sum.data() + l);
    _mm256_storeu_ps(sc.max.data() + l, new_max);
    _mm256_storeu_ps(sc.sum.data() + l, _mm256_fmadd_ps(sum, correction, block_sum));
    _mm256_storeu_ps(sc.correction.data() + l, correction);
  }
}

// acc[row] = acc[row] * correction[row] + sum_t p[t][row] * v[t] for RT rows from j0 and the
// dims d0 .. d0 + 8 * DC, over the chunk's first nt tokens.
template <int D, int RT, int DC>
inline void values_rows(Scratch& sc, int64_t rp, int64_t j0, int64_t d0,
                        const float* const* v, int nt) {
  __m256 a[RT][DC];
  for (int r = 0; r < RT; ++r) {
    const float* acc = sc.acc.data() + (j0 + r) * D + d0;
    const __m256 corr = _mm256_broadcast_ss(sc.correction.data() + j0 + r);
    for (int c = 0; c < DC; ++c) a[r][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), corr);
  }
  const float* p = sc.st.data() + j0;
  for (int t = 0; t < nt; ++t) {
    const float* vt = v[t] + d0;
    __m256 pt[RT];
    for (int r = 0; r < RT; ++r) pt[r] = _mm256_broadcast_ss(p + t * rp + r);
    for (int c = 0; c < DC; ++c) {
      const __m256 vc = _mm256_loadu_ps(vt + 8 * c);
      for (int r = 0; r < RT; ++r) a[r][c] = _mm256_fmadd_ps(pt[r], vc, a[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    float* acc = sc.acc.data() + (j0 + r) * D + d0;
    for (int c = 0; c < DC; ++c) _mm256_storeu_ps(acc + 8 * c, a[r][c]);
  }
}

template <int D>
void chunk_values(Scratch& sc, int64_t rows, int64_t rp, const float* const* v, int nt) {
  constexpr int DC = D < 32 ? D / 8 : 4;  // 8-float chunks of the dims per pass
  for (int64_t d0 = 0; d0 < D; d0 += 8 * DC) {
    int64_t j = 0;
    for (; j + 3 <= rows; j += 3) values_rows<D, 3, DC>(sc, rp, j, d0, v, nt);
    if (rows - j == 2) values_rows<D, 2, DC>(sc, rp, j, d0, v, nt);
    if (rows - j == 1) values_rows<D, 1, DC>(sc, rp, j, d0, v, nt);
  }
}

Tile tile_of(const Batch& batch, const Item& it) {
  const int64_t G = batch.num_heads / batch.num_kv_heads;
  const int64_t context_start = batch.seq_lens[it.request] - batch.query_lens[it.request];
  Tile tile;
  tile.rows = (it.last - it.first) * G;
  tile.rp = (tile.rows + 7) / 8 * 8;
  tile.first_pos = context_start + it.first;
  tile.last_pos = context_start + it.last - 1;
  tile.key_end = tile.last_pos + 1;
  tile.key_begin = batch.sliding_window > 0
                       ? std::max<int64_t>(0, tile.first_pos - batch.sliding_window + 1)
                       : 0;
  return tile;
}

// One chunk of KC keys from k0 into the tile's state: the keys' and values' rows (a token past
// the keys read repeats the last one), scores, the masks the chunk crosses, softmax, values.
template <int D, int KC, typename T>
void attend_chunk(const Pool<T>& pool, const Batch& batch, const Item& it, const Tile& tile,
                  int64_t k0, Scratch& sc) {
  const int32_t* table = batch.tables + it.request * batch.table_width;
  const int nt = static_cast<int>(std::min<int64_t>(KC, tile.key_end - k0));
  const float* k[KC];
  const float* v[KC];
  for (int t = 0; t < KC; ++t) {
    if (t > nt - 1) {
      k[t] = k[nt - 1];
      v[t] = v[nt - 1];
      continue;
    }
    const int64_t kpos = k0 + t;
    const int64_t offset = table[kpos / pool.block_size] * pool.block_stride +
                           kpos % pool.block_size * pool.token_stride + it.head * D;
    if constexpr (std::is_same_v<T, float>) {
      k[t] = pool.keys + offset;
      v[t] = pool.values + offset;
    } else {
      widen_row<D>(pool.keys + offset, sc.keys.data() + t * D);
      widen_row<D>(pool.values + offset, sc.values.data() + t * D);
      k[t] = sc.keys.data() + t * D;
      v[t] = sc.values.data() + t * D;
    }
  }
  chunk_scores<D, KC>(sc, tile.rp, k, sc.st.data());
  const bool causal_edge = k0 + KC > tile.first_pos + 1;
  const bool window_edge = batch.sliding_window > 0 && k0 <= tile.last_pos - batch.sliding_window;
  if (causal_edge || window_edge)
    mask_chunk<KC>(sc, tile.rp, k0, batch.sliding_window, sc.st.data());
  softmax_chunk<KC>(sc, tile.rp, sc.st.data());
  chunk_values<D>(sc, tile.rows, tile.rp, v, nt);
}

template <int D, typename T>
void attend_item(const Pool<T>& pool, const Batch& batch, const Item& it, Scratch& sc) {
  const int64_t G = batch.num_heads / batch.num_kv_heads, H = batch.num_heads;
  const Tile tile = tile_of(batch, it);
  const int64_t rows = tile.rows, rp = tile.rp;
  const int64_t qstart = batch.query_starts[it.request];
  sc.qt.assign(D * rp, 0.0f);
  sc.pos.resize(rp);
  for (int64_t j = 0; j < rp; ++j) {
    const int64_t i = std::min(j, rows - 1) / G;  // padding rows: the last row's position
    sc.pos[j] = static_cast<int32_t>(tile.first_pos + i);
    if (j >= rows) continue;
    const float* q = batch.query + (qstart + it.first + i) * batch.query_stride +
                     (it.head * G + j % G) * D;
    for (int d = 0; d < D; ++d) sc.qt[d * rp + j] = q[d] * batch.scale;
  }
  sc.st.resize(kKeyChunk * rp);
  sc.max.assign(rp, -FLT_MAX);
  sc.sum.assign(rp, 0.0f);
  sc.correction.resize(rp);
  sc.acc.assign(rows * D, 0.0f);
  if constexpr (!std::is_same_v<T, float>) {
    sc.keys.resize(kKeyChunk * D);
    sc.values.resize(kKeyChunk * D);
  }
  for (int64_t k0 = tile.key_begin; k0 < tile.key_end; k0 += kKeyChunk)
    attend_chunk<D, kKeyChunk>(pool, batch, it, tile, k0, sc);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t i = j / G;
    float* dst = batch.out + ((qstart + it.first + i) * H + it.head * G + j % G) * D;
    const float inv = 1.0f / sc.sum[j];
    for (int d = 0; d < D; ++d) dst[d] = sc.acc[j * D + d] * inv;
  }
}

// Every (request, kv head, tile) with its cost, and each thread's share: longest first to the
// least loaded thread.
std::vector<std::vector<Item>> plan_items(const Batch& batch, int64_t num_requests,
                                          int64_t num_threads) {
  std::vector<Item> items;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t qlen = batch.query_lens[r], context_start = batch.seq_lens[r] - qlen;
    for (int64_t first = 0; first < qlen; first += kTilePositions) {
      const int64_t last = std::min(qlen, first + kTilePositions);
      int64_t keys = context_start + last;
      if (batch.sliding_window > 0)
        keys = std::min(keys, batch.sliding_window + last - first);
      for (int64_t h = 0; h < batch.num_kv_heads; ++h)
        items.push_back(Item{r, h, first, last, (last - first) * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<std::vector<Item>> shares(num_threads);
  std::vector<int64_t> load(num_threads, 0);
  for (const Item& it : items) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    shares[t].push_back(it);
    load[t] += it.cost;
  }
  return shares;
}

template <int D, typename T>
void attend(const Pool<T>& pool, const Batch& batch, int64_t num_requests) {
  const int64_t num_threads = std::max<int64_t>(1, at::get_num_threads());
  const auto shares = plan_items(batch, num_requests, num_threads);
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t t = begin; t < end; ++t)
      for (const Item& it : shares[t]) attend_item<D>(pool, batch, it, sc);
  });
}

}  // namespace

// out[query_starts[r] + i] = softmax(q K^T * scale) V for the query_lens[r] new tokens i of
// request r, at positions seq_lens[r] - query_lens[r] + i, each over the keys of its request's
// blocks up to its own position (the last sliding_window of them when sliding_window > 0).
// Rows of out outside the requests' tokens are left as they are.
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens,
                             torch::Tensor query_starts, torch::Tensor query_lens, double scale,
                             int64_t sliding_window) {
  TORCH_CHECK(conveyor_native::cpu_has_avx2(), "paged_prefill_attention needs AVX2 and FMA");
  conveyor_native::check_attention_tensors(out, query, kv_cache);
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), block_size = kv_cache.size(2);
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  const int64_t num_requests = seq_lens.size(0);
  for (const auto* t : {&seq_lens, &query_starts, &query_lens})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == num_requests && t->is_contiguous() &&
                t->scalar_type() == at::kLong,
                "seq_lens, query_starts and query_lens must be contiguous int64 [R] tensors");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_requests &&
              block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt,
              "block_tables must be a contiguous int32 [R, W] tensor");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* qlens = query_lens.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t r = 0; r < num_requests; ++r) {
    TORCH_CHECK(qlens[r] >= 1 && qlens[r] <= lens[r] && lens[r] <= width * block_size,
                "request ", r, ": query_len ", qlens[r], " and seq_len ", lens[r],
                " must satisfy 1 <= query_len <= seq_len <= ", width * block_size);
    TORCH_CHECK(starts[r] >= 0 && starts[r] + qlens[r] <= num_tokens, "request ", r,
                ": tokens ", starts[r], "..", starts[r] + qlens[r], " are outside the query's ",
                num_tokens);
    TORCH_CHECK(lens[r] < std::numeric_limits<int32_t>::max(), "seq_len too large");
    conveyor_native::check_blocks(tables, width, r, lens[r], kv_cache);
  }
  const Batch batch{query.data_ptr<float>(), out.data_ptr<float>(), tables, lens, starts, qlens,
                    width, num_heads, num_kv_heads, sliding_window, static_cast<float>(scale),
                    conveyor_native::row_stride(query)};
  conveyor_native::with_pool_type(kv_cache, [&](auto element) {
    using T = decltype(element);
    const Pool<T> pool = conveyor_native::pool_of<T>(kv_cache);
    switch (head_dim) {
      case 32: return attend<32>(pool, batch, num_requests);
      case 64: return attend<64>(pool, batch, num_requests);
      case 128: return attend<128>(pool, batch, num_requests);
      default: TORCH_CHECK(false, "head_dim ", head_dim, " is not one of 32, 64, 128");
    }
  });
}
