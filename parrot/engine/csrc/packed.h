// The 8-bit path of the linear layers: x rounded to 8 bits, weights in a packed copy with 8 weight
// rows interleaved (one layout for the 32-weight formats, one for the K-quant formats), products
// summed in integers. What differs between formats comes from their structs (formats.h).

#pragma once

#include "pool.h"
#include "tiles.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------
// Linear layers with 8-bit activations: each row of x is quantised per unit of 32 (as Q8_0:
// a float multiplier and 32 signed bytes) and each unit's dot product with a weight unit is an
// exact integer sum of byte products, scaled once: 32 multiply-adds in two instructions where
// the float path spends four multiply-adds and the expansion of the weights to floats. A row's
// quantisation depends on its own values only, and its sums run in the same order whatever the
// tile, so this path is batch-invariant as the float one is; it rounds x to 8 bits first (as
// llama.cpp does for these formats), which the float path does not.

// ---------------------------------------------------------------------------------------------
// Packed weights for the 8-bit path: the 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with
// 8 weight rows interleaved, so that one vector of byte products covers 8 weight rows at once.
//
// Why: in the file's layout a unit's 32 products for one weight row end in one vector whose lanes
// must be summed, converted and scaled per row (~5 instructions per 32 multiply-adds); an 8-token
// verify pass or a prompt chunk was bound by that bookkeeping, not by the multiplications. Here
// the lanes are the 8 weight rows: step t (t = 0..7) of a unit is one vector holding weights
// 4t..4t+3 of each of the 8 rows, multiplied by x's bytes 4t..4t+3 broadcast; the 8 steps' 16-bit
// sums add up (4-bit values: at most 8 x 2 x 15 x 127, no overflow) and widen once, and one
// conversion and one multiply-add scale the unit for all 8 rows. Each weight row still gets
// exactly its own unit sums in unit order: a row's result does not depend on the rows of x
// computed with it (batch invariance) or on which group or thread computed it.
//
// A group (8 weight rows; the last one padded with zero rows) holds its units one after the
// other, each Pack<W>::BYTES bytes, the same size as the file's 8 blocks:
//   d: 8 float16 (row r at 2r) | m: 8 float16 (formats with a min) | h: 32 bytes of 5th bits
//   (5-bit formats; bit t of byte 4r + j: the 5th bit of value 4t + j of row r) | q: 4-bit
//   formats 128 bytes (byte 32p + 4r + j: value 4p + j of row r in the low nibble, 4(p + 4) + j
//   in the high one), Q8_0 256 bytes (byte 32t + 4r + j: value 4t + j of row r).
template <class W>
struct Pack {
  static constexpr int64_t M_AT = 16, H_AT = W::MIN ? 32 : 16, Q_AT = H_AT + (W::BITS == 5 ? 32 : 0);
  static constexpr int64_t BYTES = Q_AT + (W::BITS == 8 ? 256 : 128);
  // Value k of row r: in byte q_byte (its low 4 bits from q_shift, or the whole byte for Q8_0);
  // a 5-bit format's 5th bit is bit k / 4 of byte h_byte. pack writes there, unpack_row reads.
  static int64_t q_byte(int k, int64_t r) { return Q_AT + 32 * (W::BITS == 8 ? k / 4 : k / 4 % 4) + 4 * r + k % 4; }
  static int q_shift(int k) { return W::BITS == 8 || k / 4 < 4 ? 0 : 4; }
  static int64_t h_byte(int k, int64_t r) { return H_AT + 4 * r + k % 4; }
};

template <class W>
void pack(const W& w, int64_t N, uint8_t* out) {
  using P = Pack<W>;
  const int64_t units = w.K / 32, groups = (N + 7) / 8;
  std::memset(out, 0, groups * units * P::BYTES);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < units; ++b) {
      uint8_t* o = out + (g * units + b) * P::BYTES;
      for (int64_t r = 0; r < 8 && g * 8 + r < N; ++r) {
        const uint8_t* blk = w.block(g * 8 + r, b);
        uint8_t values[32];
        bytes::bstore(values, W::bytes(blk, b));
        std::memcpy(o + 2 * r, blk, 2);
        if constexpr (W::MIN) std::memcpy(o + P::M_AT + 2 * r, blk + 2, 2);
        for (int k = 0; k < 32; ++k) {
          if constexpr (W::BITS == 8) {
            o[P::q_byte(k, r)] = values[k];
          } else {
            o[P::q_byte(k, r)] |= (uint8_t)((values[k] & 15) << P::q_shift(k));
            if constexpr (W::BITS == 5) o[P::h_byte(k, r)] |= (uint8_t)(((values[k] >> 4) & 1) << (k / 4));
          }
        }
      }
    }
}

// Rows of x quantised per unit of 32 for the packed kernels: q [M, K], and per row and unit its
// multiplier d, s = d times the sum of its q (the min term), and the sum of its q (the offset term).
struct XU {
  int64_t K, units;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  XU(const float* x, int64_t M, int64_t K_) : K(K_), units(K_ / 32), q(M * K_), d(M * units), s(M * units), sum(M * units) {
    for (int64_t at = 0; at < M * units; ++at) {
      int32_t fours[8];
      d[at] = bytes::quantize(x + at * 32, &q[at * 32], fours);
      int32_t total = 0;
      for (int k = 0; k < 8; ++k) total += fours[k];
      sum[at] = total;
      s[at] = d[at] * (float)total;
    }
  }
};

// The `bytes` of packed weights at blk, fetched ahead of a tile's reads. A call over many rows of
// x (a prompt chunk) fetches AHEAD (4 KB) into L1. A call whose rows fit one tile (a decoding or
// verifying pass) is different: it reads each weight once from memory and spends little time per
// byte, so the hardware prefetcher's few misses in flight leave the core waiting, and near
// fetches only added to them (1B Q4_K_M one-token pass 10% faster without, AVX2 EPYC). Fetched
// FAR_AHEAD (32 KB, into L2) instead, one-row passes over 0.5-0.7 GB of weights went from 64-68%
// to 74-81% (Q4_K, Q6_K; avx512 build) and 67-73% to 82-87% (avx2 build) of the read bandwidth
// the probe measures (Intel Xeon, 2 threads); 4 KB into L1 was slower than none. Passes over 2-8
// tokens (verifying drafts) fetched near until 2026-11-27; far, Qwen2.5-Coder-1.5B's 2-token pass
// at 512 tokens of context went 55.3-58.6 -> 53.4-53.5 ms, 3 and 4 tokens 0-6% faster, 6-8 the
// same (amx set, Intel Xeon). Past a group's end this fetches the next groups, which the same
// thread reads next.
//
// Since 2026-11-27 such a call also fetches NEAR_AHEAD (1 KB) on into L1, the lines the far
// fetch has brought to L2 by then: the tiles' loads otherwise waited on L2 (perf of the avx2
// set's one-token pass: half the Q4_K tiles' samples just after the far fetch). Qwen2.5-Coder-
// 1.5B at 512 tokens of context, Intel Xeon, interleaved: one-token pass 46.2-48.1 -> 41.1-42.1
// ms (amx set), 50.0-51.2 -> 46.1-47.9 (avx2 set); passes over 2, 4 and 8 tokens 9-10%, 9-10%
// and 6-7% faster (amx); 2 KB and 4 KB gave about the same; without the far fetch the avx2 pass
// took 59-60 ms.
//
// An AMD Zen 4 is the other way round, and kernels.py builds the avx512 and avx2 sets there with
// PARROT_NEAR_FETCH=0, the far fetch alone. On an AMD EPYC (Zen 4, avx512 set; 2026-11-28, nine
// interleaved pairs of processes) Qwen2.5-Coder-1.5B's one-token pass at 512 tokens of context
// went 39.1-45.6 -> 34.7-38.1 ms without the near fetch (0.78-0.96x in every pair), at 4,096 (a
// cache of random keys and values) 45.0-51.6 -> 40.4-46.8 ms, 8 tokens at 512 0.80-1.04x (8 pairs
// of 9 faster or equal); perf of that 8-token pass had 11% of the Q4_K tiles' samples on the prefetches.
// Prompt chunks keep their AHEAD fetch there (a 400-token chunk 2.40-2.52 s with it, 2.60-2.87
// without). The avx2 set on the same Zen 4 (as on an EPYC whose hypervisor hides AVX-512; three
// interleaved pairs of processes, 2026-11-28): one token at 512 43.3 / 43.2 / 42.3 -> 31.3 /
// 34.1 / 33.4 ms, 2 tokens 0.80-0.83x, 4 tokens 0.81-1.12x, 8 tokens 1.00-1.25x (near fetch off
// against on); then 1-7 tokens faster in three more pairs, 8 tokens 0.81-0.96x.
#ifndef PARROT_NEAR_FETCH
#define PARROT_NEAR_FETCH 1
#endif
constexpr int64_t FAR_AHEAD = 32768, NEAR_AHEAD = 1024;
inline void fetch_ahead(const uint8_t* blk, int64_t bytes, bool far) {
  for (int64_t o = 0; o < bytes; o += 64) {
    if (far) {
      __builtin_prefetch(blk + FAR_AHEAD + o, 0, 2);
      if constexpr (PARROT_NEAR_FETCH) __builtin_prefetch(blk + NEAR_AHEAD + o);
    } else {
      __builtin_prefetch(blk + AHEAD + o);
    }
  }
}

