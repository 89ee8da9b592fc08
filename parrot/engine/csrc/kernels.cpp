// Parrot's CPU kernels: linear layers over GGUF block weights, causal attention of a few new
// tokens over a KV cache, and a whole decoding pass of a Llama-family model in one call.
//
// Compiled once per instruction set (simd.h: AVX-512, AVX2 + FMA, portable) into a plain shared
// library with a C interface, loaded by parrot/engine/kernels.py with ctypes.
//
// Batch invariance, the property greedy drafting's exactness rests on: every output element is
// computed by a sequence of operations fixed by its own row (its token, position and sequence),
// never by how many rows are computed with it, which tile they fall in, or which thread runs
// them. So a token's logits are the same bit for bit decoded alone or followed by a draft.
//
// Why a whole pass in one call: a decoding pass over the embedded model is ~20 small operations
// in each of 30 layers; dispatched one by one from Python/torch they cost more than the
// arithmetic (the weights of a 135M model stream from memory in a few milliseconds).

#include "pool.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

using namespace simd;

namespace {

// ---------------------------------------------------------------------------------------------
// Linear layers: y = x @ W^T (+ bias) for W [N, K] in GGUF blocks of 32 along K.

// A weight matrix in the GGUF's own blocks, row after row. The kernels work in units of 32
// weights along K (a K-quant super-block of 256 holds 8); for unit b of weight row n, `block`
// points at the (super-)block holding it, `scales` reads what multiplies its values, and
// `part(s)` expands its lanes s L .. s L + L - 1 to float32 exactly as the gguf package's
// reference de-quantises them: where the reference rounds once (d * q + m, d * q - m with d * q
// exact), so does the kernel; where it rounds d * q (Q6_K), the kernel multiplies separately.
enum Kind : int32_t { F32 = 0, F16 = 1, BF16 = 2, Q4_0 = 3, Q4_1 = 4, Q5_0 = 5, Q5_1 = 6, Q8_0 = 7, Q4_K = 8, Q5_K = 9, Q6_K = 10 };

struct Scales {
  float d0, d1, m;  // multiplier of lanes 0..15 and 16..31 of the unit; offset
};

template <int64_t Bytes, int64_t Units>
struct Layout {
  static constexpr int64_t BYTES = Bytes;  // bytes of one (super-)block
  static constexpr int64_t UNITS = Units;  // 32-weight units in it
  const uint8_t* data;
  int64_t K;
  inline const uint8_t* block(int64_t n, int64_t b) const {
    return data + (n * (K / (32 * UNITS)) + b / UNITS) * BYTES;
  }
};

// How far ahead of a weight row's reads the kernels fetch it. The rows of a tile are short
// interleaved streams that the hardware prefetcher follows too late; fetching 4 KB ahead made
// one-row passes over large matrices (32768 x 2048) 15-40% faster than 1 KB (Q4_K 19.3 against
// 17.3 GB/s, Q6_K 19.7 against 10.6, Q8_0 22.7 against 16.9; AVX2 EPYC) and the 1B Q4_K_M
// file's one-token pass 11% faster. Past a row's end it fetches the next tiles' rows.
constexpr int64_t AHEAD = 4096;

// 4-bit values of 32 weights in 16 bytes: byte j holds value j (low nibble) and j + 16 (high).
inline I nibbles(const uint8_t* qs, int s) {
  return iand(shr(load_u8(qs + (s * L) % 16), s * L >= 16 ? 4 : 0), iset1(15));
}
// The 5th bit of values s L .. s L + L - 1 from a little-endian 32-bit mask.
inline I fifth_bits(const uint8_t* qh, int s) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return shl(iand(shrv(iset1((int32_t)h), iadd(lanes(), iset1(s * L))), iset1(1)), 4);
}
inline Scales plain(float d, float m = 0.0f) { return {d, d, m}; }
inline uint32_t mask32(const uint8_t* p) { uint32_t h; std::memcpy(&h, p, 4); return h; }

// The 8-bit activation path (below) reads a unit as 32 bytes `bytes(blk, b)` of small unsigned
// values u with weight = d_h * (u - OFFSET) + m for lanes in half h (Scales as above), or, for
// Q8_0 (SIGNED), signed bytes with weight = d * q. Formats without it (floats) have INTEGER = false.
struct NoBytes {
  static constexpr bool INTEGER = false, SIGNED = false, MIN = false, SUPER = false;
  static constexpr int SHIFT = 0;  // OFFSET = 2^SHIFT, or none when 0
};
template <int Shift, bool Min, bool Signed = false>
struct Bytes {
  static constexpr bool INTEGER = true, SIGNED = Signed, MIN = Min, SUPER = false;
  static constexpr int SHIFT = Shift;
};
// The 32-weight formats: float16 d at the start of the block, then m where there is one (their
// 8-bit path runs on a packed copy, which takes d and m from there: `pack` below).
template <int Shift, bool Min, bool Signed = false>
struct HalfScales : Bytes<Shift, Min, Signed> {};
// The K-quant formats take x in super-blocks of 256 (one multiplier each, as llama.cpp's Q8_K),
// so that a super-block's products are summed in integers, each unit's scaled by its integer
// scale, and converted to float once (their packed copy: `kpack` below).
template <int Shift, bool Min>
struct SuperBytes : Bytes<Shift, Min> {
  static constexpr bool SUPER = true;
};

