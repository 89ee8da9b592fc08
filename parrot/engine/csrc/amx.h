// Q4_K, Q5_K and Q6_K layers over many rows of x (prompt chunks) on Intel AMX: the `amx` kernel
// set (AVX-512 and AMX-INT8). A layer over AMX_MIN_ROWS or more rows runs here; fewer rows
// (decoding, verifying drafts, short prompts) run packed.h's tiles.
//
// Why: a prompt chunk is bound by the multiplications. packed.h's AVX-512 tiles reach about 34
// byte multiply-adds per cycle per core; one tile instruction (TDPBUSD) multiplies 16 weight rows
// x 64 unsigned bytes by 64 x 16 signed bytes of x into 16 x 16 int32 sums (3.5 TMAC/s per core
// measured alone, Intel Xeon). Qwen2.5-Coder-1.5B at 512 rows: Q4_K layers 2x the AVX-512 tiles'
// speed, Q6_K 1.7x; a 512-token chunk about 1.9 s against 3.24-3.35 s.
//
// The same integers, bit for bit. A group of 32 weights shares an integer scale s (6 bits), so
// a tile instruction over 64 bytes would mix two scales; instead s is folded into the weights:
// s = 2^SPLIT a + b, and a q and b q are both bytes (Q4_K: q <= 15, SPLIT 4; Q5_K: q <= 31,
// SPLIT 3). A super-block's integer sum over its groups is then 2^SPLIT (a q . x) + (b q . x),
// two tiles accumulated over its 256 values: the integer packed.h sums group by group. The mins'
// term (sum over groups of min times x's group sum) takes `vpmaddwd` on x's group sums. Each
// (weight row, row of x) output then takes exactly packed.h's float operations in the same
// order: d times x's multiplier, then dmin times minus it. A row's result does not depend on the
// path or the tile (tests/test_quant.py checks every output against the avx2 build). Q6_K's
// signed scales take another split (three digits; see linear_amx6 below).
//
// Work: one job per 16 weight rows (two of packed.h's groups of 8). Its weights are expanded once
// from the packed copy into the a q and b q bytes (A tiles; fold_values4, fold_values6) with
// the rows' d, dmin and mins laid out for broadcasts, then every row of x passes through them,
// two tiles of 16 rows at a time (8 tile registers: 4 sums, 2 weights, 2 x); x is laid out once
// per layer as B tiles (16 rows of 16 x 4 bytes: VNNI order), with its group sums (amx_layout, on
// all threads).
//
// Where the time went (perf, a 512-token chunk of Qwen2.5-Coder-1.5B, Intel Xeon): the first
// version spent 35% of its Q4_K time scaling each super-block's sums (the epilogue) with scalar
// float16 conversions and mins rebuilt per row, 10% expanding weights with 2-byte copies, and
// quantised x on one thread. Now: d, dmin and the mins are floats and int32 pairs made with the
// weights, the mins' term is 4 `vpdpwssd`, the expansion permutes vectors, and super-block
// sb + 1's tile instructions are issued before sb's epilogue (two buffers of sums), so the tile
// unit and the vector units overlap. Chunk 2.65-2.67 -> 2.06-2.18 s; with Q6_K here too (half the
// down projections of a Q4_K_M file), 1.9 s. What is left is the tile loop itself (16 tile loads
// and 4 stores per 16 TDPBUSD, at about a fifth of their peak). The expansion costs the same
// whatever the rows, so a short prompt pays it on few rows: a 60-token chunk of Qwen2.5-Coder-1.5B
// spent about 0.12 s of 0.29 s outside the per-row cost (2026-11-28) until fold_values4 and
// fold_values6 replaced the gathers and widening multiplies (interleaved runs: Q4_K's
// 0.28-0.30 -> 0.24-0.26 s, Q6_K's about 5% more).

#pragma once

#if defined(PARROT_AMX)

#include "packed.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace {

// Linux lets a process use the tile registers once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a kernel that refuses leaves the AVX-512 tiles in charge.
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0-3: 16 x 16 int32 sums (high and low, for two tiles of x); tmm4, 5: 16 weight rows x 64
// bytes (high, low); tmm6, 7: x, 16 rows x 64 bytes. Loaded at the start of every job (the
// calling thread may have run other tile code since).
inline void configure_tiles() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

constexpr int64_t AMX_ROWS = 16;  // rows of x (and of weights) per tile

// Rows of x from which a layer runs here: a job expands its weights once per call, which fewer
// rows do not pay back. With the expansion of fold_values4 and fold_values6, whole prompt chunks
// of Qwen2.5-Coder-1.5B (Intel Xeon, 2026-11-28, two interleaved rounds; AMX from 16 rows against
// AMX from 48, i.e. the AVX-512 tiles below it): 16 rows 0.13-0.15 s against 0.12; 24 rows
// 0.15-0.18 against 0.16-0.19; 32 rows 0.16-0.17 against 0.22-0.23; 40 rows 0.19-0.21 against
// 0.27-0.30. (Before those, with gathers, AMX paid back from about 48.)
constexpr int64_t AMX_MIN_ROWS = 32;