// A group's outputs for MT rows of x: the first `valid` lanes of each accumulator, ldy apart.
// With `out` (outlier_sums), each row with outliers (slots[i], its slot) gets its 8 sums added.
template <int MT>
inline void store_group(const bytes::G* acc, float* y, int64_t ldy, int64_t valid, const float* out = nullptr,
                        const int32_t* slots = nullptr) {
  for (int i = 0; i < MT; ++i) {
    const bytes::G sum = out != nullptr && slots[i] >= 0 ? bytes::gadd(acc[i], bytes::gload(out + slots[i] * 8)) : acc[i];
    if (valid == 8) {  // a whole group: one store (a call to memcpy per row was 2% of a prompt chunk)
      bytes::gstore(y + i * ldy, sum);
    } else {
      float lanes[8];
      bytes::gstore(lanes, sum);
      std::memcpy(y + i * ldy, lanes, valid * sizeof(float));
    }
  }
}

// Rows of x a tile takes at a time: 4 with 16 vector registers (4 accumulators, 4 sums, the
// weights and x's bytes), 8 with AVX-512's 32, which halves the weights' unpacking per row of x
// (Qwen2.5-Coder-1.5B, a 512-token prompt chunk: 3.26-3.32 s against 3.58-3.68 s, Intel Xeon).
constexpr int TILE_ROWS = simd::REGISTERS >= 32 ? 8 : 4;
// The K-quant tiles take 8 rows in every build. With 16 registers some of a row's sums spill to
// L1, but a pass over 5-8 tokens (verifying drafts) then unpacks each weight once instead of
// twice: Qwen2.5-Coder-1.5B at 512 tokens of context, avx2 set, two interleaved A/B runs, 5 / 6 /
// 8 tokens 1.60-1.62 / 1.76 / 2.07-2.08x a one-token pass -> 1.41-1.44 / 1.54-1.57 / 1.79-1.84x,
// 1-4 tokens the same, a 512-token prompt chunk 3.98 -> 3.87 s (Intel Xeon). The 32-weight formats' tiles (the embedded model's Q4_1) were no
// faster at 8 in that build, so they keep TILE_ROWS.
constexpr int KTILE_ROWS = 8;

// One tile per group of 8 weight rows (`stride` bytes apart in `packed`), all M rows of x through
// it ROWS at a time:
// run(MT, group, row, n, valid, far) computes rows row .. row + MT - 1 against the group of outputs
// n .. n + valid - 1; `far`: all M rows fit one tile, which then reads each weight once
// (fetch_ahead).
template <int ROWS = TILE_ROWS, class Run>
Tiles group_tiles(const uint8_t* packed, int64_t stride, int64_t M, int64_t N, Run run) {
  return {[=](int64_t g) {
            const uint8_t* group = packed + g * stride;
            const int64_t n = g * 8, valid = std::min<int64_t>(8, N - n);
            const bool far = M <= ROWS;
            int64_t i = 0;
            for (; i + ROWS <= M; i += ROWS) run(std::integral_constant<int, ROWS>{}, group, i, n, valid, far);
            [&]<int... R>(std::integer_sequence<int, R...>) {  // the last M - i < ROWS rows, one tile
              ((M - i == R + 1 ? run(std::integral_constant<int, R + 1>{}, group, i, n, valid, far) : void()), ...);
            }(std::make_integer_sequence<int, ROWS - 1>{});
          },
          (N + 7) / 8};
}

// MT rows of x (from `row`) against one group of 8 weight rows (outputs n .. n + valid - 1);
// `far` as group_tiles passes it.
template <int MT, class W>
inline void ptile(const uint8_t* group, const XU& x, int64_t row, int64_t n, int64_t valid, float* y, int64_t ldy,
                  bool far) {
  using namespace bytes;
  using P = Pack<W>;
  const int64_t units = x.units;
  const int8_t* xq[MT];
  const float *xd[MT], *xs[MT];
  const int32_t* xsum[MT];
  G acc[MT];
  for (int i = 0; i < MT; ++i) {
    acc[i] = gzero();
    xq[i] = &x.q[(row + i) * x.K];
    xd[i] = &x.d[(row + i) * units];
    xs[i] = &x.s[(row + i) * units];
    xsum[i] = &x.sum[(row + i) * units];
  }
  for (int64_t b = 0; b < units; ++b) {
    const uint8_t* blk = group + b * P::BYTES;
    fetch_ahead(blk, P::BYTES, far);
    S sum[MT];
    if constexpr (W::BITS == 8) {
      for (int i = 0; i < MT; ++i) sum[i] = szero();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const B wt = load(blk + P::Q_AT + 32 * t), wa = babs(wt);
        for (int i = 0; i < MT; ++i) sum[i] = sadd(sum[i], dot(wa, sign_of(bcast4(xq[i] + 32 * b + 4 * t), wt)));
      }
    } else {
      H part[MT];
      for (int i = 0; i < MT; ++i) part[i] = hzero();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        B wt = bits(load(blk + P::Q_AT + 32 * (t % 4)), t < 4 ? 0 : 4, 15);
        if constexpr (W::BITS == 5) wt = bor(wt, fifth(load(blk + P::H_AT), t));
        for (int i = 0; i < MT; ++i) {
          part[i] = hplus(part[i], pdot16(wt, bcast4(xq[i] + 32 * b + 4 * t)));
          hpin(part[i]);  // summed in step order, not as a tree of all 8 steps' products (which spills)
        }
        if (W::BITS == 5 && t == 3)  // 5-bit values: widen every 4 steps (8 would overflow 16 bits)
          for (int i = 0; i < MT; ++i) { sum[i] = widen(part[i]); part[i] = hzero(); }
      }
      for (int i = 0; i < MT; ++i) sum[i] = W::BITS == 5 ? sadd(sum[i], widen(part[i])) : widen(part[i]);
    }
    const G dw = ghalf8(blk);
    for (int i = 0; i < MT; ++i) {
      if constexpr (W::SHIFT > 0) sum[i] = ssub(sum[i], sset1(xsum[i][b] << W::SHIFT));
      acc[i] = gfmadd(gfloat(sum[i]), gmul(dw, gset1(xd[i][b])), acc[i]);
      if constexpr (W::MIN) acc[i] = gfmadd(ghalf8(blk + P::M_AT), gset1(xs[i][b]), acc[i]);
    }
  }
  store_group<MT>(acc, y + row * ldy + n, ldy, valid);
}

