// Prefill attention (chunks of several query tokens per sequence) read in place from the paged
// KV pool: a flash-style kernel, causal within the sequence's context (a cached prefix and the
// earlier chunks included), with an optional sliding window.
//
// Pool layout (attention/__init__.py): kv_cache [2, num_blocks, block_size, Hkv, D], fp32, fp16
// or bf16 (a chunk's 16-bit key and value rows are widened into the thread's scratch once per
// tile). Queries and outputs fp32 or bf16 (a bf16 model's); all arithmetic is fp32.
// A work item is (request, kv head, tile of kTilePositions query positions): its rows are the
// tile's positions times the G = H / Hkv query heads of the kv head, so each key and value row
// loaded serves all G heads and all positions of the tile. Rows sit in the lanes (8 per ymm,
// 16 per zmm):
//   scores   st[t][row] = q[row] . k[t] for a chunk of 16 keys, each key element broadcast
//            against the tile's transposed queries (no horizontal sums);
//   softmax  online, per row, reduced across the chunk's token vectors (vertical max and sum);
//            a chunk that crosses the causal edge (or the window's) is masked per element,
//            the chunks past a tile's last position are never read;
//   values   out[row] += sum_t p[t][row] * v[t], 3 rows x 4 vectors of dims in registers.
// Items are spread over the intra-op threads by their cost (rows x keys), longest first, so
// the long causal tiles at the end of a prompt do not all land on one thread.
// The tile code (paged_prefill_tiles.inc) is built twice, for AVX2 + FMA and for AVX-512, and the
// widest the CPU runs is taken (the `isa` argument forces one): on Intel's server cores a 512-bit
// FMA issues at the 256-bit rate, so the AVX-512 path doubles the FLOPs a cycle; on Zen 5 it
// issues at half that rate, so there it buys fewer instructions, not more FLOPs.
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
using conveyor_native::exp_nonpositive512;
using conveyor_native::Pool;
using conveyor_native::widen_row;

constexpr int64_t kTilePositions = 16;  // query positions per work item
constexpr int kKeyChunk = 16;  // keys per softmax step (32 measured slower, 16 and 32 mixed too)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Q: the queries' and outputs' element type (float, or at::BFloat16 for a bf16 model; read into
// fp32 scratch, written back rounded).
template <typename Q>
struct Batch {
  const Q* query;               // [T, H, D], rows query_stride elements apart
  Q* out;                       // [T, H, D]
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
// to the vector width; padding rows have zero queries and the last row's position, and are
// never stored.
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
  std::vector<float> keys, values;  // [kKeyChunk][D] a chunk's rows widened (16-bit pool)
};

// The tile code's operations at one vector width: W rows of a tile in one vector.
struct Lanes8 {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static Vec exp(Vec x) { return exp_nonpositive(x); }
  // s[l] = -inf for each of the W rows l (positions pos[l]) that may not see the key at kpos:
  // kpos > pos (causal; the repeated tokens past the keys read are after every row's), or
  // kpos <= pos - window (window > 0).
  static void hide(float* s, const int32_t* pos, int32_t kpos, int32_t window) {
    const __m256i key = _mm256_set1_epi32(kpos);
    const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos));
    __m256i hidden = _mm256_cmpgt_epi32(key, at);
    if (window > 0)
      hidden = _mm256_or_si256(
          hidden, _mm256_cmpgt_epi32(_mm256_sub_epi32(at, _mm256_set1_epi32(window - 1)), key));
    _mm256_storeu_ps(s, _mm256_blendv_ps(_mm256_loadu_ps(s), _mm256_set1_ps(kNegInf),
                                         _mm256_castsi256_ps(hidden)));
  }
};

