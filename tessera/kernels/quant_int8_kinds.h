// The integer path's record kinds (`--quantization gguf_int8`, quant_int8.h): their layout,
// scales and mins, and the Q8 blocks each row of x is quantized to.
//
//   kind   record of one row (bytes)               GGUF types        value of code q   rows a group
//   Q4H    f16 d, 16 B nibbles (18)                Q4_0                   d q - 8 d     8
//   U4H    f16 d, f16 m, 16 B nibbles (20)         Q4_1                   d q + m       8
//   K4S    u8 sc, u8 m, 16 B nibbles (18.5: d, dmin Q4_K            d sc q - dmin m   8
//          f16 per 256 spread over 8 records)
//   K5S    K4S and 4 B of 5th bits (22.5)          Q5_K            d sc q - dmin m   8
//   U8F    f32 d, f32 m, 32 B codes 0..31 (40)     Q5_1                   d q + m       8
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
// its scales are those fp32 ones bit for bit. K5S (Q5_K, 5.625 bits a weight where codes a byte
// took 10) is K4S with a 32-byte plane of the codes' 5th bits after the factors: byte p, bit t is
// the 5th bit of chunk t's byte p.
//   unsigned kinds: sum += d dx <q, qx> + m dx sum(qx)      (q 0..31: no int16 saturation)
//   signed kinds:   sum += dx sum_g d_g <q, qx>_g            (|q| <= 127 via the sign trick)
#pragma once

#include <torch/extension.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#define TESSERA_INT8_AVX2 1
#endif

namespace tessera_int8 {

enum Kind : int64_t {
  kU4H = 10, kK4SWide = 11, kU8F = 12, kS8H = 13, kS8F2 = 14, kQ4H = 15, kK4S = 16, kK5S = 17
};
constexpr int64_t kQK = 32;  // K positions a block

// The kinds: kCols output rows a record. Unsigned codes with a min (d[8], m[8], then 4 chunks of
// nibbles, or 8 chunks of bytes 0..31; Q4H: d[8] only, m = -8 d), or signed 8-bit codes (d[8]
// and, with two groups, d1[8]; 8 chunks of int8); chunk t, byte 4 r + i is row r's code byte
// 4 t + i.
constexpr int64_t kCols = 8;
template <Kind Id, typename S, bool Signed, bool Nibbles, bool OffsetMin = false, int Groups = 1,
          bool Super = false, bool HighBits = false>
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
  // K4S, K5S: 6-bit scales and mins (S = uint8_t) times their super-block's f16 d and dmin,
  // which take kSuperBytes of each of its kSuperBlocks records, after the mins
  static constexpr bool kSuper = Super;
  static constexpr int kSuperBlocks = 8;
  static constexpr int64_t kSuperBytes = Super ? 4 : 0;
  // K5S: the nibbles' 5th bits, a 32-byte plane after the factors (byte p, bit t: chunk t's)
  static constexpr bool kHighBits = HighBits;
  static constexpr int64_t kHighBytes = HighBits ? 32 : 0;
  static constexpr int64_t kHighOffset = (OffsetMin ? 1 : 2) * kCols * sizeof(S) + kSuperBytes;
  static constexpr bool kFourBit = Nibbles && !HighBits;  // codes 0..15 (else 0..31 or int8)
  static constexpr int kChunks = Nibbles ? 4 : 8;  // 32-byte loads of codes a block
  static constexpr int64_t kHead =
      (Signed ? Groups : OffsetMin ? 1 : 2) * kCols * sizeof(S) + kSuperBytes + kHighBytes;
  static constexpr int64_t kRecord = kHead + kChunks * 32;  // a group's block
};
using Q4H = XFmt<kQ4H, c10::Half, false, true, true>;
using U4H = XFmt<kU4H, c10::Half, false, true>;
using K4S = XFmt<kK4S, uint8_t, false, true, false, 1, true>;
// K4S with its scales expanded to fp32 d and m a block (group_rows, for many rows of x): never
// packed, so not a kind with_kind knows
using K4SWide = XFmt<kK4SWide, float, false, true>;
using U8F = XFmt<kU8F, float, false, false>;
using K5S = XFmt<kK5S, uint8_t, false, true, false, 1, true, true>;
using S8H = XFmt<kS8H, c10::Half, true, false>;
using S8F2 = XFmt<kS8F2, float, true, false, false, 2>;

