// Attention of n new tokens (the last n of `end` cached positions) of one sequence.
//
// Work is split by key/value head and by chunks of CHUNK cached positions at fixed offsets
// (0, CHUNK, 2 CHUNK, ...). One item computes, for every query row of its head group (each new
// token x each query head reading that key/value head), the scores over the chunk's keys that
// row may see, their maximum, exp(s - max), its sum, and sum p v. Partial results are then
// merged per row in chunk order. Every step of a row's arithmetic is fixed by its own query, its
// position and the chunk offsets.
//
// The rows of one token (the G query heads of a key/value head) see the same keys and go through
// the chunk together, up to RMAX at a time (8 in the AVX-512 builds, 6 in the others), with the
// head dimension in the vector lanes (16 or 8): a score is a run of multiply-adds over the
// dimension's slices, summed across lanes once (av::hsum4: 4 keys of a row at a time, or where
// a block takes one key at a time, 4 rows), and sum p v
// keeps each row's sums in registers for the whole chunk. Each key or value slice is read (and
// widened from float16) once per block of rows: once per token where G <= RMAX (Qwen2.5's 6,
// Gemma 3's 4, the embedded model's 3). Keys are never transposed: a one-token pass (3 rows per
// key/value head on the embedded model) spent as long transposing keys as scoring them.
//
// Grouped-query attention: query head h reads key/value head h / (heads / kv_heads), as
// transformers' repeat_kv does. Sliding-window layers (Gemma 3's local layers) pass a window:
// each row then scores only the keys in its own window, and chunks before every row's window
// are skipped, so a one-token pass reads window positions, not the whole cache.

#pragma once

#include "pool.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

using namespace simd;

namespace {

constexpr int64_t CHUNK = 256;

// The cache is read from memory once per pass (a one-token pass reads each layer's keys and
// values once), in short streams (a chunk of one head) that the hardware prefetcher picked up
// late: a one-token pass spent most of its attention time waiting on the first value rows of
// each chunk (perf, AVX2 EPYC). So the first rows through a chunk fetch ahead: scoring fetches
// the keys KEYS_AHEAD rows on and the value rows it passes (into L2: a chunk's values are as
// large as L1). A one-token pass of the embedded model at 1,000 positions: 7-8% faster; an
// 8-token pass 6%. Summing the values also fetched the keys of the thread's next item into L1
// until 2026-11-27; on an Intel Xeon that cost a one-token pass of Qwen2.5-Coder-1.5B at 4,096
// positions about 1 ms (with the rows of a token in one block, below; avx2 and amx sets).
constexpr int64_t KEYS_AHEAD = 16;
inline void fetch_ahead(const void* keys, const void* values, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(static_cast<const char*>(keys) + o);
    __builtin_prefetch(static_cast<const char*>(values) + o, 0, 2);
  }
}