struct F32W : Layout<128, 1>, NoBytes {
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static F part(const uint8_t* blk, int64_t, int s, const Scales&) { return load((const float*)blk + s * L); }
};
struct F16W : Layout<64, 1>, NoBytes {
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static F part(const uint8_t* blk, int64_t, int s, const Scales&) { return load_f16(blk + 2 * s * L); }
};
struct BF16W : Layout<64, 1>, NoBytes {
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static F part(const uint8_t* blk, int64_t, int s, const Scales&) { return bits(shl(load_u16(blk + 2 * s * L), 16)); }
};
// Q4_0 (18 bytes): d, 16 bytes of nibbles; weight = d * (q - 8).
struct Q4_0W : Layout<18, 1>, HalfScales<3, false> {
  static constexpr int BITS = 4;
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::nibbles(blk + 2); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return mul(set1(c.d0), to_float(isub(nibbles(blk + 2, s), iset1(8))));
  }
};
// Q4_1 (20 bytes): d, m, 16 bytes of nibbles; weight = d * q + m.
struct Q4_1W : Layout<20, 1>, HalfScales<0, true> {
  static constexpr int BITS = 4;
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk), half(blk + 2)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::nibbles(blk + 4); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return fmadd(set1(c.d0), to_float(nibbles(blk + 4, s)), set1(c.m));
  }
};
// Q5_0 (22 bytes): d, 32-bit mask of 5th bits, nibbles; weight = d * (q - 16).
struct Q5_0W : Layout<22, 1>, HalfScales<4, false> {
  static constexpr int BITS = 5;
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::bor(bytes::nibbles(blk + 6), bytes::bits16(mask32(blk + 2))); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return mul(set1(c.d0), to_float(isub(ior(nibbles(blk + 6, s), fifth_bits(blk + 2, s)), iset1(16))));
  }
};
// Q5_1 (24 bytes): d, m, 5th bits, nibbles; weight = d * q + m.
struct Q5_1W : Layout<24, 1>, HalfScales<0, true> {
  static constexpr int BITS = 5;
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk), half(blk + 2)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::bor(bytes::nibbles(blk + 8), bytes::bits16(mask32(blk + 4))); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return fmadd(set1(c.d0), to_float(ior(nibbles(blk + 8, s), fifth_bits(blk + 4, s))), set1(c.m));
  }
};
// Q8_0 (34 bytes): d, 32 signed bytes; weight = d * q.
struct Q8_0W : Layout<34, 1>, HalfScales<0, false, true> {
  static constexpr int BITS = 8;
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::load(blk + 2); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) { return mul(set1(c.d0), to_float(load_i8(blk + 2 + s * L))); }
};
// Q4_K and Q5_K scales: 8 units, a 6-bit scale and a 6-bit min each, packed in 12 bytes.
inline int k_scale(const uint8_t* sc, int u) { return u < 4 ? sc[u] & 63 : (sc[u + 4] & 15) | ((sc[u - 4] >> 6) << 4); }
inline int k_min(const uint8_t* sc, int u) { return u < 4 ? sc[u + 4] & 63 : (sc[u + 4] >> 4) | ((sc[u] >> 6) << 4); }
inline Scales k_scales(const uint8_t* blk, int64_t b) {
  const int u = (int)(b % 8);
  const float d = half(blk) * (float)k_scale(blk + 4, u);  // exact: 11 x 6 bits
  return {d, d, -(half(blk + 2) * (float)k_min(blk + 4, u))};
}
// Q4_K (144 bytes per 256): d, dmin, scales, 128 bytes: unit u in bytes 32 (u / 2) .., nibble u % 2;
// weight = d * scale * q - dmin * min.
struct Q4_KW : Layout<144, 8>, SuperBytes<0, true> {
  static Scales scales(const uint8_t* blk, int64_t b) { return k_scales(blk, b); }
  static bytes::B bytes(const uint8_t* blk, int64_t b) {
    const int u = (int)(b % 8);
    return bytes::bits(bytes::load(blk + 16 + 32 * (u / 2)), 4 * (u % 2), 15);
  }
  static F part(const uint8_t* blk, int64_t b, int s, const Scales& c) {
    const int u = (int)(b % 8);
    const I q = iand(shr(load_u8(blk + 16 + 32 * (u / 2) + s * L), 4 * (u % 2)), iset1(15));
    return fmadd(set1(c.d0), to_float(q), set1(c.m));
  }
};
// Q5_K (176 bytes): d, dmin, scales, 32 bytes of 5th bits (bit u of byte l), 128 bytes as Q4_K.
struct Q5_KW : Layout<176, 8>, SuperBytes<0, true> {
  static Scales scales(const uint8_t* blk, int64_t b) { return k_scales(blk, b); }
  static bytes::B bytes(const uint8_t* blk, int64_t b) {
    const int u = (int)(b % 8);
    return bytes::bor(bytes::bits(bytes::load(blk + 48 + 32 * (u / 2)), 4 * (u % 2), 15),
                      bytes::shl4(bytes::bits(bytes::load(blk + 16), u, 1)));
  }
  static F part(const uint8_t* blk, int64_t b, int s, const Scales& c) {
    const int u = (int)(b % 8);
    const I low = iand(shr(load_u8(blk + 48 + 32 * (u / 2) + s * L), 4 * (u % 2)), iset1(15));
    const I high = shl(iand(shr(load_u8(blk + 16 + s * L), u), iset1(1)), 4);
    return fmadd(set1(c.d0), to_float(ior(low, high)), set1(c.m));
  }
};
// Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, 16 signed scales (one per 16
// weights), d; weight = (d * scale) * (q - 32), rounded as the reference rounds it. The 8-bit path
// sums scale (q - 32) x in integers: scale q x less 32 times the sum of scale times x by 16.
struct Q6_KW : Layout<210, 8>, SuperBytes<5, false> {
  static bytes::B bytes(const uint8_t* blk, int64_t b) {
    const int u = (int)(b % 8), h = u / 4, t = u % 4;
    return bytes::bor(bytes::bits(bytes::load(blk + 64 * h + 32 * (u % 2)), 4 * (t / 2), 15),
                      bytes::shl4(bytes::bits(bytes::load(blk + 128 + 32 * h), 2 * t, 3)));
  }
  static Scales scales(const uint8_t* blk, int64_t b) {
    const int u = (int)(b % 8);
    const float d = half(blk + 208);
    return {d * (float)(int8_t)blk[192 + 2 * u], d * (float)(int8_t)blk[193 + 2 * u], 0.0f};
  }
  static F part(const uint8_t* blk, int64_t b, int s, const Scales& c) {
    const int u = (int)(b % 8), h = u / 4, t = u % 4;
    const I low = iand(shr(load_u8(blk + 64 * h + 32 * (u % 2) + s * L), 4 * (t / 2)), iset1(15));
    const I high = shl(iand(shr(load_u8(blk + 128 + 32 * h + s * L), 2 * t), iset1(3)), 4);
    return mul(set1(s * L < 16 ? c.d0 : c.d1), to_float(isub(ior(low, high), iset1(32))));
  }
};

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
// other, each PACKED bytes, the same size as the file's 8 blocks:
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

// A group's outputs for MT rows of x: the first `valid` lanes of each accumulator, ldy apart.
template <int MT>
inline void store_group(const bytes::G* acc, float* y, int64_t ldy, int64_t valid) {
  for (int i = 0; i < MT; ++i) {
    float lanes[8];
    bytes::gstore(lanes, acc[i]);
    std::memcpy(y + i * ldy, lanes, valid * sizeof(float));
  }
}

// One tile per group of 8 weight rows (`stride` bytes apart in `packed`), all M rows of x through
// it 4 at a time (16 registers: 4 accumulators, 4 sums, the weights and x's bytes):
// run(MT, group, row, n, valid) computes rows row .. row + MT - 1 against the group of outputs n ...
template <class Run>
Tiles group_tiles(const uint8_t* packed, int64_t stride, int64_t M, int64_t N, Run run) {
  return {[=](int64_t g) {
            const uint8_t* group = packed + g * stride;
            const int64_t n = g * 8, valid = std::min<int64_t>(8, N - n);
            int64_t i = 0;
            for (; i + 4 <= M; i += 4) run(std::integral_constant<int, 4>{}, group, i, n, valid);
            switch (M - i) {
              case 3: run(std::integral_constant<int, 3>{}, group, i, n, valid); break;
              case 2: run(std::integral_constant<int, 2>{}, group, i, n, valid); break;
              case 1: run(std::integral_constant<int, 1>{}, group, i, n, valid); break;
              default: break;
            }
          },
          (N + 7) / 8};
}