template <class W>
Tiles linear_packed(const W& w, const uint8_t* packed, const XU& x, int64_t M, float* y, int64_t N, int64_t ldy) {
  return group_tiles(packed, (w.K / 32) * Pack<W>::BYTES, M, N, [=, &x](auto mt, const uint8_t* group, int64_t i, int64_t n, int64_t valid, bool far) {
    ptile<decltype(mt)::value, W>(group, x, i, n, valid, y, ldy, far);
  });
}

// PARROT_NARROW_ROWS (the avx512 set; kernels.py's TUNING sets 2 on AMD cores): a call over at
// most that many rows of x (a one-token pass, or one verifying a single draft) takes the 256-bit
// steps of kptile, as the avx2 set does, instead of kpairs' 512-bit step pairs and kptile2, and
// its x is arranged in their order (not VNNI's). The same integer sums, so the same results. On a
// Zen 4 (AMD EPYC, 2026-11-29), one process alternating two builds pass by pass over one loaded
// Qwen2.5-Coder-1.5B (medians of 60 or 40 pairs; logits equal): one-token passes at 512 tokens of
// context 0.91, 0.96, 0.96 and 0.96x, at 4,096 0.97x; two-token passes 0.97 and 0.98x against
// kptile2; three tokens (both builds on kptile2) 1.005x. The K-quant layers alone streamed one
// row from memory 0-11% faster so (Q4_K 3-11%, Q6_K 0-7%), though in a core's L2 the pairs are
// the faster (0.54 against 0.59 ns a step); why the narrower steps stream better was not taken
// apart. On the Intel Xeon the pairs had taken 12% off the one-token pass (kpairs' comment), so
// other vendors keep them.
#ifndef PARROT_NARROW_ROWS
#define PARROT_NARROW_ROWS 0
#endif

// Rows of x quantised per super-block of 256 for the K-quant formats: per row and super-block,
// q (256 bytes), d and the sums of q by 16.
// For the packed K-quant kernels also: the sums by 32, and q arranged as their steps read it
// (`arranged(G)`: per pair of groups of G, 4 bytes a step: 2t, 2t + 1 of each group; built with
// AVX-512 VNNI, each two steps' 8 bytes in simd.h's VNNI_ORDER, as kpairs reads the weights then).
// Only the forms a layer's parts read are kept: q itself for the AMX tiles (amx_layout), each
// arrangement for the tiles of a format with groups of that size. Their bytes are written whole,
// so they are not zeroed first (a prompt chunk of 400 rows spent about 1% of its time zeroing
// three copies of each layer's x in one thread).
//
// `fine` (the LM head's rows): each unit of 32 with its own multiplier f, 1 .. 8 (quantize256_fine;
// 8 per row and super-block); the sums are of q f.
//
// `split` (the rows of every K-quant layer but the LM head): a row's outliers, its values over
// SPLIT_BETA times its root mean square (the SPLIT_MAX largest of them at most), are taken out
// before it is rounded and added back in float32 (outlier_sums). One such value sets the step of
// its whole super-block, and Qwen2.5's ffn_down inputs have about 10 per row: rounded with them,
// the 8-bit path's next-token distributions diverged from float32's about twice as much (KL
// 0.001508 against 0.000785 over docs/PERFORMANCE.md's "Perplexity" text).
constexpr float SPLIT_BETA = 8.0f;
constexpr int SPLIT_MAX = 16;
struct XK {
  // Which forms of q to keep: q (the AMX tiles), arranged by 16 (Q6_K), arranged by 32 (Q4_K, Q5_K).
  enum Forms : int { PLAIN = 1, BY16 = 2, BY32 = 4 };
  int64_t supers;
  bool fine;
  bool narrow;  // at most PARROT_NARROW_ROWS rows: the avx512 tiles take the 256-bit steps, x in their order
  std::unique_ptr<int8_t[]> q, q16, q32;
  std::vector<int16_t> sums, sums32, f;
  std::vector<float> d;
  // split: row i's outliers are out_c / out_v [i SPLIT_MAX, i SPLIT_MAX + outliers[i]), by channel.
  std::vector<int32_t> outliers, out_c;
  std::vector<float> out_v;
  bool any_outliers = false;
  // The same outliers by channel, for outlier_sums (which de-quantises each channel's weights once
  // per group of 8 weight rows): channel channels[u] is row slot_row[pick_slot[p]]'s outlier
  // pick_v[p] for p in [channel_at[u], channel_at[u + 1]), the rows in order.
  std::vector<int32_t> channels, channel_at, pick_slot, slot_row;
  std::vector<float> pick_v;
  std::vector<int32_t> slot_of;  // row i's slot, -1 for a row without outliers
#if defined(PARROT_AVX512) && defined(__AVX512VNNI__)
  // For kptile2, which scales two rows of x in one vector (so only for 2 rows or more, and the
  // tiles' forms of x), by tiles of 8 rows (tiles start at rows 8 t; rows past M are zero):
  // d8 [t][sb][8] (each row's d), pairs8 [t][sb][block][8] (a block's two sums by 32 as one int32, as hpair reads them; the formats with groups of 32). And
  // by row, offsets [row][sb][16]: minus the sums by 16 times 32, the start of kpairs' block sums
  // for Q6_K (the only format with groups of 16), so that q - 32 is summed, not q.
  std::vector<float> d8;
  std::vector<int32_t> pairs8, offsets;
#endif
  XK(const float* x, int64_t M, int64_t K, int threads, int forms, bool fine_ = false, bool split = false)
      : supers(K / 256), fine(fine_), narrow(M <= PARROT_NARROW_ROWS), q(bytes_if(forms & PLAIN, M * K)), q16(bytes_if(forms & BY16, M * K)),
        q32(bytes_if(forms & BY32, M * K)), sums(M * supers * 16), sums32(M * supers * 8),
        f(fine_ ? M * supers * 8 : 0), d(M * supers) {
#if defined(PARROT_AVX512) && defined(__AVX512VNNI__)
    if (!fine && !narrow && M >= 2 && (forms & (BY16 | BY32))) {
      const int64_t tiles = (M + 7) / 8;
      d8.assign(tiles * supers * 8, 0.0f);
      if (forms & BY32) pairs8.assign(tiles * supers * 4 * 8, 0);
      if (forms & BY16) offsets.resize(M * supers * 16);
    }
#endif
    if (split) {
      outliers.assign(M, 0);
      out_c.resize(M * SPLIT_MAX);
      out_v.resize(M * SPLIT_MAX);
      pool(threads).parallel_for(M, [&](int64_t i) { find_outliers(x + i * K, K, i); });
      for (int64_t i = 0; i < M; ++i) any_outliers |= outliers[i] > 0;
      if (any_outliers) by_channel(M);
    }
    pool(threads).parallel_for(M * supers, [&](int64_t at) {
      alignas(64) int8_t own[256];
      int8_t* qa = q ? &q[at * 256] : own;
      const float* xs = x + at * 256;
      alignas(64) float rest[256];  // the super-block without the row's outliers
      if (any_outliers) {
        const int64_t i = at / supers, first = at % supers * 256;
        for (int o = 0; o < outliers[i]; ++o) {
          const int64_t c = out_c[i * SPLIT_MAX + o];
          if (c < first || c >= first + 256) continue;
          if (xs != rest) { std::memcpy(rest, xs, sizeof rest); xs = rest; }
          rest[c - first] = 0.0f;
        }
      }
      d[at] = fine ? bytes::quantize256_fine(xs, qa, &sums[at * 16], &f[at * 8])
                   : bytes::quantize256(xs, qa, &sums[at * 16]);
      for (int g = 0; g < 8; ++g) sums32[at * 8 + g] = (int16_t)(sums[at * 16 + 2 * g] + sums[at * 16 + 2 * g + 1]);
      if (q16) arrange(qa, 16, &q16[at * 256], !narrow);
      if (q32) arrange(qa, 32, &q32[at * 256], !narrow);
#if defined(PARROT_AVX512) && defined(__AVX512VNNI__)
      if (!d8.empty()) {
        const int64_t i = at / supers, sb = at % supers, tile = i / 8 * supers + sb;
        d8[tile * 8 + i % 8] = d[at];
        if (!pairs8.empty())
          for (int b = 0; b < 4; ++b) std::memcpy(&pairs8[(tile * 4 + b) * 8 + i % 8], &sums32[at * 8 + 2 * b], 4);
        if (!offsets.empty())
          for (int g = 0; g < 16; ++g) offsets[at * 16 + g] = -32 * (int32_t)sums[at * 16 + g];
      }
#endif
    });
  }
  const int8_t* arranged(int G) const { return G == 16 ? q16.get() : q32.get(); }
  // A row's unit multipliers, from super-block 0 (fine only).
  const int16_t* multipliers(int64_t row) const { return &f[row * supers * 8]; }
  // The AMX kernel set's layout of q and of the group sums (amx.h's amx_layout), where a layer's
  // parts run on it; empty otherwise.
  std::vector<int8_t> amx_tiles;
  std::vector<int32_t> amx_pairs;

