// The integer path's group loop on AVX2 and AVX-512 VNNI (256-bit vectors): the exact
// integer sums of a block for the 8 rows of a group at once, then the scales as vectors.
#pragma once

#include <type_traits>

#include "prefetch.h"
#include "quant_int8_kinds.h"

#if defined(TESSERA_INT8_AVX2)

namespace tessera_int8 {

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

// K4S, K5S: the super-block's d[8] and dmin[8], 4 bytes of them in each of its records from
// `first`.
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
// the block record at w. K4S, K5S: d sc and -(dmin m), given its super-block's d and dmin.
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

// K5S: bit t of each byte of the 5th-bit plane at p becomes bit 4 of chunk t's codes.
inline void add_high_bits(const uint8_t* p, __m256i* codes) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i bit4 = _mm256_set1_epi8(16);
  // 16-bit shifts: what crosses into a neighbouring byte lands off bit 4, masked away
  codes[0] = _mm256_or_si256(codes[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
  codes[1] = _mm256_or_si256(codes[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
  codes[2] = _mm256_or_si256(codes[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), bit4));
  codes[3] = _mm256_or_si256(codes[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), bit4));
  codes[4] = _mm256_or_si256(codes[4], _mm256_and_si256(h, bit4));
  codes[5] = _mm256_or_si256(codes[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), bit4));
  codes[6] = _mm256_or_si256(codes[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), bit4));
  codes[7] = _mm256_or_si256(codes[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), bit4));
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
//
// `weight` multiplies the sums (AVX2: in the int16 -> int32 widening vpmaddwd, for free; the
// VNNI build, which has no such step, takes 1 only).
template <typename F, int J0 = 0, int J1 = 8>
inline __m256i block_sums8(const __m256i* codes, const int8_t* qx, int16_t weight = 1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  (void)weight;
  // two chains (even and odd chunks), added at the end: the integer sums are exact, so the
  // result is the same, and a block's dependent vpdpbusd halve
  __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int j = J0; j < J1; ++j) {
    const __m256i x = broadcast4(qx + 4 * j);
    if constexpr (F::kSigned) {
      s[j & 1] = _mm256_dpbusd_epi32(s[j & 1], _mm256_sign_epi8(codes[j], codes[j]),
                                     _mm256_sign_epi8(x, codes[j]));
    } else {
      s[j & 1] = _mm256_dpbusd_epi32(s[j & 1], codes[j], x);
    }
  }
  return _mm256_add_epi32(s[0], s[1]);
#else
  const __m256i widen = _mm256_set1_epi16(weight);  // vpmaddwd: int16 pairs summed, x weight
  if constexpr (F::kSigned) {  // pairs up to 2 * 128 * 127: widened to int32 every step
    __m256i s = _mm256_setzero_si256();
    for (int j = J0; j < J1; ++j) {
      const __m256i x = broadcast4(qx + 4 * j);
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(codes[j], codes[j]),
                                             _mm256_sign_epi8(x, codes[j]));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, widen));
    }
    return s;
  } else if constexpr (F::kFourBit) {
    static_assert(J0 == 0 && J1 == 8, "4-bit kinds sum whole blocks");
    // int16 pairs: |15 * 127 * 2| * 8 products summed = 30480 < 32767, no saturation
    __m256i s16 = _mm256_maddubs_epi16(codes[0], broadcast4(qx));
    for (int j = 1; j < 8; ++j)
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(codes[j], broadcast4(qx + 4 * j)));
    return _mm256_madd_epi16(s16, widen);
  } else {
    // codes 0..31: int16 pairs up to 31 * 127 * 2 = 7874, so four of them at most (31496)
    static_assert(J0 == 0 && J1 == 8, "5-bit kinds sum whole blocks");
    __m256i s = _mm256_setzero_si256();
    for (int h = 0; h < 8; h += 4) {
      __m256i s16 = _mm256_maddubs_epi16(codes[h], broadcast4(qx + 4 * h));
      for (int j = h + 1; j < h + 4; ++j)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(codes[j], broadcast4(qx + 4 * j)));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, widen));
    }
    return s;
  }
#endif
}

// block_sums8 for one row of x: with its residual plane lo (QRow), kLoScale <codes, qx> +
// <codes, lo>.
template <typename F, int J0 = 0, int J1 = 8>
inline __m256i row_sums8(const __m256i* codes, const int8_t* qx, const int8_t* lo) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  const __m256i s = block_sums8<F, J0, J1>(codes, qx);
  if (!lo) return s;
  return _mm256_add_epi32(_mm256_mullo_epi32(s, _mm256_set1_epi32(kLoScale)),
                          block_sums8<F, J0, J1>(codes, lo));
#else
  // kLoScale in the widening vpmaddwd instead of a vpmulld after it: the same exact sums, one
  // instruction fewer a block and row (the 1B Llama's batch-1 linears, AVX2 path: 0.99x the time)
  if (!lo) return block_sums8<F, J0, J1>(codes, qx);
  return _mm256_add_epi32(block_sums8<F, J0, J1>(codes, qx, kLoScale),
                          block_sums8<F, J0, J1>(codes, lo));
#endif
}

// The 8 chunks of codes of the group's block record at w: codes[j] holds K positions 4 j .. 4 j + 3
// of each of the 8 rows (one row a 32-bit lane), as block_sums8 takes them.
template <typename F>
inline void load_codes8(const uint8_t* w, __m256i* codes) {
  const __m256i low = _mm256_set1_epi8(15);
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
  if constexpr (F::kHighBits) add_high_bits(w + F::kHighOffset, codes);
}

// out[r][c] = <row c of the group at w, x row r> for R rows of quantized x (AVX2 / VNNI).
template <typename F, int R>
inline void dot_group(const uint8_t* w, int64_t nb, const QRow* xr, float (*out)[kCols]) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
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
    load_codes8<F>(w, codes);
    for (int r = 0; r < R; ++r) {
      const int8_t* qx = xr[r].q + b * kQK;
      const int8_t* lo = xr[r].lo ? xr[r].lo + b * kQK : nullptr;
      const float dx = xr[r].d[b];
      if constexpr (F::kGroups == 2) {  // Q6_K: a sum and a scale a half of 16
        const __m256i s0 = row_sums8<F, 0, 4>(codes, qx, lo);
        const __m256i s1 = row_sums8<F, 4, 8>(codes, qx, lo);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(e, _mm256_set1_ps(dx)), acc[r]);
        continue;
      }
      const __m256i s = row_sums8<F>(codes, qx, lo);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
      if constexpr (!F::kSigned) {
        acc[r] = _mm256_fmadd_ps(e, _mm256_set1_ps(xr[r].dsum[b]), acc[r]);
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

}  // namespace tessera_int8

#endif