// Formats whose values and scales fit the folding below: unsigned values of up to 5 bits,
// unsigned 6-bit scales and mins (Q4_K, Q5_K). Q6_K's signed scales take AMX_DIGITS (below).
template <class W>
constexpr bool AMX_FOLDS = W::SUPER && W::MIN && W::SHIFT == 0 && KLayout<W>::VB <= 5;

// The scale folded into the weights: weight value q of a group with integer scale s gives
// (s >> SPLIT) q and (s & (2^SPLIT - 1)) q, both bytes (Q4_K: q <= 15, digits <= 3 and <= 15;
// Q5_K: q <= 31, digits <= 7), so that a super-block's sum over all groups is
// 2^SPLIT (high products) + (low products): the integer packed.h sums group by group. Two A
// tiles per 64 bytes along K.
// Bytes of one kind (high or low) of a super-block's A tiles: 4 tiles of 16 rows x 64 bytes.
constexpr int64_t KIND_BYTES = 4 * AMX_ROWS * 64;

template <class W>
constexpr int SPLIT = KLayout<W>::VB <= 4 ? 4 : 3;

// The values (0 .. 2^VB - 1) of the 8 weight rows of a packed super-block (blk): q[r][k].
template <class W>
void unpack_values(const uint8_t* blk, uint8_t (*q)[256]) {
  using P = KLayout<W>;
  constexpr int G = P::G;
  alignas(64) uint16_t words[P::S][16];  // one block's value vectors: t, then (row r, group 2b + h) as 2 r + h
  for (int b = 0; b < P::NB; ++b) {
    const uint8_t* v = blk + P::BLK_AT + b * P::BLOCK;
    for (int t = 0; t < P::S; ++t) {
      using namespace bytes;
      B wt = bits(load(v + 32 * (t % (P::S / 2))), t < P::S / 2 ? 0 : 4, 15);
      if constexpr (P::VB == 5) wt = bor(wt, fifth(load(v + P::LOW + 32 * (t / 8)), t % 8));
      if constexpr (P::VB == 6) wt = bor(wt, sixth(load(v + P::LOW + 32 * (t / 4)), t % 4));
      bstore(reinterpret_cast<uint8_t*>(words[t]), wt);
    }
    // Row r's two groups: word pair r of every vector t (values 2 t, 2 t + 1 of groups 2 b, 2 b + 1).
    for (int r = 0; r < 8; ++r) {
      if constexpr (P::S == 16) {
        const __m512i by_t = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(32));
        const __m512i pairs = _mm512_i32gather_epi32(by_t, &words[0][2 * r], 1);
        _mm256_store_si256((__m256i*)&q[r][2 * b * G], _mm512_cvtepi32_epi16(pairs));
        _mm256_store_si256((__m256i*)&q[r][(2 * b + 1) * G], _mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
      } else {
        static_assert(P::S == 8);
        const __m256i by_t = _mm256_set_epi32(7 * 32, 6 * 32, 5 * 32, 4 * 32, 3 * 32, 2 * 32, 32, 0);
        const __m256i pairs = _mm256_i32gather_epi32((const int*)&words[0][2 * r], by_t, 1);
        _mm_storeu_si128((__m128i*)&q[r][2 * b * G], _mm256_cvtepi32_epi16(pairs));
        _mm_storeu_si128((__m128i*)&q[r][(2 * b + 1) * G], _mm256_cvtepi32_epi16(_mm256_srli_epi32(pairs, 16)));
      }
    }
  }
}

// Shared by fold_values4 and fold_values6. STEP_ROWS[half]: dword 4 r' + u = row r' + 4 half of
// step vector u of 4 (a row's 4 bytes at 32 u + 4 r), from two sources of 64 bytes (vectors 0, 1
// and 2, 3) as `vpermt2d` takes them. PAIRS: within each 16 bytes of a row's 4 steps (a word of
// group 2b's values, then one of group 2b + 1's, per step), two steps regrouped as group 2b's two
// words, then group 2b + 1's.
alignas(64) constexpr int32_t STEP_ROWS[2][16] = {
    {0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27},
    {4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31}};
alignas(16) constexpr int8_t PAIRS[16] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};