 private:
  // Row i's outliers (x its K values): those with x^2 over SPLIT_BETA^2 times the mean square,
  // the largest SPLIT_MAX (the lower channel first between equals), kept in channel order.
  // The squares are summed in 16 lanes (k % 16), then the lanes in order: the same sum on every
  // kernel set, in vector instructions (one chain of 8,960 additions took longer than the rest).
  void find_outliers(const float* x, int64_t K, int64_t i) {
    float lanes[16] = {};
    for (int64_t k = 0; k < K; k += 16)
      for (int l = 0; l < 16; ++l) lanes[l] += x[k + l] * x[k + l];
    float squares = 0.0f;
    for (int l = 0; l < 16; ++l) squares += lanes[l];
    const float bound = SPLIT_BETA * SPLIT_BETA * (squares / (float)K);
    std::vector<std::pair<float, int32_t>> over;  // (-|x|, channel)
    for (int64_t k = 0; k < K; k += 16) {
      // 16 at a time, where none is over (most rows of most layers)
#if defined(__AVX2__)
      const __m256 lo = _mm256_loadu_ps(x + k), hi = _mm256_loadu_ps(x + k + 8), b = _mm256_set1_ps(bound);
      const bool any = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(_mm256_mul_ps(lo, lo), b, _CMP_GT_OQ),
                                                       _mm256_cmp_ps(_mm256_mul_ps(hi, hi), b, _CMP_GT_OQ))) != 0;
#else
      bool any = false;
      for (int l = 0; l < 16; ++l) any |= x[k + l] * x[k + l] > bound;
#endif
      if (any)
        for (int l = 0; l < 16; ++l)
          if (x[k + l] * x[k + l] > bound) over.emplace_back(-std::fabs(x[k + l]), (int32_t)(k + l));
    }
    if ((int)over.size() > SPLIT_MAX) {
      std::partial_sort(over.begin(), over.begin() + SPLIT_MAX, over.end());
      over.resize(SPLIT_MAX);
    }
    std::sort(over.begin(), over.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    outliers[i] = (int32_t)over.size();
    for (size_t o = 0; o < over.size(); ++o) {
      out_c[i * SPLIT_MAX + o] = over[o].second;
      out_v[i * SPLIT_MAX + o] = x[over[o].second];
    }
  }
  void by_channel(int64_t M) {
    std::vector<std::tuple<int32_t, int32_t, float>> picks;  // (channel, slot, value)
    slot_of.assign(M, -1);
    for (int64_t i = 0; i < M; ++i) {
      if (outliers[i] == 0) continue;
      slot_of[i] = (int32_t)slot_row.size();
      for (int o = 0; o < outliers[i]; ++o)
        picks.emplace_back(out_c[i * SPLIT_MAX + o], (int32_t)slot_row.size(), out_v[i * SPLIT_MAX + o]);
      slot_row.push_back((int32_t)i);
    }
    std::sort(picks.begin(), picks.end());  // by channel, then slot (a row has a channel once)
    for (const auto& [c, slot, v] : picks) {
      if (channels.empty() || channels.back() != c) {
        channels.push_back(c);
        channel_at.push_back((int32_t)pick_slot.size());
      }
      pick_slot.push_back(slot);
      pick_v.push_back(v);
    }
    channel_at.push_back((int32_t)pick_slot.size());
  }
  static std::unique_ptr<int8_t[]> bytes_if(bool keep, int64_t n) { return keep ? std::unique_ptr<int8_t[]>(new int8_t[n]) : nullptr; }
  static void arrange(const int8_t* in, int G, int8_t* out, [[maybe_unused]] bool pairs_order) {
    for (int b = 0; b < 256 / (2 * G); ++b)
      for (int t = 0; t < G / 2; ++t)
        for (int j = 0; j < 4; ++j) out[b * 2 * G + 4 * t + j] = in[(2 * b + j / 2) * G + 2 * t + j % 2];
#if defined(PARROT_AVX512) && defined(__AVX512VNNI__)
    for (int o = 0; pairs_order && o < 256; o += 8) {  // kpairs' VNNI order
      int8_t steps[8];
      std::memcpy(steps, out + o, 8);
      for (int j = 0; j < 8; ++j) out[o + j] = steps[bytes::VNNI_ORDER[j]];
    }
#endif
  }
};

