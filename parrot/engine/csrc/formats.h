// The GGUF block formats the kernels run: each format's block layout in one struct, and the table
// of formats (PARROT_FORMATS) that the enum of kinds, the library's exported table and the one
// dispatch from a kind to its struct (with_format) all come from.
//
// A weight matrix is kept in the GGUF's own blocks, row after row. The kernels work in units of
// 32 weights along K (a K-quant super-block of 256 holds 8; a float format's 32 weights are read
// as one unit): for unit b of weight row n, `block` points at the (super-)block holding it,
// `scales` reads what multiplies its values, and `part(s)` expands its lanes s L .. s L + L - 1 to
// float32 exactly as the gguf package's reference de-quantises them: where the reference rounds
// once (d * q + m, d * q - m with d * q exact), so does the kernel; where it rounds d * q (Q6_K),
// the kernel multiplies separately.
//
// Adding a format: its struct here (the float path needs Layout, scales and part; the 8-bit path
// the members of HalfScales or SuperBytes below), its row in PARROT_FORMATS and in
// parrot/engine/quant.py's FORMATS (kernels.py checks that the two agree).

#pragma once

#include "simd.h"

#include <cstdint>
#include <cstring>

using namespace simd;

namespace {

struct Scales {
  float d0, d1, m;  // multiplier of lanes 0..15 and 16..31 of the unit; offset
};

// A GGUF block of `Weights` weights in `Bytes` bytes, as ggml defines it (the table's block
// size). The kernels address whole units of 32 weights, so `block` steps over BYTES bytes
// holding UNITS units: the block itself, or for a float format (one weight per block) 32 of them.
template <int64_t Bytes, int64_t Weights>
struct Layout {
  static constexpr int64_t BLOCK_BYTES = Bytes, BLOCK_WEIGHTS = Weights;
  static constexpr int64_t UNITS = Weights >= 32 ? Weights / 32 : 1;         // 32-weight units `block` spans
  static constexpr int64_t BYTES = Weights >= 32 ? Bytes : 32 / Weights * Bytes;  // bytes `block` spans
  static_assert(Weights % 32 == 0 || 32 % Weights == 0, "a block is a whole number of 32-weight units, or divides one");
  const uint8_t* data;
  int64_t K;
  inline const uint8_t* block(int64_t n, int64_t b) const {
    return data + (n * (K / (32 * UNITS)) + b / UNITS) * BYTES;
  }
};

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

// The 8-bit activation path (packed.h) reads a unit as 32 bytes `bytes(blk, b)` of small unsigned
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

// The 32-weight formats share one layout: float16 d at the start of the block, float16 m after
// it where there is one (Min), a little-endian 32-bit mask of 5th bits for 5-bit values, then the
// values: 16 bytes of nibbles (byte j: value j low, j + 16 high), or 32 signed bytes (8 bits).
// Their 8-bit path runs on a packed copy (packed.h: `pack`), which takes d and m from there and
// gives the file's blocks back through `rebuild`.
template <int Bits, int Shift, bool Min, bool Signed = false>
struct HalfScales : Bytes<Shift, Min, Signed> {
  static constexpr int BITS = Bits;
  static constexpr int64_t HEAD = Min ? 4 : 2, QH_AT = HEAD, NIB_AT = HEAD + (Bits == 5 ? 4 : 0);
  // The block of d, m (float16 bytes) and values (as `bytes` gives them), into blk (zeroed).
  static void rebuild(uint8_t* blk, const uint8_t* d, const uint8_t* m, const uint8_t values[32]) {
    std::memcpy(blk, d, 2);
    if constexpr (Min) std::memcpy(blk + 2, m, 2);
    uint32_t fifth = 0;
    for (int k = 0; k < 32; ++k) {
      if constexpr (Bits == 8) {
        blk[2 + k] = values[k];
      } else {
        blk[NIB_AT + k % 16] |= (uint8_t)((values[k] & 15) << (k < 16 ? 0 : 4));
        if constexpr (Bits == 5) fifth |= (uint32_t)((values[k] >> 4) & 1) << k;
      }
    }
    if constexpr (Bits == 5) for (int i = 0; i < 4; ++i) blk[QH_AT + i] = (uint8_t)(fifth >> (8 * i));
  }
};

// The K-quant formats take x in super-blocks of 256 (one multiplier each, as llama.cpp's Q8_K),
// so that a super-block's products are summed in integers, each group's scaled by its integer
// scale, and converted to float once (their packed copy: packed.h's `kpack`). Each format says
// how many weights share an integer scale (GROUP: 16 or 32), how many bits its values have
// (VALUE_BITS), where d (D_AT) and, with a min, dmin (DMIN_AT) are, and gives its groups'
// integer scales and mins (`group_scales`; they fit a signed byte) and the block of given values,
// scales and mins back (`rebuild`).
template <int Shift, bool Min>
struct SuperBytes : Bytes<Shift, Min> {
  static constexpr bool SUPER = true;
};

struct F32W : Layout<4, 1>, NoBytes {
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static F part(const uint8_t* blk, int64_t, int s, const Scales&) { return load((const float*)blk + s * L); }
};
struct F16W : Layout<2, 1>, NoBytes {
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static F part(const uint8_t* blk, int64_t, int s, const Scales&) { return load_f16(blk + 2 * s * L); }
};
struct BF16W : Layout<2, 1>, NoBytes {
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static F part(const uint8_t* blk, int64_t, int s, const Scales&) { return bits(shl(load_u16(blk + 2 * s * L), 16)); }
};
// Q4_0 (18 bytes): d, 16 bytes of nibbles; weight = d * (q - 8).
struct Q4_0W : Layout<18, 32>, HalfScales<4, 3, false> {
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::nibbles(blk + 2); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return mul(set1(c.d0), to_float(isub(nibbles(blk + 2, s), iset1(8))));
  }
};
// Q4_1 (20 bytes): d, m, 16 bytes of nibbles; weight = d * q + m.
struct Q4_1W : Layout<20, 32>, HalfScales<4, 0, true> {
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk), half(blk + 2)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::nibbles(blk + 4); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return fmadd(set1(c.d0), to_float(nibbles(blk + 4, s)), set1(c.m));
  }
};
// Q5_0 (22 bytes): d, 32-bit mask of 5th bits, nibbles; weight = d * (q - 16).
struct Q5_0W : Layout<22, 32>, HalfScales<5, 4, false> {
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::bor(bytes::nibbles(blk + 6), bytes::bits16(mask32(blk + 2))); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return mul(set1(c.d0), to_float(isub(ior(nibbles(blk + 6, s), fifth_bits(blk + 2, s)), iset1(16))));
  }
};
// Q5_1 (24 bytes): d, m, 5th bits, nibbles; weight = d * q + m.
struct Q5_1W : Layout<24, 32>, HalfScales<5, 0, true> {
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk), half(blk + 2)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::bor(bytes::nibbles(blk + 8), bytes::bits16(mask32(blk + 4))); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return fmadd(set1(c.d0), to_float(ior(nibbles(blk + 8, s), fifth_bits(blk + 4, s))), set1(c.m));
  }
};
// Q8_0 (34 bytes): d, 32 signed bytes; weight = d * q.
struct Q8_0W : Layout<34, 32>, HalfScales<8, 0, false, true> {
  static Scales scales(const uint8_t* blk, int64_t) { return plain(half(blk)); }
  static bytes::B bytes(const uint8_t* blk, int64_t) { return bytes::load(blk + 2); }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) { return mul(set1(c.d0), to_float(load_i8(blk + 2 + s * L))); }
};

