// Float vectors of L lanes for one instruction set, chosen when the file is compiled:
// PARROT_AVX512 (16 lanes, + F16C), PARROT_AVX2 (8 lanes, AVX2 + FMA + F16C), or neither (8 lanes of GCC
// vector extensions, which the compiler turns into whatever the target has: SSE2, NEON, ...).
// kernels.cpp (with the headers it includes) is compiled once per instruction set into its own
// library; kernels.py picks one at run time by what the CPU has (PARROT_KERNELS overrides).
//
// Every operation is a fixed sequence of instructions: a horizontal sum adds its lanes in the
// same order every time, and nothing here depends on how many rows a kernel processes. All
// builds use -ffp-contract=off, so a * b + c is two roundings unless fmadd is called, in every
// inlined copy alike (a contraction chosen differently in two template instances would make a
// row's result depend on the tile it went through).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(PARROT_AVX512) || defined(PARROT_AVX2)
#include <immintrin.h>
#endif

namespace simd {

#if defined(PARROT_AVX512)

constexpr int L = 16;
constexpr int REGISTERS = 32;
#if defined(PARROT_AMX)
constexpr const char* ISA = "amx";  // the AVX-512 vectors, and packed K-quant layers over many rows on AMX (amx.h)
#else
constexpr const char* ISA = "avx512";
#endif
struct F { __m512 v; };
inline F zero() { return {_mm512_setzero_ps()}; }
inline F set1(float a) { return {_mm512_set1_ps(a)}; }
inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F div(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
inline float hsum(F a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(F a) { return _mm512_reduce_max_ps(a.v); }
// Keeps a value in a register: left alone, the compiler folds loads into the multiply-adds and
// loads an x block once per weight row of a tile (measured: wide tiles then wait on loads).
inline void pin(F& a) { asm("" : "+v"(a.v)); }
inline float half(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return _cvtsh_ss(h); }

// exp(x): x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (error below
// 2e-8 relative on that interval), times 2^k. Below -87.3 it is 0.
inline F exp(F a) {
  __m512 x = a.v;
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
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
  return {_mm512_maskz_mov_ps(~under, _mm512_scalef_ps(p, k))};
}

// Integer lanes, for unpacking quantised weights (formats.h, the block formats).
struct I { __m512i v; };
inline I load_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline I load_i8(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline I load_u16(const uint8_t* p) { return {_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p))}; }
inline I iset1(int32_t a) { return {_mm512_set1_epi32(a)}; }
inline I lanes() { return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }
inline I iadd(I a, I b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I isub(I a, I b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline I iand(I a, I b) { return {_mm512_and_si512(a.v, b.v)}; }
inline I ior(I a, I b) { return {_mm512_or_si512(a.v, b.v)}; }
inline I shr(I a, int n) { return {_mm512_srl_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline I shl(I a, int n) { return {_mm512_sll_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline I shrv(I a, I n) { return {_mm512_srlv_epi32(a.v, n.v)}; }
inline F to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline F bits(I a) { return {_mm512_castsi512_ps(a.v)}; }
inline F load_f16(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }


#elif defined(PARROT_AVX2)

constexpr int L = 8;
constexpr int REGISTERS = 16;
constexpr const char* ISA = "avx2";
struct F { __m256 v; };
inline F zero() { return {_mm256_setzero_ps()}; }
inline F set1(float a) { return {_mm256_set1_ps(a)}; }
inline F load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, F a) { _mm256_storeu_ps(p, a.v); }
inline F add(F a, F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F div(F a, F b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm256_max_ps(a.v, b.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float hsum(F a) {  // (lanes i + i + 4), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline float hmax(F a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline void pin(F& a) { asm("" : "+x"(a.v)); }
inline float half(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return _cvtsh_ss(h); }

inline F exp(F a) {  // the same algorithm as the AVX-512 build
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(a.v, lo, _CMP_LT_OQ);
  const __m256 x = _mm256_min_ps(_mm256_max_ps(a.v, lo), _mm256_set1_ps(88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^k for k in [-126, 127]: the exponent field set directly.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return {_mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)))};
}

struct I { __m256i v; };
inline I load_u8(const uint8_t* p) { return {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))}; }
inline I load_i8(const uint8_t* p) { return {_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))}; }
inline I load_u16(const uint8_t* p) { return {_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline I iset1(int32_t a) { return {_mm256_set1_epi32(a)}; }
inline I lanes() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)}; }
inline I iadd(I a, I b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline I isub(I a, I b) { return {_mm256_sub_epi32(a.v, b.v)}; }
inline I iand(I a, I b) { return {_mm256_and_si256(a.v, b.v)}; }
inline I ior(I a, I b) { return {_mm256_or_si256(a.v, b.v)}; }
inline I shr(I a, int n) { return {_mm256_srl_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline I shl(I a, int n) { return {_mm256_sll_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline I shrv(I a, I n) { return {_mm256_srlv_epi32(a.v, n.v)}; }
inline F to_float(I a) { return {_mm256_cvtepi32_ps(a.v)}; }
inline F bits(I a) { return {_mm256_castsi256_ps(a.v)}; }
inline F load_f16(const uint8_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))}; }


#else  // portable: GCC/Clang vector extensions

constexpr int L = 8;
constexpr int REGISTERS = 16;
constexpr const char* ISA = "portable";
typedef float vf __attribute__((vector_size(32)));
struct F { vf v; };
inline F zero() { return {vf{}}; }
inline F set1(float a) { return {vf{} + a}; }
inline F load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return {v}; }
inline void store(float* p, F a) { std::memcpy(p, &a.v, sizeof a.v); }
inline F add(F a, F b) { return {a.v + b.v}; }
inline F sub(F a, F b) { return {a.v - b.v}; }
inline F mul(F a, F b) { return {a.v * b.v}; }
inline F div(F a, F b) { return {a.v / b.v}; }
inline F max(F a, F b) { return {a.v > b.v ? a.v : b.v}; }
inline F fmadd(F a, F b, F c) { return {a.v * b.v + c.v}; }  // two roundings (no FMA assumed)
inline float hsum(F a) {
  const float lo = (a.v[0] + a.v[4]) + (a.v[2] + a.v[6]);
  const float hi = (a.v[1] + a.v[5]) + (a.v[3] + a.v[7]);
  return lo + hi;
}
inline float hmax(F a) {
  float m = a.v[0];
  for (int i = 1; i < 8; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline void pin(F&) {}
// IEEE float16 -> float32, exact (subnormals, infinities and NaNs included).
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = std::ldexp((float)mantissa, -24);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline F exp(F a) {  // the same algorithm, lane by lane
  F out;
  for (int i = 0; i < 8; ++i) {
    const float x0 = a.v[i];
    const float x = std::fmin(std::fmax(x0, -87.3f), 88.0f);
    const float k = std::nearbyint(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    out.v[i] = x0 < -87.3f ? 0.0f : std::ldexp(p, (int)k);
  }
  return out;
}

typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
struct I { vi v; };
inline I load_u8(const uint8_t* p) { I a; for (int i = 0; i < 8; ++i) a.v[i] = p[i]; return a; }
inline I load_i8(const uint8_t* p) { I a; for (int i = 0; i < 8; ++i) a.v[i] = (int8_t)p[i]; return a; }
inline I load_u16(const uint8_t* p) { I a; for (int i = 0; i < 8; ++i) a.v[i] = p[2 * i] | (p[2 * i + 1] << 8); return a; }
inline I iset1(int32_t a) { return {vi{} + a}; }
inline I lanes() { return {vi{0, 1, 2, 3, 4, 5, 6, 7}}; }
inline I iadd(I a, I b) { return {a.v + b.v}; }
inline I isub(I a, I b) { return {a.v - b.v}; }
inline I iand(I a, I b) { return {a.v & b.v}; }
inline I ior(I a, I b) { return {a.v | b.v}; }
inline I shr(I a, int n) { return {(vi)((vu)a.v >> n)}; }
inline I shl(I a, int n) { return {(vi)((vu)a.v << n)}; }
inline I shrv(I a, I n) { return {(vi)((vu)a.v >> (vu)n.v)}; }
inline F to_float(I a) { return {__builtin_convertvector(a.v, vf)}; }
inline F bits(I a) { F f; std::memcpy(&f.v, &a.v, sizeof f.v); return f; }
inline F load_f16(const uint8_t* p) { F a; for (int i = 0; i < 8; ++i) a.v[i] = half(p + 2 * i); return a; }


#endif

// Blocks of 32 weights are L-lane vectors in PARTS parts.
constexpr int PARTS = 32 / L;

// float -> float16 bits, rounded to nearest even (the KV cache of the 8-bit path).
#if defined(PARROT_AVX512) || defined(PARROT_AVX2)
inline uint16_t to_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
#else
inline uint16_t to_half(float x) {
  const _Float16 h = (_Float16)x;
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
#endif


// ---------------------------------------------------------------------------------------------
// 8-bit integer dot products, 32 bytes at a time in every build (the AVX-512 build uses the same
// 256-bit instructions): the linear layers with quantised activations (packed.h); and vectors of
// 8 floats (G), which the attention kernel also uses in every build (attention.h). Products
// of one unsigned and one signed byte, summed in pairs and then in fours: lane k of dot(u, x)
// is u[4k] x[4k] + ... + u[4k+3] x[4k+3], exactly (the callers keep |u| <= 128 and |x| <= 127,
// so no 16-bit pair sum saturates).
namespace bytes {

#if defined(PARROT_AVX512) || defined(PARROT_AVX2)

struct B { __m256i v; };   // 32 bytes
struct S { __m256i v; };   // 8 int32 (sums)
struct G { __m256 v; };    // 8 float32
inline B load(const uint8_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
// 16 bytes of nibbles -> their 32 values: low nibbles in bytes 0..15, high ones in 16..31.
inline B nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128((const __m128i*)p);
  return {_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15))};
}
// Bits (b >> shift) & mask of 32 bytes.
inline B bits(B a, int shift, int mask) {
  return {_mm256_and_si256(_mm256_srl_epi16(a.v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask))};
}
inline B shl4(B a) { return {_mm256_slli_epi16(a.v, 4)}; }  // callers keep bytes below 16
inline B bor(B a, B b) { return {_mm256_or_si256(a.v, b.v)}; }
// Byte j = 16 where bit j of the 32-bit mask is set, else 0.
inline B bits16(uint32_t mask) {
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)mask), shuffle);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return {_mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16))};
}
inline B babs(B a) { return {_mm256_sign_epi8(a.v, a.v)}; }
inline B sign_of(B x, B w) { return {_mm256_sign_epi8(x.v, w.v)}; }  // x where w > 0, -x where w < 0, 0 where w = 0
inline S dot(B u, B x) { return {_mm256_madd_epi16(_mm256_maddubs_epi16(u.v, x.v), _mm256_set1_epi16(1))}; }
inline B bzero() { return {_mm256_setzero_si256()}; }
inline void bstore(uint8_t* p, B a) { _mm256_storeu_si256((__m256i*)p, a.v); }
inline B bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return {_mm256_set1_epi32(v)}; }  // 4 bytes, 8 times
// Bit t of each byte of h, moved to bit 4 (the 5th bit of a 5-bit value).
inline B fifth(B h, int t) {
  const __m256i moved = t <= 4 ? _mm256_slli_epi16(h.v, 4 - t) : _mm256_srli_epi16(h.v, t - 4);
  return {_mm256_and_si256(moved, _mm256_set1_epi8(16))};
}
// Bits 2s, 2s + 1 of each byte of h, moved to bits 4, 5 (the high bits of a 6-bit value).
inline B sixth(B h, int s) {
  const __m256i moved = s <= 2 ? _mm256_slli_epi16(h.v, 4 - 2 * s) : _mm256_srli_epi16(h.v, 2 * s - 4);
  return {_mm256_and_si256(moved, _mm256_set1_epi8(0x30))};
}
inline S ssub(S a, S b) { return {_mm256_sub_epi32(a.v, b.v)}; }
inline S sshl(S a, int n) { return {_mm256_sll_epi32(a.v, _mm_cvtsi32_si128(n))}; }
inline S sload(const int32_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }
inline G gfloat(S a) { return {_mm256_cvtepi32_ps(a.v)}; }
inline G gset1(float a) { return {_mm256_set1_ps(a)}; }
inline G gload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline G gzero() { return {_mm256_setzero_ps()}; }
inline G gmul(G a, G b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline G gadd(G a, G b) { return {_mm256_add_ps(a.v, b.v)}; }
inline G gfmadd(G a, G b, G c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float ghsum(G a) {  // the AVX2 build's hsum order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline void gpin(G& a) { asm("" : "+x"(a.v)); }
inline void bpin(B& a) { asm("" : "+x"(a.v)); }

// 16 int16 lanes: sums of byte pairs (2k, 2k + 1) as maddubs makes them, and their multipliers
// (the K-quant formats' integer scales); hdot multiplies them and adds lanes in pairs, exactly.
struct H { __m256i v; };
inline H hsigned(const uint8_t* p) { return {_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p))}; }  // 16 signed bytes
inline S hdot(H a, H b) { return {_mm256_madd_epi16(a.v, b.v)}; }  // lane k: a[2k] b[2k] + a[2k+1] b[2k+1]
inline S sadd(S a, S b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline S szero() { return {_mm256_setzero_si256()}; }
// Row-interleaved weights (packed.h, packed layout): 16-bit lanes of byte-pair products, their
// sums, and the widening to int32 (lane k: lanes 2k + 2k + 1).
inline H pdot16(B u, B x) { return {_mm256_maddubs_epi16(u.v, x.v)}; }
inline H hplus(H a, H b) { return {_mm256_add_epi16(a.v, b.v)}; }
inline H hzero() { return {_mm256_setzero_si256()}; }
inline S widen(H a) { return {_mm256_madd_epi16(a.v, _mm256_set1_epi16(1))}; }
inline void hpin(H& a) { asm("" : "+x"(a.v)); }
inline H hbytes(const uint8_t* p) { return {_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p))}; }   // 16 unsigned bytes
inline H hpair(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return {_mm256_set1_epi32(v)}; }  // p[0], p[1], 8 times
inline H hmul(H a, H b) { return {_mm256_mullo_epi16(a.v, b.v)}; }  // lane by lane, the low 16 bits
inline H hpairs(int32_t v) { return {_mm256_set1_epi32(v)}; }  // v's low and high 16 bits, 8 times
inline S sset1(int32_t a) { return {_mm256_set1_epi32(a)}; }
inline G ghalf8(const uint8_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))}; }  // 8 float16
inline void gstore(float* p, G a) { _mm256_storeu_ps(p, a.v); }
// The lane sums of a, b, c, d into out[0..3], each ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
inline void ghsum4(G a, G b, G c, G d, float* out) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a.v, b.v), _mm256_hadd_ps(c.v, d.v));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

