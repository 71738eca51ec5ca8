// The integer path for GGUF weights (`--quantization gguf_int8`): llama.cpp's numeric form.
//
// Why: the exact path (quant_exact.h, quant_blocksum.h) turns every weight into a float before
// its product; at batch 1 that conversion, not memory, bounds the step on AVX2. Here each row of
// x is quantized once a call to Q8 blocks of 32 (int8 codes, one fp32 scale, the codes' sum), and
// each block's products run on integer instructions (vpdpbusd on AVX-512 VNNI, 256-bit;
// vpmaddubsw + vpmaddwd on AVX2; plain C++ in the portable build). The weights never leave
// their codes.
//
// Every kind interleaves 8 output rows a record (quant_int8.py): 32-bit lane r of the products
// is output row r; 4 bytes of x broadcast against 4 codes of each of the 8 rows, 8 such
// instructions a block, give the block's exact integer sums of 8 outputs at once (S8F2: one sum
// a half of 16); the scales then apply once a block as vectors (8 d, 8 m). ~4x fewer instructions
// than one output a dot product.
//
// Row independence: a row's codes, scale and sums come from that row alone, and its outputs are
// one chain of fmas over its blocks in K order, whatever rows are batched with it (the integer
// sums are exact), so greedy results do not depend on the batch. Each build (ISA) has its own
// rounding order.
//
//   kind   record of one row (bytes)               GGUF types        value of code q   rows a group
//   Q4H    f16 d, 16 B nibbles (18)                Q4_0                   d q - 8 d     8
//   U4H    f16 d, f16 m, 16 B nibbles (20)         Q4_1                   d q + m       8
//   K4S    u8 sc, u8 m, 16 B nibbles (18.5: d, dmin Q4_K            d sc q - dmin m   8
//          f16 per 256 spread over 8 records)
//   U8F    f32 d, f32 m, 32 B codes 0..31 (40)     Q5_K, Q5_1             d q + m       8
//   S8H    f16 d, 32 int8 (34)                     Q8_0                   d q           8
//   S8F2   f32 d0, f32 d1 (per 16), 32 int8 (40)   Q6_K (q - 32)          d_(k/16) q    8
//
// Nibbles as GGML stores them: byte j holds k = j (low) and k = j + 16 (high). An interleaved
// record: d[8] | m[8] (unsigned kinds but Q4H, whose m = -8 d is computed) or d1[8] (S8F2, the
// second half's scales) | chunks of 32 B (4 of nibbles, or 8 of bytes), chunk t
// byte 4 r + i = row r's code byte 4 t + i. K4S keeps Q4_K's own factors, 4.625 bits a weight
// where fp32 scales and mins took 6: sc[8] | m[8] (6-bit, as bytes) | 4 bytes of its super-block's
// d[8] and dmin[8] (f16; record j of the 8 holds d of rows 2j, 2j + 1, or, from j = 4, dmin of
// rows 2j - 8, 2j - 7) | 4 chunks of nibbles. d sc and dmin m are exact in fp32 (11 x 6 bits), so
// its scales are those fp32 ones bit for bit.
//   unsigned kinds: sum += d dx <q, qx> + m dx sum(qx)      (q 0..31: no int16 saturation)
//   signed kinds:   sum += dx sum_g d_g <q, qx>_g            (|q| <= 127 via the sign trick)
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "linear_tiles.h"
#include "prefetch.h"

#if defined(__AVX2__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define TESSERA_INT8_AVX2 1
#endif

