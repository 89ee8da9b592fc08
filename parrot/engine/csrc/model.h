// A whole decoding pass of a Llama-family or Gemma 3 model in one call, for sequences that each
// feed a few tokens: the embedding, then per layer norm, q|k|v, (Gemma 3: q and k norms), RoPE,
// the KV cache, attention, o, (Gemma 3: a norm of its output), norm, gate|up, SiLU or GELU,
// down, (Gemma 3: a norm of its output) and the residuals, then the final norm and the LM head.
//
// Why a whole pass in one call: a decoding pass over the embedded model is ~20 small operations
// in each of 30 layers; dispatched one by one from Python/torch they cost more than the
// arithmetic (the weights of a 135M model stream from memory in a few milliseconds).

#pragma once

#include "attention.h"
#include "linear.h"

#include <cmath>
#include <vector>

// The model and the sequences of a pass as the library sees them (kernels.py builds these).
// A norm weight is the factor the normalised value is multiplied by (Gemma's 1 + w is passed
// as that sum); a norm that is null is not applied.
struct Layer {
  Mat qkv, o, gate_up, down;     // q|k|v and gate|up fused along N
  const float* input_norm;       // [hidden], before attention
  const float* ffn_norm;         // [hidden], before the MLP (Llama's post_attention_layernorm)
  const float* attn_post_norm;   // [hidden], on attention's output before its residual (Gemma 3), or null
  const float* ffn_post_norm;    // [hidden], on the MLP's output before its residual (Gemma 3), or null
  const float* q_norm;           // [head_dim], on each q head before RoPE (Gemma 3), or null
  const float* k_norm;           // [head_dim], on each k head before RoPE, or null
  const float* cos;              // this layer's rotary tables [max_positions, head_dim]
  const float* sin;
  int64_t window;                // a query sees this many positions up to its own; 0: all of them
};

// Activations of the gated MLP (act(gate) * up).
enum Activation : int32_t { SILU = 0, GELU_TANH = 1 };

struct Model {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_positions;
  float eps, scale;
  float embed_scale;        // token rows are multiplied by it (Gemma: sqrt(hidden); else 1)
  int32_t threads;
  int32_t q8;               // 8-bit activations for integer block formats (linear.h)
  int32_t kv16;             // the caches hold float16 (else float32)
  int32_t act;              // Activation
  const float* embed;       // [vocab, hidden] float32 rows, or null: rows of embed_blocks
  const Mat* embed_blocks;  // the embedding in blocks (a tied LM head's), expanded per token
  const float* final_norm;  // [hidden]
  Mat lm_head;
  const Layer* layers;
};

// One sequence of a pass: its cache (k, v [layers, kv_heads, capacity, head_dim], float16 where
// the model's kv16 is set, else float32; `start` positions filled), the n tokens it feeds, and
// how many of its last rows need logits. Sliding-window layers keep every position too (the
// window is applied when attending), so a cache can be cropped back to any length.
struct Seq {
  void* k;
  void* v;
  int64_t capacity, start, n, num_logits;
};

namespace {

// transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)), the sum of squares in a fixed order.
void rms_norm(const float* x, const float* weight, int64_t rows, int64_t H, float eps, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * H;
    F sq = zero();
    int64_t h = 0;
    for (; h + L <= H; h += L) { const F v = load(xr + h); sq = fmadd(v, v, sq); }
    float sum = hsum(sq);
    for (; h < H; ++h) sum += xr[h] * xr[h];
    const float inv = 1.0f / std::sqrt(sum / (float)H + eps);
    for (h = 0; h < H; ++h) out[i * H + h] = weight[h] * (xr[h] * inv);
  }
}

// x * cos + rotate_half(x) * sin over each head of one row (rotate_half(x) = [-x2, x1]).
void rope(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  float tmp[256];
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * D;
    for (int64_t d = 0; d < half; ++d) tmp[d] = xh[d] * cos[d] + (-xh[d + half]) * sin[d];
    for (int64_t d = half; d < D; ++d) tmp[d] = xh[d] * cos[d] + xh[d - half] * sin[d];
    std::memcpy(xh, tmp, D * sizeof(float));
  }
}

