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
// once for all rows. Partial results are then merged per row in chunk order. Every step of a
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

// Sixteen dot products, one per accumulator (its 16 lanes summed), as one vector: lane j = sum of
// a[j]. A fixed tree of adds, the same for every call.
inline __m512 transpose_sum16(const __m512* a) {
  __m512 t[8], u[4], x[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane sums of a, b, c, d
    const __m512d p = _mm512_castps_pd(t[2 * i]), q = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes 0+1 and 2+3 of two groups of four
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t CHUNK = 256;

// One item: rows r = t * G + g (token t sees keys < limit[t]) against keys [c0, c1) of one
// key/value head. Writes per row: max, sum of exp(s - max), sum of exp(s - max) v (D floats);
// max = -inf when the row sees none of the chunk.
template <int C>
void chunk(const float* q, int64_t q_stride, int64_t n, int64_t G, const int64_t* limit, const float* keys,
           const float* values, int64_t c0, int64_t c1, float scale, float* scores, float* part) {
  constexpr int D = 16 * C;
  const int64_t R = n * G, S = c1 - c0;
  // Scores, 16 keys at a time; each key tile is read from memory once and stays in L1 for all rows.
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const int64_t m = S - j0 < 16 ? S - j0 : 16;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = r / G, g = r % G;
      const float* qr = q + t * q_stride + g * D;
      __m512 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(qr + c * 16), _mm512_set1_ps(scale));
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        if (j < m) {
          const float* k = keys + (c0 + j0 + j) * D;
          acc[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
          for (int c = 1; c < C; ++c) acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), acc[j]);
        } else {
          acc[j] = _mm512_setzero_ps();
        }
      }
      _mm512_storeu_ps(scores + r * CHUNK + j0, transpose_sum16(acc));
    }
  }
  // Softmax pieces per row over the keys it sees in this chunk.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t seen = std::min(std::max(limit[r / G] - c0, (int64_t)0), S);
    float* pr = part + r * (D + 2);
    float* sr = scores + r * CHUNK;
    if (seen == 0) {
      pr[0] = -INFINITY;
      pr[1] = 0.0f;
      continue;
    }
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < seen; j0 += 16) {
      const __mmask16 valid = (__mmask16)((1u << (seen - j0 < 16 ? seen - j0 : 16)) - 1);
      best = _mm512_mask_max_ps(best, valid, best, _mm512_maskz_loadu_ps(valid, sr + j0));
    }
    const float top = _mm512_reduce_max_ps(best);
    const __m512 bv = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < seen; j0 += 16) {
      const __mmask16 valid = (__mmask16)((1u << (seen - j0 < 16 ? seen - j0 : 16)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sr + j0), bv)));
      _mm512_storeu_ps(sr + j0, e);  // zero past `seen`
      total = _mm512_add_ps(total, e);
    }
    pr[0] = top;
    pr[1] = _mm512_reduce_add_ps(total);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(pr + 2 + c * 16, _mm512_setzero_ps());
  }
  // sum_j p_j v_j, 16 values at a time; each value tile is read once for all rows.
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const int64_t m = S - j0 < 16 ? S - j0 : 16;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t seen = std::min(std::max(limit[r / G] - c0, (int64_t)0), S);
      if (j0 >= seen) continue;
      const int64_t upto = std::min(m, seen - j0);
      float* pr = part + r * (D + 2) + 2;
      const float* sr = scores + r * CHUNK + j0;
      __m512 o[C];
      for (int c = 0; c < C; ++c) o[c] = _mm512_loadu_ps(pr + c * 16);
      for (int64_t j = 0; j < upto; ++j) {
        const __m512 p = _mm512_set1_ps(sr[j]);
        const float* v = values + (c0 + j0 + j) * D;
        for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + c * 16), o[c]);
      }
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(pr + c * 16, o[c]);
    }
  }
}

using ChunkFn = void (*)(const float*, int64_t, int64_t, int64_t, const int64_t*, const float*, const float*,
                         int64_t, int64_t, float, float*, float*);

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

// q [n, heads, D]; k, v [kv_heads, capacity, D] (one layer of the cache) holding `end` positions,
// the last n of which are the queries' own. Returns [n, heads * D].
bool decode_attention_supports(int64_t head_dim, int64_t heads, int64_t kv_heads) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 16 && pick(head_dim) != nullptr;
}

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
  const int64_t items = kv_heads * chunks;
  #pragma omp parallel if (items > 1)
  {
    std::vector<float> scores(R * CHUNK);
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t h = i / chunks, c = i % chunks;
      fn(qp + h * G * D, heads * D, n, G, limit.data(), kp + h * capacity * D, vp + h * capacity * D,
         c * CHUNK, std::min((c + 1) * CHUNK, end), (float)scale, scores.data(), part.data() + i * R * (D + 2));
    }
  }
  // Merge each row's chunks in order.
  auto out = torch::empty({n, heads * D}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      float top = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part[((h * chunks + c) * R + r) * (D + 2)]);
      float total = 0.0f;
      std::vector<float> acc(D, 0.0f);
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