// MT rows of x (from `row`) against one group of 8 weight rows (outputs n .. n + valid - 1).
template <int MT, class W>
inline void ptile(const uint8_t* group, const XU& x, int64_t row, int64_t n, int64_t valid, float* y, int64_t ldy) {
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
    // Fetched ahead for tiles of several rows of x; a one-row tile streams its group once, in
    // order, and the fetches only added to the misses in flight (1B Q4_K_M one-token pass 10% faster without).
    if constexpr (MT > 1)
      for (int64_t o = 0; o < P::BYTES; o += 64) __builtin_prefetch(blk + AHEAD + o);
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
  return group_tiles(packed, (w.K / 32) * Pack<W>::BYTES, M, N, [=, &x](auto mt, const uint8_t* group, int64_t i, int64_t n, int64_t valid) {
    ptile<decltype(mt)::value, W>(group, x, i, n, valid, y, ldy);
  });
}

// Rows of x quantised per super-block of 256 for the K-quant formats: per row and super-block,
// q (256 bytes), d and the sums of q by 16.
// For the packed K-quant kernels also: the sums by 32, and q arranged as their steps read it
// (`arranged(G)`: per pair of groups of G, 4 bytes a step: 2t, 2t + 1 of each group).
struct XK {
  int64_t supers;
  std::vector<int8_t> q, q16, q32;
  std::vector<int16_t> sums, sums32;
  std::vector<float> d;
  XK(const float* x, int64_t M, int64_t K)
      : supers(K / 256), q(M * K), q16(M * K), q32(M * K), sums(M * supers * 16), sums32(M * supers * 8), d(M * supers) {
    for (int64_t at = 0; at < M * supers; ++at) {
      d[at] = bytes::quantize256(x + at * 256, &q[at * 256], &sums[at * 16]);
      for (int g = 0; g < 8; ++g) sums32[at * 8 + g] = (int16_t)(sums[at * 16 + 2 * g] + sums[at * 16 + 2 * g + 1]);
      arrange(&q[at * 256], 16, &q16[at * 256]);
      arrange(&q[at * 256], 32, &q32[at * 256]);
    }
  }
  const int8_t* arranged(int G) const { return G == 16 ? q16.data() : q32.data(); }

 private:
  static void arrange(const int8_t* in, int G, int8_t* out) {
    for (int b = 0; b < 256 / (2 * G); ++b)
      for (int t = 0; t < G / 2; ++t)
        for (int j = 0; j < 4; ++j) out[b * 2 * G + 4 * t + j] = in[(2 * b + j / 2) * G + 2 * t + j % 2];
  }
};

// ---------------------------------------------------------------------------------------------
// Packed K-quant weights for the 8-bit path (Q4_K, Q5_K, Q6_K), 8 weight rows interleaved as the
// 32-weight formats' packed copy is. A super-block's integer scale belongs to a group of G
// weights (32 for Q4_K and Q5_K, 16 for Q6_K); groups go in pairs (a "block" of 2 G weights), and
// step t of a block holds, for each of the 8 rows, weights 2t, 2t + 1 of the pair's first group
// and 2t, 2t + 1 of its second: the 16-bit lanes of one vector of byte products are then (row r,
// first group), (row r, second group), so a multiply-add by the 16 scales (each row's two) adds a
// block's products into one int32 per row, exactly. x is arranged in the same order (XK::arranged).
// A super-block's sum is converted and scaled once per row, as in the file layout's kernels.
//
// A super-block of a group of 8 rows, BYTES bytes: d (8 float16) | dmin (8 float16; Q4_K, Q5_K)
// | scales: per block 16 bytes (row r's two at 2r) | mins likewise (Q4_K, Q5_K) | per block: low
// 4 bits of S = G / 2 steps, two steps per byte (step t in the low nibble of vector t % (S / 2)
// when t < S / 2, else the high), then the high bits: Q5_K one plane per 8 steps (bit t % 8),
// Q6_K one plane per 4 steps (bits 2 (t % 4), 2 (t % 4) + 1).
template <class W>
struct KPack;
template <>
struct KPack<Q4_KW> { static constexpr int G = 32, VB = 4; };
template <>
struct KPack<Q5_KW> { static constexpr int G = 32, VB = 5; };
template <>
struct KPack<Q6_KW> { static constexpr int G = 16, VB = 6; };

template <class W>
struct KLayout {
  static constexpr int G = KPack<W>::G, VB = KPack<W>::VB, NB = 256 / (2 * G), S = G / 2;
  static constexpr bool MIN = VB != 6;
  static constexpr int FLUSH = VB == 4 ? 8 : VB == 5 ? 4 : 2;  // steps whose 16-bit sums cannot overflow
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
};

// Value k (0..255) of super-block `sb` of row n and its group's scale (and min).
template <class W>
void kvalues(const W& w, int64_t n, int64_t sb, uint8_t values[256], int scales[16], int mins[16]) {
  const uint8_t* blk = w.block(n, sb * 8);
  for (int u = 0; u < 8; ++u) bytes::bstore(values + 32 * u, W::bytes(blk, sb * 8 + u));
  if constexpr (KPack<W>::VB == 6) {
    for (int g = 0; g < 16; ++g) { scales[g] = (int8_t)blk[192 + g]; mins[g] = 0; }
  } else {
    for (int g = 0; g < 8; ++g) { scales[g] = k_scale(blk + 4, g); mins[g] = k_min(blk + 4, g); }
  }
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
        std::memcpy(o + 2 * r, P::VB == 6 ? blk + 208 : blk, 2);
        if constexpr (P::MIN) std::memcpy(o + 16 + 2 * r, blk + 2, 2);
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
              if constexpr (P::VB != 4) v[P::high_byte(t, r, j)] |= (uint8_t)(((value >> 4) & P::HIGH_MASK) << P::high_shift(t));
            }
        }
      }
    }
}