// Q4_K's folding straight from a packed super-block (blk) of 8 weight rows, written as rows
// first .. first + 7 of the super-block's A tiles at o (both kinds), the same bytes as
// unpack_values and fold_values5's loop give: the block's 8 step vectors (a row's 4 bytes
// in each) transposed to a row's 32 bytes by two rounds of `vpermt2d`, split into nibbles, the
// row's 64 values put in k order by a `vpshufb` and a `vpermt2d` (a word holds values 2 t, 2 t + 1
// of one group), and each group's values times its scale's digits by one `vpmullw` per digit: a
// word q0 + 256 q1 times a digit d is q0 d + 256 q1 d, both products under 256 (q <= 15, d <= 15),
// so its two bytes are the two products. The version through unpack_values (gathers, then a
// widening multiply per group) spent about 29 ns per 256 weights here, at which rate a 60-token
// prompt of Qwen2.5-Coder-1.5B paid about 60 ms of its 0.3 s for it (2 threads, Intel Xeon).
template <class W>
void fold_values4(const uint8_t* blk, int64_t first, uint8_t* o) {
  using P = KLayout<W>;
  static_assert(P::VB == 4 && P::G == 32 && P::NB == 4 && P::S == 16 && SPLIT<W> == 4, "Q4_K's layout");
  // Y (STEP_ROWS of vectors 0 .. 3, or of 4 .. 7), then O_p: dword 8 e + u = row 2 p + e of
  // vector u (u < 4 from the first Y, u >= 4 from the second).
  alignas(64) static constexpr int32_t O_ROWS[2][16] = {
      {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
      {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
  // A row's 16 dwords from the low (L) and high (+16: H) nibbles regrouped by PAIRS: group 2b's values of
  // steps 0 .. 7 (L), 8 .. 15 (H), then group 2b + 1's likewise; e: the row's place in O_p.
  alignas(64) static constexpr int32_t ROW[2][16] = {
      {0, 2, 4, 6, 16, 18, 20, 22, 1, 3, 5, 7, 17, 19, 21, 23},
      {8, 10, 12, 14, 24, 26, 28, 30, 9, 11, 13, 15, 25, 27, 29, 31}};
  const __m512i nibble = _mm512_set1_epi8(15), low_digit = _mm512_set1_epi16(15);
  const __m512i y0 = _mm512_load_si512(STEP_ROWS[0]), y1 = _mm512_load_si512(STEP_ROWS[1]);
  const __m512i o0 = _mm512_load_si512(O_ROWS[0]), o1 = _mm512_load_si512(O_ROWS[1]);
  const __m512i w0 = _mm512_load_si512(ROW[0]), w1 = _mm512_load_si512(ROW[1]);
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)PAIRS));
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int b = 0; b < P::NB; ++b) {
    const uint8_t* v = blk + P::BLK_AT + b * P::BLOCK;  // step vectors u = 0 .. 7: row r's bytes at 32 u + 4 r
    const __m512i z0 = _mm512_loadu_si512(v), z1 = _mm512_loadu_si512(v + 64), z2 = _mm512_loadu_si512(v + 128),
                  z3 = _mm512_loadu_si512(v + 192);
    const __m512i ya = _mm512_permutex2var_epi32(z0, y0, z1), yb = _mm512_permutex2var_epi32(z0, y1, z1);
    const __m512i yc = _mm512_permutex2var_epi32(z2, y0, z3), yd = _mm512_permutex2var_epi32(z2, y1, z3);
    // The block's scales (row r's two at 2 r, 2 r + 1), each as a dword of two equal words.
    const __m512i scale32 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + P::SC_AT + 16 * b)));
    const __m512i scales = _mm512_or_si512(scale32, _mm512_slli_epi32(scale32, 16));
    uint8_t* high = o + b * AMX_ROWS * 64, *low = high + KIND_BYTES;
    for (int p = 0; p < 4; ++p) {
      const __m512i op = _mm512_permutex2var_epi32(p < 2 ? ya : yb, p % 2 ? o1 : o0, p < 2 ? yc : yd);
      const __m512i lo = _mm512_shuffle_epi8(_mm512_and_si512(op, nibble), pairs);
      const __m512i hi = _mm512_shuffle_epi8(_mm512_and_si512(_mm512_srli_epi16(op, 4), nibble), pairs);
      for (int e = 0; e < 2; ++e) {
        const int64_t r = 2 * p + e, m = first + r;
        const __m512i values = _mm512_permutex2var_epi32(lo, e ? w1 : w0, hi);
        // row r's scales as words: 16 of group 2b, then 16 of group 2b + 1
        const __m512i scale = _mm512_permutexvar_epi32(_mm512_add_epi32(halves, _mm512_set1_epi32((int)(2 * r))), scales);
        _mm512_storeu_si512(high + m * 64, _mm512_mullo_epi16(values, _mm512_srli_epi16(scale, 4)));
        _mm512_storeu_si512(low + m * 64, _mm512_mullo_epi16(values, _mm512_and_si512(scale, low_digit)));
      }
    }
  }
}

// Weight rows n0 .. n0 + 15 (packed groups n0 / 8 and n0 / 8 + 1; rows past N are 0), per
// super-block (SB_BYTES): for high and low in turn, 4 A tiles of 16 rows x 64 bytes; then the
// rows' d and dmin as floats (16 each) and their mins by pairs of groups (4 x 16 int32: group
// 2p in the low half, 2p + 1 in the high), for the epilogue's broadcasts. Every byte is written.
constexpr int64_t SB_BYTES = 2 * KIND_BYTES + 2 * 64 + 4 * 64;

// Q5_K's folding of a packed super-block (blk) of 8 weight rows, rows first .. first + 7 of the
// A tiles at o: the values unpacked (unpack_values), then each group's times its scale's digits,
// widened to words.
template <class W>
void fold_values5(const uint8_t* blk, int64_t first, uint8_t* o) {
  using P = KLayout<W>;
  constexpr int G = P::G;
  alignas(64) uint8_t q[8][256];
  unpack_values<W>(blk, q);
  for (int r = 0; r < 8; ++r)
    for (int g = 0; g < 8; ++g) {  // group g: values 32 (g % 2) .. of the A tiles' row first + r of chunk g / 2
      const int scale = blk[P::SC_AT + 16 * (g / 2) + 2 * r + g % 2];
      const __m512i values = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i*)&q[r][G * g]));
      const int64_t at = (int64_t)(g / 2) * AMX_ROWS * 64 + (first + r) * 64 + 32 * (g % 2);
      const int high = scale >> SPLIT<W>, low = scale & ((1 << SPLIT<W>) - 1);
      _mm256_storeu_si256((__m256i*)(o + at), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(values, _mm512_set1_epi16((short)high))));
      _mm256_storeu_si256((__m256i*)(o + KIND_BYTES + at), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(values, _mm512_set1_epi16((short)low))));
    }
}