#if defined(PARROT_AVX512)
// Two steps of the packed K-quant layout in one 512-bit vector (the AVX-512 build's tiles,
// packed.h's kpairs), interleaved by row: 32-bit lane 2r holds row r's 4 bytes of step t, lane
// 2r + 1 those of step t + 1. The weights' two step vectors (32 bytes apart) are interleaved once
// per load (pairs2), shared by every row of x of a tile; x's 4 bytes of both steps are then one
// 64-bit broadcast from memory (bcast8). The 16-bit sums of the two steps meet only when folded
// to int32 (fold), and integer sums do not depend on their order: the results are those of the
// 256-bit steps, bit for bit.
struct B2 { __m512i v; };
struct H2 { __m512i v; };
struct S2 { __m512i v; };
inline __m512i by_row_pairs() { return _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15); }
inline __m512i rows_twice() { return _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7); }
// The step vectors at p and p + 32, interleaved by row.
inline B2 pairs2(const uint8_t* p) { return {_mm512_permutexvar_epi32(by_row_pairs(), _mm512_loadu_si512(p))}; }
inline B2 bits2(B2 a, int shift, int mask) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, (unsigned)shift), _mm512_set1_epi8((char)mask))};
}
inline B2 bor2(B2 a, B2 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline B2 bcast8(const int8_t* p) { int64_t v; std::memcpy(&v, p, 8); return {_mm512_set1_epi64(v)}; }  // x's bytes of steps t, t + 1
// A 32-byte high-bit plane, each row's 4 bytes twice (for steps t and t + 1).
inline B2 plane2(const uint8_t* p) {
  return {_mm512_permutexvar_epi32(rows_twice(), _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)))};
}
// Each row's step t shifted left by `even`, its step t + 1 by `odd` (negative: right), then
// masked: the 5th (fifth2) or 5th and 6th (sixth2) bits of two steps. Step t is a row's even
// 32-bit lane (plane2), or with `words` the first 16-bit lane of each 32-bit lane (vnni_plane).
// Shifts are by 16-bit lanes; the mask keeps only bits that came from their own byte. The counts
// are constants once the callers' loops are unrolled.
inline __m512i shifted2(B2 h, int even, int odd, bool words) {
  const auto counts = [words](int a, int b) {
    return words ? _mm512_set_epi16(b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a)
                 : _mm512_set_epi16(b, b, a, a, b, b, a, a, b, b, a, a, b, b, a, a, b, b, a, a, b, b, a, a, b, b, a, a, b, b, a, a);
  };
  __m512i out = h.v;
  if (even > 0 || odd > 0) out = _mm512_sllv_epi16(out, counts(even > 0 ? even : 0, odd > 0 ? odd : 0));
  if (even < 0 || odd < 0) out = _mm512_srlv_epi16(out, counts(even < 0 ? -even : 0, odd < 0 ? -odd : 0));
  return out;
}
// Bits t, t + 1 of each byte, to bit 4.
inline B2 fifth2(B2 h, int t, bool words = false) {
  return {_mm512_and_si512(shifted2(h, 4 - t, 3 - t, words), _mm512_set1_epi8(16))};
}
// Bits 2 s, 2 s + 1 (step t) and 2 s + 2, 2 s + 3 (step t + 1), to bits 4, 5.
inline B2 sixth2(B2 h, int s, bool words = false) {
  return {_mm512_and_si512(shifted2(h, 4 - 2 * s, 2 - 2 * s, words), _mm512_set1_epi8(0x30))};
}
inline H2 pdot16x2(B2 u, B2 x) { return {_mm512_maddubs_epi16(u.v, x.v)}; }
inline H2 hplus2(H2 a, H2 b) { return {_mm512_add_epi16(a.v, b.v)}; }
inline H2 hzero2() { return {_mm512_setzero_si512()}; }
inline void hpin2(H2& a) { asm("" : "+v"(a.v)); }
// 16 signed bytes (a block's scales, row r's two at 2r) as int16, each row's pair twice.
inline H2 hsigned2(const uint8_t* p) {
  return {_mm512_permutexvar_epi32(rows_twice(), _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p))))};
}
inline S2 hdot2(H2 a, H2 b) { return {_mm512_madd_epi16(a.v, b.v)}; }
inline H2 hmul2(H2 a, H2 b) { return {_mm512_mullo_epi16(a.v, b.v)}; }
inline H2 hpairs2(int32_t v) { return {_mm512_set1_epi32(v)}; }  // v's low and high 16 bits, 16 times
inline S2 sadd2(S2 a, S2 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline S2 szero2() { return {_mm512_setzero_si512()}; }
#if defined(__AVX512VNNI__)
// With VNNI (`vpdpbusd`: 4 byte products added into a 32-bit lane) each lane must hold 4 values of
// one group: within each row's 8 bytes of two steps, [a0 a1 b0 b1 a2 a3 b2 b3] (a, b: the block's
// first and second group) becomes [a0 a1 a2 a3 b0 b1 b2 b3], so that lane 2r sums row r's first
// group and lane 2r + 1 its second. XK::arranged puts x's bytes in the same order (VNNI_ORDER).
constexpr int VNNI_ORDER[8] = {0, 1, 4, 5, 2, 3, 6, 7};
inline B2 vnni_order(B2 a) {
  return {_mm512_shuffle_epi8(a.v, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15)))};
}
#if defined(__AVX512VBMI__)
// With VBMI (`vpermb`, any byte of a 512-bit vector to any place) the loads put the bytes in VNNI
// order themselves: one permutation instead of pairs2's and vnni_order's two, for both steps of a
// low nibble's load and its high nibble's (taking bits commutes with moving bytes). Byte m of row
// r's 8 comes from byte VNNI_ORDER[m] % 4 of step t (VNNI_ORDER[m] < 4) or t + 1 (the others).
struct VnniIndex { alignas(64) int8_t at[64]; };
constexpr VnniIndex vnni_index(bool plane) {
  VnniIndex index{};
  for (int r = 0; r < 8; ++r)
    for (int m = 0; m < 8; ++m) {
      const int from = VNNI_ORDER[m];
      index.at[8 * r + m] = (int8_t)(plane ? 4 * r + from % 4 : 4 * (from < 4 ? r : 8 + r) + from % 4);
    }
  return index;
}
inline constexpr VnniIndex VNNI_PAIRS = vnni_index(false), VNNI_PLANE = vnni_index(true);
// The step vectors at p and p + 32 in VNNI order (pairs2, then vnni_order).
inline B2 vnni_pairs(const uint8_t* p) {
  return {_mm512_permutexvar_epi8(_mm512_load_si512(VNNI_PAIRS.at), _mm512_loadu_si512(p))};
}
// A 32-byte high-bit plane, each row's 4 bytes placed as vnni_pairs places both steps' (step t's in
// the first 16-bit lane of each 32-bit lane, t + 1's in the second: fifth2's and sixth2's `words`).
inline B2 vnni_plane(const uint8_t* p) {
  return {_mm512_permutexvar_epi8(_mm512_load_si512(VNNI_PLANE.at), _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)))};
}
#endif
inline S2 dot4x2(S2 acc, B2 u, B2 x) { return {_mm512_dpbusd_epi32(acc.v, u.v, x.v)}; }
inline S2 smul2(S2 a, S2 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
// 16 signed bytes (a block's scales, row r's two at 2r) as int32: lane 2r row r's first, 2r + 1 its second.
inline S2 ssigned2(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
// v's low and high 16 bits as int32, alternating in 16 lanes.
inline S2 spairs2(int32_t v) { return {_mm512_cvtepi16_epi32(_mm256_set1_epi32(v))}; }
#endif
// Row r's sum: lanes 2r + 2r + 1.
inline S fold(S2 a) {
  const __m512i sums = _mm512_add_epi32(a.v, _mm512_shuffle_epi32(a.v, _MM_PERM_CDAB));
  return {_mm512_castsi512_si256(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), sums))};
}
#endif