struct Lanes16 {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  CONVEYOR_AVX512 static Vec zero() { return _mm512_setzero_ps(); }
  CONVEYOR_AVX512 static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  CONVEYOR_AVX512 static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  CONVEYOR_AVX512 static Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
  CONVEYOR_AVX512 static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  CONVEYOR_AVX512 static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  CONVEYOR_AVX512 static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  CONVEYOR_AVX512 static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  CONVEYOR_AVX512 static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  CONVEYOR_AVX512 static Vec exp(Vec x) { return exp_nonpositive512(x); }
  CONVEYOR_AVX512 static void hide(float* s, const int32_t* pos, int32_t kpos, int32_t window) {
    const __m512i key = _mm512_set1_epi32(kpos);
    const __m512i at = _mm512_loadu_si512(pos);
    __mmask16 hidden = _mm512_cmpgt_epi32_mask(key, at);
    if (window > 0)
      hidden |= _mm512_cmpgt_epi32_mask(_mm512_sub_epi32(at, _mm512_set1_epi32(window - 1)), key);
    _mm512_mask_storeu_ps(s, hidden, _mm512_set1_ps(kNegInf));
  }
};

template <typename Q>
Tile tile_of(const Batch<Q>& batch, const Item& it, int64_t width) {
  const int64_t G = batch.num_heads / batch.num_kv_heads;
  const int64_t context_start = batch.seq_lens[it.request] - batch.query_lens[it.request];
  Tile tile;
  tile.rows = (it.last - it.first) * G;
  tile.rp = (tile.rows + width - 1) / width * width;
  tile.first_pos = context_start + it.first;
  tile.last_pos = context_start + it.last - 1;
  tile.key_end = tile.last_pos + 1;
  tile.key_begin = batch.sliding_window > 0
                       ? std::max<int64_t>(0, tile.first_pos - batch.sliding_window + 1)
                       : 0;
  return tile;
}

namespace avx2 {
using Lanes = Lanes8;
#define PREFILL_TARGET
#include "paged_prefill_tiles.inc"
#undef PREFILL_TARGET
}  // namespace avx2

namespace avx512 {
using Lanes = Lanes16;
#define PREFILL_TARGET CONVEYOR_AVX512
#include "paged_prefill_tiles.inc"
#undef PREFILL_TARGET
}  // namespace avx512

// Every (request, kv head, tile) with its cost, and each thread's share: longest first to the
// least loaded thread.
template <typename Q>
std::vector<std::vector<Item>> plan_items(const Batch<Q>& batch, int64_t num_requests,
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

template <int D, typename T, typename Q>
void attend(const Pool<T>& pool, const Batch<Q>& batch, int64_t num_requests, bool wide) {
  const int64_t num_threads = std::max<int64_t>(1, at::get_num_threads());
  const auto shares = plan_items(batch, num_requests, num_threads);
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t t = begin; t < end; ++t)
      for (const Item& it : shares[t]) {
        if (wide)
          avx512::attend_item<D>(pool, batch, it, sc);
        else
          avx2::attend_item<D>(pool, batch, it, sc);
      }
  });
}

}  // namespace

// out[query_starts[r] + i] = softmax(q K^T * scale) V for the query_lens[r] new tokens i of
// request r, at positions seq_lens[r] - query_lens[r] + i, each over the keys of its request's
// blocks up to its own position (the last sliding_window of them when sliding_window > 0).
// Rows of out outside the requests' tokens are left as they are. isa: cpu_isa.h's kIsaAuto (the
// widest path this CPU runs), kIsaAvx2 or kIsaAvx512.
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens,
                             torch::Tensor query_starts, torch::Tensor query_lens, double scale,
                             int64_t sliding_window, int64_t isa) {
  const bool wide =
      conveyor_native::resolve_isa(isa, "paged_prefill_attention") == conveyor_native::kIsaAvx512;
  conveyor_native::check_attention_tensors(out, query, kv_cache);
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
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
  conveyor_native::with_pool_shape(query, kv_cache, [&](auto rows, auto element, auto dim) {
    using Q = decltype(rows);
    using T = decltype(element);
    constexpr int D = decltype(dim)::value;
    const Batch<Q> batch{static_cast<const Q*>(query.data_ptr()), static_cast<Q*>(out.data_ptr()),
                         tables, lens, starts, qlens, width, num_heads, num_kv_heads,
                         sliding_window, static_cast<float>(scale),
                         conveyor_native::row_stride(query)};
    attend<D>(conveyor_native::pool_of<T>(kv_cache), batch, num_requests, wide);
  });
}