// Rows first .. first + 7 of `tiles` consecutive A tiles at o set to 0 (weight rows past N).
inline void clear_tile_rows(uint8_t* o, int tiles, int64_t first) {
  for (int c = 0; c < tiles; ++c) std::memset(o + c * AMX_ROWS * 64 + first * 64, 0, 8 * 64);
}

template <class W>
void weight_tiles(const uint8_t* packed, int64_t supers, int64_t groups8, int64_t g8, uint8_t* out) {
  using P = KLayout<W>;
  for (int64_t sb = 0; sb < supers; ++sb) {
    uint8_t* o = out + sb * SB_BYTES;
    float* d = reinterpret_cast<float*>(o + 2 * KIND_BYTES);
    float* dmin = d + AMX_ROWS;
    int32_t* mins = reinterpret_cast<int32_t*>(dmin + AMX_ROWS);
    for (int half_ = 0; half_ < 2; ++half_) {
      if (g8 + half_ >= groups8) {  // rows past N: their rows of both kinds' 4 tiles, d, dmin and mins 0
        clear_tile_rows(o, 8, 8 * half_);
        for (int r = 0; r < 8; ++r) {
          d[8 * half_ + r] = dmin[8 * half_ + r] = 0;
          for (int p = 0; p < 4; ++p) mins[p * AMX_ROWS + 8 * half_ + r] = 0;
        }
        continue;
      }
      const uint8_t* blk = packed + ((g8 + half_) * supers + sb) * P::BYTES;
      for (int r = 0; r < 8; ++r) {
        d[8 * half_ + r] = half(blk + 2 * r);
        dmin[8 * half_ + r] = half(blk + 16 + 2 * r);
        for (int p = 0; p < 4; ++p) {
          const uint8_t* mn = blk + P::MN_AT + 16 * p + 2 * r;
          mins[p * AMX_ROWS + 8 * half_ + r] = (int32_t)(mn[0] | (uint32_t)mn[1] << 16);
        }
      }
      if constexpr (P::VB == 4) fold_values4<W>(blk, 8 * half_, o);
      else fold_values5<W>(blk, 8 * half_, o);
    }
  }
}

// x as the tiles need it, in x.amx_tiles and x.amx_pairs, once per layer (before its parts run):
// - its bytes (XK::q, [M, K]) as B tiles: for each 16 rows of x and 64 bytes along K, 16 rows of
//   16 x 4 bytes (row of x n's bytes 4k .. 4k + 3 of the 64 at 64 k + 4 n); rows past M are 0;
// - its group sums as int16 pairs for the mins' term: for each 16 rows of x, super-block and pair
//   of groups p, 16 int32 (row of x n: sum of group 2p in the low half, 2p + 1 in the high).
inline void amx_layout(XK& x, int64_t M, int threads) {
  const int64_t K = x.supers * 256, tiles = (M + AMX_ROWS - 1) / AMX_ROWS;
  x.amx_tiles.assign(tiles * AMX_ROWS * K, 0);
  x.amx_pairs.assign(tiles * x.supers * 4 * AMX_ROWS, 0);
  pool(threads).parallel_for(M, [&](int64_t n) {
    const int8_t* q = &x.q[n * K];
    int8_t* tile = &x.amx_tiles[(n / AMX_ROWS) * AMX_ROWS * K + (n % AMX_ROWS) * 4];
    for (int64_t c = 0; c < K / 64; ++c)
      for (int k = 0; k < 64; k += 4) std::memcpy(tile + c * 64 * AMX_ROWS + k * 16, q + c * 64 + k, 4);
    for (int64_t sb = 0; sb < x.supers; ++sb)
      for (int p = 0; p < 4; ++p) {
        const int16_t* sums = &x.sums32[(n * x.supers + sb) * 8 + 2 * p];
        x.amx_pairs[((n / AMX_ROWS * x.supers + sb) * 4 + p) * AMX_ROWS + n % AMX_ROWS] = (int32_t)((uint16_t)sums[0] | ((uint32_t)(uint16_t)sums[1] << 16));
      }
  });
}

// A job's expanded weights: this thread's buffer of at least `bytes`, 64-byte aligned, reused
// by its next job (a thread runs one job at a time).
inline uint8_t* job_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(bytes + 64);
  return buffer.data() + (64 - (uintptr_t)buffer.data() % 64) % 64;
}