// ---------------------------------------------------------------------------------------------
// Packed K-quant weights for the 8-bit path (Q4_K, Q5_K, Q6_K), 8 weight rows interleaved as the
// 32-weight formats' packed copy is. A super-block's integer scale belongs to a group of G
// weights (the format's GROUP: 32 for Q4_K and Q5_K, 16 for Q6_K); groups go in pairs (a "block" of 2 G weights), and
// step t of a block holds, for each of the 8 rows, weights 2t, 2t + 1 of the pair's first group
// and 2t, 2t + 1 of its second: the 16-bit lanes of one vector of byte products are then (row r,
// first group), (row r, second group), so a multiply-add by the 16 scales (each row's two) adds a
// block's products into one int32 per row, exactly. x is arranged in the same order (XK::arranged).
// A super-block's sum is converted and scaled once per row, as in the file layout's kernels.
//
// A super-block of a group of 8 rows, BYTES bytes: d (8 float16) | dmin (8 float16; formats with
// a min: Q4_K, Q5_K) | scales: per block 16 bytes (row r's two at 2r) | mins likewise (formats
// with a min) | per block: low 4 bits of S = G / 2 steps, two steps per byte (step t in the low
// nibble of vector t % (S / 2) when t < S / 2, else the high), then the high bits of values of
// more than 4 bits: 5-bit (Q5_K) one plane per 8 steps (bit t % 8), 6-bit (Q6_K) one plane per 4
// steps (bits 2 (t % 4), 2 (t % 4) + 1).
template <class W>
struct KLayout {
  static constexpr int G = W::GROUP, VB = W::VALUE_BITS, NB = 256 / (2 * G), S = G / 2;
  static constexpr bool MIN = W::MIN;
  static_assert(VB <= 6 && (G == 16 || G == 32), "values of up to 6 bits, in groups of 16 or 32");
  static constexpr int FLUSH = VB <= 4 ? 8 : VB == 5 ? 4 : 2;  // steps whose 16-bit sums cannot overflow
  static constexpr int64_t SC_AT = MIN ? 32 : 16, MN_AT = SC_AT + NB * 16, BLK_AT = MN_AT + (MIN ? NB * 16 : 0);
  static constexpr int64_t LOW = S / 2 * 32, HIGH = VB == 5 ? S / 8 * 32 : VB == 6 ? S / 4 * 32 : 0;
  static constexpr int64_t BLOCK = LOW + HIGH, BYTES = BLK_AT + NB * BLOCK;
  // Step t's byte j of row r in a pair's block holds value value_at(b, t, j) of the super-block:
  // its low 4 bits at low_shift(t) of byte low_byte, its 5th/6th bits at high_shift(t) of byte
  // high_byte. kpack writes there, kunpack_row reads.
  static int value_at(int b, int t, int j) { return (2 * b + j / 2) * G + 2 * t + j % 2; }
  static int64_t low_byte(int t, int64_t r, int j) { return 32 * (t % (S / 2)) + 4 * r + j; }
  static int low_shift(int t) { return t < S / 2 ? 0 : 4; }
  static int64_t high_byte(int t, int64_t r, int j) { return LOW + 32 * (VB == 5 ? t / 8 : t / 4) + 4 * r + j; }
  static int high_shift(int t) { return VB == 5 ? t % 8 : 2 * (t % 4); }
  static constexpr int HIGH_MASK = VB == 5 ? 1 : 3;
  // Step t's value j of row r (0 .. 2^VB - 1), from a block's bytes v.
  static int value(const uint8_t* v, int t, int64_t r, int j) {
    int u = (v[low_byte(t, r, j)] >> low_shift(t)) & 15;
    if constexpr (VB > 4) u |= ((v[high_byte(t, r, j)] >> high_shift(t)) & HIGH_MASK) << 4;
    return u;
  }
};

// Value k (0..255) of super-block `sb` of row n and its group's scale (and min).
template <class W>
void kvalues(const W& w, int64_t n, int64_t sb, uint8_t values[256], int scales[16], int mins[16]) {
  const uint8_t* blk = w.block(n, sb * 8);
  for (int u = 0; u < 8; ++u) bytes::bstore(values + 32 * u, W::bytes(blk, sb * 8 + u));
  W::group_scales(blk, scales, mins);
}

template <class W>
void kpack(const W& w, int64_t N, uint8_t* out) {
  using P = KLayout<W>;
  const int64_t supers = w.K / 256, groups = (N + 7) / 8;
  std::memset(out, 0, groups * supers * P::BYTES);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t sb = 0; sb < supers; ++sb) {
      uint8_t* o = out + (g * supers + sb) * P::BYTES;
      for (int64_t r = 0; r < 8 && g * 8 + r < N; ++r) {
        const uint8_t* blk = w.block(g * 8 + r, sb * 8);
        uint8_t values[256];
        int scales[16], mins[16];
        kvalues(w, g * 8 + r, sb, values, scales, mins);
        std::memcpy(o + 2 * r, blk + W::D_AT, 2);
        if constexpr (P::MIN) std::memcpy(o + 16 + 2 * r, blk + W::DMIN_AT, 2);
        for (int b = 0; b < P::NB; ++b) {
          for (int h = 0; h < 2; ++h) {
            o[P::SC_AT + 16 * b + 2 * r + h] = (uint8_t)scales[2 * b + h];
            if constexpr (P::MIN) o[P::MN_AT + 16 * b + 2 * r + h] = (uint8_t)mins[2 * b + h];
          }
          uint8_t* v = o + P::BLK_AT + b * P::BLOCK;
          for (int t = 0; t < P::S; ++t)
            for (int j = 0; j < 4; ++j) {
              const int value = values[P::value_at(b, t, j)];
              v[P::low_byte(t, r, j)] |= (uint8_t)((value & 15) << P::low_shift(t));
              if constexpr (P::VB > 4) v[P::high_byte(t, r, j)] |= (uint8_t)(((value >> 4) & P::HIGH_MASK) << P::high_shift(t));
            }
        }
      }
    }
}

// The multipliers of block b's two groups (f: a super-block's 8 units of 32) as one 32-bit pair,
// the first group's in the low half, as the block's scales hold a row's two: groups 2b, 2b + 1
// are units 2b, 2b + 1 with groups of 32, and both unit b with groups of 16.
template <class P>
inline int32_t factor_pair(const int16_t* f, int b) {
  const int16_t first = P::G == 32 ? f[2 * b] : f[b], second = P::G == 32 ? f[2 * b + 1] : f[b];
  return (int32_t)((uint16_t)first | (uint32_t)(uint16_t)second << 16);
}

#if defined(PARROT_AVX512)
// Steps t, t + 1 of a block's weights (at v) for the 8 rows, interleaved by row: both low nibbles
// or both high, in adjacent vectors, with Q5_K's and Q6_K's high bits added. With VNNI in VNNI
// order (simd.h's vnni_order), which VBMI's loads give directly (vnni_pairs, vnni_plane).
template <class P>
inline bytes::B2 step_pair(const uint8_t* v, int t) {
  using namespace bytes;
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  constexpr bool loaded_in_order = true;  // the loads give VNNI order (fifth2's and sixth2's `words`)
  const auto pairs = [](const uint8_t* p) { return vnni_pairs(p); };
  const auto plane = [](const uint8_t* p) { return vnni_plane(p); };
#else
  constexpr bool loaded_in_order = false;
  const auto pairs = [](const uint8_t* p) { return pairs2(p); };
  const auto plane = [](const uint8_t* p) { return plane2(p); };
#endif
  B2 wt = bits2(pairs(v + 32 * (t % (P::S / 2))), t < P::S / 2 ? 0 : 4, 15);
  if constexpr (P::VB == 5) wt = bor2(wt, fifth2(plane(v + P::LOW + 32 * (t / 8)), t % 8, loaded_in_order));
  if constexpr (P::VB == 6) wt = bor2(wt, sixth2(plane(v + P::LOW + 32 * (t / 4)), t % 4, loaded_in_order));
#if defined(__AVX512VNNI__)
  if constexpr (!loaded_in_order) wt = vnni_order(wt);
#endif
  return wt;
}