namespace tessera_int8 {

enum Kind : int64_t {
  kU4H = 10, kK4SWide = 11, kU8F = 12, kS8H = 13, kS8F2 = 14, kQ4H = 15, kK4S = 16
};
constexpr int64_t kQK = 32;  // K positions a block

// The kinds: kCols output rows a record. Unsigned codes with a min (d[8], m[8], then 4 chunks of
// nibbles, or 8 chunks of bytes 0..31; Q4H: d[8] only, m = -8 d), or signed 8-bit codes (d[8]
// and, with two groups, d1[8]; 8 chunks of int8); chunk t, byte 4 r + i is row r's code byte
// 4 t + i.
constexpr int64_t kCols = 8;
template <Kind Id, typename S, bool Signed, bool Nibbles, bool OffsetMin = false, int Groups = 1,
          bool Super = false>
struct XFmt {
  static constexpr Kind kId = Id;
  using Scale = S;
  static constexpr bool kSigned = Signed;
  static constexpr bool kNibbles = Nibbles;  // 4-bit codes, two a byte (else a byte each)
  // Q4_0's codes are q - 8: its min -8 d is computed (exact in fp32), not stored, so a record is
  // the file's 18 bytes a row, not 20 (the decode step streams 10% fewer bytes)
  static constexpr bool kOffsetMin = OffsetMin;
  // scales a block of a row (signed kinds): 2 for Q6_K, one a half of 16 (chunks 0-3 and 4-7)
  static constexpr int kGroups = Groups;
  // K4S: 6-bit scales and mins (S = uint8_t) times their super-block's f16 d and dmin, which
  // take kSuperBytes of each of its kSuperBlocks records, after the mins
  static constexpr bool kSuper = Super;
  static constexpr int kSuperBlocks = 8;
  static constexpr int64_t kSuperBytes = Super ? 4 : 0;
  static constexpr int kChunks = Nibbles ? 4 : 8;  // 32-byte loads of codes a block
  static constexpr int64_t kHead =
      (Signed ? Groups : OffsetMin ? 1 : 2) * kCols * sizeof(S) + kSuperBytes;
  static constexpr int64_t kRecord = kHead + kChunks * 32;  // a group's block
};
using Q4H = XFmt<kQ4H, c10::Half, false, true, true>;
using U4H = XFmt<kU4H, c10::Half, false, true>;
using K4S = XFmt<kK4S, uint8_t, false, true, false, 1, true>;
// K4S with its scales expanded to fp32 d and m a block (group_rows, for many rows of x): never
// packed, so not a kind with_kind knows
using K4SWide = XFmt<kK4SWide, float, false, true>;
using U8F = XFmt<kU8F, float, false, false>;
using S8H = XFmt<kS8H, c10::Half, true, false>;
using S8F2 = XFmt<kS8F2, float, true, false, false, 2>;

template <typename Fn>
decltype(auto) with_kind(int64_t kind, Fn&& fn) {
  switch (kind) {
    case kQ4H: return fn(Q4H{});
    case kU4H: return fn(U4H{});
    case kK4S: return fn(K4S{});
    case kU8F: return fn(U8F{});
    case kS8H: return fn(S8H{});
    case kS8F2: return fn(S8F2{});
  }
  TORCH_CHECK(false, "unknown int8 weight kind ", kind);
}

// Bytes of a group's block record (the packed tensor holds rows rounded up to whole groups of
// kCols: groups x K / 32 records).
inline int64_t record_bytes(int64_t kind) {
  return with_kind(kind, [](auto f) { return decltype(f)::kRecord; });
}

// K positions a row's K must be a multiple of: a block, or K4S's super-block of 8.
inline int64_t k_multiple(int64_t kind) {
  return with_kind(kind, [](auto f) {
    using F = decltype(f);
    return F::kSuper ? kQK * F::kSuperBlocks : kQK;
  });
}

template <typename S>
inline float scale_at(const uint8_t* p, int i) {
  S s;
  std::memcpy(&s, p + i * sizeof(S), sizeof(S));
  return static_cast<float>(s);
}

// K4S: row r's super-block factor (`which` 0: d, 1: dmin) for the record rec of block b.
template <typename F>
inline float super_at(const uint8_t* rec, int64_t b, int which, int r) {
  const uint8_t* first = rec - (b % F::kSuperBlocks) * F::kRecord;
  return scale_at<c10::Half>(first + (4 * which + r / 2) * F::kRecord + 2 * kCols, r % 2);
}

// Scale i of an interleaved record rec of block b (i < kCols: row i's d; else the second
// half's, S8F2): stored, or d sc (K4S).
template <typename F>
inline float scale_of(const uint8_t* rec, int64_t b, int i) {
  if constexpr (F::kSuper) {
    return super_at<F>(rec, b, 0, i) * static_cast<float>(rec[i]);
  } else {
    return scale_at<typename F::Scale>(rec, i);
  }
}

// The min of row r of an interleaved record of an unsigned kind: stored, -8 d (Q4H), or
// -(dmin m) (K4S).
template <typename F>
inline float min_at(const uint8_t* rec, int64_t b, int r) {
  if constexpr (F::kOffsetMin) {
    return -8.f * scale_at<typename F::Scale>(rec, r);
  } else if constexpr (F::kSuper) {
    return -(super_at<F>(rec, b, 1, r) * static_cast<float>(rec[kCols + r]));
  } else {
    return scale_at<typename F::Scale>(rec, kCols + r);
  }
}

// One row of x quantized: per block of 32, int8 codes, the scale dx, and the codes' sum.
struct QRow {
  int8_t* q;     // [K]
  float* d;      // [K / 32]
  int32_t* sum;  // [K / 32]
};

// Q8 blocks of one row (llama.cpp's Q8_0/Q8_K rule: dx = max|x| / 127, q = round(x / dx), ties
// to even). Scalar on purpose: the same codes on every ISA, and it is O(K) against O(N K).
template <typename T>
void quantize_row(const T* x, int64_t K, QRow r) {
  for (int64_t b = 0; b < K / kQK; ++b) {
    float amax = 0.f;
    for (int64_t i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[b * kQK + i])));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int32_t s = 0;
    for (int64_t i = 0; i < kQK; ++i) {
      const int v = static_cast<int>(std::nearbyint(static_cast<float>(x[b * kQK + i]) * id));
      r.q[b * kQK + i] = static_cast<int8_t>(v);
      s += v;
    }
    r.d[b] = d;
    r.sum[b] = s;
  }
}