// Q4_K and Q5_K: d, dmin, then 8 units' 6-bit scales and 6-bit mins packed in 12 bytes.
inline int k_scale(const uint8_t* sc, int u) { return u < 4 ? sc[u] & 63 : (sc[u + 4] & 15) | ((sc[u - 4] >> 6) << 4); }
inline int k_min(const uint8_t* sc, int u) { return u < 4 ? sc[u + 4] & 63 : (sc[u + 4] >> 4) | ((sc[u] >> 6) << 4); }
inline Scales k_scales(const uint8_t* blk, int64_t b) {
  const int u = (int)(b % 8);
  const float d = half(blk) * (float)k_scale(blk + 4, u);  // exact: 11 x 6 bits
  return {d, d, -(half(blk + 2) * (float)k_min(blk + 4, u))};
}
// Their super-block's head, the inverse of k_scale and k_min.
inline void k_rebuild_head(uint8_t* blk, const int scales[16], const int mins[16], const uint8_t* d, const uint8_t* dmin) {
  std::memcpy(blk, d, 2);
  std::memcpy(blk + 2, dmin, 2);
  uint8_t* sc = blk + 4;
  for (int u = 0; u < 4; ++u) {
    sc[u] = (uint8_t)((scales[u] & 63) | ((scales[u + 4] >> 4) << 6));
    sc[u + 4] = (uint8_t)((mins[u] & 63) | ((mins[u + 4] >> 4) << 6));
    sc[u + 8] = (uint8_t)((scales[u + 4] & 15) | ((mins[u + 4] & 15) << 4));
  }
}
// Q4_K (144 bytes per 256): d, dmin, scales, 128 bytes: unit u in bytes 32 (u / 2) .., nibble u % 2;
// weight = d * scale * q - dmin * min.
struct Q4_KW : Layout<144, 256>, SuperBytes<0, true> {
  static constexpr int GROUP = 32, VALUE_BITS = 4;
  static constexpr int64_t D_AT = 0, DMIN_AT = 2;
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
  static void group_scales(const uint8_t* blk, int scales[16], int mins[16]) {
    for (int g = 0; g < 8; ++g) { scales[g] = k_scale(blk + 4, g); mins[g] = k_min(blk + 4, g); }
  }
  static void rebuild(uint8_t* blk, const uint8_t values[256], const int scales[16], const int mins[16], const uint8_t* d,
                      const uint8_t* dmin) {
    k_rebuild_head(blk, scales, mins, d, dmin);
    for (int u = 0; u < 8; ++u)
      for (int l = 0; l < 32; ++l) blk[16 + 32 * (u / 2) + l] |= (uint8_t)((values[32 * u + l] & 15) << (4 * (u % 2)));
  }
};
// Q5_K (176 bytes): d, dmin, scales, 32 bytes of 5th bits (bit u of byte l), 128 bytes as Q4_K.
struct Q5_KW : Layout<176, 256>, SuperBytes<0, true> {
  static constexpr int GROUP = 32, VALUE_BITS = 5;
  static constexpr int64_t D_AT = 0, DMIN_AT = 2;
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
  static void group_scales(const uint8_t* blk, int scales[16], int mins[16]) { Q4_KW::group_scales(blk, scales, mins); }
  static void rebuild(uint8_t* blk, const uint8_t values[256], const int scales[16], const int mins[16], const uint8_t* d,
                      const uint8_t* dmin) {
    k_rebuild_head(blk, scales, mins, d, dmin);
    for (int u = 0; u < 8; ++u)
      for (int l = 0; l < 32; ++l) {
        const int value = values[32 * u + l];
        blk[48 + 32 * (u / 2) + l] |= (uint8_t)((value & 15) << (4 * (u % 2)));
        blk[16 + l] |= (uint8_t)(((value >> 4) & 1) << u);
      }
  }
};
// Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, 16 signed scales (one per 16
// weights), d; weight = (d * scale) * (q - 32), rounded as the reference rounds it. The 8-bit path
// sums scale (q - 32) x in integers: scale q x less 32 times the sum of scale times x by 16.
struct Q6_KW : Layout<210, 256>, SuperBytes<5, false> {
  static constexpr int GROUP = 16, VALUE_BITS = 6;
  static constexpr int64_t D_AT = 208, DMIN_AT = 0;  // no dmin
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
  static void group_scales(const uint8_t* blk, int scales[16], int mins[16]) {
    for (int g = 0; g < 16; ++g) { scales[g] = (int8_t)blk[192 + g]; mins[g] = 0; }
  }
  static void rebuild(uint8_t* blk, const uint8_t values[256], const int scales[16], const int*, const uint8_t* d,
                      const uint8_t*) {
    for (int u = 0; u < 8; ++u) {
      const int h = u / 4, t = u % 4;
      for (int l = 0; l < 32; ++l) {
        const int value = values[32 * u + l];
        blk[64 * h + 32 * (u % 2) + l] |= (uint8_t)((value & 15) << (4 * (t / 2)));
        blk[128 + 32 * h + l] |= (uint8_t)(((value >> 4) & 3) << (2 * t));
      }
    }
    for (int i = 0; i < 16; ++i) blk[192 + i] = (uint8_t)scales[i];
    std::memcpy(blk + 208, d, 2);
  }
};

