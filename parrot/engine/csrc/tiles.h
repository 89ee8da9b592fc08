// The float path of the linear layers: y = x @ W^T for W [N, K] in any block format (formats.h),
// each weight block expanded to float32 in registers and multiplied by float32 x. It also serves
// the 8-bit path's tiling (Tiles: a layer's work as tiles that one parallel job runs) and the
// expansion of whole weight rows (an embedding's token rows).

#pragma once

#include "formats.h"

#include <functional>
#include <type_traits>

namespace {

// How far ahead of a weight row's reads the kernels fetch it. The rows of a tile are short
// interleaved streams that the hardware prefetcher follows too late; fetching 4 KB ahead made
// one-row passes over large matrices (32768 x 2048) 15-40% faster than 1 KB (Q4_K 19.3 against
// 17.3 GB/s, Q6_K 19.7 against 10.6, Q8_0 22.7 against 16.9; AVX2 EPYC) and the 1B Q4_K_M
// file's one-token pass 11% faster. Past a row's end it fetches the next tiles' rows.
constexpr int64_t AHEAD = 4096;

// MT rows of x against NT weight rows n .. n + NT - 1. Each accumulator acc[i][j] sums
// w[j] part * x[i] part over blocks and parts in order, then its lanes in hsum's order: the same
// sequence whatever MT and NT are. Each part of a weight block is expanded once for the MT rows
// and each x part is loaded once for the NT weight rows (pinned in a register).
template <int MT, int NT, class W>
inline void tile(const W& w, const float* x, int64_t K, int64_t n, float* y, int64_t ldy) {
  F acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = zero();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk[NT];
    Scales sc[NT];
    for (int j = 0; j < NT; ++j) {
      blk[j] = w.block(n + j, b);
      __builtin_prefetch(blk[j] + AHEAD);
      sc[j] = W::scales(blk[j], b);
    }
    for (int s = 0; s < PARTS; ++s) {
      F wp[NT];
      for (int j = 0; j < NT; ++j) wp[j] = W::part(blk[j], b, s, sc[j]);
      for (int i = 0; i < MT; ++i) {
        F xp = load(x + i * K + b * 32 + s * L);
        pin(xp);
        for (int j = 0; j < NT; ++j) acc[i][j] = fmadd(wp[j], xp, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[i * ldy + n + j] = hsum(acc[i][j]);
}

// Rows left after the full MT-row tiles: one tile of R rows (R < MT).
template <int R, int MT, int NT, class W>
inline void rest(const W& w, const float* x, int64_t left, int64_t K, int64_t n, float* y, int64_t ldy) {
  if constexpr (R > 0 && R < MT) {
    if (left == R) tile<R, NT>(w, x, K, n, y, ldy);
    else rest<R - 1, MT, NT>(w, x, left, K, n, y, ldy);
  }
}

template <int MT, int NT, class W>
inline void columns(const W& w, const float* x, int64_t M, int64_t K, int64_t n, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + MT <= M; i += MT) tile<MT, NT>(w, x + i * K, K, n, y + i * ldy, ldy);
  rest<MT - 1, MT, NT>(w, x + i * K, M - i, K, n, y + i * ldy, ldy);
}

// A layer's work as tiles of NT weight rows (the last one narrower), so that one parallel job
// covers every part of a fused layer: `run(t)` computes tile t of `count`.
struct Tiles {
  std::function<void(int64_t)> run;
  int64_t count;
};

// Tiles of NT of N weight rows: tile t runs columns(n, width) for n = t NT with width NT, or,
// for a last tile narrower than NT, for each of its rows with width 1 (a std::integral_constant).
template <int NT, class Columns>
Tiles row_tiles(int64_t N, Columns columns) {
  return {[=](int64_t t) {
            const int64_t n = t * NT;
            if (n + NT <= N) columns(n, std::integral_constant<int, NT>{});
            else for (int64_t c = n; c < N; ++c) columns(c, std::integral_constant<int, 1>{});
          },
          (N + NT - 1) / NT};
}

template <int MT, int NT, class W>
Tiles tiles(const W& w, const float* x, int64_t M, int64_t K, float* y, int64_t N, int64_t ldy) {
  return row_tiles<NT>(N, [=](int64_t n, auto width) { columns<MT, decltype(width)::value>(w, x, M, K, n, y, ldy); });
}

// Tile shapes by the number of rows, so that each weight block is expanded once per pass for up
// to 8 rows: MT x NT accumulators, NT expanded weight parts and one x part fit the registers.
template <class W>
Tiles linear_rows(const W& w, const float* x, int64_t M, int64_t K, float* y, int64_t N, int64_t ldy) {
  if constexpr (REGISTERS >= 32) {
    if (M <= 4) return tiles<4, 4>(w, x, M, K, y, N, ldy);
    if (M == 5) return tiles<5, 4>(w, x, M, K, y, N, ldy);
    if (M == 6) return tiles<6, 4>(w, x, M, K, y, N, ldy);
    return tiles<8, 3>(w, x, M, K, y, N, ldy);
  } else {
    // 16 registers: 2 weight rows at a time up to 6 rows, 1 beyond (wider tiles, which also
    // hold the scales of every weight row, spilled registers and measured slower).
    if (M <= 2) return tiles<2, 2>(w, x, M, K, y, N, ldy);
    if (M == 3) return tiles<3, 2>(w, x, M, K, y, N, ldy);
    if (M == 4) return tiles<4, 2>(w, x, M, K, y, N, ldy);
    if (M <= 6) return tiles<6, 2>(w, x, M, K, y, N, ldy);
    return tiles<8, 1>(w, x, M, K, y, N, ldy);
  }
}

// Rows `rows` of W expanded to float32, as the float path expands them (the reference's values).
template <class W>
void expand_rows(const W& w, const int64_t* rows, int64_t count, float* out) {
  const int64_t K = w.K;
  for (int64_t i = 0; i < count; ++i)
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = w.block(rows[i], b);
      const Scales c = W::scales(blk, b);
      for (int s = 0; s < PARTS; ++s) store(out + i * K + b * 32 + s * L, W::part(blk, b, s, c));
    }
}

}  // namespace
