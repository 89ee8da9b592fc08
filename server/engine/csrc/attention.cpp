// Causal attention of a few new query tokens over one sequence's KV cache, float32, on CPU.
//
// Why: a decoding pass feeds 1 to ~16 tokens per sequence. torch's CPU SDPA costs ~150-200 us
// per layer at one query over 900 cached keys (setup, masks, thread hand-off; the arithmetic is
// ~2 MFLOP), a sixth of a one-token pass of the embedded model.
//
// Work is split by key/value head and by chunks of CHUNK cached positions at fixed offsets
// (0, CHUNK, 2 CHUNK, ...). One item computes, for every query row of its head group (each new
// token x each query head reading that key/value head), the scores over the chunk's keys that
// row may see, their maximum, exp(s - max), its sum, and sum p v, reading each key and value
// once for all rows: keys 16 at a time, transposed once so that each score is a run of
// multiply-adds with no horizontal sums (measured over 900 keys, 8 new tokens: scores 104 -> 75 us
// per layer against per-key dot products), values 16 at a time for groups of rows. Partial
// results are then merged per row in chunk order. Every step of a
// row's arithmetic is fixed by its own query, its position and the chunk offsets: nothing depends
// on how many tokens are in the pass or which thread runs what, so a row's result is the same bit
// for bit whether its token is verified alone or with a draft (batch invariance, as in
// quant_linear.cpp).
//
// Grouped-query attention: query head h reads key/value head h / (heads / kv_heads), as
// transformers' repeat_kv does.

#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// exp(x) for float32 lanes: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7 Taylor
// polynomial (error below 2e-8 relative on that interval), times 2^k. Below -87.3 it is 0.
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);   // ln2, high part (exact product)
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);      // ln2, low part
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(p, k));
}

constexpr int64_t CHUNK = 256;

// Lanes 0 .. min(left, 16) - 1.
inline __mmask16 first_lanes(int64_t left) {
  return (__mmask16)((1u << (left < 16 ? left : 16)) - 1);
}