template <typename Fn>
decltype(auto) with_kind(int64_t kind, Fn&& fn) {
  switch (kind) {
    case kQ4H: return fn(Q4H{});
    case kU4H: return fn(U4H{});
    case kK4S: return fn(K4S{});
    case kU8F: return fn(U8F{});
    case kK5S: return fn(K5S{});
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

// K positions a row's K must be a multiple of: a block, or K4S's and K5S's super-block of 8.
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

// K4S, K5S: row r's super-block factor (`which` 0: d, 1: dmin) for the record rec of block b.
template <typename F>
inline float super_at(const uint8_t* rec, int64_t b, int which, int r) {
  const uint8_t* first = rec - (b % F::kSuperBlocks) * F::kRecord;
  return scale_at<c10::Half>(first + (4 * which + r / 2) * F::kRecord + 2 * kCols, r % 2);
}

// Scale i of an interleaved record rec of block b (i < kCols: row i's d; else the second
// half's, S8F2): stored, or d sc (K4S, K5S).
template <typename F>
inline float scale_of(const uint8_t* rec, int64_t b, int i) {
  if constexpr (F::kSuper) {
    return super_at<F>(rec, b, 0, i) * static_cast<float>(rec[i]);
  } else {
    return scale_at<typename F::Scale>(rec, i);
  }
}

// The min of row r of an interleaved record of an unsigned kind: stored, -8 d (Q4H), or
// -(dmin m) (K4S, K5S).
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

// The code at K position 4 t + i of row r (p = 4 r + i) of a group's block record rec: 0..15,
// 0..31 or int8.
template <typename F>
inline int code_at(const uint8_t* rec, int t, int p) {
  const uint8_t* c = rec + F::kHead;
  int v;
  if constexpr (!F::kNibbles) {
    v = F::kSigned ? static_cast<int>(static_cast<int8_t>(c[32 * t + p])) : c[32 * t + p];
  } else {
    v = t < 4 ? (c[32 * t + p] & 15) : (c[32 * (t - 4) + p] >> 4);
  }
  if constexpr (F::kHighBits) v |= ((rec[F::kHighOffset + p] >> t) & 1) << 4;
  return v;
}

// One row of x quantized: per block of 32, int8 codes, the scale dx, and the codes' sum. With a
// second plane (`lo` not null) the row is held to 16 bits: lo is the residual x - dx q in units
// of dx / kLoScale, the block's value is (dx / kLoScale) (kLoScale q + lo), d holds dx / kLoScale
// and sum the sum of kLoScale q + lo. The kernels take kLoScale <w, q> + <w, lo> as the block's
// integer sum (exact in int32: at most 32 x 127 x 127 x 254 < 2^31) and the rest is unchanged.
struct QRow {
  int8_t* q;     // [K]
  int8_t* lo;    // [K] or null (one plane)
  float* d;      // [K / 32]
  // [K / 32] d times the block's code sum (kLoScale q + lo with the residual plane): the factor
  // of the unsigned kinds' min term, formed once a row and block, not once an output group
  float* dsum;
};

// The residual plane's weight: its codes lie in [-127, 127] (|x - dx q| <= dx / 2), so the sign
// trick of the signed kinds and vpmaddubsw's int16 pairs hold for them as for q.
constexpr int32_t kLoScale = 254;

// One block of a row (llama.cpp's Q8_0/Q8_K rule: dx = max|x| / 127, q = round(x / dx), ties
// to even; with lo, the residual plane too): codes into q (and lo), and its dx and dsum (QRow).
// Plain C++ (the portable build); the vector version below gives the same bits, and
// tests/kernels/test_quant_int8_kernel.py checks each build's codes against the rule in torch.
inline void quantize_block_scalar(const float* v, int8_t* q, int8_t* lo, float* dx, float* dsum) {
  float amax = 0.f;
  for (int64_t i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  const float lo_id = id * static_cast<float>(kLoScale);
  int32_t s = 0, s_lo = 0;
  for (int64_t i = 0; i < kQK; ++i) {
    const int c = static_cast<int>(std::nearbyint(v[i] * id));
    q[i] = static_cast<int8_t>(c);
    s += c;
    if (lo) {
      const float rest = std::fma(-d, static_cast<float>(c), v[i]);  // one rounding on every ISA
      const int l = std::clamp(static_cast<int>(std::nearbyint(rest * lo_id)), -127, 127);
      lo[i] = static_cast<int8_t>(l);
      s_lo += l;
    }
  }
  *dx = lo ? d / static_cast<float>(kLoScale) : d;
  *dsum = *dx * static_cast<float>(lo ? kLoScale * s + s_lo : s);
}

#if defined(TESSERA_INT8_AVX2)
// The same block in 8-lane vectors: every step is an IEEE operation of the scalar code (max of
// |x|, products, fma, round to nearest even by the default MXCSR, integer sums), so the codes and
// factors are the scalar ones bit for bit. The scalar loop was ~15% of a prefill's linears.
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// four vectors of 8 int32 (each within int8) -> 32 bytes in order
inline void store_codes(const __m256i* c, int8_t* out) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(b, order));
}

inline void quantize_block(const float* v, int8_t* q, int8_t* lo, float* dx, float* dsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4];
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm256_loadu_ps(v + 8 * j);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, x[j]), m);  // a NaN lane keeps m, as std::max
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i c[4], s = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], vid));
    s = _mm256_add_epi32(s, c[j]);
  }
  store_codes(c, q);
  int32_t total = hsum8_epi32(s);
  if (lo) {
    const __m256 vd = _mm256_set1_ps(d), vlo = _mm256_set1_ps(id * static_cast<float>(kLoScale));
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    __m256i l[4], sl = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256 rest = _mm256_fnmadd_ps(vd, _mm256_cvtepi32_ps(c[j]), x[j]);
      l[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(rest, vlo)), top),
                              bottom);
      sl = _mm256_add_epi32(sl, l[j]);
    }
    store_codes(l, lo);
    total = kLoScale * total + hsum8_epi32(sl);
  }
  *dx = lo ? d / static_cast<float>(kLoScale) : d;
  *dsum = *dx * static_cast<float>(total);
}
#else
inline void quantize_block(const float* v, int8_t* q, int8_t* lo, float* dx, float* dsum) {
  quantize_block_scalar(v, q, lo, dx, dsum);
}
#endif

// A row's Q8 blocks, and its residual plane when r.lo is set: the same codes on every ISA, O(K)
// against the product's O(N K).
template <typename T>
void quantize_row(const T* x, int64_t K, QRow r) {
  float v[kQK];
  for (int64_t b = 0; b < K / kQK; ++b) {
    const float* block = nullptr;
    if constexpr (std::is_same<T, float>::value) {
      block = x + b * kQK;
    } else {
      for (int64_t i = 0; i < kQK; ++i) v[i] = static_cast<float>(x[b * kQK + i]);
      block = v;
    }
    quantize_block(block, r.q + b * kQK, r.lo ? r.lo + b * kQK : nullptr, r.d + b, r.dsum + b);
  }
}

}  // namespace tessera_int8