// Block formats defined outside the repository, for tests only (tests/test_block_formats.py):
// a header that defines their structs here and lists their rows in PARROT_EXTRA_FORMATS.
#ifdef PARROT_EXTRA_FORMAT_HEADER
#include PARROT_EXTRA_FORMAT_HEADER
#endif
#ifndef PARROT_EXTRA_FORMATS
#define PARROT_EXTRA_FORMATS(X)
#endif

// Every format the kernels run, one row each: its kind, Parrot's name for it, ggml's type id and
// the struct above that reads it (the block size comes from its Layout). A format's number in the
// library (Mat::kind) is its place here; quant.FORMATS lists the same rows in the same order, and
// kernels.py checks it against this table (parrot_format_info) when it loads a library.
#define PARROT_FORMATS(X)       \
  X(F32, "f32", 0, F32W)        \
  X(F16, "f16", 1, F16W)        \
  X(BF16, "bf16", 30, BF16W)    \
  X(Q4_0, "q4_0", 2, Q4_0W)     \
  X(Q4_1, "q4_1", 3, Q4_1W)     \
  X(Q5_0, "q5_0", 6, Q5_0W)     \
  X(Q5_1, "q5_1", 7, Q5_1W)     \
  X(Q8_0, "q8_0", 8, Q8_0W)     \
  X(Q4_K, "q4_k", 12, Q4_KW)    \
  X(Q5_K, "q5_k", 13, Q5_KW)    \
  X(Q6_K, "q6_k", 14, Q6_KW)    \
  PARROT_EXTRA_FORMATS(X)

