// Linear layers as the library's callers give them: a chain of weight matrices (parts along N,
// each in its own block format), run in one parallel job on the float path (tiles.h) or the
// 8-bit path (packed.h); and a matrix's rows, packed copy and its size. Each reaches its format's
// struct through with_format (formats.h).

#pragma once

#include "amx.h"
#include "packed.h"
#include "pool.h"

#include <algorithm>
#include <memory>
#include <vector>

// One weight matrix as the library sees it (kernels.py builds these): N rows of K weights in
// one block format, and optionally the next matrix of a fused layer (q|k|v of different
// formats, as Q4_K_M files have), whose outputs follow along N.
struct Mat {
  int32_t kind;  // the format's place in PARROT_FORMATS
  int64_t N, K;
  const uint8_t* data;  // [N, K / weights per block blocks]
  const float* bias;    // [N] or null
  const Mat* next;      // the next part along N, or null
  const uint8_t* packed;  // the 8-bit path's packed copy (parrot_pack) of an integer format, or null
};

namespace {

// Bytes of one weight row of K weights in format W.
template <class W>
constexpr int64_t bytes_of(int64_t K) { return K / (32 * W::UNITS) * W::BYTES; }

// One part of a layer: the 8-bit path when asked for and the part has it (a packed copy of a
// 32-weight format, or a K-quant format; xu / xk are then the quantised x), the float path otherwise.
template <class W>
Tiles linear_part(const W& w, const uint8_t* packed, const float* x, const XU* xu, const XK* xk, int64_t M,
                  float* y, int64_t N, int64_t ldy) {
  if constexpr (W::SUPER) {
    if (packed != nullptr && xk != nullptr && xk->supers == w.K / 256) {
#if defined(PARROT_AMX)
      if (!xk->amx_tiles.empty()) {  // linear() decided: the formats that run on AMX do
        if constexpr (AMX_FOLDS<W>) return linear_amx(w, packed, *xk, M, y, N, ldy);
        if constexpr (AMX_DIGITS<W>) return linear_amx6(w, packed, *xk, M, y, N, ldy);
      }
#endif
      return linear_kpacked(w, packed, *xk, M, y, N, ldy);
    }
  } else if constexpr (W::INTEGER) {
    if (packed != nullptr && xu != nullptr && xu->K == w.K) return linear_packed(w, packed, *xu, M, y, N, ldy);
  }
  return linear_rows(w, x, M, w.K, y, N, ldy);
}

// Rows `rows` of W (one part), de-quantised as the kernels expand them (the gguf reference's
// values): out [count, K].
void matrix_rows(const Mat* w, const int64_t* rows, int64_t count, float* out) {
  with_format(w->kind, [&]<class W>() {
    if constexpr (W::INTEGER) {
      if (w->packed != nullptr) {  // the file's blocks may have been handed back: read the packed copy
        expand_packed_rows<W>(w->packed, w->K, rows, count, out);
        return;
      }
    }
    expand_rows(matrix<W>(w->data, w->K), rows, count, out);
  });
}

// Bytes of the packed copy for the 8-bit path of N rows of K weights in format `kind` (0: the
// format has none, or K is not a whole number of its super-blocks).
int64_t packed_size(int32_t kind, int64_t N, int64_t K) {
  const int64_t groups = (N + 7) / 8;
  int64_t size = 0;
  with_format(kind, [&]<class W>() {
    if constexpr (W::SUPER) size = K % 256 ? 0 : groups * (K / 256) * KLayout<W>::BYTES;
    else if constexpr (W::INTEGER) size = groups * (K / 32) * Pack<W>::BYTES;
  });
  return size;
}

// W (one part) packed into out (packed_size of it).
void pack_matrix(const Mat* w, uint8_t* out) {
  with_format(w->kind, [&]<class W>() {
    if constexpr (W::SUPER) kpack(matrix<W>(w->data, w->K), w->N, out);
    else if constexpr (W::INTEGER) pack(matrix<W>(w->data, w->K), w->N, out);
  });
}

constexpr int64_t PIECES = 4;
// A call over more rows of x than one tile (a prompt chunk) is split finer: its tiles compute for
// long on weights that stay in cache, so short pieces cost nothing in reading, and the thread that
// finishes first waits at most one short piece for the other. With PIECES, one thread spent 3.4%
// of a 400-token chunk's samples waiting at the end of layers (Qwen2.5-Coder-1.5B, AMD EPYC).
constexpr int64_t PIECES_WIDE = 32;
constexpr int Q8_FINE = 2;  // linear()'s q8 for x with multipliers per unit of 32 (below)

// y = x @ W^T (+ bias) for x [M, K]; y [M, total N of the parts]. `q8`: quantise x to 8 bits
// for the parts that have the 8-bit path (the K-quant formats, and the 32-weight formats given
// their packed copy); 0: float32 throughout. Q8_FINE: the K-quant parts' x with a multiplier per
// unit of 32 as well (XK::fine; the LM head), on packed.h's tiles whatever the number of rows.
// With q8 = 1 the K-quant parts' rows are rounded without their outliers, which are added in
// float32 as the tiles store y (XK split, outlier_sums).
void linear(const Mat* w, const float* x, int64_t M, float* y, int threads, int q8) {
  int64_t ldy = 0;
#if defined(PARROT_AMX)
  const bool amx = M >= AMX_MIN_ROWS && q8 != Q8_FINE && amx_ready();  // layers in the formats amx.h runs go there
#endif
  // K-quant parts on the packed tiles read x arranged (XK), parts on the AMX tiles read it in
  // their layout: each is made only where a part reads it.
  bool any_packed = false, any_super = false, any_amx = false;
  int forms = 0;  // the forms of x (XK::Forms) the K-quant parts read
  for (const Mat* p = w; p != nullptr; p = p->next) {
    ldy += p->N;
    with_format(p->kind, [&]<class W>() {
      if constexpr (W::SUPER) {
        any_super = true;
        bool on_amx = false;
#if defined(PARROT_AMX)
        if constexpr (AMX_FOLDS<W> || AMX_DIGITS<W>) on_amx = amx;
#endif
        if (p->packed != nullptr) {
          any_amx |= on_amx;
          forms |= on_amx ? XK::PLAIN : W::GROUP == 16 ? XK::BY16 : XK::BY32;
        }
      } else if constexpr (W::INTEGER) {
        any_packed |= p->packed != nullptr;
      }
    });
  }
  const std::unique_ptr<XU> xu(q8 && any_packed ? new XU(x, M, w->K) : nullptr);
  const std::unique_ptr<XK> xk(q8 && any_super && w->K % 256 == 0 ? new XK(x, M, w->K, threads, forms, q8 == Q8_FINE, q8 == 1) : nullptr);
#if defined(PARROT_AMX)
  if (xk && any_amx) amx_layout(*xk, M, threads);
#endif
  std::vector<Tiles> parts;
  std::vector<int64_t> first, bytes;  // each part's first cost unit in the job and bytes per tile
  int64_t total = 0, offset = 0;
  for (const Mat* p = w; p != nullptr; offset += p->N, p = p->next) {
    const int64_t K = p->K, N = p->N;
    Tiles part{[](int64_t) {}, 0};  // a kind the table does not have computes nothing
    int64_t row_bytes = 0;
    with_format(p->kind, [&]<class W>() {
      part = linear_part(matrix<W>(p->data, K), p->packed, x, xu.get(), xk.get(), M, y + offset, N, ldy);
      row_bytes = bytes_of<W>(K);
    });
    parts.push_back(std::move(part));
    const Tiles& added = parts.back();
    first.push_back(total);
    bytes.push_back(std::max<int64_t>(1, row_bytes * ((N + added.count - 1) / std::max<int64_t>(1, added.count))));
    total += added.count * bytes.back();
  }
  // One job over every part's tiles (a layer of several parts costs one hand-off to the
  // threads), split into pieces of equal bytes of weights: parts in different formats (a Q4_K_M
  // file's q, k and v) cost different amounts per tile. PIECES per thread, claimed as the threads
  // come free: with one piece each, the thread that started later or read slower memory kept the
  // other waiting at the end of every layer.
  //
  // Passes whose rows fit one tile (decoding, verifying drafts) read every weight from memory:
  // their pieces taper, each round of one piece per thread half the size of the round before
  // (the last round the size of the one before it), so that the thread that finishes first waits
  // at most a short piece, while most of the layer is read in long contiguous runs.
  const int64_t T = std::max(1, threads), pieces = T * (M > 8 ? PIECES_WIDE : PIECES), rounds = pieces / T;
  const auto weight = [&](int64_t id) -> int64_t {  // piece id's relative share: rounds of 8, 4, 2, 2 with PIECES = 4
    return M > 8 ? 1 : int64_t(1) << (rounds - 1 - std::min(id / T, rounds - 2));
  };
  int64_t sum = 0;
  for (int64_t id = 0; id < pieces; ++id) sum += weight(id);
  std::vector<int64_t> edge(pieces + 1, total);  // piece id covers cost units [edge[id], edge[id + 1])
  for (int64_t id = 0, at = 0; id < pieces; at += weight(id), ++id) edge[id] = total * at / sum;
  pool(threads).parallel_for(pieces, [&](int64_t id) {
    const int64_t lo = edge[id], hi = edge[id + 1];
    for (size_t i = 0; i < parts.size(); ++i) {
      // Tile t of part i starts at first[i] + t bytes[i]; it is this thread's if that is in [lo, hi).
      const auto from = [&](int64_t at) { return std::clamp<int64_t>((at - first[i] + bytes[i] - 1) / bytes[i], 0, parts[i].count); };
      for (int64_t t = from(lo), end = from(hi); t < end; ++t) parts[i].run(t);
    }
  }, pieces);
  for_rows(M, threads, [&](int64_t i) {
    int64_t at = 0;
    for (const Mat* p = w; p != nullptr; at += p->N, p = p->next)
      if (p->bias != nullptr)
        for (int64_t n = 0; n < p->N; ++n) y[i * ldy + at + n] += p->bias[n];
  });
}

}  // namespace