// Row i of x's outputs, weight rows n0 .. n0 + 15 (`lanes` of them), from acc [weight row][row of
// x] (AMX_ROWS x AMX_ROWS): a column of acc, gathered.
// With `out` (outlier_sums of the job's two groups), a row with outliers gets its 16 sums added.
inline void store_column(const float (*acc)[AMX_ROWS], int64_t i, float* y, __mmask16 lanes, const float* out,
                         int32_t slot) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(AMX_ROWS));
  __m512 v = _mm512_i32gather_ps(column, &acc[0][i], 4);
  if (out != nullptr && slot >= 0) v = _mm512_add_ps(v, _mm512_loadu_ps(out + slot * AMX_ROWS));
  _mm512_mask_storeu_ps(y, lanes, v);
}

// A job's outlier sums (XK split; nullptr without outliers): its weight rows n0 .. n0 + 15, one or
// two groups of 8 of the packed copy.
template <class W>
const float* job_outliers(const uint8_t* packed, const XK& x, int64_t n0, int64_t N) {
  if (!x.any_outliers) return nullptr;
  const int64_t stride = x.supers * KLayout<W>::BYTES;
  return outlier_sums<W>(packed + n0 / 8 * stride, stride, n0 + 8 < N ? 2 : 1, AMX_ROWS, x);
}

template <class W>
Tiles linear_amx(const W& w, const uint8_t* packed, const XK& x, int64_t M, float* y, int64_t N, int64_t ldy) {
  using P = KLayout<W>;
  const int64_t supers = w.K / 256, groups8 = (N + 7) / 8, xtiles = (M + AMX_ROWS - 1) / AMX_ROWS;
  const int8_t* xt = x.amx_tiles.data();
  const int32_t* xp = x.amx_pairs.data();
  const XK* xk = &x;
  return {[=](int64_t job) {
            const int64_t n0 = job * AMX_ROWS;
            uint8_t* wa = job_buffer(supers * SB_BYTES);
            weight_tiles<W>(packed, supers, groups8, n0 / 8, wa);
            const float* out = job_outliers<W>(packed, *xk, n0, N);  // while the weights are in cache
            configure_tiles();
            const int64_t rows_n = std::min<int64_t>(AMX_ROWS, N - n0);
            // [super-block parity][x tile of the pair][high, low][weight row][row of x]
            alignas(64) int32_t sums[2][2][2][AMX_ROWS][AMX_ROWS];
            alignas(64) float acc[2][AMX_ROWS][AMX_ROWS];
            const __mmask16 lanes = (__mmask16)((1u << rows_n) - 1);
            for (int64_t first = 0; first < xtiles; first += 2) {  // two tiles of x through each A tile loaded
              const int64_t pair = std::min<int64_t>(2, xtiles - first);
              // Super-block sb's integer sums into sums[sb % 2]: issued before the epilogue of
              // sb - 1, so that the tile unit works while the vector units scale.
              const auto products = [&](int64_t sb) {
                const uint8_t* a = wa + sb * SB_BYTES;
                const int8_t* b0 = xt + (first * supers + sb) * 256 * AMX_ROWS;
                const int8_t* b1 = b0 + supers * 256 * AMX_ROWS;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int c = 0; c < 4; ++c) {
                  _tile_loadd(4, a + c * 64 * AMX_ROWS, 64);
                  _tile_loadd(5, a + KIND_BYTES + c * 64 * AMX_ROWS, 64);
                  _tile_loadd(6, b0 + c * 64 * AMX_ROWS, 64);
                  _tile_dpbusd(0, 4, 6);
                  _tile_dpbusd(1, 5, 6);
                  if (pair == 2) {
                    _tile_loadd(7, b1 + c * 64 * AMX_ROWS, 64);
                    _tile_dpbusd(2, 4, 7);
                    _tile_dpbusd(3, 5, 7);
                  }
                }
                _tile_stored(0, sums[sb % 2][0][0], 64);
                _tile_stored(1, sums[sb % 2][0][1], 64);
                if (pair == 2) {
                  _tile_stored(2, sums[sb % 2][1][0], 64);
                  _tile_stored(3, sums[sb % 2][1][1], 64);
                }
              };
              std::memset(acc, 0, sizeof acc);
              products(0);
              for (int64_t sb = 0; sb < supers; ++sb) {
                if (sb + 1 < supers) products(sb + 1);
                const uint8_t* a = wa + sb * SB_BYTES;
                const float* d = reinterpret_cast<const float*>(a + 2 * KIND_BYTES);
                const float* dmin = d + AMX_ROWS;
                const int32_t* mins_w = reinterpret_cast<const int32_t*>(dmin + AMX_ROWS);
                for (int64_t h = 0; h < pair; ++h) {
                  const int64_t m0 = (first + h) * AMX_ROWS, rows = std::min<int64_t>(AMX_ROWS, M - m0);
                  alignas(64) float xd[AMX_ROWS] = {};  // x's multipliers of this super-block (0 past M)
                  for (int64_t i = 0; i < rows; ++i) xd[i] = xk->d[(m0 + i) * supers + sb];
                  const __m512 xdv = _mm512_load_ps(xd);  // and -xd, as packed.h negates it (sign bit: -0 stays -0)
                  const __m512 minus_xd = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(xdv), _mm512_set1_epi32((int)0x80000000)));
                  const int32_t* pairs = xp + ((first + h) * supers + sb) * 4 * AMX_ROWS;
                  const __m512i p0 = _mm512_loadu_si512(pairs), p1 = _mm512_loadu_si512(pairs + AMX_ROWS),
                                p2 = _mm512_loadu_si512(pairs + 2 * AMX_ROWS), p3 = _mm512_loadu_si512(pairs + 3 * AMX_ROWS);
                  for (int64_t m = 0; m < rows_n; ++m) {
                    const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[sb % 2][h][0][m]), SPLIT<W>), _mm512_load_si512(sums[sb % 2][h][1][m]));
                    // sum over groups of min times x's group sum (the integers packed.h adds)
                    __m512i mins = _mm512_dpwssd_epi32(_mm512_setzero_si512(), p0, _mm512_set1_epi32(mins_w[m]));
                    mins = _mm512_dpwssd_epi32(mins, p1, _mm512_set1_epi32(mins_w[AMX_ROWS + m]));
                    mins = _mm512_dpwssd_epi32(mins, p2, _mm512_set1_epi32(mins_w[2 * AMX_ROWS + m]));
                    mins = _mm512_dpwssd_epi32(mins, p3, _mm512_set1_epi32(mins_w[3 * AMX_ROWS + m]));
                    __m512 v = _mm512_load_ps(acc[h][m]);
                    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(_mm512_set1_ps(d[m]), xdv), v);
                    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(_mm512_set1_ps(dmin[m]), minus_xd), v);
                    _mm512_store_ps(acc[h][m], v);
                  }
                }
              }
              for (int64_t h = 0; h < pair; ++h) {
                const int64_t m0 = (first + h) * AMX_ROWS, rows = std::min<int64_t>(AMX_ROWS, M - m0);
                for (int64_t i = 0; i < rows; ++i)
                  store_column(acc[h], i, y + (m0 + i) * ldy + n0, lanes, out, out ? xk->slot_of[m0 + i] : -1);
              }
            }
            _tile_release();
          },
          (N + AMX_ROWS - 1) / AMX_ROWS};
}