enum Kind : int32_t {
#define PARROT_KIND(kind, name, ggml_type, W) kind,
  PARROT_FORMATS(PARROT_KIND)
#undef PARROT_KIND
};

struct FormatInfo {
  const char* name;
  int32_t ggml_type;
  int64_t block_bytes, block_weights;
};
constexpr FormatInfo FORMAT_INFO[] = {
#define PARROT_INFO(kind, name, ggml_type, W) {name, ggml_type, W::BLOCK_BYTES, W::BLOCK_WEIGHTS},
  PARROT_FORMATS(PARROT_INFO)
#undef PARROT_INFO
};
constexpr int32_t FORMAT_COUNT = sizeof(FORMAT_INFO) / sizeof(FORMAT_INFO[0]);

// Calls fn.template operator()<W>() with the struct W of format `kind` (a lambda
// [&]<class W>() { ... }); false, calling nothing, for a kind the table does not have.
template <class Fn>
inline bool with_format(int32_t kind, Fn&& fn) {
  switch (kind) {
#define PARROT_CASE(kind, name, ggml_type, W) \
  case kind: fn.template operator()<W>(); return true;
    PARROT_FORMATS(PARROT_CASE)
#undef PARROT_CASE
    default: return false;
  }
}

// Format W's view of a matrix at `data` with rows of K weights.
template <class W>
inline W matrix(const uint8_t* data, int64_t K) {
  W w{};
  w.data = data;
  w.K = K;
  return w;
}

}  // namespace