// silu(gate) * up = gate * up / (1 + exp(-gate)), of one row [gate | up] -> [I].
void silu_mul(const float* gu, int64_t I, float* out) {
  const float* g = gu;
  const float* u = g + I;
  int64_t j = 0;
  for (; j + L <= I; j += L) {
    const F gv = load(g + j);
    store(out + j, div(mul(gv, load(u + j)), add(set1(1.0f), exp(sub(zero(), gv)))));
  }
  for (; j < I; ++j) out[j] = g[j] * u[j] / (1.0f + std::exp(-g[j]));
}

// gelu_tanh(gate) * up, of one row [gate | up] -> [I]. gelu_tanh(x) = x (1 + tanh(u)) / 2 with
// u = sqrt(2 / pi) (x + 0.044715 x^3) (torch's gelu(approximate="tanh")), written as
// x / (1 + exp(-2u)), the same value.
void gelu_tanh_mul(const float* gu, int64_t I, float* out) {
  constexpr float c = -2.0f * 0.7978845608028654f, c3 = -2.0f * 0.7978845608028654f * 0.044715f;  // -2u = x (c + c3 x^2)
  const float* g = gu;
  const float* u = g + I;
  int64_t j = 0;
  for (; j + L <= I; j += L) {
    const F x = load(g + j);
    const F minus_2u = mul(x, add(set1(c), mul(set1(c3), mul(x, x))));
    store(out + j, div(mul(x, load(u + j)), add(set1(1.0f), exp(minus_2u))));
  }
  for (; j < I; ++j) {
    const float x = g[j];
    out[j] = x * u[j] / (1.0f + std::exp(x * (c + c3 * (x * x))));
  }
}