#if defined(TESSERA_INT8_AVX2)

// 8 scales of an interleaved record as floats.
template <typename F>
inline __m256 load_scales8(const uint8_t* p) {
  if constexpr (std::is_same_v<typename F::Scale, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// The 8 mins of an interleaved record of an unsigned kind, given its 8 scales d.
template <typename F>
inline __m256 load_mins8(const uint8_t* p, __m256 d) {
  if constexpr (F::kOffsetMin) {
    return _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
  } else {
    return load_scales8<F>(p + kCols * sizeof(typename F::Scale));
  }
}

// K4S: the super-block's d[8] and dmin[8], 4 bytes of them in each of its records from `first`.
template <typename F>
inline void load_super8(const uint8_t* first, __m256* d, __m256* dmin) {
  int32_t p[F::kSuperBlocks];
  for (int j = 0; j < F::kSuperBlocks; ++j)
    std::memcpy(&p[j], first + j * F::kRecord + 2 * kCols, 4);
  *d = _mm256_cvtph_ps(_mm_setr_epi32(p[0], p[1], p[2], p[3]));
  *dmin = _mm256_cvtph_ps(_mm_setr_epi32(p[4], p[5], p[6], p[7]));
}

inline __m256 bytes8_ps(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

// The 8 rows' scales d and second scales e (the mins, or S8F2's second half; zero for S8H) of
// the block record at w. K4S: d sc and -(dmin m), given its super-block's d and dmin.
template <typename F>
inline void block_scales8(const uint8_t* w, __m256 sd, __m256 sm, __m256* d, __m256* e) {
  if constexpr (F::kSuper) {
    *d = _mm256_mul_ps(sd, bytes8_ps(w));
    *e = _mm256_xor_ps(_mm256_mul_ps(sm, bytes8_ps(w + kCols)), _mm256_set1_ps(-0.f));
  } else {
    *d = load_scales8<F>(w);
    if constexpr (F::kGroups == 2) {
      *e = load_scales8<F>(w + kCols * sizeof(typename F::Scale));
    } else if constexpr (!F::kSigned) {
      *e = load_mins8<F>(w, *d);
    } else {
      *e = _mm256_setzero_ps();
    }
  }
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

#ifndef TESSERA_INT8_PREFETCH
#define TESSERA_INT8_PREFETCH 1536
#endif
// Each record read at batch 1 is used once, and the step streams ~96 MB of them (the default
// model), so from DRAM or a shared L3. The records of a thread's groups are one contiguous
// stream, yet with the hardware prefetchers alone a core read them at ~8 GB/s, against ~35 GB/s
// for the same kernel on L2-resident weights. A prefetch this many bytes ahead of the record
// being read, one a cache line: 0.86x the time of every linear of a decode step at one thread
// (Sapphire Rapids, all 121 linears of the default model in stream order, in-process A/B,
// outputs bitwise equal); 512 B gave 0.93-0.95x, 1 and 2 KiB ~0.89x, 4 KiB nothing.
//
// That near prefetch (prefetcht0) holds one of the core's ~16 L1 fill buffers per line until it
// arrives, so from DRAM a core's reads stay few in flight: the kernel ran at ~10 GB/s a core,
// as if memory and arithmetic took turns (a plain read streams ~16 GB/s a core here). A second
// prefetch 4 KiB ahead into L2 only (prefetcht2), which the L2's own queue carries, keeps more
// lines in flight; the near one still lifts them into L1. A 288 MB weight stream on 2 threads:
// 17.3-18.7 -> 24.3-24.9 GB/s (2.5 KiB 21.8, 8 KiB 24.2); the random 1B Llama in Q4_0 decodes
// at 38.9 -> 47.2-49.9 tok/s; the default model (L3-resident) 248 -> 256. The far prefetch alone
// (no near one) lost ~4% on the default model.
constexpr int64_t kPrefetchBytes = TESSERA_INT8_PREFETCH;
#ifndef TESSERA_INT8_FAR_PREFETCH
#define TESSERA_INT8_FAR_PREFETCH 4096
#endif
constexpr int64_t kFarPrefetchBytes = TESSERA_INT8_FAR_PREFETCH;
template <int64_t Bytes>
inline void prefetch_ahead(const uint8_t* w) {
  if constexpr (kPrefetchBytes > 0) tessera_prefetch::prefetch_lines(w + kPrefetchBytes, Bytes);
  if constexpr (kFarPrefetchBytes > 0)
    tessera_prefetch::prefetch_lines<1>(w + kFarPrefetchBytes, Bytes);
}

// The exact integer sums of chunks [J0, J1) of one block for the 8 rows of a group: lane r =
// <codes of row r, qx> over K positions 4 J0 .. 4 J1 - 1. codes[j] holds K positions 4 j .. 4 j + 3
// of each row: unsigned 0..15 or 0..31 (F::kSigned false), or int8 (then |code| against x with
// the code's sign, so vpmaddubsw's pairs stay in int16).
template <typename F, int J0 = 0, int J1 = 8>
inline __m256i block_sums8(const __m256i* codes, const int8_t* qx) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __m256i s = _mm256_setzero_si256();
  for (int j = J0; j < J1; ++j) {
    const __m256i x = broadcast4(qx + 4 * j);
    if constexpr (F::kSigned) {
      s = _mm256_dpbusd_epi32(s, _mm256_sign_epi8(codes[j], codes[j]), _mm256_sign_epi8(x, codes[j]));
    } else {
      s = _mm256_dpbusd_epi32(s, codes[j], x);
    }
  }
  return s;
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (F::kSigned) {  // pairs up to 2 * 128 * 127: widened to int32 every step
    __m256i s = _mm256_setzero_si256();
    for (int j = J0; j < J1; ++j) {
      const __m256i x = broadcast4(qx + 4 * j);
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(codes[j], codes[j]),
                                             _mm256_sign_epi8(x, codes[j]));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
  } else if constexpr (F::kNibbles) {
    static_assert(J0 == 0 && J1 == 8, "4-bit kinds sum whole blocks");
    // int16 pairs: |15 * 127 * 2| * 8 products summed = 30480 < 32767, no saturation
    __m256i s16 = _mm256_maddubs_epi16(codes[0], broadcast4(qx));
    for (int j = 1; j < 8; ++j)
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(codes[j], broadcast4(qx + 4 * j)));
    return _mm256_madd_epi16(s16, ones);
  } else {
    // codes 0..31: int16 pairs up to 31 * 127 * 2 = 7874, so four of them at most (31496)
    static_assert(J0 == 0 && J1 == 8, "5-bit kinds sum whole blocks");
    __m256i s = _mm256_setzero_si256();
    for (int h = 0; h < 8; h += 4) {
      __m256i s16 = _mm256_maddubs_epi16(codes[h], broadcast4(qx + 4 * h));
      for (int j = h + 1; j < h + 4; ++j)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(codes[j], broadcast4(qx + 4 * j)));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, ones));
    }
    return s;
  }