// The head dimension's vectors: simd.h's F (16 lanes in the AVX-512 builds, 8 in the others),
// with up to RMAX rows of a token through a chunk together (8 with AVX-512's 32 registers, 6 with
// 16, where 6 rows take two keys at a time, each row's query loaded as it is used). A one-token
// pass of Qwen2.5-1.5B (6 query heads per key/value head, head size 128) at 4,096 positions was
// arithmetic-bound in 8 lanes and 4 rows: 5.8 ms of 28 layers with the cache in cache, 7.9 ms
// streaming it (15 GB/s of a 29 GB/s machine; Intel Xeon, AVX-512). In 4 rows and 2 its keys and
// values were read and widened twice per token.
namespace av {
using V = F;
constexpr int W = L, RMAX = REGISTERS >= 32 ? 8 : 6;
// Keys (or value slices) at a time for RB rows: the most of 4, 2 and 1 that fit in registers
// with an accumulator per row and key, the key, and either a query (or weight) per row held for
// the whole block (`pinned`) or one row's at a time, loaded where it is used (the block's keys
// then stay in registers). Every accumulator is the same chain of multiply-adds either way.
// With 16 registers and 6 rows (Qwen2.5's query heads per key/value head) the second way takes 2
// keys at a time, not 1: 12 independent chains, where 6 left the multiply-adds waiting on each
// other's latency. A 64-token prompt chunk at 2,048 positions spent about a fifth of its time in
// attention, much of it in the values' loop; with 2 keys, attention alone over float32 keys
// (64 rows at 2,112 positions) took 12% less time, and Qwen2.5-Coder-1.5B's passes at 3,000
// positions 4% less over 8 and 64 tokens (the same logits; AMD EPYC Zen 4, avx2 set).
constexpr bool fits(int RB, int KB, bool pinned) { return RB * KB + (pinned ? RB : KB) + 1 <= REGISTERS; }
constexpr int width(int RB) {
  return fits(RB, 4, true) || fits(RB, 4, false) ? 4 : fits(RB, 2, true) || fits(RB, 2, false) ? 2 : 1;
}
constexpr bool pinned(int RB, int KB) { return fits(RB, KB, true); }
// acc[r][k] += row(r) * col(k) for RB rows and KB columns (keys or value slices): the rows'
// operands held for the block where they fit beside it (`pinned`), else the columns held and
// each row's operand made where it is used.
template <int RB, int KB, class Row, class Col>
inline void fma_block(V (&acc)[RB][KB], Row row, Col col) {
  if constexpr (pinned(RB, KB)) {
    V a[RB];
    for (int r = 0; r < RB; ++r) a[r] = row(r);
    for (int k = 0; k < KB; ++k) {
      const V x = col(k);
      for (int r = 0; r < RB; ++r) acc[r][k] = fmadd(a[r], x, acc[r][k]);
    }
  } else {
    V x[KB];
    for (int k = 0; k < KB; ++k) x[k] = col(k);
    for (int r = 0; r < RB; ++r) {
      const V a = row(r);
      for (int k = 0; k < KB; ++k) acc[r][k] = fmadd(a, x[k], acc[r][k]);
    }
  }
}
inline V kv(const float* p) { return load(p); }
inline V kv(const uint16_t* p) { return load_f16((const uint8_t*)p); }
// The sums of 4 vectors across their lanes, in a fixed order (bytes::ghsum4's, after adding
// lanes i and i + 8 in the AVX-512 builds).
inline void hsum4(V a, V b, V c, V d, float* out) {
#if defined(PARROT_AVX512)
  const auto fold = [](V x) {
    return bytes::G{_mm256_add_ps(_mm512_castps512_ps256(x.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1)))};
  };
  bytes::ghsum4(fold(a), fold(b), fold(c), fold(d), out);
#else
  bytes::ghsum4({a.v}, {b.v}, {c.v}, {d.v}, out);
#endif
}
}  // namespace av

// Scores of RB rows (scaled queries qs, D = W C apart) against keys [0, m) of the chunk
// (keys, D apart), into scores (CHUNK apart per row). KB keys at a time; a last partial group
// repeats key m - 1 (each score depends on its own row and key only; the extra ones are dropped).
template <int C, int RB, class T>
inline void score_block(const float* qs, const T* keys, int64_t m, float* scores, const T* values) {
  using namespace av;
  constexpr int D = W * C, KB = width(RB);
  for (int64_t j0 = 0; j0 < m; j0 += KB) {
    const T* kp[KB];
    for (int k = 0; k < KB; ++k) kp[k] = keys + std::min(j0 + k, m - 1) * D;
    if (values != nullptr) fetch_ahead(keys + (j0 + KEYS_AHEAD) * D, values + j0 * D, KB * D * sizeof(T));
    V acc[RB][KB];
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < KB; ++k) acc[r][k] = zero();
    for (int c = 0; c < C; ++c)
      fma_block(acc, [&](int r) { return load(qs + r * D + W * c); }, [&](int k) { return kv(kp[k] + W * c); });
    if constexpr (KB == 1) {  // one key: the sums of 4 rows at a time (each row's own lanes in the same order)
      const auto row = [&](int r) { return r < RB ? acc[r][0] : zero(); };
      for (int r0 = 0; r0 < RB; r0 += 4) {
        float s[4];
        hsum4(row(r0), row(r0 + 1), row(r0 + 2), row(r0 + 3), s);
        for (int i = 0; i < 4 && r0 + i < RB; ++i) scores[(r0 + i) * CHUNK + j0] = s[i];
      }
    } else {
      for (int r = 0; r < RB; ++r) {
        float s[4];
        if constexpr (KB == 4) hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s);
        else hsum4(acc[r][0], acc[r][1], zero(), zero(), s);
        for (int k = 0; k < KB && j0 + k < m; ++k) scores[r * CHUNK + j0 + k] = s[k];
      }
    }
  }
}

// out_r = sum_j p_rj v_j over keys j < m in key order, for RB rows (weights at scores + r CHUNK,
// sums at part + r (D + 2) + 2): VS vectors of the head dimension at a time, held in registers
// for all m keys.
template <int C, int RB, class T>
inline void value_block(const float* scores, const T* values, int64_t m, float* part) {
  using namespace av;
  constexpr int D = W * C, VS0 = width(RB), VS = VS0 < C ? VS0 : C;
  for (int c0 = 0; c0 < C; c0 += VS) {
    V o[RB][VS];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < VS; ++c) o[r][c] = zero();
    for (int64_t j = 0; j < m; ++j)
      fma_block(o, [&](int r) { return set1(scores[r * CHUNK + j]); },
                [&](int c) { return kv(values + j * D + W * (c0 + c)); });
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < VS; ++c) store(part + r * (D + 2) + 2 + W * (c0 + c), o[r][c]);
  }
}