// MT rows of x (from `row`) against one group of 8 weight rows, a super-block at a time.
template <int MT, class W>
inline void kptile(const uint8_t* group, const XK& x, int64_t row, int64_t n, int64_t valid, float* y, int64_t ldy) {
  using namespace bytes;
  using P = KLayout<W>;
  const int64_t supers = x.supers;
  const int8_t* xa[MT];
  G acc[MT];
  for (int i = 0; i < MT; ++i) { acc[i] = gzero(); xa[i] = x.arranged(P::G) + (row + i) * supers * 256; }
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* blk = group + sb * P::BYTES;
    // Fetched ahead for tiles of several rows of x; a one-row tile streams its group once, in
    // order, and the fetches only added to the misses in flight (1B Q4_K_M one-token pass 10% faster without).
    if constexpr (MT > 1)
      for (int64_t o = 0; o < P::BYTES; o += 64) __builtin_prefetch(blk + AHEAD + o);
    S total[MT];
    for (int i = 0; i < MT; ++i) total[i] = szero();
    for (int b = 0; b < P::NB; ++b) {
      const H scale = P::VB == 6 ? hsigned(blk + P::SC_AT + 16 * b) : hbytes(blk + P::SC_AT + 16 * b);
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
          for (int i = 0; i < MT; ++i) { total[i] = sadd(total[i], hdot(part[i], scale)); part[i] = hzero(); }
      }
    }
    const G dw = ghalf8(blk);
    for (int i = 0; i < MT; ++i) {
      const int64_t at = (row + i) * supers + sb;
      if constexpr (P::VB == 6) {  // weight = d scale (q - 32): less 32 times the scales times x's sums by 16
        S offset = szero();
        for (int b = 0; b < P::NB; ++b) offset = sadd(offset, hdot(hsigned(blk + P::SC_AT + 16 * b), hpair(&x.sums[at * 16 + 2 * b])));
        total[i] = ssub(total[i], sshl(offset, 5));
      }
      acc[i] = gfmadd(gfloat(total[i]), gmul(dw, gset1(x.d[at])), acc[i]);
      if constexpr (P::MIN) {  // weight = d scale q - dmin min: less dmin times the mins times x's sums by 32
        S mins = szero();
        for (int b = 0; b < P::NB; ++b) mins = sadd(mins, hdot(hbytes(blk + P::MN_AT + 16 * b), hpair(&x.sums32[at * 8 + 2 * b])));
        acc[i] = gfmadd(gfloat(mins), gmul(ghalf8(blk + 16), gset1(-x.d[at])), acc[i]);
      }
    }
  }
  store_group<MT>(acc, y + row * ldy + n, ldy, valid);
}

template <class W>
Tiles linear_kpacked(const W& w, const uint8_t* packed, const XK& x, int64_t M, float* y, int64_t N, int64_t ldy) {
  return group_tiles(packed, (w.K / 256) * KLayout<W>::BYTES, M, N, [=, &x](auto mt, const uint8_t* group, int64_t i, int64_t n, int64_t valid) {
    kptile<decltype(mt)::value, W>(group, x, i, n, valid, y, ldy);
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
  constexpr int64_t HEAD = W::MIN ? 4 : 2, QH_AT = HEAD, NIB_AT = HEAD + (W::BITS == 5 ? 4 : 0);
  const int64_t units = K / 32, g = n / 8, r = n % 8;
  for (int64_t b = 0; b < units; ++b) {
    const uint8_t* o = packed + (g * units + b) * P::BYTES;
    uint8_t* blk = out + b * W::BYTES;
    std::memset(blk, 0, W::BYTES);
    std::memcpy(blk, o + 2 * r, 2);
    if constexpr (W::MIN) std::memcpy(blk + 2, o + P::M_AT + 2 * r, 2);
    uint32_t fifth = 0;
    for (int k = 0; k < 32; ++k) {
      if constexpr (W::BITS == 8) {
        blk[2 + k] = o[P::q_byte(k, r)];
      } else {
        const int v = (o[P::q_byte(k, r)] >> P::q_shift(k)) & 15;
        blk[NIB_AT + k % 16] |= (uint8_t)(v << (k < 16 ? 0 : 4));
        if constexpr (W::BITS == 5) fifth |= (uint32_t)((o[P::h_byte(k, r)] >> (k / 4)) & 1) << k;
      }
    }
    if constexpr (W::BITS == 5) for (int i = 0; i < 4; ++i) blk[QH_AT + i] = (uint8_t)(fifth >> (8 * i));
  }
}

template <class W>
void kunpack_row(const uint8_t* packed, int64_t K, int64_t n, uint8_t* out) {
  using P = KLayout<W>;
  const int64_t supers = K / 256, g = n / 8, r = n % 8;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* o = packed + (g * supers + sb) * P::BYTES;
    uint8_t* blk = out + sb * W::BYTES;
    uint8_t values[256];
    int scales[16], mins[16] = {0};
    for (int b = 0; b < P::NB; ++b) {
      for (int h = 0; h < 2; ++h) {
        scales[2 * b + h] = o[P::SC_AT + 16 * b + 2 * r + h];
        if constexpr (P::MIN) mins[2 * b + h] = o[P::MN_AT + 16 * b + 2 * r + h];
      }
      const uint8_t* v = o + P::BLK_AT + b * P::BLOCK;
      for (int t = 0; t < P::S; ++t)
        for (int j = 0; j < 4; ++j) {
          int value = (v[P::low_byte(t, r, j)] >> P::low_shift(t)) & 15;
          if constexpr (P::VB != 4) value |= ((v[P::high_byte(t, r, j)] >> P::high_shift(t)) & P::HIGH_MASK) << 4;
          values[P::value_at(b, t, j)] = (uint8_t)value;
        }
    }
    std::memset(blk, 0, W::BYTES);
    if constexpr (P::VB == 6) {  // Q6_K: 128 bytes of low nibbles, 64 of high bits, 16 scales, d
      for (int u = 0; u < 8; ++u) {
        const int h = u / 4, t = u % 4;
        for (int l = 0; l < 32; ++l) {
          const int value = values[32 * u + l];
          blk[64 * h + 32 * (u % 2) + l] |= (uint8_t)((value & 15) << (4 * (t / 2)));
          blk[128 + 32 * h + l] |= (uint8_t)(((value >> 4) & 3) << (2 * t));
        }
      }
      for (int i = 0; i < 16; ++i) blk[192 + i] = (uint8_t)scales[i];
      std::memcpy(blk + 208, o + 2 * r, 2);
    } else {  // Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (5th bits), nibbles
      std::memcpy(blk, o + 2 * r, 2);
      std::memcpy(blk + 2, o + 16 + 2 * r, 2);
      uint8_t* sc = blk + 4;
      for (int u = 0; u < 4; ++u) {
        sc[u] = (uint8_t)((scales[u] & 63) | ((scales[u + 4] >> 4) << 6));
        sc[u + 4] = (uint8_t)((mins[u] & 63) | ((mins[u + 4] >> 4) << 6));
        sc[u + 8] = (uint8_t)((scales[u + 4] & 15) | ((mins[u + 4] & 15) << 4));
      }
      const int64_t nib = P::VB == 5 ? 48 : 16;
      for (int u = 0; u < 8; ++u)
        for (int l = 0; l < 32; ++l) {
          const int value = values[32 * u + l];
          blk[nib + 32 * (u / 2) + l] |= (uint8_t)((value & 15) << (4 * (u % 2)));
          if constexpr (P::VB == 5) blk[16 + l] |= (uint8_t)(((value >> 4) & 1) << u);
        }
    }
  }
}

template <class W>
void expand_rows(const W& w, const int64_t* rows, int64_t count, float* out);

// Rows of W expanded from its packed copy: each row's blocks rebuilt, then expanded as from the file.
template <class W, bool SUPER>
void expand_packed_rows(const uint8_t* packed, int64_t K, const int64_t* rows, int64_t count, float* out) {
  std::vector<uint8_t> row(K / (32 * W::UNITS) * W::BYTES);
  const W one{{row.data(), K}};
  const int64_t first = 0;
  for (int64_t i = 0; i < count; ++i) {
    if constexpr (SUPER) kunpack_row<W>(packed, K, rows[i], row.data());
    else unpack_row<W>(packed, K, rows[i], row.data());
    expand_rows(one, &first, 1, out + i * K);
  }
}

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

// Bytes of one weight row of K weights in format `kind`.
template <class W>
constexpr int64_t bytes_of(int64_t K) { return K / (32 * W::UNITS) * W::BYTES; }
inline int64_t row_bytes(int32_t kind, int64_t K) {
  switch (kind) {
    case F32: return bytes_of<F32W>(K);
    case F16: return bytes_of<F16W>(K);
    case BF16: return bytes_of<BF16W>(K);
    case Q4_0: return bytes_of<Q4_0W>(K);
    case Q4_1: return bytes_of<Q4_1W>(K);
    case Q5_0: return bytes_of<Q5_0W>(K);
    case Q5_1: return bytes_of<Q5_1W>(K);
    case Q8_0: return bytes_of<Q8_0W>(K);
    case Q4_K: return bytes_of<Q4_KW>(K);
    case Q5_K: return bytes_of<Q5_KW>(K);
    case Q6_K: return bytes_of<Q6_KW>(K);
    default: return 0;
  }
}

// One part of a layer: the 8-bit path when asked for and the part has it (a packed copy of a
// 32-weight format, or a K-quant format; xu / xk are then the quantised x), the float path otherwise.
template <class W>
Tiles linear_part(const W& w, const uint8_t* packed, const float* x, const XU* xu, const XK* xk, int64_t M,
                  float* y, int64_t N, int64_t ldy) {
  if constexpr (W::SUPER) {
    if (packed != nullptr && xk != nullptr && xk->supers == w.K / 256) return linear_kpacked(w, packed, *xk, M, y, N, ldy);
  } else if constexpr (W::INTEGER) {
    if (packed != nullptr && xu != nullptr && xu->K == w.K) return linear_packed(w, packed, *xu, M, y, N, ldy);
  }
  return linear_rows(w, x, M, w.K, y, N, ldy);
}

}  // namespace