// dst[i * 16 + j] = src[j][col + i] for i, j < 16: sixteen dimensions of sixteen keys, transposed.
inline void transpose16(const float* const* src, int64_t col, float* dst) {
  __m512 r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(src[j] + col);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane L: r[4i + k] = rows 4i..4i+3 of column 4L + k
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k = lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
    const __m512 u0 = _mm512_shuffle_f32x4(r[k], r[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 u1 = _mm512_shuffle_f32x4(r[k], r[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 u3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_store_ps(dst + (0 + k) * 16, _mm512_shuffle_f32x4(u0, u2, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_store_ps(dst + (4 + k) * 16, _mm512_shuffle_f32x4(u0, u2, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_store_ps(dst + (8 + k) * 16, _mm512_shuffle_f32x4(u1, u3, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_store_ps(dst + (12 + k) * 16, _mm512_shuffle_f32x4(u1, u3, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}

// Scores of GR rows (scaled queries qs, D apart) against a transposed tile of 16 keys.
template <int C, int GR>
inline void score_rows(const float* qs, const float* kt, float* scores) {
  constexpr int D = 16 * C;
  __m512 even[GR], odd[GR];
  for (int g = 0; g < GR; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  #pragma GCC unroll 8
  for (int d = 0; d < D; d += 2) {
    const __m512 k0 = _mm512_load_ps(kt + d * 16), k1 = _mm512_load_ps(kt + (d + 1) * 16);
    for (int g = 0; g < GR; ++g) {
      even[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + d]), k0, even[g]);
      odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + d + 1]), k1, odd[g]);
    }
  }
  for (int g = 0; g < GR; ++g) _mm512_storeu_ps(scores + g * CHUNK, _mm512_add_ps(even[g], odd[g]));
}

// o_r += p_rj v_j for keys j < m of one tile, for GR rows r (their weights at scores + r * CHUNK,
// their sums at part + r * (D + 2) + 2).
template <int C, int GR>
inline void weighted_values(const int64_t* rows, int64_t m, const float* scores, const float* values, float* part) {
  constexpr int D = 16 * C;
  __m512 o[GR][C];
  for (int g = 0; g < GR; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = _mm512_loadu_ps(part + rows[g] * (D + 2) + 2 + c * 16);
  for (int64_t j = 0; j < m; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(values + j * D + c * 16);
    for (int g = 0; g < GR; ++g) {
      const __m512 p = _mm512_set1_ps(scores[rows[g] * CHUNK + j]);
      for (int c = 0; c < C; ++c) o[g][c] = _mm512_fmadd_ps(p, v[c], o[g][c]);
    }
  }
  for (int g = 0; g < GR; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(part + rows[g] * (D + 2) + 2 + c * 16, o[g][c]);
}

// One item: rows r = t * G + g (token t sees keys < limit[t]) against keys [c0, c1) of one
// key/value head. Writes per row: max, sum of exp(s - max), sum of exp(s - max) v (D floats);
// max = -inf when the row sees none of the chunk.
template <int C>
void chunk(const float* qs, int64_t n, int64_t G, const int64_t* limit, const float* keys,
           const float* values, int64_t c0, int64_t c1, float* scores, float* part) {
  constexpr int D = 16 * C;
  const int64_t R = n * G, S = c1 - c0;
  std::vector<int64_t> seen(R);  // keys of this chunk each row sees
  for (int64_t r = 0; r < R; ++r) seen[r] = std::min(std::max(limit[r / G] - c0, (int64_t)0), S);
  // Scores, 16 keys at a time: the tile is transposed once (kt[d] = dimension d of its 16 keys)
  // and serves every row, each score a sum over d in a fixed order (even and odd d apart, then
  // added). A partial tile points its missing keys at zeros (their scores are never used).
  alignas(64) static const float zeros[D] = {};
  alignas(64) float kt[D * 16];
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const float* kp[16];
    for (int j = 0; j < 16; ++j) kp[j] = j0 + j < S ? keys + (c0 + j0 + j) * D : zeros;
    for (int c = 0; c < C; ++c) transpose16(kp, c * 16, kt + c * 256);
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) score_rows<C, 4>(qs + r * D, kt, scores + r * CHUNK + j0);
    switch (R - r) {
      case 1: score_rows<C, 1>(qs + r * D, kt, scores + r * CHUNK + j0); break;
      case 2: score_rows<C, 2>(qs + r * D, kt, scores + r * CHUNK + j0); break;
      case 3: score_rows<C, 3>(qs + r * D, kt, scores + r * CHUNK + j0); break;
      default: break;
    }
  }
  // Softmax pieces per row over the keys it sees in this chunk.
  for (int64_t r = 0; r < R; ++r) {
    float* pr = part + r * (D + 2);
    float* sr = scores + r * CHUNK;
    if (seen[r] == 0) {
      pr[0] = -INFINITY;
      pr[1] = 0.0f;
      continue;
    }
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < seen[r]; j0 += 16) {
      const __mmask16 valid = first_lanes(seen[r] - j0);
      best = _mm512_mask_max_ps(best, valid, best, _mm512_maskz_loadu_ps(valid, sr + j0));
    }
    const float top = _mm512_reduce_max_ps(best);
    const __m512 bv = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < seen[r]; j0 += 16) {
      const __mmask16 valid = first_lanes(seen[r] - j0);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sr + j0), bv)));
      _mm512_storeu_ps(sr + j0, e);  // zero past `seen`
      total = _mm512_add_ps(total, e);
    }
    pr[0] = top;
    pr[1] = _mm512_reduce_add_ps(total);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(pr + 2 + c * 16, _mm512_setzero_ps());
  }
  // sum_j p_j v_j, 16 values at a time, in key order for every row. Rows that see the whole tile
  // go through it in groups (each value vector loaded once per group), the others one by one;
  // both do the same multiply-adds in the same order.
  std::vector<int64_t> whole;
  whole.reserve(R);
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const int64_t m = S - j0 < 16 ? S - j0 : 16;
    whole.clear();
    for (int64_t r = 0; r < R; ++r) {
      if (j0 >= seen[r]) continue;
      const int64_t upto = std::min(m, seen[r] - j0);
      if (upto == m) {
        whole.push_back(r);
      } else {
        weighted_values<C, 1>(&r, upto, scores + j0, values + (c0 + j0) * D, part);
      }
    }
    constexpr int GR = 16 / C;  // rows per group: GR * C accumulators
    size_t i = 0;
    for (; i + GR <= whole.size(); i += GR) weighted_values<C, GR>(whole.data() + i, m, scores + j0, values + (c0 + j0) * D, part);
    for (; i < whole.size(); ++i) weighted_values<C, 1>(whole.data() + i, m, scores + j0, values + (c0 + j0) * D, part);
  }
}

using ChunkFn = void (*)(const float*, int64_t, int64_t, const int64_t*, const float*, const float*,
                         int64_t, int64_t, float*, float*);

ChunkFn pick(int64_t D) {
  switch (D) {
    case 16: return chunk<1>;
    case 32: return chunk<2>;
    case 64: return chunk<4>;
    case 128: return chunk<8>;
    default: return nullptr;
  }
}

}  // namespace