// The integer sums of super-block sb of a group (at blk) with MT rows of x (xa: each row's
// arranged bytes), two steps per instruction (simd.h's B2: the two steps' vectors interleaved by
// row, once per load for all MT rows, and x's bytes of both steps one 64-bit broadcast). Each
// 16-bit lane adds half as many steps between flushes, so a flush comes every 2 FLUSH steps; fold
// adds each row's two lanes. The same integers as the 256-bit steps below, in about half the
// instructions: a one-token Q4_K pass spent more time computing than waiting for memory (Intel
// Xeon: 32 GB/s of packed weights from L2 on one core, 14 from memory). Qwen2.5-Coder-1.5B,
// interleaved A/B: one-token pass 50.0-50.3 -> 44.1-45.5 ms; a 512-token chunk 4.06-4.07 s with
// x broadcast per row, 3.58-3.68 s with the weights interleaved instead.
//
// Each row's sums come back unfolded (lanes 2r, 2r + 1: row r's two groups of each block). With
// `xo` (VNNI only), each block's sums start from x's offsets (XK::offsets) instead of zero.
template <int MT, class P, bool FINE>
inline void kpairs(const uint8_t* blk, const int8_t* const* xa, const int16_t* const* xf, int64_t sb, bytes::S2* sums,
                   const int32_t* const* xo = nullptr) {
  using namespace bytes;
  static_assert(P::S % (2 * P::FLUSH) == 0 && P::S % 4 == 0, "whole pairs of steps, flushed within a block");
  for (int i = 0; i < MT; ++i) sums[i] = szero2();
  // With VNNI: each step pair's bytes in VNNI order (simd.h's vnni_order; x is arranged so), added
  // into one int32 per row and group by `vpdpbusd` (no 16-bit sums, so no flushes), and each
  // block's sums times their scales (32-bit). The same integers as the 16-bit steps: a row's
  // super-block sum is exact either way (at most 2^31 - 1 in magnitude with FINE's multipliers).
#if defined(__AVX512VNNI__)
  using Scale = S2;
  using Part = S2;
  const auto scales = [](const uint8_t* p) { return ssigned2(p); };
  const auto times = [](Scale a, int32_t f) { return smul2(a, spairs2(f)); };
  const auto part_zero = [] { return szero2(); };
#else
  using Scale = H2;
  using Part = H2;
  const auto scales = [](const uint8_t* p) { return hsigned2(p); };
  const auto times = [](Scale a, int32_t f) { return hmul2(a, hpairs2(f)); };
  const auto part_zero = [] { return hzero2(); };
#endif
  for (int b = 0; b < P::NB; ++b) {
    const Scale scale = scales(blk + P::SC_AT + 16 * b);
    Scale scaled[FINE ? MT : 1];  // FINE: each row's scales times its multipliers, made once per block
    if constexpr (FINE)
      for (int i = 0; i < MT; ++i) scaled[i] = times(scale, factor_pair<P>(xf[i] + sb * 8, b));
    const uint8_t* v = blk + P::BLK_AT + b * P::BLOCK;
    const int8_t* xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = xa[i] + sb * 256 + b * 2 * P::G;
    Part part[MT];
#if defined(__AVX512VNNI__)
    if (xo != nullptr)
      for (int i = 0; i < MT; ++i) part[i] = {bcast8((const int8_t*)(xo[i] + sb * 16 + 2 * b)).v};  // the block's two offsets
    else
#endif
      for (int i = 0; i < MT; ++i) part[i] = part_zero();
#pragma GCC unroll 8
    for (int t = 0; t < P::S; t += 2) {
      const B2 wt = step_pair<P>(v, t);
#if defined(__AVX512VNNI__)
      for (int i = 0; i < MT; ++i) part[i] = dot4x2(part[i], wt, bcast8(xb[i] + 4 * t));
#else
      for (int i = 0; i < MT; ++i) {
        part[i] = hplus2(part[i], pdot16x2(wt, bcast8(xb[i] + 4 * t)));
        hpin2(part[i]);
      }
      if ((t + 2) % (2 * P::FLUSH) == 0)
        for (int i = 0; i < MT; ++i) {
          sums[i] = sadd2(sums[i], hdot2(part[i], FINE ? scaled[i] : scale));
          part[i] = hzero2();
        }
#endif
    }
#if defined(__AVX512VNNI__)
    for (int i = 0; i < MT; ++i) sums[i] = sadd2(sums[i], smul2(part[i], FINE ? scaled[i] : scale));
#endif
  }
}
#endif

// Channel c's weights in group g (8 weight rows; `group` its packed super-blocks), de-quantised
// as the file's blocks are: 8 weight rows per vector where there is AVX2, one at a time elsewhere,
// the same float operations either way (the library is built without contracting them to fused
// multiply-adds).
template <class W>
void kcolumn(const uint8_t* group, int64_t c, float w[8]) {
  using P = KLayout<W>;
  constexpr int OFFSET = W::SHIFT > 0 ? 1 << W::SHIFT : 0;
  const uint8_t* blk = group + (c / 256) * P::BYTES;
  // The channel's place in the layout (KLayout::value_at inverted): block b, step t, byte j of
  // each row's 4, in the first (h = 0) or second group of the block.
  const int k = c % 256, in_group = k % P::G, h = k / P::G % 2, b = k / (2 * P::G), t = in_group / 2, j = 2 * h + in_group % 2;
  const uint8_t* vb = blk + P::BLK_AT + b * P::BLOCK;
#if defined(__AVX2__)
  // Byte 2 r + h of 16 (a row's scale or min of this group), r = 0 .. 7, in the low 8 bytes.
  const __m128i order = _mm_add_epi8(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1),
                                     _mm_setr_epi8(h, h, h, h, h, h, h, h, 0, 0, 0, 0, 0, 0, 0, 0));
  const auto pick = [&](const uint8_t* at) { return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)at), order); };
  // Byte j of each row's 4 (32 bytes at `at`), shifted right by `shift`, as 8 int32.
  const auto lanes = [j](const uint8_t* at, int shift) {
    return _mm256_srl_epi32(_mm256_loadu_si256((const __m256i*)at), _mm_cvtsi32_si128(8 * j + shift));
  };
  __m256i u = _mm256_and_si256(lanes(vb + P::low_byte(t, 0, 0), P::low_shift(t)), _mm256_set1_epi32(15));
  if constexpr (P::VB > 4)
    u = _mm256_or_si256(u, _mm256_slli_epi32(_mm256_and_si256(lanes(vb + P::high_byte(t, 0, 0), P::high_shift(t)),
                                                               _mm256_set1_epi32(P::HIGH_MASK)), 4));
  const __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(pick(blk + P::SC_AT + 16 * b))));
  __m256 v = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(OFFSET))));
  if constexpr (P::MIN)
    v = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16))),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(pick(blk + P::MN_AT + 16 * b)))));
  _mm256_storeu_ps(w, v);
#else
  for (int r = 0; r < 8; ++r) {
    const float scale = simd::half(blk + 2 * r) * (float)(int8_t)blk[P::SC_AT + 16 * b + 2 * r + h];
    w[r] = scale * (float)(P::value(vb, t, r, j) - OFFSET);
    if constexpr (P::MIN) w[r] = w[r] - simd::half(blk + 16 + 2 * r) * (float)blk[P::MN_AT + 16 * b + 2 * r + h];
  }
#endif
}

// The outlier sums (XK split) of `groups` groups of 8 weight rows (the first at `group`, the next
// `stride` bytes on): for each row with outliers, the sum over its outliers in channel order of
// the outlier times its channel's de-quantised weight (kcolumn), in float32, for output 8 j + r
// of group j at [width slot + 8 j + r] (XK::slot_of; 0 past the groups). The tiles' stores add them. The
// channels are taken in order, each de-quantised once for all the rows it is an outlier of, so
// every kernel set does the same float operations in the same order. The sums are this thread's
// (outlier_buffer) until its next call.
inline std::vector<float>& outlier_buffer() {
  thread_local std::vector<float> sums;
  return sums;
}
template <class W>
const float* outlier_sums(const uint8_t* group, int64_t stride, int groups, int width, const XK& x) {
  std::vector<float>& sums = outlier_buffer();
  sums.assign(x.slot_row.size() * width, 0.0f);
#if defined(__AVX512F__)
  if (width == 16) {  // the AMX jobs' two groups in one vector (the same products and sums per lane)
    for (size_t u = 0; u + 1 < x.channel_at.size(); ++u) {
      alignas(64) float w[16] = {};
      for (int j = 0; j < groups; ++j) kcolumn<W>(group + j * stride, x.channels[u], w + 8 * j);
      const __m512 wv = _mm512_load_ps(w);
      for (int32_t p = x.channel_at[u]; p < x.channel_at[u + 1]; ++p) {
        float* sum = sums.data() + x.pick_slot[p] * 16;
        _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_loadu_ps(sum), _mm512_mul_ps(_mm512_set1_ps(x.pick_v[p]), wv)));
      }
    }
    return sums.data();
  }