// 32 floats -> 32 bytes q = round(x scale) (to nearest, ties to even: MXCSR's default) and their
// sums in fours (lane k: q[4k] + .. + q[4k+3]).
inline void round_bytes(const float* x, float scale, int8_t* q, int32_t* sums) {
  const __m256 inv = _mm256_set1_ps(scale);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), inv));
  // Pack 4 x 8 int32 into 32 bytes in order (packs interleave 128-bit halves; the permute undoes it).
  const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i bytes = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, bytes);
  const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
  _mm256_storeu_si256((__m256i*)sums, s);
}
// max |x| over n floats (n a multiple of 8).
inline float amax(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

#else  // portable

typedef uint8_t vb __attribute__((vector_size(32)));
typedef int32_t vw __attribute__((vector_size(32)));
typedef float vg __attribute__((vector_size(32)));
struct B { vb v; };
struct S { vw v; };
struct G { vg v; };
inline B load(const uint8_t* p) { B a; std::memcpy(&a.v, p, 32); return a; }
inline B nibbles(const uint8_t* p) {
  B a;
  for (int j = 0; j < 16; ++j) { a.v[j] = p[j] & 15; a.v[j + 16] = p[j] >> 4; }
  return a;
}
inline B bits(B a, int shift, int mask) { return {(vb)((a.v >> shift) & (uint8_t)mask)}; }
inline B shl4(B a) { return {(vb)(a.v << 4)}; }
inline B bor(B a, B b) { return {a.v | b.v}; }
inline B bits16(uint32_t mask) { B a; for (int j = 0; j < 32; ++j) a.v[j] = ((mask >> j) & 1) << 4; return a; }
inline B babs(B a) { B r; for (int j = 0; j < 32; ++j) { const int8_t s = (int8_t)a.v[j]; r.v[j] = (uint8_t)(s < 0 ? -s : s); } return r; }
inline B sign_of(B x, B w) {
  B r;
  for (int j = 0; j < 32; ++j) { const int8_t s = (int8_t)w.v[j], t = (int8_t)x.v[j]; r.v[j] = (uint8_t)(s > 0 ? t : s < 0 ? -t : 0); }
  return r;
}
inline S dot(B u, B x) {
  S r;
  for (int k = 0; k < 8; ++k) {
    int32_t s = 0;
    for (int j = 4 * k; j < 4 * k + 4; ++j) s += (int32_t)u.v[j] * (int32_t)(int8_t)x.v[j];
    r.v[k] = s;
  }
  return r;
}
inline B bzero() { return {vb{}}; }
inline void bstore(uint8_t* p, B a) { std::memcpy(p, &a.v, 32); }
inline B bcast4(const int8_t* p) { B a; for (int j = 0; j < 32; ++j) a.v[j] = (uint8_t)p[j % 4]; return a; }
inline S ssub(S a, S b) { return {a.v - b.v}; }
inline S sshl(S a, int n) { return {a.v << n}; }
inline S sload(const int32_t* p) { S a; std::memcpy(&a.v, p, 32); return a; }
inline G gfloat(S a) { return {__builtin_convertvector(a.v, vg)}; }
inline G gset1(float a) { return {vg{} + a}; }
inline G gload(const float* p) { G a; std::memcpy(&a.v, p, 32); return a; }
inline G gzero() { return {vg{}}; }
inline G gmul(G a, G b) { return {a.v * b.v}; }
inline G gadd(G a, G b) { return {a.v + b.v}; }
inline G gfmadd(G a, G b, G c) { return {a.v * b.v + c.v}; }
inline float ghsum(G a) {
  const float lo = (a.v[0] + a.v[4]) + (a.v[2] + a.v[6]);
  const float hi = (a.v[1] + a.v[5]) + (a.v[3] + a.v[7]);
  return lo + hi;
}
inline void gpin(G&) {}
inline void bpin(B&) {}

typedef int16_t vh __attribute__((vector_size(32)));
struct H { vh v; };
inline H hsigned(const uint8_t* p) { H a; for (int k = 0; k < 16; ++k) a.v[k] = (int8_t)p[k]; return a; }
inline S hdot(H a, H b) {
  S r;
  for (int k = 0; k < 8; ++k) r.v[k] = (int32_t)a.v[2 * k] * b.v[2 * k] + (int32_t)a.v[2 * k + 1] * b.v[2 * k + 1];
  return r;
}
inline S sadd(S a, S b) { return {a.v + b.v}; }
inline S szero() { return {vw{}}; }
inline H pdot16(B u, B x) {
  H r;
  for (int k = 0; k < 16; ++k) r.v[k] = (int16_t)((int32_t)u.v[2 * k] * (int8_t)x.v[2 * k] + (int32_t)u.v[2 * k + 1] * (int8_t)x.v[2 * k + 1]);
  return r;
}
inline H hplus(H a, H b) { return {(vh)(a.v + b.v)}; }
inline H hzero() { return {vh{}}; }
inline S widen(H a) { S r; for (int k = 0; k < 8; ++k) r.v[k] = (int32_t)a.v[2 * k] + a.v[2 * k + 1]; return r; }
inline void hpin(H&) {}
inline B fifth(B h, int t) { return {(vb)(((h.v >> t) & 1) << 4)}; }
inline B sixth(B h, int s) { return {(vb)(((h.v >> (2 * s)) & 3) << 4)}; }
inline H hbytes(const uint8_t* p) { H a; for (int k = 0; k < 16; ++k) a.v[k] = p[k]; return a; }
inline H hpair(const int16_t* p) { H a; for (int k = 0; k < 16; ++k) a.v[k] = p[k % 2]; return a; }
inline H hmul(H a, H b) { return {(vh)(a.v * b.v)}; }
inline H hpairs(int32_t v) { H r; for (int k = 0; k < 16; ++k) r.v[k] = (int16_t)(k % 2 ? v >> 16 : v); return r; }
inline S sset1(int32_t a) { return {vw{} + a}; }
inline G ghalf8(const uint8_t* p) { G a; for (int k = 0; k < 8; ++k) a.v[k] = half(p + 2 * k); return a; }
inline void gstore(float* p, G a) { std::memcpy(p, &a.v, 32); }
inline void ghsum4(G a, G b, G c, G d, float* out) {
  const G all[4] = {a, b, c, d};
  for (int k = 0; k < 4; ++k) {
    const vg x = all[k].v;
    out[k] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
}

inline void round_bytes(const float* x, float scale, int8_t* q, int32_t* sums) {
  for (int j = 0; j < 32; ++j) q[j] = (int8_t)std::nearbyint(x[j] * scale);
  for (int k = 0; k < 8; ++k) sums[k] = q[4 * k] + q[4 * k + 1] + q[4 * k + 2] + q[4 * k + 3];
}
inline float amax(const float* x, int64_t n) {
  float top = 0.0f;
  for (int64_t j = 0; j < n; ++j) top = std::fmax(top, std::fabs(x[j]));
  return top;
}

#endif

// 32 floats -> 32 bytes q = round(x / d), d = max |x| / 127, and q's sums in fours (lane k:
// q[4k] + .. + q[4k+3]); returns d (0 for a unit of zeros).
inline float quantize(const float* x, int8_t* q, int32_t* sums) {
  const float top = amax(x, 32);
  round_bytes(x, top > 0.0f ? 127.0f / top : 0.0f, q, sums);
  return top / 127.0f;
}

// Levels of a unit's multiplier under quantize256_fine: FINE_LEVELS (8) at most. The bound is
// the packed K-quant tiles' int32 super-block sum (Q6_K: 16 groups x 16 x 63 x 127 x 128 x 8 <
// 2^31) and their 16-bit scale products (128 x 8).
constexpr int FINE_LEVELS = 8;

// 256 floats -> q in units of 32, each unit u with its own multiplier f[u] in 1 .. FINE_LEVELS:
// x ~ q d f[u] with d = max |x| / (127 FINE_LEVELS) for all 256 and f[u] = ceil(FINE_LEVELS
// max_u / max) (the unit holding the maximum: FINE_LEVELS, q up to 127, as quantize256). A unit
// of small values then keeps up to FINE_LEVELS times the resolution it has under quantize256.
// q's sums by 16 are returned multiplied by their unit's f (the sums of q f, which the K-quant
// tiles' min and offset terms take); returns d.
inline float quantize256_fine(const float* x, int8_t* q, int16_t* sums16, int16_t* f) {
  const float top = amax(x, 256), inv = top > 0.0f ? (127.0f * FINE_LEVELS) / top : 0.0f;
  for (int u = 0; u < 8; ++u) {
    const float unit = amax(x + 32 * u, 32);
    const int levels = top > 0.0f ? std::clamp((int)std::ceil(unit * FINE_LEVELS / top), 1, FINE_LEVELS) : 1;
    int32_t fours[8];
    round_bytes(x + 32 * u, inv / (float)levels, q + 32 * u, fours);
    f[u] = (int16_t)levels;
    sums16[2 * u] = (int16_t)(levels * (fours[0] + fours[1] + fours[2] + fours[3]));
    sums16[2 * u + 1] = (int16_t)(levels * (fours[4] + fours[5] + fours[6] + fours[7]));
  }
  return top / (127.0f * FINE_LEVELS);
}

// 256 floats (a K-quant super-block) -> q as quantize() with one d = max |x| / 127 for all 256,
// and q's sums by 16; returns d.
inline float quantize256(const float* x, int8_t* q, int16_t* sums16) {
  const float top = amax(x, 256), scale = top > 0.0f ? 127.0f / top : 0.0f;
  for (int u = 0; u < 8; ++u) {
    int32_t fours[8];
    round_bytes(x + 32 * u, scale, q + 32 * u, fours);
    sums16[2 * u] = (int16_t)(fours[0] + fours[1] + fours[2] + fours[3]);
    sums16[2 * u + 1] = (int16_t)(fours[4] + fours[5] + fours[6] + fours[7]);
  }
  return top / 127.0f;
}

}  // namespace bytes

}  // namespace simd