bool decode_attention_supports(int64_t head_dim, int64_t heads, int64_t kv_heads) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 16 && pick(head_dim) != nullptr;
}

// q [n, heads, D]; k, v [kv_heads, capacity, D] (one layer of the cache) holding `end` positions,
// the last n of which are the queries' own. Returns [n, heads * D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t end, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && q.dim() == 3 && k.dim() == 3, "contiguous q [n, heads, D], k/v [kv_heads, capacity, D]");
  const int64_t n = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = k.size(0), capacity = k.size(1);
  TORCH_CHECK(k.size(2) == D && decode_attention_supports(D, heads, kv_heads), "unsupported head shape");
  TORCH_CHECK(n >= 1 && n <= 64 && end >= n && end <= capacity, "bad query count or cache length");
  const int64_t G = heads / kv_heads, R = n * G, chunks = (end + CHUNK - 1) / CHUNK;
  const ChunkFn fn = pick(D);
  std::vector<int64_t> limit(n);
  for (int64_t t = 0; t < n; ++t) limit[t] = end - n + t + 1;  // token t sees positions < limit[t]
  // Partials [kv_heads, chunks, R, D + 2]: max, sum, weighted values.
  std::vector<float> part(kv_heads * chunks * R * (D + 2));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  // Scaled queries by key/value head: qs[h][t * G + g] = scale * q[t][h * G + g].
  std::vector<float> qs(kv_heads * R * D);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < D; ++d)
        qs[((h / G) * R + t * G + h % G) * D + d] = qp[(t * heads + h) * D + d] * (float)scale;
  const int64_t items = kv_heads * chunks;
  #pragma omp parallel if (items > 1)
  {
    std::vector<float> scores(R * CHUNK);
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t h = i / chunks, c = i % chunks;
      fn(qs.data() + h * R * D, n, G, limit.data(), kp + h * capacity * D, vp + h * capacity * D,
         c * CHUNK, std::min((c + 1) * CHUNK, end), scores.data(), part.data() + i * R * (D + 2));
    }
  }
  // Merge each row's chunks in order.
  auto out = torch::empty({n, heads * D}, q.options());
  float* op = out.data_ptr<float>();
  std::vector<float> acc(D);
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      float top = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part[((h * chunks + c) * R + r) * (D + 2)]);
      float total = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* pr = part.data() + ((h * chunks + c) * R + r) * (D + 2);
        if (pr[0] == -INFINITY) continue;
        const float w = std::exp(pr[0] - top);
        total += pr[1] * w;
        for (int64_t d = 0; d < D; ++d) acc[d] += pr[2 + d] * w;
      }
      const int64_t t = r / G, g = r % G;
      float* dst = op + t * heads * D + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] / total;
    }
  }
  return out;
}
