// y = x @ W^T for weights kept in their GGUF block formats, with float32 activations and sums.
//
// Why: at one to a few tokens per pass a forward is bound by reading the weights. Float32 copies
// of the embedded model's weights are 540 MB per pass; its Q4_1 blocks are 4.5 bits per weight
// and its Q8_0 embedding 8.5. Each block is expanded to float32 in registers exactly as the
// GGUF defines it (Q4_1: d * q + m, Q8_0: d * q; d * q is exact in float32, so the fused
// multiply-add rounds once, like the separate multiply and add of the reference dequantisation),
// then multiplied with the activations in float32. The only difference from a float32 matmul
// of the dequantised weights is the order of the additions.
//
// Each output element is a sum over K in a fixed order whatever the number of rows M, so a row's
// result does not depend on the rows computed with it (batch invariance).
//
// Built by server/engine/quant.py with -mavx512f -mavx512bw -mfma -fopenmp; used only on CPUs that
// have AVX-512.

#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

namespace {

// One weight matrix in Q4_1: blocks of 32 along K; byte j of a block holds value j in its low
// nibble and value j + 16 in its high nibble.
struct Q4_1 {
  const uint8_t* qs;  // [N, K / 2]
  const float* d;     // [N, K / 32]
  const float* m;     // [N, K / 32]
  int64_t K;
  inline void block(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qs + n * (K / 2) + b * 16)));
    const __m512 scale = _mm512_set1_ps(d[n * (K / 32) + b]);
    const __m512 offset = _mm512_set1_ps(m[n * (K / 32) + b]);
    lo = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), offset);
    hi = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), offset);
  }
};

// One weight matrix in Q8_0: blocks of 32 signed bytes and one scale.
struct Q8_0 {
  const int8_t* qs;  // [N, K]
  const float* d;    // [N, K / 32]
  int64_t K;
  inline void block(int64_t n, int64_t b, __m512& lo, __m512& hi) const {
    const int8_t* p = qs + n * K + b * 32;
    const __m512 scale = _mm512_set1_ps(d[n * (K / 32) + b]);
    lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))));
    hi = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))));
  }
};

// MT rows of x against NT weight rows n .. n + NT - 1. Fixed sizes keep the MT x NT accumulators
// in registers; each block of a weight row is expanded once for all MT rows, and each load of x
// feeds NT multiply-adds. The empty asm keeps each x block in a register: left alone, the
// compiler folds the loads into the multiply-adds, loading every x block NT times, and wide
// tiles (6 rows and more) then wait on loads (measured: 8 rows x 3 weight rows took 7.0 ns per
// block and weight row instead of 5.9).
template <int MT, int NT, class W>
inline void tile(const W& w, const float* x, int64_t K, int64_t n, float* y, int64_t N) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512 lo[NT], hi[NT];
    for (int j = 0; j < NT; ++j) w.block(n + j, b, lo[j], hi[j]);
    for (int i = 0; i < MT; ++i) {
      __m512 x_lo = _mm512_loadu_ps(x + i * K + b * 32);
      __m512 x_hi = _mm512_loadu_ps(x + i * K + b * 32 + 16);
      asm("" : "+v"(x_lo), "+v"(x_hi));
      for (int j = 0; j < NT; ++j) {
        acc[i][j] = _mm512_fmadd_ps(lo[j], x_lo, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(hi[j], x_hi, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[i * N + n + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// Rows left over after the full MT-row tiles: one tile of R rows (R < MT).
template <int R, int MT, int NT, class W>
inline void rest(const W& w, const float* x, int64_t left, int64_t K, int64_t n, float* y, int64_t N) {
  if constexpr (R > 0 && R < MT) {
    if (left == R) tile<R, NT>(w, x, K, n, y, N);
    else rest<R - 1, MT, NT>(w, x, left, K, n, y, N);
  }
}

// All M rows of x against weight rows n .. n + NT - 1, MT rows of x at a time.
template <int MT, int NT, class W>
inline void columns(const W& w, const float* x, int64_t M, int64_t K, int64_t n, float* y, int64_t N) {
  int64_t i = 0;
  for (; i + MT <= M; i += MT) tile<MT, NT>(w, x + i * K, K, n, y + i * N, N);
  rest<MT - 1, MT, NT>(w, x + i * K, M - i, K, n, y + i * N, N);
}

template <int MT, int NT, class W>
void run(const W& w, const float* xp, int64_t M, int64_t K, float* yp, int64_t N) {
  const int64_t tiled = N - N % NT;
  #pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < tiled; n += NT) columns<MT, NT>(w, xp, M, K, n, yp, N);
  for (int64_t n = tiled; n < N; ++n) columns<MT, 1>(w, xp, M, K, n, yp, N);
}

template <class W>
torch::Tensor linear(const W& w, const torch::Tensor& x, int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Up to 8 rows in one tile, so that each weight block is expanded once per pass: 4 weight rows
  // at a time up to 6 rows of x (24 accumulators), 3 beyond. Groups of four with the rest in a
  // second tile expanded every block again (single thread, 3072 x 576 Q4_1, ns per block and
  // weight row: 1 row 2.0, 4 rows 3.7, 5 rows 4.1; 6 rows 6.3 as 4 + 2 -> 4.8 in one tile,
  // 7 rows 6.9 -> 5.3, 8 rows 7.3 -> 5.9).
  if (M <= 4) run<4, 4>(w, xp, M, K, yp, N);
  else if (M == 5) run<5, 4>(w, xp, M, K, yp, N);
  else if (M == 6) run<6, 4>(w, xp, M, K, yp, N);
  else run<8, 3>(w, xp, M, K, yp, N);
  return y;
}

}  // namespace

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(qs.dtype() == torch::kUInt8 && qs.is_contiguous() && qs.size(1) * 2 == x.size(1), "bad Q4_1 blocks");
  TORCH_CHECK(d.is_contiguous() && m.is_contiguous() && d.dtype() == torch::kFloat32 && m.dtype() == torch::kFloat32, "bad Q4_1 scales");
  return linear(Q4_1{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), x.size(1)}, x, qs.size(0));
}

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  TORCH_CHECK(qs.dtype() == torch::kInt8 && qs.is_contiguous() && qs.size(1) == x.size(1), "bad Q8_0 blocks");
  TORCH_CHECK(d.is_contiguous() && d.dtype() == torch::kFloat32, "bad Q8_0 scales");
  return linear(Q8_0{qs.data_ptr<int8_t>(), d.data_ptr<float>(), x.size(1)}, x, qs.size(0));
}

// attention.cpp
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t end, double scale);
bool decode_attention_supports(int64_t head_dim, int64_t heads, int64_t kv_heads);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q4_1_linear", &q4_1_linear, "x @ W^T with W in GGUF Q4_1 blocks");
  module.def("q8_0_linear", &q8_0_linear, "x @ W^T with W in GGUF Q8_0 blocks");
  module.def("decode_attention", &decode_attention, "causal attention of a few new tokens over a KV cache");
  module.def("decode_attention_supports", &decode_attention_supports, "whether decode_attention covers this head shape");
}
