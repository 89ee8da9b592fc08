// Parrot's CPU kernels: linear layers over GGUF block weights, causal attention of a few new
// tokens over a KV cache, and a whole decoding pass of a Llama-family or Gemma 3 model in one call. This
// file is the library's C interface; the work is in the headers, one job each:
//   formats.h    the block formats: each one's layout, and the table they are dispatched from
//   tiles.h      linear layers, float path: blocks expanded to float32 in registers
//   packed.h     linear layers, 8-bit path: packed copies of the weights, integer sums
//   amx.h        the same for K-quant prompt layers on AMX tiles (the amx set only)
//   linear.h     a layer of parts in any formats, in one parallel job
//   attention.h  attention over the KV cache
//   model.h      the whole decoding pass
//   simd.h       the vectors of each instruction set; pool.h the threads
//
// Compiled once per instruction set (simd.h: AVX-512 with or without AMX, AVX2 + FMA, portable), as one translation
// unit, into a plain shared library with a C interface, loaded by parrot/engine/kernels.py with
// ctypes.
//
// Batch invariance, the property greedy drafting's exactness rests on: every output element is
// computed by a sequence of operations fixed by its own row (its token, position and sequence),
// never by how many rows are computed with it, which tile they fall in, or which thread runs
// them. So a token's logits are the same bit for bit decoded alone or followed by a draft.

#include "formats.h"
#include "model.h"
#include "pool.h"
#include "simd.h"

extern "C" {

// The table of block formats (formats.h's PARROT_FORMATS), which kernels.py checks its own
// against: format i's name, ggml type id and GGUF block (bytes, weights); 0 past the end.
int32_t parrot_format_count() { return FORMAT_COUNT; }

int parrot_format_info(int32_t i, const char** name, int32_t* ggml_type, int64_t* block_bytes, int64_t* block_weights) {
  if (i < 0 || i >= FORMAT_COUNT) return 0;
  *name = FORMAT_INFO[i].name;
  *ggml_type = FORMAT_INFO[i].ggml_type;
  *block_bytes = FORMAT_INFO[i].block_bytes;
  *block_weights = FORMAT_INFO[i].block_weights;
  return 1;
}

// Rows `rows` of W (one part), de-quantised as the kernels expand them (the gguf reference's
// values): out [count, K].
void parrot_rows(const Mat* w, const int64_t* rows, int64_t count, float* out) { matrix_rows(w, rows, count, out); }

// Bytes of W's packed copy for the 8-bit path (0: its format has none).
int64_t parrot_packed_bytes(int32_t kind, int64_t N, int64_t K) { return packed_size(kind, N, K); }

// W (one part) packed into out (parrot_packed_bytes of it).
void parrot_pack(const Mat* w, uint8_t* out) { pack_matrix(w, out); }

// y = x @ W^T (+ bias) for x [M, K]; y [M, total N of the parts]; `q8`: 8-bit activations for
// the parts that have that path (linear.h).
void parrot_linear(const Mat* w, const float* x, int64_t M, float* y, int threads, int q8) { linear(w, x, M, y, threads, q8); }

int parrot_attention_supports(int64_t head_dim, int64_t heads, int64_t kv_heads) {
  return attention_supports(head_dim, heads, kv_heads);
}

// q [n, heads, D]; k, v [kv_heads, capacity, D] float32 holding `end` positions; out [n, heads * D];
// `window` > 0: each query sees only the last `window` positions up to its own.
void parrot_attention(const float* q, int64_t n, int64_t heads, int64_t D, const float* k, const float* v,
                      int64_t kv_heads, int64_t capacity, int64_t end, int64_t window, float scale, float* out,
                      int threads) {
  attention(q, n, heads, D, k, v, kv_heads, capacity, end, window, scale, out, threads);
}

// One decoding pass (model.h): ids every sequence's tokens, concatenated; logits [sum of
// num_logits, vocab]. Each cache grows by its n tokens (the caller has reserved the room).
void parrot_forward(const Model* md, int64_t num_seqs, const Seq* seqs, const int64_t* ids, float* logits) {
  forward(md, num_seqs, seqs, ids, logits);
}

const char* parrot_isa() { return ISA; }

// Whether this library runs prompt layers on AMX tiles (the amx set, when Linux grants them).
int parrot_amx_ready() {
#if defined(PARROT_AMX)
  return amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

// Reads `bytes` of `data` (split between `threads` threads, as a decoding pass reads its
// weights) `repeats` times; returns a sum so that the reads cannot be optimised away.
float parrot_read(const float* data, int64_t bytes, int repeats, int threads) {
  const int64_t n = bytes / (int64_t)sizeof(float), pieces = (n + 4095) / 4096;
  std::vector<float> sums(pieces);
  for (int r = 0; r < repeats; ++r) {
    pool(threads).parallel_for(pieces, [&](int64_t p) {
      F acc = zero();
      const int64_t i1 = std::min((p + 1) * 4096, n);
      for (int64_t i = p * 4096; i + L <= i1; i += L) acc = add(acc, load(data + i));
      sums[p] += hsum(acc);
    });
  }
  float total = 0.0f;
  for (float s : sums) total += s;
  return total;
}

}  // extern "C"