// ---------------------------------------------------------------------------------------------
// Q6_K: values q of 6 bits, weight = d s (q - 32) with a signed 8-bit scale s per group of 16.
// s (q - 32) does not fit a byte, so s is written in balanced base 7: s = 49 s2 + 7 s1 + s0 with
// digits in -3 .. 3 (every s in -128 .. 127 has one), and each digit times q - 32 is a signed
// byte (|3 x 32| = 96). Three A tiles per 64 bytes along K, one per digit, multiplied with x's
// signed bytes by TDPBSSD (signed by signed), and a super-block's sum is 49 S2 + 7 S1 + S0: the
// integer packed.h sums (scale times q times x, less 32 times the scales times x's group sums).

template <class W>
constexpr bool AMX_DIGITS = W::SUPER && !W::MIN && W::SHIFT == 5 && KLayout<W>::VB == 6 && KLayout<W>::G == 16;

// Per super-block: for digits 0, 1, 2 in turn, 4 A tiles of 16 rows x 64 bytes; then the rows' d
// as floats (16).
constexpr int64_t SB6_BYTES = 3 * KIND_BYTES + 64;

// The balanced base-7 digits of every signed byte s: s = 49 d[2] + 7 d[1] + d[0], each in -3 .. 3
// (DIGITS7[s + 128]).
struct Digits7 {
  int8_t d[256][3];
  constexpr Digits7() : d{} {
    for (int s0 = -128; s0 < 128; ++s0) {
      int s = s0;
      for (int j = 0; j < 2; ++j) {
        d[s0 + 128][j] = (int8_t)(((s % 7) + 7 + 3) % 7 - 3);
        s = (s - d[s0 + 128][j]) / 7;
      }
      d[s0 + 128][2] = (int8_t)s;
    }
  }
};
constexpr Digits7 DIGITS7{};

// The digits of every signed byte s as one int32 (digit j in byte j): DIGITS7_WORD[s + 128].
struct Digits7Words {
  int32_t w[256];
  constexpr Digits7Words() : w{} {
    for (int i = 0; i < 256; ++i)
      w[i] = (int32_t)((uint32_t)(uint8_t)DIGITS7.d[i][0] | (uint32_t)(uint8_t)DIGITS7.d[i][1] << 8 |
                       (uint32_t)(uint8_t)DIGITS7.d[i][2] << 16);
  }
};
alignas(64) constexpr Digits7Words DIGITS7_WORD{};