// score_block and value_block for rb (1..RMAX) rows.
template <int C, class T, int RB = 1>
inline void score_rows(int64_t rb, const float* qs, const T* keys, int64_t m, float* scores, const T* values) {
  if constexpr (RB < av::RMAX) {
    if (rb != RB) return score_rows<C, T, RB + 1>(rb, qs, keys, m, scores, values);
  }
  score_block<C, RB, T>(qs, keys, m, scores, values);
}
template <int C, class T, int RB = 1>
inline void value_rows(int64_t rb, const float* scores, const T* values, int64_t m, float* part) {
  if constexpr (RB < av::RMAX) {
    if (rb != RB) return value_rows<C, T, RB + 1>(rb, scores, values, m, part);
  }
  value_block<C, RB, T>(scores, values, m, part);
}

// One item: rows r = t * G + g (token t sees keys lower[t] <= j < limit[t]) against keys
// [c0, c1) of one key/value head. Writes per row: max, sum of exp(s - max), sum of exp(s - max) v
// (D floats); max = -inf when the row sees none of the chunk.
template <int C, class T>
void chunk(const float* qs, int64_t n, int64_t G, const int64_t* lower, const int64_t* limit, const T* keys,
           const T* values, int64_t c0, int64_t c1, float* scores, float* part) {
  constexpr int D = av::W * C;
  const int64_t S = c1 - c0;
  for (int64_t t = 0; t < n; ++t) {
    // The keys of this chunk token t sees: [lo, lo + seen) from c0.
    const int64_t lo = std::min(std::max(lower[t] - c0, (int64_t)0), S);
    const int64_t seen = std::max(std::min(std::max(limit[t] - c0, (int64_t)0), S) - lo, (int64_t)0);
    const T* k0 = keys + (c0 + lo) * D;
    const T* v0 = values + (c0 + lo) * D;
    for (int64_t g0 = 0; g0 < G; g0 += av::RMAX) {
      const int64_t r = t * G + g0, rb = std::min<int64_t>(av::RMAX, G - g0);
      float* pr = part + r * (D + 2);
      if (seen == 0) {
        for (int64_t i = 0; i < rb; ++i) { pr[i * (D + 2)] = -INFINITY; pr[i * (D + 2) + 1] = 0.0f; }
        continue;
      }
      float* sr = scores + r * CHUNK;
      const bool first = t == 0 && g0 == 0;  // the first rows through the chunk fetch it (the rest find it in cache)
      score_rows<C, T>(rb, qs + r * D, k0, seen, sr, first ? v0 : nullptr);
      // Softmax pieces per row over its seen keys; a partial last vector is padded with -inf.
      for (int64_t i = 0; i < rb; ++i) {
        float* s = sr + i * CHUNK;
        alignas(64) float tail[L];
        auto piece = [&](int64_t j0) {
          if (j0 + L <= seen) return load(s + j0);
          for (int j = 0; j < L; ++j) tail[j] = j0 + j < seen ? s[j0 + j] : -INFINITY;
          return load(tail);
        };
        F best = set1(-INFINITY);
        for (int64_t j0 = 0; j0 < seen; j0 += L) best = max(best, piece(j0));
        const float top = hmax(best);
        const F bv = set1(top);
        F total = zero();
        for (int64_t j0 = 0; j0 < seen; j0 += L) {
          const F e = exp(sub(piece(j0), bv));
          total = add(total, e);
          if (j0 + L <= seen) {
            store(s + j0, e);
          } else {
            store(tail, e);
            std::memcpy(s + j0, tail, (seen - j0) * sizeof(float));
          }
        }
        pr[i * (D + 2)] = top;
        pr[i * (D + 2) + 1] = hsum(total);
      }
      value_rows<C, T>(rb, sr, v0, seen, pr);
    }
  }
}

template <class T>
using ChunkFn = void (*)(const float*, int64_t, int64_t, const int64_t*, const int64_t*, const T*, const T*, int64_t,
                         int64_t, float*, float*);

template <class T>
ChunkFn<T> pick(int64_t D) {
  switch (D) {
    case 16: return chunk<16 / av::W, T>;
    case 32: return chunk<32 / av::W, T>;
    case 64: return chunk<64 / av::W, T>;
    case 128: return chunk<128 / av::W, T>;
    case 256: return chunk<256 / av::W, T>;
    default: return nullptr;
  }
}