#endif
  for (size_t u = 0; u + 1 < x.channel_at.size(); ++u)
    for (int j = 0; j < groups; ++j) {
      alignas(32) float w[8];
      kcolumn<W>(group + j * stride, x.channels[u], w);
      const bytes::G wv = bytes::gload(w);
      for (int32_t p = x.channel_at[u]; p < x.channel_at[u + 1]; ++p) {
        float* sum = sums.data() + x.pick_slot[p] * width + 8 * j;
        bytes::gstore(sum, bytes::gadd(bytes::gload(sum), bytes::gmul(bytes::gset1(x.pick_v[p]), wv)));
      }
    }
  return sums.data();
}

// MT rows of x (from `row`) against one group of 8 weight rows, a super-block at a time; `far`
// as group_tiles passes it. FINE: x with a multiplier per unit of 32 (XK::fine), which multiplies
// each group's weight scale (both at most 8 bits: the 16-bit product is exact) before its sums
// are scaled.
template <int MT, class W, bool FINE>
inline void kptile(const uint8_t* group, const XK& x, int64_t row, int64_t n, int64_t valid, float* y, int64_t ldy,
                   bool far) {
  using namespace bytes;
  using P = KLayout<W>;
  const int64_t supers = x.supers;
  const int8_t* xa[MT];
  const int16_t* xf[MT] = {};
  G acc[MT];
  for (int i = 0; i < MT; ++i) {
    acc[i] = gzero();
    xa[i] = x.arranged(P::G) + (row + i) * supers * 256;
    if constexpr (FINE) xf[i] = x.multipliers(row + i);
  }
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* blk = group + sb * P::BYTES;
    // The first tile of rows brings the group's weights in; the next ones find them in L1 or L2
    // (a group is 7-60 KB), where fetching again only cost instructions (a 400-token chunk of
    // Qwen2.5-Coder-1.5B about 1% faster without, avx2 set, Intel Xeon).
    if (far || row == 0) fetch_ahead(blk, P::BYTES, far);
    S total[MT];
#if defined(PARROT_AVX512)
    if (!x.narrow) {
      S2 sums[MT];
      kpairs<MT, P, FINE>(blk, xa, xf, sb, sums);
      for (int i = 0; i < MT; ++i) total[i] = fold(sums[i]);
    } else
#endif
    {  // the 256-bit steps: the avx2 set's, and the avx512 set's calls over PARROT_NARROW_ROWS rows
      for (int i = 0; i < MT; ++i) total[i] = szero();
      for (int b = 0; b < P::NB; ++b) {
        const H scale = hsigned(blk + P::SC_AT + 16 * b);  // signed bytes (Q4_K's and Q5_K's 6-bit scales read the same)
        H scaled[FINE ? MT : 1];  // FINE: each row's scales times its multipliers, made once per block
        if constexpr (FINE)
          for (int i = 0; i < MT; ++i) scaled[i] = hmul(scale, hpairs(factor_pair<P>(xf[i] + sb * 8, b)));
        const uint8_t* v = blk + P::BLK_AT + b * P::BLOCK;
        H part[MT];
        for (int i = 0; i < MT; ++i) part[i] = hzero();
#pragma GCC unroll 16
        for (int t = 0; t < P::S; ++t) {
          B wt = bits(load(v + 32 * (t % (P::S / 2))), t < P::S / 2 ? 0 : 4, 15);
          if constexpr (P::VB == 5) wt = bor(wt, fifth(load(v + P::LOW + 32 * (t / 8)), t % 8));
          if constexpr (P::VB == 6) wt = bor(wt, sixth(load(v + P::LOW + 32 * (t / 4)), t % 4));
          for (int i = 0; i < MT; ++i) {
            part[i] = hplus(part[i], pdot16(wt, bcast4(xa[i] + sb * 256 + b * 2 * P::G + 4 * t)));
            hpin(part[i]);
          }
          if ((t + 1) % P::FLUSH == 0)
            for (int i = 0; i < MT; ++i) {
              total[i] = sadd(total[i], hdot(part[i], FINE ? scaled[i] : scale));
              part[i] = hzero();
            }
        }
      }
    }
    const G dw = ghalf8(blk);
    for (int i = 0; i < MT; ++i) {
      const int64_t at = (row + i) * supers + sb;
      const int16_t* xsums = P::G == 16 ? &x.sums[at * 16] : &x.sums32[at * 8];  // x's sums by group
      if constexpr (W::SHIFT > 0) {  // weight = d scale (q - 2^SHIFT) (Q6_K: q - 32): less 2^SHIFT times the scales times x's sums
        S offset = szero();
        for (int b = 0; b < P::NB; ++b) offset = sadd(offset, hdot(hsigned(blk + P::SC_AT + 16 * b), hpair(xsums + 2 * b)));
        total[i] = ssub(total[i], sshl(offset, W::SHIFT));
      }
      acc[i] = gfmadd(gfloat(total[i]), gmul(dw, gset1(x.d[at])), acc[i]);
      if constexpr (P::MIN) {  // weight = d scale q - dmin min: less dmin times the mins times x's sums
        S mins = szero();
        for (int b = 0; b < P::NB; ++b) mins = sadd(mins, hdot(hbytes(blk + P::MN_AT + 16 * b), hpair(xsums + 2 * b)));
        acc[i] = gfmadd(gfloat(mins), gmul(ghalf8(blk + 16), gset1(-x.d[at])), acc[i]);
      }
    }
  }
  // The group's outlier sums, made by its first tile of rows (a job runs its tiles in order, on one
  // thread), which has just brought the group's weights in.
  const float* out = !x.any_outliers ? nullptr : row == 0 ? outlier_sums<W>(group, 0, 1, 8, x) : outlier_buffer().data();
  store_group<MT>(acc, y + row * ldy + n, ldy, valid, out, out != nullptr ? &x.slot_of[row] : nullptr);
}