// Q6_K's digit tiles straight from a packed super-block (blk) of 8 weight rows, as rows first ..
// first + 7 of the super-block's A tiles at o (all three digits), digit j of a group's scale
// times q - 32 (as fold_values4 for Q4_K; the same bytes as the version before it, which
// unpacked the values with gathers and multiplied each group widened to words, 58-64 -> 17-21 ns
// per 256 weights on one thread, Intel Xeon): the 4 step vectors of low nibbles
// transposed to rows by `vpermt2d`, each row's 5th and 6th bits from its dword of the block's two
// planes (`vpermd`, shifted by step), a row's 32 values gathered by `vpshufb` and `vpermt2d`, and
// each digit's products in one `vpmullw`: with a word q0 + 256 q1, (q - 32) d + 128 is in 32 ..
// 224 for both bytes (q <= 63, |d| <= 3), so q0 d + 256 q1 d plus 257 (128 - 32 d) has them as
// its two bytes, and flipping their top bits leaves (q - 32) d as signed bytes.
template <class W>
void fold_values6(const uint8_t* blk, int64_t first, uint8_t* o) {
  using P = KLayout<W>;
  static_assert(P::VB == 6 && P::G == 16 && P::NB == 8 && P::S == 8 && P::LOW == 128 && P::BLOCK == 192, "Q6_K's layout");
  // T: STEP_ROWS of the 4 low-nibble vectors. PLANE: each dword of T's row's dword of plane 0
  // (steps 0 .. 3) and of plane 1 (steps 4 .. 7), by half; SHIFTS: step u's bits at 2 u.
  alignas(64) static constexpr int32_t PLANE[2][2][16] = {
      {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11}},
      {{4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}, {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}}};
  alignas(64) static constexpr int32_t SHIFTS[16] = {0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6};
  // Rows 2 q, 2 q + 1 of a T, from its steps 0 .. 3 (L) and 4 .. 7 (+16: H) regrouped by PAIRS:
  // each row's group 2b values (16 bytes), then group 2b + 1's.
  alignas(64) static constexpr int32_t ROWS2[2][16] = {
      {0, 2, 16, 18, 1, 3, 17, 19, 4, 6, 20, 22, 5, 7, 21, 23},
      {8, 10, 24, 26, 9, 11, 25, 27, 12, 14, 28, 30, 13, 15, 29, 31}};
  const __m512i nibble = _mm512_set1_epi8(15), two_bits = _mm512_set1_epi8(3), top = _mm512_set1_epi8((char)0x80);
  const __m512i shifts = _mm512_load_si512(SHIFTS), pairs = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)PAIRS));
  const __m512i bias = _mm512_set1_epi16((short)0x8080), minus_32x257 = _mm512_set1_epi16(-32 * 257);
  const __m512i low_words = _mm512_set1_epi32(0xFFFF);
  for (int b = 0; b < P::NB; ++b) {
    const uint8_t* v = blk + P::BLK_AT + b * P::BLOCK;
    const __m512i z0 = _mm512_loadu_si512(v), z1 = _mm512_loadu_si512(v + 64), planes = _mm512_loadu_si512(v + P::LOW);
    // The digits of the block's 16 scales (row r's two at 2 r, 2 r + 1), digit j as words twice per dword.
    const __m512i code = _mm512_i32gather_epi32(
        _mm512_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + P::SC_AT + 16 * b))), _mm512_set1_epi32(128)),
        DIGITS7_WORD.w, 4);
    __m512i digits[3];
    for (int j = 0; j < 3; ++j) {
      const __m512i dj = _mm512_srai_epi32(_mm512_slli_epi32(code, 24 - 8 * j), 24);
      digits[j] = _mm512_or_si512(_mm512_and_si512(dj, low_words), _mm512_slli_epi32(dj, 16));
    }
    for (int half_ = 0; half_ < 2; ++half_) {
      const __m512i t = _mm512_permutex2var_epi32(z0, _mm512_load_si512(STEP_ROWS[half_]), z1);
      const __m512i h0 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_load_si512(PLANE[half_][0]), planes), shifts), two_bits), 4);
      const __m512i h1 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_load_si512(PLANE[half_][1]), planes), shifts), two_bits), 4);
      const __m512i lo = _mm512_shuffle_epi8(_mm512_or_si512(_mm512_and_si512(t, nibble), h0), pairs);
      const __m512i hi = _mm512_shuffle_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(t, 4), nibble), h1), pairs);
      for (int q = 0; q < 2; ++q) {
        const int r0 = 4 * half_ + 2 * q;
        const __m512i values = _mm512_permutex2var_epi32(lo, _mm512_load_si512(ROWS2[q]), hi);
        // rows r0, r0 + 1: 8 words of each group's digit, groups 2b, 2b + 1 of r0, then of r0 + 1
        const __m512i pick = _mm512_set_epi32(2 * r0 + 3, 2 * r0 + 3, 2 * r0 + 3, 2 * r0 + 3, 2 * r0 + 2, 2 * r0 + 2, 2 * r0 + 2, 2 * r0 + 2,
                                              2 * r0 + 1, 2 * r0 + 1, 2 * r0 + 1, 2 * r0 + 1, 2 * r0, 2 * r0, 2 * r0, 2 * r0);
        for (int j = 0; j < 3; ++j) {
          const __m512i d = _mm512_permutexvar_epi32(pick, digits[j]);
          const __m512i biased = _mm512_add_epi16(_mm512_mullo_epi16(values, d), _mm512_add_epi16(bias, _mm512_mullo_epi16(d, minus_32x257)));
          const __m512i bytes = _mm512_xor_si512(biased, top);
          uint8_t* at = o + j * KIND_BYTES + (int64_t)(b / 2) * AMX_ROWS * 64 + 32 * (b % 2);
          _mm256_storeu_si256((__m256i*)(at + (first + r0) * 64), _mm512_castsi512_si256(bytes));
          _mm256_storeu_si256((__m256i*)(at + (first + r0 + 1) * 64), _mm512_extracti64x4_epi64(bytes, 1));
        }
      }
    }
  }
}