extern "C" {

// One weight matrix as the library sees it (kernels.py builds these): N rows of K weights in
// one block format, and optionally the next matrix of a fused layer (q|k|v of different
// formats, as Q4_K_M files have), whose outputs follow along N.
struct Mat {
  int32_t kind;
  int64_t N, K;
  const uint8_t* data;  // [N, K / weights per block blocks]
  const float* bias;    // [N] or null
  const Mat* next;      // the next part along N, or null
  const uint8_t* packed;  // the 8-bit path's packed copy (parrot_pack) of a 32-weight format, or null
};

// Rows `rows` of W (one part), de-quantised as the kernels expand them (the gguf reference's
// values): out [count, K].
void parrot_rows(const Mat* w, const int64_t* rows, int64_t count, float* out) {
  const int64_t K = w->K;
  if (w->packed != nullptr) {  // the file's blocks may have been handed back: read the packed copy
    switch (w->kind) {
      case Q4_0: return expand_packed_rows<Q4_0W, false>(w->packed, K, rows, count, out);
      case Q4_1: return expand_packed_rows<Q4_1W, false>(w->packed, K, rows, count, out);
      case Q5_0: return expand_packed_rows<Q5_0W, false>(w->packed, K, rows, count, out);
      case Q5_1: return expand_packed_rows<Q5_1W, false>(w->packed, K, rows, count, out);
      case Q8_0: return expand_packed_rows<Q8_0W, false>(w->packed, K, rows, count, out);
      case Q4_K: return expand_packed_rows<Q4_KW, true>(w->packed, K, rows, count, out);
      case Q5_K: return expand_packed_rows<Q5_KW, true>(w->packed, K, rows, count, out);
      case Q6_K: return expand_packed_rows<Q6_KW, true>(w->packed, K, rows, count, out);
      default: break;
    }
  }
  switch (w->kind) {
    case F32: expand_rows(F32W{{w->data, K}}, rows, count, out); break;
    case F16: expand_rows(F16W{{w->data, K}}, rows, count, out); break;
    case BF16: expand_rows(BF16W{{w->data, K}}, rows, count, out); break;
    case Q4_0: expand_rows(Q4_0W{{w->data, K}}, rows, count, out); break;
    case Q4_1: expand_rows(Q4_1W{{w->data, K}}, rows, count, out); break;
    case Q5_0: expand_rows(Q5_0W{{w->data, K}}, rows, count, out); break;
    case Q5_1: expand_rows(Q5_1W{{w->data, K}}, rows, count, out); break;
    case Q8_0: expand_rows(Q8_0W{{w->data, K}}, rows, count, out); break;
    case Q4_K: expand_rows(Q4_KW{{w->data, K}}, rows, count, out); break;
    case Q5_K: expand_rows(Q5_KW{{w->data, K}}, rows, count, out); break;
    case Q6_K: expand_rows(Q6_KW{{w->data, K}}, rows, count, out); break;
    default: break;
  }
}

// Bytes of W's packed copy for the 8-bit path (0: its format has none).
int64_t parrot_packed_bytes(int32_t kind, int64_t N, int64_t K) {
  const int64_t groups = (N + 7) / 8, units = K / 32;
  switch (kind) {
    case Q4_0: return groups * units * Pack<Q4_0W>::BYTES;
    case Q4_1: return groups * units * Pack<Q4_1W>::BYTES;
    case Q5_0: return groups * units * Pack<Q5_0W>::BYTES;
    case Q5_1: return groups * units * Pack<Q5_1W>::BYTES;
    case Q8_0: return groups * units * Pack<Q8_0W>::BYTES;
    case Q4_K: return K % 256 ? 0 : groups * (K / 256) * KLayout<Q4_KW>::BYTES;
    case Q5_K: return K % 256 ? 0 : groups * (K / 256) * KLayout<Q5_KW>::BYTES;
    case Q6_K: return K % 256 ? 0 : groups * (K / 256) * KLayout<Q6_KW>::BYTES;
    default: return 0;
  }
}

// W (one part) packed into out (parrot_packed_bytes of it).
void parrot_pack(const Mat* w, uint8_t* out) {
  const int64_t K = w->K;
  switch (w->kind) {
    case Q4_0: pack(Q4_0W{{w->data, K}}, w->N, out); break;
    case Q4_1: pack(Q4_1W{{w->data, K}}, w->N, out); break;
    case Q5_0: pack(Q5_0W{{w->data, K}}, w->N, out); break;
    case Q5_1: pack(Q5_1W{{w->data, K}}, w->N, out); break;
    case Q8_0: pack(Q8_0W{{w->data, K}}, w->N, out); break;
    case Q4_K: kpack(Q4_KW{{w->data, K}}, w->N, out); break;
    case Q5_K: kpack(Q5_KW{{w->data, K}}, w->N, out); break;
    case Q6_K: kpack(Q6_KW{{w->data, K}}, w->N, out); break;
    default: break;
  }
}

constexpr int64_t PIECES = 4;

// y = x @ W^T (+ bias) for x [M, K]; y [M, total N of the parts]. `q8`: quantise x to 8 bits
// for the parts that have the 8-bit path (the K-quant formats, and the 32-weight formats given
// their packed copy); 0: float32 throughout.
void parrot_linear(const Mat* w, const float* x, int64_t M, float* y, int threads, int q8) {
  int64_t ldy = 0;
  bool any_packed = false, any_super = false;
  for (const Mat* p = w; p != nullptr; p = p->next) {
    ldy += p->N;
    any_packed |= p->packed != nullptr && p->kind >= Q4_0 && p->kind <= Q8_0;
    any_super |= p->kind >= Q4_K && p->kind <= Q6_K;
  }
  const std::unique_ptr<XU> xu(q8 && any_packed ? new XU(x, M, w->K) : nullptr);
  const std::unique_ptr<XK> xk(q8 && any_super && w->K % 256 == 0 ? new XK(x, M, w->K) : nullptr);
  std::vector<Tiles> parts;
  std::vector<int64_t> first, bytes;  // each part's first cost unit in the job and bytes per tile
  int64_t total = 0, offset = 0;
  for (const Mat* p = w; p != nullptr; offset += p->N, p = p->next) {
    const int64_t K = p->K, N = p->N;
    float* out = y + offset;
    switch (p->kind) {
      case F32: parts.push_back(linear_part(F32W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case F16: parts.push_back(linear_part(F16W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case BF16: parts.push_back(linear_part(BF16W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q4_0: parts.push_back(linear_part(Q4_0W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q4_1: parts.push_back(linear_part(Q4_1W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q5_0: parts.push_back(linear_part(Q5_0W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q5_1: parts.push_back(linear_part(Q5_1W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q8_0: parts.push_back(linear_part(Q8_0W{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q4_K: parts.push_back(linear_part(Q4_KW{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q5_K: parts.push_back(linear_part(Q5_KW{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      case Q6_K: parts.push_back(linear_part(Q6_KW{{p->data, K}}, p->packed, x, xu.get(), xk.get(), M, out, N, ldy)); break;
      default: parts.push_back({[](int64_t) {}, 0}); break;
    }
    const Tiles& added = parts.back();
    first.push_back(total);
    bytes.push_back(std::max<int64_t>(1, row_bytes(p->kind, K) * ((N + added.count - 1) / std::max<int64_t>(1, added.count))));
    total += added.count * bytes.back();
  }
  // One job over every part's tiles (a layer of several parts costs one hand-off to the
  // threads), split into pieces of equal bytes of weights: parts in different formats (a Q4_K_M
  // file's q, k and v) cost different amounts per tile. PIECES per thread, claimed as the threads
  // come free: with one piece each, the thread that started later or read slower memory kept the
  // other waiting at the end of every layer.
  const int64_t pieces = std::max(1, threads) * PIECES;
  pool(threads).parallel_for(pieces, [&](int64_t id) {
    const int64_t lo = total * id / pieces, hi = total * (id + 1) / pieces;
    for (size_t i = 0; i < parts.size(); ++i) {
      // Tile t of part i starts at first[i] + t bytes[i]; it is this thread's if that is in [lo, hi).
      const auto from = [&](int64_t at) { return std::clamp<int64_t>((at - first[i] + bytes[i] - 1) / bytes[i], 0, parts[i].count); };
      for (int64_t t = from(lo), end = from(hi); t < end; ++t) parts[i].run(t);
    }
  }, pieces);
  offset = 0;
  for (const Mat* p = w; p != nullptr; offset += p->N, p = p->next)
    if (p->bias != nullptr)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t n = 0; n < p->N; ++n) y[i * ldy + offset + n] += p->bias[n];
}

}  // extern "C"

namespace {

// ---------------------------------------------------------------------------------------------
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
// the chunk together, up to 4 at a time, with the head dimension in the vector lanes: a score is
// a run of multiply-adds over the dimension's 8-lane slices, summed across lanes once (for 4 keys
// at a time, bytes::ghsum4), and sum p v keeps each row's sums in registers for the whole chunk.
// Each key or value slice is read (and widened from float16) once per block of rows. Keys are
// never transposed: a one-token pass (3 rows per key/value head on the embedded model) spent as
// long transposing keys as scoring them. All builds use 8-lane vectors here (the AVX-512 build
// too, as in the 8-bit linear layers).
//
// Grouped-query attention: query head h reads key/value head h / (heads / kv_heads), as
// transformers' repeat_kv does.

constexpr int64_t CHUNK = 256;

// The cache is read from memory once per pass (a one-token pass reads each layer's keys and
// values once), in short streams (a chunk of one head) that the hardware prefetcher picked up
// late: a one-token pass spent most of its attention time waiting on the first value rows of
// each chunk (perf, AVX2 EPYC). So the first rows through a chunk fetch ahead: scoring fetches
// the keys KEYS_AHEAD rows on and the value rows it passes (into L2: a chunk's values are as
// large as L1), and summing the values fetches the keys of the thread's next item. A one-token
// pass of the embedded model at 1,000 positions: 7-8% faster; an 8-token pass 6%.
constexpr int64_t KEYS_AHEAD = 16;
inline void fetch_ahead(const void* keys, const void* values, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(static_cast<const char*>(keys) + o);
    if (values != nullptr) __builtin_prefetch(static_cast<const char*>(values) + o, 0, 2);
  }
}

inline bytes::G kv8(const float* p) { return bytes::gload(p); }
inline bytes::G kv8(const uint16_t* p) { return bytes::ghalf8((const uint8_t*)p); }

// Scores of RB rows (scaled queries qs, D = 8 C8 apart) against keys [0, m) of the chunk
// (keys, D apart), into scores (CHUNK apart per row). KB keys at a time; a last partial group
// repeats key m - 1 (each score depends on its own row and key only; the extra ones are dropped).
template <int C8, int RB, class T>
inline void score_block(const float* qs, const T* keys, int64_t m, float* scores, const T* values) {
  using namespace bytes;
  constexpr int D = 8 * C8, KB = RB <= 3 ? 4 : 2;
  for (int64_t j0 = 0; j0 < m; j0 += KB) {
    const T* kp[KB];
    for (int k = 0; k < KB; ++k) kp[k] = keys + std::min(j0 + k, m - 1) * D;
    if (values != nullptr) fetch_ahead(keys + (j0 + KEYS_AHEAD) * D, values + j0 * D, KB * D * sizeof(T));
    G acc[RB][KB];
    for (int r = 0; r < RB; ++r)
      for (int k = 0; k < KB; ++k) acc[r][k] = gzero();
    for (int c = 0; c < C8; ++c) {
      G q[RB];
      for (int r = 0; r < RB; ++r) q[r] = gload(qs + r * D + 8 * c);
      for (int k = 0; k < KB; ++k) {
        const G kv = kv8(kp[k] + 8 * c);
        for (int r = 0; r < RB; ++r) acc[r][k] = gfmadd(q[r], kv, acc[r][k]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      float s[4];
      if constexpr (KB == 4) ghsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s);
      else ghsum4(acc[r][0], acc[r][1], gzero(), gzero(), s);
      for (int k = 0; k < KB && j0 + k < m; ++k) scores[r * CHUNK + j0 + k] = s[k];
    }
  }
}

// out_r = sum_j p_rj v_j over keys j < m in key order, for RB rows (weights at scores + r CHUNK,
// sums at part + r (D + 2) + 2): VS 8-lane slices of the head dimension at a time, held in
// registers for all m keys.
template <int C8, int RB, class T>
inline void value_block(const float* scores, const T* values, int64_t m, float* part, const T* next_keys) {
  using namespace bytes;
  constexpr int D = 8 * C8, VS0 = RB <= 3 ? 4 : 2, VS = VS0 < C8 ? VS0 : C8;
  for (int c0 = 0; c0 < C8; c0 += VS) {
    G o[RB][VS];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < VS; ++c) o[r][c] = gzero();
    for (int64_t j = 0; j < m; ++j) {
      if (next_keys != nullptr && c0 == 0) fetch_ahead(next_keys + j * D, nullptr, D * sizeof(T));
      G p[RB];
      for (int r = 0; r < RB; ++r) p[r] = gset1(scores[r * CHUNK + j]);
      for (int c = 0; c < VS; ++c) {
        const G v = kv8(values + j * D + 8 * (c0 + c));
        for (int r = 0; r < RB; ++r) o[r][c] = gfmadd(p[r], v, o[r][c]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < VS; ++c) gstore(part + r * (D + 2) + 2 + 8 * (c0 + c), o[r][c]);
  }
}

// One item: rows r = t * G + g (token t sees keys < limit[t]) against keys [c0, c1) of one
// key/value head. Writes per row: max, sum of exp(s - max), sum of exp(s - max) v (D floats);
// max = -inf when the row sees none of the chunk.
template <int C8, class T>
void chunk(const float* qs, int64_t n, int64_t G, const int64_t* limit, const T* keys,
           const T* values, int64_t c0, int64_t c1, float* scores, float* part, const T* next_keys) {
  constexpr int D = 8 * C8;
  const int64_t S = c1 - c0;
  const T* k0 = keys + c0 * D;
  const T* v0 = values + c0 * D;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t seen = std::min(std::max(limit[t] - c0, (int64_t)0), S);  // keys of this chunk token t sees
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t r = t * G + g0, rb = std::min<int64_t>(4, G - g0);
      float* pr = part + r * (D + 2);
      if (seen == 0) {
        for (int64_t i = 0; i < rb; ++i) { pr[i * (D + 2)] = -INFINITY; pr[i * (D + 2) + 1] = 0.0f; }
        continue;
      }
      float* sr = scores + r * CHUNK;
      const bool first = t == 0 && g0 == 0;  // the first rows through the chunk fetch it (the rest find it in cache)
      switch (rb) {
        case 1: score_block<C8, 1, T>(qs + r * D, k0, seen, sr, first ? v0 : nullptr); break;
        case 2: score_block<C8, 2, T>(qs + r * D, k0, seen, sr, first ? v0 : nullptr); break;
        case 3: score_block<C8, 3, T>(qs + r * D, k0, seen, sr, first ? v0 : nullptr); break;
        default: score_block<C8, 4, T>(qs + r * D, k0, seen, sr, first ? v0 : nullptr); break;
      }
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
      switch (rb) {
        case 1: value_block<C8, 1, T>(sr, v0, seen, pr, first ? next_keys : nullptr); break;
        case 2: value_block<C8, 2, T>(sr, v0, seen, pr, first ? next_keys : nullptr); break;
        case 3: value_block<C8, 3, T>(sr, v0, seen, pr, first ? next_keys : nullptr); break;
        default: value_block<C8, 4, T>(sr, v0, seen, pr, first ? next_keys : nullptr); break;
      }
    }
  }
}

template <class T>
using ChunkFn = void (*)(const float*, int64_t, int64_t, const int64_t*, const T*, const T*, int64_t, int64_t, float*, float*, const T*);

template <class T>
ChunkFn<T> pick(int64_t D) {
  switch (D) {
    case 16: return chunk<2, T>;
    case 32: return chunk<4, T>;
    case 64: return chunk<8, T>;
    case 128: return chunk<16, T>;
    default: return nullptr;
  }
}

// q [n, heads, D]; k, v [kv_heads, capacity, D] (one layer of one sequence's cache, float32 or
// float16) holding `end` positions, the last n of which are the queries' own. out [n, heads * D].
template <class T>
void attention(const float* q, int64_t n, int64_t heads, int64_t D, const T* k, const T* v,
               int64_t kv_heads, int64_t capacity, int64_t end, float scale, float* out, int threads) {
  const int64_t G = heads / kv_heads, R = n * G, chunks = (end + CHUNK - 1) / CHUNK;
  const ChunkFn<T> fn = pick<T>(D);
  std::vector<int64_t> limit(n);
  for (int64_t t = 0; t < n; ++t) limit[t] = end - n + t + 1;  // token t sees positions < limit[t]
  // Partials [kv_heads, chunks, R, D + 2]: max, sum, weighted values.
  std::vector<float> part(kv_heads * chunks * R * (D + 2));
  // Scaled queries by key/value head: qs[h][t * G + g] = scale * q[t][h * G + g].
  std::vector<float> qs(kv_heads * R * D);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < D; ++d)
        qs[((h / G) * R + t * G + h % G) * D + d] = q[(t * heads + h) * D + d] * scale;
  const int64_t items = kv_heads * chunks;
  std::vector<float> scores(items * R * CHUNK);  // each item's own scratch
  // A thread takes items in order (contiguous shares): while it sums an item's values it fetches
  // the keys of the next one, which would otherwise wait on memory when its scoring starts.
  const auto keys_of = [&](int64_t i) { return k + (i / chunks) * capacity * D + (i % chunks) * CHUNK * D; };
  pool(threads).parallel_for(items, [&](int64_t i) {
    const int64_t h = i / chunks, c = i % chunks;
    fn(qs.data() + h * R * D, n, G, limit.data(), k + h * capacity * D, v + h * capacity * D,
       c * CHUNK, std::min((c + 1) * CHUNK, end), scores.data() + i * R * CHUNK, part.data() + i * R * (D + 2),
       i + 1 < items ? keys_of(i + 1) : nullptr);
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
        const float* pr = part.data() + ((h * chunks + c) * R + r) * (D + 2);
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

}  // namespace

extern "C" {

int parrot_attention_supports(int64_t head_dim, int64_t heads, int64_t kv_heads) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 16 && pick<float>(head_dim) != nullptr;
}

void parrot_attention(const float* q, int64_t n, int64_t heads, int64_t D, const float* k, const float* v,
                      int64_t kv_heads, int64_t capacity, int64_t end, float scale, float* out, int threads) {
  attention(q, n, heads, D, k, v, kv_heads, capacity, end, scale, out, threads);
}

// ---------------------------------------------------------------------------------------------
// A whole pass of a Llama-family model for sequences that each feed a few tokens.

struct Layer {
  Mat qkv, o, gate_up, down;  // q|k|v and gate|up fused along N
  const float* input_norm;    // [hidden]
  const float* post_norm;     // [hidden]
};

struct Model {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_positions;
  float eps, scale;
  int32_t threads;
  int32_t q8;               // 8-bit activations for integer block formats (parrot_linear)
  int32_t kv16;             // the caches hold float16 (else float32)
  const float* embed;       // [vocab, hidden] float32 rows, or null: rows of embed_blocks
  const Mat* embed_blocks;  // the embedding in blocks (a tied LM head's), expanded per token
  const float* cos;         // [max_positions, head_dim]
  const float* sin;
  const float* final_norm;  // [hidden]
  Mat lm_head;
  const Layer* layers;
};

// One sequence of a pass: its cache (k, v [layers, kv_heads, capacity, head_dim], float16 where
// the model's kv16 is set, else float32; `start` positions filled), the n tokens it feeds, and
// how many of its last rows need logits.
struct Seq {
  void* k;
  void* v;
  int64_t capacity, start, n, num_logits;
};

}  // extern "C"

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

// silu(gate) * up = gate * up / (1 + exp(-gate)), per row [gate | up] -> [I].
void silu_mul(const float* gu, int64_t rows, int64_t I, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* g = gu + i * 2 * I;
    const float* u = g + I;
    int64_t j = 0;
    for (; j + L <= I; j += L) {
      const F gv = load(g + j);
      store(out + i * I + j, div(mul(gv, load(u + j)), add(set1(1.0f), exp(sub(zero(), gv)))));
    }
    for (; j < I; ++j) out[i * I + j] = g[j] * u[j] / (1.0f + std::exp(-g[j]));
  }
}

}  // namespace

extern "C" {

// ids: every sequence's tokens, concatenated; logits: [sum of num_logits, vocab]. Each cache
// grows by its n tokens (the caller has reserved the room and updates its lengths).
void parrot_forward(const Model* md, int64_t num_seqs, const Seq* seqs, const int64_t* ids, float* logits) {
  const int64_t H = md->hidden, D = md->head_dim, heads = md->heads, kvh = md->kv_heads, I = md->intermediate;
  const int64_t q_width = heads * D, kv_width = kvh * D, qkv_width = q_width + 2 * kv_width;
  int64_t M = 0, rows_out = 0;
  for (int64_t s = 0; s < num_seqs; ++s) { M += seqs[s].n; rows_out += seqs[s].num_logits; }
  std::vector<float> hidden(M * H), x(M * H), tmp(M * H), qkv(M * qkv_width), att(M * q_width),
      gu(M * 2 * I), act(M * I);
  if (md->embed != nullptr) {
    for (int64_t i = 0; i < M; ++i) std::memcpy(&hidden[i * H], md->embed + ids[i] * H, H * sizeof(float));
  } else {
    parrot_rows(md->embed_blocks, ids, M, hidden.data());
  }

  for (int64_t l = 0; l < md->num_layers; ++l) {
    const Layer& layer = md->layers[l];
    rms_norm(hidden.data(), layer.input_norm, M, H, md->eps, x.data());
    parrot_linear(&layer.qkv, x.data(), M, qkv.data(), md->threads, md->q8);
    int64_t row = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const Seq& seq = seqs[s];
      const int64_t cache_layer = l * kvh * seq.capacity * D;
      for (int64_t t = 0; t < seq.n; ++t) {
        const int64_t pos = seq.start + t;
        float* r = &qkv[(row + t) * qkv_width];
        rope(r, heads + kvh, D, md->cos + pos * D, md->sin + pos * D);  // q and k heads are adjacent
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
      }
      // The attention kernel reads q as [n, heads, D]: gather this sequence's q rows.
      std::vector<float> q(seq.n * q_width);
      for (int64_t t = 0; t < seq.n; ++t) std::memcpy(&q[t * q_width], &qkv[(row + t) * qkv_width], q_width * sizeof(float));
      if (md->kv16)
        attention(q.data(), seq.n, heads, D, static_cast<const uint16_t*>(seq.k) + cache_layer,
                  static_cast<const uint16_t*>(seq.v) + cache_layer, kvh, seq.capacity, seq.start + seq.n, md->scale,
                  &att[row * q_width], md->threads);
      else
        attention(q.data(), seq.n, heads, D, static_cast<const float*>(seq.k) + cache_layer,
                  static_cast<const float*>(seq.v) + cache_layer, kvh, seq.capacity, seq.start + seq.n, md->scale,
                  &att[row * q_width], md->threads);
      row += seq.n;
    }
    parrot_linear(&layer.o, att.data(), M, tmp.data(), md->threads, md->q8);
    for (int64_t i = 0; i < M * H; ++i) hidden[i] += tmp[i];
    rms_norm(hidden.data(), layer.post_norm, M, H, md->eps, x.data());
    parrot_linear(&layer.gate_up, x.data(), M, gu.data(), md->threads, md->q8);
    silu_mul(gu.data(), M, I, act.data());
    parrot_linear(&layer.down, act.data(), M, tmp.data(), md->threads, md->q8);
    for (int64_t i = 0; i < M * H; ++i) hidden[i] += tmp[i];
  }
  // Logits of each sequence's last num_logits rows.
  std::vector<float> last(rows_out * H);
  int64_t row = 0, out_row = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first = row + seqs[s].n - seqs[s].num_logits;
    rms_norm(&hidden[first * H], md->final_norm, seqs[s].num_logits, H, md->eps, &last[out_row * H]);
    out_row += seqs[s].num_logits;
    row += seqs[s].n;
  }
  if (rows_out > 0) parrot_linear(&md->lm_head, last.data(), rows_out, logits, md->threads, md->q8);
}

const char* parrot_isa() { return ISA; }

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