#if defined(PARROT_AVX512) && defined(__AVX512VNNI__)
// kptile with VNNI (x not FINE): the same sums and the same float operations on each output, with
// each super-block's scaling done for two rows of x per 512-bit vector (lane 2 r: row r's output
// for the pair's first row of x, 2 r + 1 for its second). The scaling was a quarter of the Q4_K
// tiles' time in a prompt chunk, in instructions more than in arithmetic: per row of x, the fold
// of its sums to 8 lanes and back through memory, a 256-bit conversion, multiply and multiply-add,
// and for the mins four 32-bit broadcasts, four `vpmaddwd` and three additions. Here a pair's
// two folds meet in one blend, x's d and sums of both rows come in one 64-bit broadcast each
// (XK's by-8-rows copies), the mins add up in `vpdpwssd`, the accumulators stay in registers, and
// Q6_K's offsets are where its block sums start (XK::offsets), not subtracted afterwards. Sums are
// integers, so their order does not matter; each output's floats are kptile's, in its order.
template <int MT, class W>
inline void kptile2(const uint8_t* group, const XK& x, int64_t row, int64_t n, int64_t valid, float* y, int64_t ldy,
                    bool far) {
  using namespace bytes;
  using P = KLayout<W>;
  static_assert(W::SHIFT == 0 || (W::SHIFT == 5 && P::G == 16), "XK::offsets are Q6_K's (q - 32, groups of 16)");
  static_assert(!P::MIN || P::NB == 4, "XK::pairs8 holds 4 blocks (groups of 32)");
  constexpr int PAIRS = (MT + 1) / 2;
  const int64_t supers = x.supers;
  const int8_t* xa[MT];
  const int32_t* xo[MT] = {};
  for (int i = 0; i < MT; ++i) {
    xa[i] = x.arranged(P::G) + (row + i) * supers * 256;
    if constexpr (W::SHIFT > 0) xo[i] = &x.offsets[(row + i) * supers * 16];
  }
  // 8 bytes at p (2 floats, or 2 int32), 8 times
  const auto pair_of = [](const float* p) { return _mm512_castsi512_ps(bcast8((const int8_t*)p).v); };
  const auto sums_of = [](const int32_t* p) { return bcast8((const int8_t*)p).v; };
  const auto twice = [](__m256 v) { return _mm512_permutexvar_ps(rows_twice(), _mm512_castps256_ps512(v)); };
  const auto row_sums = [](__m512i s) { return _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB)); };
  const __m512i negative = _mm512_set1_epi32(INT32_MIN);  // the sign bit
  __m512 acc[PAIRS];
  for (int p = 0; p < PAIRS; ++p) acc[p] = _mm512_setzero_ps();
  const int64_t tile = row / 8 * supers;  // group_tiles starts tiles at multiples of KTILE_ROWS (8)
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* blk = group + sb * P::BYTES;
    if (far || row == 0) fetch_ahead(blk, P::BYTES, far);
    S2 sums[MT];
    kpairs<MT, P, false>(blk, xa, nullptr, sb, sums, W::SHIFT > 0 ? xo : nullptr);
    const __m512 dw = twice(ghalf8(blk).v);
    const float* xd = &x.d8[(tile + sb) * 8];
    for (int p = 0; p < PAIRS; ++p) {
      const __m512i first = row_sums(sums[2 * p].v);
      const __m512i both = 2 * p + 1 < MT ? _mm512_mask_blend_epi32(0xAAAA, first, row_sums(sums[2 * p + 1].v)) : first;
      acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(dw, pair_of(xd + 2 * p)), acc[p]);
    }
    if constexpr (P::MIN) {
      const __m512 dmin = twice(ghalf8(blk + 16).v);
      __m512i mins[P::NB];  // block b's: lanes 2 r and 2 r + 1 both row r's two mins, as 16-bit words
      for (int b = 0; b < P::NB; ++b)
        mins[b] = _mm512_permutexvar_epi32(rows_twice(), _mm512_castsi256_si512(hbytes(blk + P::MN_AT + 16 * b).v));
      const int32_t* xs = &x.pairs8[(tile + sb) * 4 * 8];
      for (int p = 0; p < PAIRS; ++p) {
        __m512i m = _mm512_madd_epi16(mins[0], sums_of(xs + 2 * p));
        for (int b = 1; b < P::NB; ++b) m = _mm512_dpwssd_epi32(m, mins[b], sums_of(xs + 8 * b + 2 * p));
        acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dmin, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(pair_of(xd + 2 * p)), negative))), acc[p]);
      }
    }
  }
  G out_rows[PAIRS * 2];
  const __m512i by_row = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int p = 0; p < PAIRS; ++p) {
    const __m512 v = _mm512_permutexvar_ps(by_row, acc[p]);
    out_rows[2 * p] = {_mm512_castps512_ps256(v)};
    out_rows[2 * p + 1] = {_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))};
  }
  const float* out = !x.any_outliers ? nullptr : row == 0 ? outlier_sums<W>(group, 0, 1, 8, x) : outlier_buffer().data();
  store_group<MT>(out_rows, y + row * ldy + n, ldy, valid, out, out != nullptr ? &x.slot_of[row] : nullptr);
}
#endif

template <class W>
Tiles linear_kpacked(const W& w, const uint8_t* packed, const XK& x, int64_t M, float* y, int64_t N, int64_t ldy) {
  return group_tiles<KTILE_ROWS>(packed, (w.K / 256) * KLayout<W>::BYTES, M, N, [=, &x](auto mt, const uint8_t* group, int64_t i, int64_t n, int64_t valid, bool far) {
    if (x.fine) kptile<decltype(mt)::value, W, true>(group, x, i, n, valid, y, ldy, far);
#if defined(PARROT_AVX512) && defined(__AVX512VNNI__)
    else if constexpr (decltype(mt)::value >= 2) {
      if (x.narrow) kptile<decltype(mt)::value, W, false>(group, x, i, n, valid, y, ldy, far);
      else kptile2<decltype(mt)::value, W>(group, x, i, n, valid, y, ldy, far);
    }
#endif
    else kptile<decltype(mt)::value, W, false>(group, x, i, n, valid, y, ldy, far);
  });
}

// ---------------------------------------------------------------------------------------------
// The file's blocks of one weight row, rebuilt from the packed copy (the inverse of pack and
// kpack: every bit of a block is in the copy, so the bytes come back as the file has them). A
// tied embedding's token rows are expanded from these, so that its file pages, handed back once
// packed, are never read again (they came back, 64 KB around each row looked up, until the
// whole embedding was resident twice).
template <class W>
void unpack_row(const uint8_t* packed, int64_t K, int64_t n, uint8_t* out) {
  using P = Pack<W>;
  const int64_t units = K / 32, g = n / 8, r = n % 8;
  for (int64_t b = 0; b < units; ++b) {
    const uint8_t* o = packed + (g * units + b) * P::BYTES;
    uint8_t values[32];
    for (int k = 0; k < 32; ++k) {
      if constexpr (W::BITS == 8) {
        values[k] = o[P::q_byte(k, r)];
      } else {
        values[k] = (uint8_t)((o[P::q_byte(k, r)] >> P::q_shift(k)) & 15);
        if constexpr (W::BITS == 5) values[k] |= (uint8_t)(((o[P::h_byte(k, r)] >> (k / 4)) & 1) << 4);
      }
    }
    uint8_t* blk = out + b * W::BYTES;
    std::memset(blk, 0, W::BYTES);
    W::rebuild(blk, o + 2 * r, o + P::M_AT + 2 * r, values);
  }
}

template <class W>
void kunpack_row(const uint8_t* packed, int64_t K, int64_t n, uint8_t* out) {
  using P = KLayout<W>;
  const int64_t supers = K / 256, g = n / 8, r = n % 8;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* o = packed + (g * supers + sb) * P::BYTES;
    uint8_t values[256];
    int scales[16], mins[16] = {0};
    for (int b = 0; b < P::NB; ++b) {
      for (int h = 0; h < 2; ++h) {
        scales[2 * b + h] = o[P::SC_AT + 16 * b + 2 * r + h];
        if constexpr (P::MIN) mins[2 * b + h] = o[P::MN_AT + 16 * b + 2 * r + h];
      }
      const uint8_t* v = o + P::BLK_AT + b * P::BLOCK;
      for (int t = 0; t < P::S; ++t)
        for (int j = 0; j < 4; ++j) values[P::value_at(b, t, j)] = (uint8_t)P::value(v, t, r, j);
    }
    uint8_t* blk = out + sb * W::BYTES;
    std::memset(blk, 0, W::BYTES);
    W::rebuild(blk, values, scales, mins, o + 2 * r, o + 16 + 2 * r);
  }
}

// Rows of W expanded from its packed copy: each row's blocks rebuilt, then expanded as from the file.
template <class W>
void expand_packed_rows(const uint8_t* packed, int64_t K, const int64_t* rows, int64_t count, float* out) {
  std::vector<uint8_t> row(K / (32 * W::UNITS) * W::BYTES);
  const W one = matrix<W>(row.data(), K);
  const int64_t first = 0;
  for (int64_t i = 0; i < count; ++i) {
    if constexpr (W::SUPER) kunpack_row<W>(packed, K, rows[i], row.data());
    else unpack_row<W>(packed, K, rows[i], row.data());
    expand_rows(one, &first, 1, out + i * K);
  }
}

}  // namespace