template <class W>
void weight_tiles6(const uint8_t* packed, int64_t supers, int64_t groups8, int64_t g8, uint8_t* out) {
  using P = KLayout<W>;
  for (int64_t sb = 0; sb < supers; ++sb) {
    uint8_t* o = out + sb * SB6_BYTES;
    float* d = reinterpret_cast<float*>(o + 3 * KIND_BYTES);
    for (int half_ = 0; half_ < 2; ++half_) {
      if (g8 + half_ >= groups8) {  // rows past N: weights and d 0 (their rows of the three digits' 4 tiles)
        clear_tile_rows(o, 12, 8 * half_);
        for (int r = 0; r < 8; ++r) d[8 * half_ + r] = 0;
        continue;
      }
      const uint8_t* blk = packed + ((g8 + half_) * supers + sb) * P::BYTES;
      for (int r = 0; r < 8; ++r) d[8 * half_ + r] = half(blk + 2 * r);
      fold_values6<W>(blk, 8 * half_, o);
    }
  }
}

template <class W>
Tiles linear_amx6(const W& w, const uint8_t* packed, const XK& x, int64_t M, float* y, int64_t N, int64_t ldy) {
  const int64_t supers = w.K / 256, groups8 = (N + 7) / 8, xtiles = (M + AMX_ROWS - 1) / AMX_ROWS;
  const int8_t* xt = x.amx_tiles.data();
  const XK* xk = &x;
  return {[=](int64_t job) {
            const int64_t n0 = job * AMX_ROWS;
            uint8_t* wa = job_buffer(supers * SB6_BYTES);
            weight_tiles6<W>(packed, supers, groups8, n0 / 8, wa);
            const float* out = job_outliers<W>(packed, *xk, n0, N);  // while the weights are in cache
            configure_tiles();
            const int64_t rows_n = std::min<int64_t>(AMX_ROWS, N - n0);
            alignas(64) int32_t sums[2][3][AMX_ROWS][AMX_ROWS];  // [super-block parity][digit][weight row][row of x]
            alignas(64) float acc[AMX_ROWS][AMX_ROWS];
            const __mmask16 lanes = (__mmask16)((1u << rows_n) - 1);
            for (int64_t xtile = 0; xtile < xtiles; ++xtile) {
              const int64_t m0 = xtile * AMX_ROWS, rows = std::min<int64_t>(AMX_ROWS, M - m0);
              // Super-block sb's three digit sums into sums[sb % 2], issued before sb - 1's epilogue.
              const auto products = [&](int64_t sb) {
                const uint8_t* a = wa + sb * SB6_BYTES;
                const int8_t* b = xt + (xtile * supers + sb) * 256 * AMX_ROWS;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                for (int c = 0; c < 4; ++c) {
                  _tile_loadd(7, b + c * 64 * AMX_ROWS, 64);
                  _tile_loadd(4, a + c * 64 * AMX_ROWS, 64);
                  _tile_loadd(5, a + KIND_BYTES + c * 64 * AMX_ROWS, 64);
                  _tile_loadd(6, a + 2 * KIND_BYTES + c * 64 * AMX_ROWS, 64);
                  _tile_dpbssd(0, 4, 7);
                  _tile_dpbssd(1, 5, 7);
                  _tile_dpbssd(2, 6, 7);
                }
                _tile_stored(0, sums[sb % 2][0], 64);
                _tile_stored(1, sums[sb % 2][1], 64);
                _tile_stored(2, sums[sb % 2][2], 64);
              };
              std::memset(acc, 0, sizeof acc);
              products(0);
              for (int64_t sb = 0; sb < supers; ++sb) {
                if (sb + 1 < supers) products(sb + 1);
                const float* d = reinterpret_cast<const float*>(wa + sb * SB6_BYTES + 3 * KIND_BYTES);
                alignas(64) float xd[AMX_ROWS] = {};  // x's multipliers of this super-block (0 past M)
                for (int64_t i = 0; i < rows; ++i) xd[i] = xk->d[(m0 + i) * supers + sb];
                const __m512 xdv = _mm512_load_ps(xd);
                for (int64_t m = 0; m < rows_n; ++m) {
                  const __m512i total = _mm512_add_epi32(
                      _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(sums[sb % 2][2][m]), _mm512_set1_epi32(49)),
                                       _mm512_mullo_epi32(_mm512_load_si512(sums[sb % 2][1][m]), _mm512_set1_epi32(7))),
                      _mm512_load_si512(sums[sb % 2][0][m]));
                  _mm512_store_ps(acc[m], _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(_mm512_set1_ps(d[m]), xdv), _mm512_load_ps(acc[m])));
                }
              }
              for (int64_t i = 0; i < rows; ++i)
                store_column(acc, i, y + (m0 + i) * ldy + n0, lanes, out, out ? xk->slot_of[m0 + i] : -1);
            }
            _tile_release();
          },
          (N + AMX_ROWS - 1) / AMX_ROWS};
}

}  // namespace

#endif  // PARROT_AMX