#endif
}

// out[r][c] = <row c of the group at w, x row r> for R rows of quantized x (AVX2 / VNNI).
template <typename F, int R>
inline void dot_group(const uint8_t* w, int64_t nb, const QRow* xr, float (*out)[kCols]) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(15);
  __m256 sd = _mm256_setzero_ps(), sm = sd;  // K4S: the super-block's d and dmin
  for (int64_t b = 0; b < nb; ++b, w += F::kRecord) {
    prefetch_ahead<F::kRecord>(w);
    if constexpr (F::kSuper) {
      if (b % F::kSuperBlocks == 0) load_super8<F>(w, &sd, &sm);
    }
    // the block's scales and its other 8 scales (Q6_K's second half, or the mins), once for
    // every row
    __m256 d, e;
    block_scales8<F>(w, sd, sm, &d, &e);
    __m256i codes[8];
    const uint8_t* c = w + F::kHead;
    for (int t = 0; t < F::kChunks; ++t) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * t));
      if constexpr (!F::kNibbles) {
        codes[t] = raw;
      } else {
        codes[t] = _mm256_and_si256(raw, low);
        codes[t + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* qx = xr[r].q + b * kQK;
      const float dx = xr[r].d[b];
      if constexpr (F::kGroups == 2) {  // Q6_K: a sum and a scale a half of 16
        const __m256i s0 = block_sums8<F, 0, 4>(codes, qx), s1 = block_sums8<F, 4, 8>(codes, qx);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(e, _mm256_set1_ps(dx)), acc[r]);
        continue;
      }
      const __m256i s = block_sums8<F>(codes, qx);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
      if constexpr (!F::kSigned) {
        const float sx = dx * static_cast<float>(xr[r].sum[b]);
        acc[r] = _mm256_fmadd_ps(e, _mm256_set1_ps(sx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r], acc[r]);
}

// x rows a pass over a group's records: AVX-512 has the 32 registers for 4 (8 codes, 4
// accumulators, scales); AVX2's 16 hold 2.
#if defined(__AVX512F__)
constexpr int kXRows = 4;
#else
constexpr int kXRows = 2;
#endif

#else  // portable: the same integer sums in plain C++

template <typename F, int R>
inline void dot_group(const uint8_t* w, int64_t nb, const QRow* xr, float (*out)[kCols]) {
  float acc[R][kCols] = {};
  for (int64_t b = 0; b < nb; ++b, w += F::kRecord) {
    int32_t q[kCols][32];  // row c's codes in K order
    for (int t = 0; t < F::kChunks; ++t) {
      for (int c = 0; c < kCols; ++c) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = w[F::kHead + 32 * t + 4 * c + i];
          if constexpr (F::kSigned) {
            q[c][4 * t + i] = static_cast<int8_t>(byte);
          } else if constexpr (!F::kNibbles) {
            q[c][4 * t + i] = byte;
          } else {
            q[c][4 * t + i] = byte & 15;
            q[c][16 + 4 * t + i] = byte >> 4;
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* qx = xr[r].q + b * kQK;
      const float dx = xr[r].d[b];
      for (int c = 0; c < kCols; ++c) {
        for (int g = 0; g < F::kGroups; ++g) {  // Q6_K: a sum and a scale a half of 16
          constexpr int n = 32 / F::kGroups;
          int32_t s = 0;
          for (int k = g * n; k < (g + 1) * n; ++k) s += q[c][k] * qx[k];
          acc[r][c] = std::fma(static_cast<float>(s), scale_of<F>(w, b, g * kCols + c) * dx,
                               acc[r][c]);
        }
        if constexpr (!F::kSigned) {
          const float sx = dx * static_cast<float>(xr[r].sum[b]);
          acc[r][c] = std::fma(min_at<F>(w, b, c), sx, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) out[r][c] = acc[r][c];
}

constexpr int kXRows = 4;

#endif

// Row n of a weight of kind F as gguf's values (the embedding lookup of a tied lm_head): code
// * d + m, or code * d for the signed kinds (d of the code's half for S8F2). code * d is exact
// (d has at most ~19 significant bits, the code 5), so the fma's one rounding equals
// dequantize_int8's mul + add.
template <typename F, typename T>
void int8_row(const uint8_t* w, int64_t K, int64_t n, T* out) {
  const int64_t nb = K / kQK;
  const int64_t r = n % kCols;
  const uint8_t* rec = w + (n / kCols) * nb * F::kRecord;
  for (int64_t b = 0; b < nb; ++b, rec += F::kRecord, out += kQK) {
    const float d = scale_of<F>(rec, b, static_cast<int>(r));
    float m = 0.f, d1 = d;  // the min (unsigned kinds); the second half's scale (Q6_K)
    if constexpr (!F::kSigned) m = min_at<F>(rec, b, static_cast<int>(r));
    if constexpr (F::kGroups == 2) d1 = scale_of<F>(rec, b, static_cast<int>(kCols + r));
    const uint8_t* c = rec + F::kHead + 4 * r;
    for (int t = 0; t < F::kChunks; ++t) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = c[32 * t + i];
        if constexpr (F::kSigned) {
          const float dt = t >= 4 ? d1 : d;
          out[4 * t + i] = static_cast<T>(static_cast<float>(static_cast<int8_t>(byte)) * dt);
        } else if constexpr (!F::kNibbles) {
          out[4 * t + i] = static_cast<T>(std::fma(static_cast<float>(byte), d, m));
        } else {
          out[4 * t + i] = static_cast<T>(std::fma(static_cast<float>(byte & 15), d, m));
          out[16 + 4 * t + i] = static_cast<T>(std::fma(static_cast<float>(byte >> 4), d, m));
        }
      }
    }
  }
}

// A group's K4S records as K4SWide ones (the same fp32 scales and mins, bit for bit).
inline void widen_k4s(const uint8_t* w, int64_t nb, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b, w += K4S::kRecord, out += K4SWide::kRecord) {
    float d[kCols], m[kCols];
    for (int r = 0; r < kCols; ++r) {
      d[r] = scale_of<K4S>(w, b, r);
      m[r] = min_at<K4S>(w, b, r);
    }
    std::memcpy(out, d, sizeof(d));
    std::memcpy(out + sizeof(d), m, sizeof(m));
    std::memcpy(out + K4SWide::kHead, w + K4S::kHead, K4S::kChunks * 32);
  }
}

// Rows [m_begin, M) of x against the group of 8 output rows at wg (its records stay in L1),
// kXRows at a time: y[m][n0 + c] for the group's outputs below N.
template <typename F, typename T>
inline void group_rows(const uint8_t* wg, int64_t nb, const QRow* rows, int64_t m_begin, int64_t M,
                       T* y, int64_t ldy, int64_t n0, int64_t N, const float* bias) {
  if constexpr (F::kSuper) {
    // more than one pass: K4S's scales (d sc, -dmin m) computed once for all of them, not in
    // every pass (AVX2 prefill ran 9-13% slower computing them each pass)
    if (M - m_begin > kXRows) {
      uint8_t* wide = tessera_tiles::thread_scratch<uint8_t, tessera_tiles::Scratch::kWideRecords>(
          nb * K4SWide::kRecord);
      widen_k4s(wg, nb, wide);
      group_rows<K4SWide>(wide, nb, rows, m_begin, M, y, ldy, n0, N, bias);
      return;
    }
  }
  float out[kXRows][kCols];
  const int64_t cols = std::min(kCols, N - n0);
  auto store = [&](int64_t m, int nrows) {
    for (int r = 0; r < nrows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        y[(m + r) * ldy + n0 + c] = static_cast<T>(bias ? out[r][c] + bias[n0 + c] : out[r][c]);
  };
  int64_t m = m_begin;
  for (; m + kXRows <= M; m += kXRows) {
    dot_group<F, kXRows>(wg, nb, rows + m, out);
    store(m, kXRows);
  }
  for (; m < M; ++m) {
    dot_group<F, 1>(wg, nb, rows + m, out);
    store(m, 1);
  }
}

// y[M, N] (row stride ldy) = x @ W^T (+ bias) for an interleaved kind: each group of 8 output
// rows meets every row of x (group_rows).
template <typename F, typename T>
void run_int8_groups(int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y, int64_t ldy,
                     const float* bias, const QRow* rows) {
  const int64_t nb = K / kQK, groups = (N + kCols - 1) / kCols, group_bytes = nb * F::kRecord;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      group_rows<F>(w + g * group_bytes, nb, rows, 0, M, y, ldy, g * kCols, N, bias);
  });
}

}  // namespace tessera_int8