// q [n, heads, D]; k, v [kv_heads, capacity, D] (one layer of one sequence's cache, float32 or
// float16) holding `end` positions, the last n of which are the queries' own. out [n, heads * D].
// `window` > 0: a query sees the last `window` positions up to its own (itself included), as a
// sliding-window layer does (transformers: key j is seen from position i when i - window < j);
// 0: every position up to its own. Chunks wholly before every query's window are not visited;
// a row's arithmetic stays fixed by its own position (chunks it does not see add nothing).
// attention_rows takes the rows at once; its scratch grows with rows x context.
template <class T>
void attention_rows(const float* q, int64_t n, int64_t heads, int64_t D, const T* k, const T* v,
                    int64_t kv_heads, int64_t capacity, int64_t end, int64_t window, float scale, float* out, int threads) {
  const int64_t G = heads / kv_heads, R = n * G;
  const ChunkFn<T> fn = pick<T>(D);
  std::vector<int64_t> lower(n), limit(n);
  for (int64_t t = 0; t < n; ++t) {
    limit[t] = end - n + t + 1;  // token t sees positions lower[t] <= j < limit[t]
    lower[t] = window > 0 ? std::max(limit[t] - window, (int64_t)0) : 0;
  }
  const int64_t c_lo = lower[0] / CHUNK, chunks = (end + CHUNK - 1) / CHUNK - c_lo;  // lower[0] is the least
  // Partials [kv_heads, chunks, R, D + 2]: max, sum, weighted values. Every row's max and sum
  // are written, its weighted values only where it sees the chunk (the merge skips the others),
  // so the buffer is not zeroed first.
  const std::unique_ptr<float[]> part(new float[kv_heads * chunks * R * (D + 2)]);
  // Scaled queries by key/value head: qs[h][t * G + g] = scale * q[t][h * G + g].
  std::vector<float> qs(kv_heads * R * D);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < D; ++d)
        qs[((h / G) * R + t * G + h % G) * D + d] = q[(t * heads + h) * D + d] * scale;
  const int64_t items = kv_heads * chunks;
  pool(threads).parallel_for(items, [&](int64_t i) {
    const int64_t h = i / chunks, c = c_lo + i % chunks;
    // An item's scores live in scratch of its thread's own, still in cache from its item before.
    thread_local std::vector<float> scores;
    if ((int64_t)scores.size() < R * CHUNK) scores.resize(R * CHUNK);
    fn(qs.data() + h * R * D, n, G, lower.data(), limit.data(), k + h * capacity * D, v + h * capacity * D,
       c * CHUNK, std::min((c + 1) * CHUNK, end), scores.data(), part.get() + i * R * (D + 2));
  });
  // Merge each row's chunks in order.
  std::vector<float> acc(D);
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      float top = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part[((h * chunks + c) * R + r) * (D + 2)]);
      float total = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* pr = part.get() + ((h * chunks + c) * R + r) * (D + 2);
        if (pr[0] == -INFINITY) continue;
        const float w = std::exp(pr[0] - top);
        total += pr[1] * w;
        for (int64_t d = 0; d < D; ++d) acc[d] += pr[2 + d] * w;
      }
      const int64_t t = r / G, g = r % G;
      float* dst = out + t * heads * D + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] / total;
    }
  }
}

// Rows per attention_rows call: a whole prompt chunk at once would hold rows x context x heads
// floats of scratch (512 rows at 8,192 positions: some 300 MB for Qwen2.5-1.5B).
constexpr int64_t ATTENTION_ROWS = 64;

// The same, ATTENTION_ROWS rows at a time, each piece over the positions up to its last row: a
// row's result does not depend on its piece.
template <class T>
void attention(const float* q, int64_t n, int64_t heads, int64_t D, const T* k, const T* v,
               int64_t kv_heads, int64_t capacity, int64_t end, int64_t window, float scale, float* out, int threads) {
  for (int64_t t0 = 0; t0 < n; t0 += ATTENTION_ROWS) {
    const int64_t rows = std::min(ATTENTION_ROWS, n - t0);
    attention_rows(q + t0 * heads * D, rows, heads, D, k, v, kv_heads, capacity, end - n + t0 + rows, window, scale,
                   out + t0 * heads * D, threads);
  }
}

// Whether `attention` covers this head shape.
inline bool attention_supports(int64_t head_dim, int64_t heads, int64_t kv_heads) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 16 && pick<float>(head_dim) != nullptr;
}

}  // namespace