// ids: every sequence's tokens, concatenated; logits: [sum of num_logits, vocab]. Each cache
// grows by its n tokens (the caller has reserved the room and updates its lengths).
//
// The last layer runs its attention, o and MLP only for the rows that need logits (each
// sequence's last num_logits rows): the other rows' outputs of that layer feed nothing, and its
// keys and values come from q|k|v, which every row still computes. A prompt chunk then skips
// almost a layer's work (all of it for a chunk before the last), as llama.cpp does with its
// output rows; each kept row gets the same values as before, since no kernel's result for a
// row depends on the other rows.
void forward(const Model* md, int64_t num_seqs, const Seq* seqs, const int64_t* ids, float* logits) {
  const int64_t H = md->hidden, D = md->head_dim, heads = md->heads, kvh = md->kv_heads, I = md->intermediate;
  const int64_t q_width = heads * D, kv_width = kvh * D, qkv_width = q_width + 2 * kv_width;
  const int threads = md->threads;
  Pool::Hold hold(pool(threads));  // the workers stay awake until the pass ends
  int64_t M = 0, rows_out = 0;
  for (int64_t s = 0; s < num_seqs; ++s) { M += seqs[s].n; rows_out += seqs[s].num_logits; }
  std::vector<float> hidden(M * H), x(M * H), tmp(M * H), qkv(M * qkv_width), att(M * q_width),
      gu(M * 2 * I), act(M * I);
  if (md->embed != nullptr) {
    for (int64_t i = 0; i < M; ++i) std::memcpy(&hidden[i * H], md->embed + ids[i] * H, H * sizeof(float));
  } else {
    matrix_rows(md->embed_blocks, ids, M, hidden.data());
  }
  if (md->embed_scale != 1.0f)
    for (int64_t i = 0; i < M * H; ++i) hidden[i] *= md->embed_scale;
  const auto norm = [&](const float* in, const float* weight, int64_t rows, float* out) {
    for_rows(rows, threads, [&](int64_t i) { rms_norm(in + i * H, weight, 1, H, md->eps, out + i * H); });
  };
  const auto add_rows = [&](float* to, const float* from, int64_t rows) {
    for_rows(rows, threads, [&](int64_t i) {
      for (int64_t h = 0; h < H; ++h) to[i * H + h] += from[i * H + h];
    });
  };

  int64_t m = M;  // the rows that go on: all of them, then in the last layer the rows with logits
  for (int64_t l = 0; l < md->num_layers; ++l) {
    const Layer& layer = md->layers[l];
    const bool last = l + 1 == md->num_layers;
    norm(hidden.data(), layer.input_norm, m, x.data());
    linear(&layer.qkv, x.data(), m, qkv.data(), threads, md->q8);
    int64_t row = 0, out = 0;  // this sequence's first row in qkv, and in att
    for (int64_t s = 0; s < num_seqs; ++s) {
      const Seq& seq = seqs[s];
      const int64_t cache_layer = l * kvh * seq.capacity * D;
      for_rows(seq.n, threads, [&](int64_t t) {
        const int64_t pos = seq.start + t;
        float* r = &qkv[(row + t) * qkv_width];
        if (layer.q_norm != nullptr) rms_norm(r, layer.q_norm, heads, D, md->eps, r);  // each head, in place
        if (layer.k_norm != nullptr) rms_norm(r + q_width, layer.k_norm, kvh, D, md->eps, r + q_width);
        rope(r, heads + kvh, D, layer.cos + pos * D, layer.sin + pos * D);  // q and k heads are adjacent
        for (int64_t h = 0; h < kvh; ++h) {
          const int64_t at = cache_layer + (h * seq.capacity + pos) * D;
          const float *kr = r + q_width + h * D, *vr = r + q_width + kv_width + h * D;
          if (md->kv16) {
            for (int64_t d = 0; d < D; ++d) {
              static_cast<uint16_t*>(seq.k)[at + d] = to_half(kr[d]);
              static_cast<uint16_t*>(seq.v)[at + d] = to_half(vr[d]);
            }
          } else {
            std::memcpy(static_cast<float*>(seq.k) + at, kr, D * sizeof(float));
            std::memcpy(static_cast<float*>(seq.v) + at, vr, D * sizeof(float));
          }
        }
      });
      // The attention kernel reads q as [n, heads, D]: gather the rows that attend (the last nq).
      const int64_t nq = last ? seq.num_logits : seq.n, first = row + seq.n - nq;
      std::vector<float> q(nq * q_width);
      for_rows(nq, threads, [&](int64_t t) { std::memcpy(&q[t * q_width], &qkv[(first + t) * qkv_width], q_width * sizeof(float)); });
      if (last)  // the residual stream of the rows that go on, gathered in front (out <= first)
        std::memmove(&hidden[out * H], &hidden[first * H], nq * H * sizeof(float));
      if (nq > 0) {
        if (md->kv16)
          attention(q.data(), nq, heads, D, static_cast<const uint16_t*>(seq.k) + cache_layer,
                    static_cast<const uint16_t*>(seq.v) + cache_layer, kvh, seq.capacity, seq.start + seq.n, layer.window,
                    md->scale, &att[out * q_width], threads);
        else
          attention(q.data(), nq, heads, D, static_cast<const float*>(seq.k) + cache_layer,
                    static_cast<const float*>(seq.v) + cache_layer, kvh, seq.capacity, seq.start + seq.n, layer.window,
                    md->scale, &att[out * q_width], threads);
      }
      row += seq.n;
      out += nq;
    }
    m = out;
    if (m == 0) break;  // a chunk before a prompt's last: nothing needs the last layer's outputs
    linear(&layer.o, att.data(), m, tmp.data(), threads, md->q8);
    if (layer.attn_post_norm != nullptr) norm(tmp.data(), layer.attn_post_norm, m, tmp.data());
    add_rows(hidden.data(), tmp.data(), m);
    norm(hidden.data(), layer.ffn_norm, m, x.data());
    linear(&layer.gate_up, x.data(), m, gu.data(), threads, md->q8);
    for_rows(m, threads, [&](int64_t i) {
      if (md->act == GELU_TANH) gelu_tanh_mul(&gu[i * 2 * I], I, &act[i * I]);
      else silu_mul(&gu[i * 2 * I], I, &act[i * I]);
    });
    linear(&layer.down, act.data(), m, tmp.data(), threads, md->q8);
    if (layer.ffn_post_norm != nullptr) norm(tmp.data(), layer.ffn_post_norm, m, tmp.data());
    add_rows(hidden.data(), tmp.data(), m);
  }
  // Logits of each sequence's last num_logits rows, now hidden's first rows_out rows (the last
  // layer gathered them; a model without layers keeps every row).
  std::vector<float> last(rows_out * H);
  int64_t row = 0, out_row = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first = md->num_layers > 0 ? out_row : row + seqs[s].n - seqs[s].num_logits;
    norm(&hidden[first * H], md->final_norm, seqs[s].num_logits, &last[out_row * H]);
    out_row += seqs[s].num_logits;
    row += seqs[s].n;
  }
  if (rows_out > 0) linear(&md->lm_head, last.data(), rows_out, logits, threads, md->q8 ? Q8_FINE : 0);
}

}  // namespace
