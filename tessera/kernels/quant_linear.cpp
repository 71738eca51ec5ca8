// Linear layers on GGUF-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x fp32 or bf16.
//
// Why: batch-1 decode is bound by the bytes of weight it streams. Q4_1 is 5 bits a weight against
// 16 for bf16, so the kernel streams the quantized blocks and dequantizes them in registers.
//
// fp32 activations: exact dequantization. The dequantized value of every weight is computed here
// exactly as gguf's reference does (q * d + m, where q * d is exact in fp32, so one fma rounds
// once, as its mul + add does). Those values are fed, in the same K order and with the same
// instructions, to the accumulators of the dense tiles in linear_tiles.h. So the result equals the
// dense kernel on gguf-dequantized weights bit for bit, whatever M is: a row does not depend on the
// rows batched with it, and --quantization gguf gives the tokens of --quantization none.
//
// bf16 activations: the block-sum form. A block's weights are q * d + m, so a row's dot product
// over the block is d * sum(x q) + m * sum(x). The codes themselves are exact bf16 numbers, so
// vdpbf16ps runs on x against the codes, with no dequantization per weight at all: 4-bit codes
// become the bf16 number 128 + q by OR-ing the nibble under the exponent bits of 128 (one shift
// and one ternary-logic op for 32 weights, against ten ops to dequantize, round and interleave
// them), and the 128 comes back out with m' = m - 128 d: d * sum(x (128 + q)) + m' * sum(x).
// One code path serves every M, so rows are independent as before. The products are exact and
// the weights are never rounded to bf16, so this is closer to the fp32 reference than the dense
// bf16 kernel on dequantized weights (which rounds every weight to bf16): the two no longer agree
// bit for bit. (On a CPU with AMX the bf16 path is run_amx, exact dequantization into AMX tiles.)
//
// Layout (packed once at load by quant_linear.py): panels of kPanel (48) output features, each a
// run of records, one per block of `kBlock` K-positions:
//
//   record = codes (4-bit: kBlock * 48 / 2 bytes; 8-bit: kBlock * 48 int8)
//            scales [48] (fp16 or fp32), mins [48] (4-bit formats only)
//
// so a panel streams as one contiguous pass, 16 outputs a vector, like the dense panels. The codes
// come in one of two orders (quant_linear.py, code_positions): "natural" for fp32 activations and
// AMX (one K position of 16 outputs per 16-byte load; 4-bit: low nibble k = 2j, high k = 2j + 1)
// and "pairs" for the block-sum form, in the lane order of vdpbf16ps's operand (code_pairs).
//
// Two ways through a panel for fp32, with the same result:
// - registers (few rows): each block is dequantized in registers and used by every row at once;
// - dense (many rows, prefill): the panel is dequantized once into an L2-resident fp32/bf16 dense
//   panel and the dense tiles run over it, at the dense matmul's rate.
// The row count where "dense" starts is chosen by measurement (quant_linear.py, benchmarks/linear.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <type_traits>
#include <utility>
#include <vector>

#include "linear_amx.h"
#include "linear_tiles.h"

namespace {

using namespace tessera_tiles;

// Kernel format ids, shared with quant_linear.py's QuantFormat.kernel_id.
enum FormatId : int64_t { kQ4Half = 0, kQ4Float = 1, kQ8Half = 2, kQ8Float16 = 3 };

template <int Bits, int Block, typename ScaleT, bool HasMin>
struct Fmt {
  static constexpr int kBits = Bits;
  static constexpr int kBlock = Block;
  static constexpr bool kHasMin = HasMin;
  using Scale = ScaleT;
  static constexpr int64_t kCodeBytes = (Bits == 4 ? Block / 2 : Block) * kPanel;
  static constexpr int64_t kScaleBytes = kPanel * static_cast<int64_t>(sizeof(ScaleT));
  static constexpr int64_t kRecord = kCodeBytes + kScaleBytes * (HasMin ? 2 : 1);
};
using Q4Half = Fmt<4, 32, at::Half, true>;     // Q4_0 (m = -8 d), Q4_1
using Q4Float = Fmt<4, 32, float, true>;       // Q4_K (d * sc, -dmin * m per 32)
using Q8Half = Fmt<8, 32, at::Half, false>;    // Q8_0
using Q8Float16 = Fmt<8, 16, float, false>;    // Q6_K (d * sc per 16, codes q - 32)

int64_t record_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ4Half: return Q4Half::kRecord;
    case kQ4Float: return Q4Float::kRecord;
    case kQ8Half: return Q8Half::kRecord;
    case kQ8Float16: return Q8Float16::kRecord;
  }
  TORCH_CHECK(false, "unknown quant format id ", fmt);
}

int64_t block_size(int64_t fmt) { return (fmt == kQ8Float16) ? 16 : 32; }

#if defined(__AVX512F__)

template <typename S>
inline __m512 load_scales(const uint8_t* p, int v) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + 16 * v);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + v));
  }
}

// The fp32 weights of K-positions 2j (w0) and 2j + 1 (w1) of a block, outputs 16v..16v+15.
template <typename F>
inline void dequant_pair(const uint8_t* rec, int j, int v, __m512 sc, __m512 mn, __m512& w0,
                         __m512& w1) {
  if constexpr (F::kBits == 4) {
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * kPanel + 16 * v)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    w0 = _mm512_fmadd_ps(lo, sc, mn);  // q * d is exact: one rounding, as gguf's q * d + m
    w1 = _mm512_fmadd_ps(hi, sc, mn);
  } else {
    const uint8_t* c = rec + 2 * j * kPanel + 16 * v;
    const __m512i b0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    const __m512i b1 =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kPanel)));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(b0), sc);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(b1), sc);
  }
}

template <typename F>
inline void block_scales(const uint8_t* rec, __m512* sc, __m512* mn) {
  const uint8_t* sp = rec + F::kCodeBytes;
  for (int v = 0; v < kVecs; ++v) {
    sc[v] = load_scales<typename F::Scale>(sp, v);
    mn[v] = F::kHasMin ? load_scales<typename F::Scale>(sp + F::kScaleBytes, v) : _mm512_setzero_ps();
  }
}

#ifndef TESSERA_QUANT_PREFETCH_BLOCKS
#define TESSERA_QUANT_PREFETCH_BLOCKS 8
#endif
// Records ahead of the one being dequantized that are pulled into L1. A record keeps its scales
// after its codes, so each block starts by reading 768 bytes ahead: the hardware's stream
// prefetcher does not run far enough ahead of that, and streaming from L3/DRAM ran at half the
// cache-hot rate (benchmarks/quant_linear.py).
constexpr int64_t kPrefetchBlocks = TESSERA_QUANT_PREFETCH_BLOCKS;

template <typename F>
inline void prefetch_ahead(const uint8_t* rec) {
  const uint8_t* ahead = rec + kPrefetchBlocks * F::kRecord;
  for (int64_t l = 0; l < F::kRecord; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
// (w0, w1) fp32 -> bf16 pairs per output lane: the operand layout of vdpbf16ps and of the dense
// bf16 panels ([K/2][kPanel][2]). Rounds to nearest even, as torch's fp32 -> bf16 cast.
inline __m512i bf16_pairs(__m512 w0, __m512 w1) {
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}
#endif  // __AVX512BF16__

// R rows of fp32 x, packed as linear_tiles.h pack_rows does ([K][R]), against one quantized panel
// (natural layout): each block is dequantized in registers and used by every row, with the
// accumulation of tile_f32 on the dequantized panel.
template <typename F, int R>
void qtile(const float* x, const uint8_t* panel, int64_t K, float* y, int64_t ldy, int64_t n_valid,
           const float* bias) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < K / F::kBlock; ++blk) {
    const uint8_t* rec = panel + blk * F::kRecord;
    prefetch_ahead<F>(rec);
    __m512 sc[kVecs], mn[kVecs];
    block_scales<F>(rec, sc, mn);
    for (int j = 0; j < F::kBlock / 2; ++j) {
      __m512 w0[kVecs], w1[kVecs];
      for (int v = 0; v < kVecs; ++v) dequant_pair<F>(rec, j, v, sc[v], mn[v], w0[v], w1[v]);
      const int64_t k = blk * F::kBlock + 2 * j;  // the K position of w0
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[k * R + r]);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, w0[v], acc[r][v]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[(k + 1) * R + r]);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, w1[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, acc[r], bias);
}

#if defined(__AVX512BF16__)
// body(std::integral_constant<int, J>{}) for J = 0..N-1: a code pair's index as a compile-time
// constant, so the 4-bit shift below is an immediate.
template <typename Body, int... J>
inline void unroll_impl(Body&& body, std::integer_sequence<int, J...>) {
  (body(std::integral_constant<int, J>{}), ...);
}
template <int N, typename Body>
inline void unroll(Body&& body) {
  unroll_impl(body, std::make_integer_sequence<int, N>{});
}

// The codes of K positions 2J, 2J + 1 of a block, outputs 16t..16t+15, as the bf16 operand of
// vdpbf16ps (one 32-bit lane an output, its two K positions side by side), from the pairs layout:
//   4-bit: 16-bit word 2L + p of the 64 bytes at (J / 4, t) (load_codes) holds, in nibble J % 4,
//          the code of K 2J + p, output 16t + L; it becomes the bf16 number 128 + q (0x4300 | q);
//   8-bit: bytes 32t.. of pair J hold lanes 2L + p in that order; int8 -> fp32 -> bf16 is exact.
template <typename F>
constexpr int kPairsPerLoad = F::kBits == 4 ? 4 : 1;  // 4-bit: one 64-byte load serves 4 pairs

// The 4-bit codes of pairs 4G..4G+3, outputs 16t..16t+15 (unused for 8-bit).
template <typename F, int G>
inline __m512i load_codes(const uint8_t* rec, int t) {
  if constexpr (F::kBits == 4) return _mm512_loadu_si512(rec + (G * kVecs + t) * 64);
  return _mm512_setzero_si512();
}

template <typename F, int J>
inline __m512bh code_pairs(const uint8_t* rec, __m512i z, int t) {
  if constexpr (F::kBits == 4) {
    if constexpr (J % 4 != 0) z = _mm512_srli_epi16(z, 4 * (J % 4));
    // (z & 0x000F) | 0x4300 per 16-bit word
    return (__m512bh)_mm512_ternarylogic_epi32(z, _mm512_set1_epi16(0x000F),
                                               _mm512_set1_epi16(0x4300), 0xEA);
  } else {
    const __m128i* c = reinterpret_cast<const __m128i*>(rec + J * 2 * kPanel + 32 * t);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1)));
    return _mm512_cvtne2ps_pbh(b, a);
  }
}

// R rows of bf16 x (pack_rows: [K/2][R] pairs) against one panel in the block-sum form (see the
// header). `xsum` [R][K / kBlock]: each row's fp32 sum over each block (4-bit formats only).
template <typename F, int R>
void qtile_blocksum(const at::BFloat16* x, const float* xsum, const uint8_t* panel, int64_t K,
                    at::BFloat16* y, int64_t ldy, int64_t n_valid, const float* bias) {
  static_assert(F::kBits == 8 || F::kHasMin, "the 4-bit form takes the 128 back out with the min");
  const int64_t nb = K / F::kBlock;
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);
  __m512 total[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) total[r][v] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = panel + blk * F::kRecord;
    prefetch_ahead<F>(rec);
    __m512 acc[R][kVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
    const int32_t* xb = xpairs + blk * (F::kBlock / 2) * R;
    constexpr int kLoads = F::kBlock / 2 / kPairsPerLoad<F>;
    unroll<kLoads>([&](auto g) {
      __m512i z[kVecs];
      for (int v = 0; v < kVecs; ++v) z[v] = load_codes<F, g>(rec, v);
      unroll<kPairsPerLoad<F>>([&](auto s) {
        constexpr int j = decltype(g)::value * kPairsPerLoad<F> + decltype(s)::value;
        __m512bh w[kVecs];
        for (int v = 0; v < kVecs; ++v) w[v] = code_pairs<F, j>(rec, z[v], v);
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(xb[j * R + r]);
          for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, w[v]);
        }
      });
    });
    const uint8_t* sp = rec + F::kCodeBytes;
    for (int v = 0; v < kVecs; ++v) {
      const __m512 d = load_scales<typename F::Scale>(sp, v);
      for (int r = 0; r < R; ++r) total[r][v] = _mm512_fmadd_ps(acc[r][v], d, total[r][v]);
      if constexpr (F::kBits == 4) {
        const __m512 m = load_scales<typename F::Scale>(sp + F::kScaleBytes, v);
        const __m512 m128 = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, m);  // m - 128 d
        for (int r = 0; r < R; ++r)
          total[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * nb + blk]), m128, total[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, total[r], bias);
}

// A bf16 row's fp32 sum over each block of kBlock (32) K positions: the sum(x) of the block-sum
// form, in one fixed order (two 16-lane halves added, then reduced), whatever the batch.
template <typename F>
inline void block_sums(const at::BFloat16* row, int64_t nb, float* out) {
  static_assert(F::kBlock == 32, "4-bit blocks are 32 wide");
  const auto widen = [](const at::BFloat16* p) {  // 16 bf16 -> fp32: the bits, shifted up
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  for (int64_t b = 0; b < nb; ++b)
    out[b] = _mm512_reduce_add_ps(_mm512_add_ps(widen(row + 32 * b), widen(row + 32 * b + 16)));
}

template <typename F>
struct BlockSumTile {
  template <int R>
  static constexpr auto fn = qtile_blocksum<F, R>;
};

// bf16 x [M, K] against every panel (pairs layout), in the block-sum form: one way for every M.
// Measured against exact dequantization (registers below 16 rows, dense panels above), 30 layers
// of the default model's Q4_1 shapes (benchmarks/quant_linear.py): 0.62x the time at M = 1, 0.67x
// at 8, 0.72x at 16, 0.87x at 64, the same at 512.
template <typename F>
void run_blocksum(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
                  int64_t num_panels, int64_t N, at::BFloat16* y, int64_t ldy, const float* bias) {
  using Fn = void (*)(const at::BFloat16*, const float*, const uint8_t*, int64_t, at::BFloat16*,
                      int64_t, int64_t, const float*);
  static const auto tiles = make_tiles<Fn, BlockSumTile<F>>();
  const int64_t nb = K / F::kBlock;
  std::vector<at::BFloat16> xp(M * K);
  std::vector<float> xsum(F::kBits == 4 ? M * nb : 0);  // [M][nb]: each row's sum over each block
  // Packing and block sums go row tile by row tile, split over the threads from two tiles up.
  // As one thread's scalar loop they cost 2-11% of the call at M = 8-512 (alternated in-process
  // against it: 0.94x at M = 8, 0.93x at 16, 0.89x at 64, 0.92x at 512).
  const int64_t num_tiles = (M + kMaxRows - 1) / kMaxRows;
  const auto prepare = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * kMaxRows, rows = std::min<int64_t>(kMaxRows, M - m0);
      pack_rows<at::BFloat16, 2>(x + m0 * ldx, ldx, rows, K, xp.data() + m0 * K);
      if constexpr (F::kBits == 4)
        for (int64_t m = m0; m < m0 + rows; ++m) block_sums<F>(x + m * ldx, nb, xsum.data() + m * nb);
    }
  };
  if (num_tiles < 2) prepare(0, num_tiles);
  else at::parallel_for(0, num_tiles, 1, prepare);
  const int64_t rows_per_block = std::min(M, kRowsPerBlock);
  const int64_t num_row_blocks = (M + rows_per_block - 1) / rows_per_block;
  at::parallel_for(0, num_row_blocks * num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {  // panel-major: a panel's row blocks run back to back
      const int64_t p = u / num_row_blocks, m0 = (u % num_row_blocks) * rows_per_block;
      const int64_t rows = std::min(rows_per_block, M - m0), n0 = p * kPanel;
      const uint8_t* panel = packed + p * nb * F::kRecord;
      for (int64_t m = m0; m < m0 + rows; m += kMaxRows) {
        const int64_t r = std::min<int64_t>(kMaxRows, m0 + rows - m);
        tiles[r](xp.data() + m * K, xsum.empty() ? nullptr : xsum.data() + m * nb, panel, K,
                 y + m * ldy + n0, ldy, N - n0, bias ? bias + n0 : nullptr);
      }
    }
  });
}
#endif  // __AVX512BF16__

// Blocks [b0, b1) of a panel dequantized into the dense panel layout of T (fp32 [k][kPanel],
// bf16 [k/2][kPanel][2]): the weights the register tiles compute with, so the dense tiles over
// this buffer give the same sums.
template <typename F, typename T>
void dequant_panel(const uint8_t* panel, int64_t b0, int64_t b1, T* out) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* rec = panel + blk * F::kRecord;
    prefetch_ahead<F>(rec);
    __m512 sc[kVecs], mn[kVecs];
    block_scales<F>(rec, sc, mn);
    for (int j = 0; j < F::kBlock / 2; ++j) {
      T* o = out + ((blk - b0) * F::kBlock + 2 * j) * kPanel;  // K position 2j, either layout
      for (int v = 0; v < kVecs; ++v) {
        __m512 w0, w1;
        dequant_pair<F>(rec, j, v, sc[v], mn[v], w0, w1);
        if constexpr (std::is_same_v<T, float>) {
          _mm512_storeu_ps(o + 16 * v, w0);
          _mm512_storeu_ps(o + kPanel + 16 * v, w1);
        } else {
#if defined(__AVX512BF16__)
          _mm512_storeu_si512(o + 32 * v, bf16_pairs(w0, w1));
#endif
        }
      }
    }
  }
}

template <typename F>
struct QTile {
  template <int R>
  static constexpr auto fn = qtile<F, R>;
};

#if defined(TESSERA_HAVE_AMX)
// bf16 activations on AMX (linear_amx.h), for every M, as the dense kernel's AMX path does (so
// the two agree bit for bit). One row group (decode, M <= 16): each K step's block is dequantized
// into a 3 KB buffer just before its tiles load it, so the quantized bytes are the only stream
// from memory. More rows: each panel is dequantized once per thread into a dense bf16 panel in
// L2, and every row group runs over it.
template <typename F>
void run_amx(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
             int64_t num_panels, int64_t N, at::BFloat16* y, int64_t ldy, const float* bias) {
  std::vector<at::BFloat16> xa_store(round_up(M, kAmxRows) * K + kAlignElems);
  at::BFloat16* const xa = align64(xa_store.data());
  amx_pack_rows(x, ldx, M, K, xa);
  const int64_t rows_per_block = std::min(M, kRowsPerBlock);
  const int64_t num_row_blocks = (M + rows_per_block - 1) / rows_per_block;
  const int64_t panel_bytes = (K / F::kBlock) * F::kRecord;
  at::parallel_for(0, num_row_blocks * num_panels, 1, [&](int64_t begin, int64_t end) {
    amx_configure(M);
    if (M <= kAmxRows && K % kAmxK == 0) {
      alignas(64) at::BFloat16 step[kAmxStepElems];
      for (int64_t p = begin; p < end; ++p) {
        const uint8_t* panel = packed + p * panel_bytes;
        const auto dequant_step = [&](int64_t k0) -> const at::BFloat16* {
          dequant_panel<F>(panel, k0 / F::kBlock, (k0 + kAmxK) / F::kBlock, step);
          return step;
        };
        const int64_t n0 = p * kPanel;
        amx_rows_against_panel(xa, M, step, K, y + n0, ldy, N - n0,
                               bias ? bias + n0 : nullptr, dequant_step);
      }
      _tile_release();
      return;
    }
    thread_local std::vector<at::BFloat16> buf_store;
    if (static_cast<int64_t>(buf_store.size()) < K * kPanel + kAlignElems)
      buf_store.resize(K * kPanel + kAlignElems);
    at::BFloat16* const buf = align64(buf_store.data());
    int64_t buf_panel = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = u / num_row_blocks, rb = u % num_row_blocks;
      const int64_t m0 = rb * rows_per_block;
      const int64_t n0 = p * kPanel;
      if (buf_panel != p) {
        dequant_panel<F>(packed + p * panel_bytes, 0, K / F::kBlock, buf);
        buf_panel = p;
      }
      amx_rows_against_panel(xa + m0 * K, std::min(rows_per_block, M - m0), buf, K,
                             y + m0 * ldy + n0, ldy, N - n0, bias ? bias + n0 : nullptr);
    }
    _tile_release();
  });
}
#endif

// fp32 x against every panel (natural layout); see the header for the two ways through a panel.
template <typename F>
void run_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
             int64_t num_panels, int64_t N, float* y, int64_t ldy, const float* bias,
             int64_t dense_min_rows) {
  using T = float;
  using Fn = void (*)(const T*, const uint8_t*, int64_t, T*, int64_t, int64_t, const float*);
  using DenseFn = void (*)(const T*, const T*, int64_t, const Span&, T*, int64_t, int64_t,
                           const float*, const T*);
  static const auto qtiles = make_tiles<Fn, QTile<F>>();
  static const auto dense_tiles = make_tiles<DenseFn, F32Tile>();
  std::vector<T> xp_store;
  const T* xp = x;
  if (M > 1 || ldx != K) {  // M == 1 with a contiguous row is already in the packed layout
    xp_store.resize(M * K);
    pack_rows<T, 1>(x, ldx, M, K, xp_store.data());
    xp = xp_store.data();
  }
  const bool dense = dense_min_rows > 0 && M >= dense_min_rows;
  const int64_t rows_per_block = std::min(M, kRowsPerBlock);
  const int64_t num_row_blocks = (M + rows_per_block - 1) / rows_per_block;
  const int64_t units = num_row_blocks * num_panels;
  // Dense way, one row block: each K slice of the panel is dequantized into L1 once and every row
  // tile runs over it. Several row blocks (prefill): the whole panel is dequantized once per thread
  // into an L2 buffer and each row block runs over that.
  const bool whole_panel = dense && num_row_blocks > 1;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<T> buf;
    const int64_t buf_elems = whole_panel ? K * kPanel : kSliceK * kPanel;
    if (dense && static_cast<int64_t>(buf.size()) < buf_elems) buf.resize(buf_elems);
    int64_t buf_panel = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = u / num_row_blocks, rb = u % num_row_blocks;
      const int64_t m0 = rb * rows_per_block;
      const int64_t rows = std::min(rows_per_block, M - m0);
      const int64_t n0 = p * kPanel;
      const uint8_t* panel = packed + p * (K / F::kBlock) * F::kRecord;
      T* y0 = y + m0 * ldy + n0;
      const float* b0 = bias ? bias + n0 : nullptr;
      if (!dense) {
        for (int64_t m = 0; m < rows; m += kMaxRows) {
          const int64_t r = std::min<int64_t>(kMaxRows, rows - m);
          qtiles[r](xp + (m0 + m) * K, panel, K, y0 + m * ldy, ldy, N - n0, b0);
        }
        continue;
      }
      if (whole_panel) {
        if (buf_panel != p) {  // units are panel-major: a thread dequantizes each panel once
          dequant_panel<F>(panel, 0, K / F::kBlock, buf.data());
          buf_panel = p;
        }
        rows_against_panel(xp + m0 * K, rows, buf.data(), K, y0, ldy, N - n0, b0,
                           dense_tiles.data());
        continue;
      }
      float* partial = partial_sums(rows);
      for (int64_t k0 = 0; k0 < K; k0 += kSliceK) {
        const int64_t k1 = std::min(K, k0 + kSliceK);
        dequant_panel<F>(panel, k0 / F::kBlock, k1 / F::kBlock, buf.data());
        rows_against_slice(xp + m0 * K, rows, K, k0, k1, buf.data(), partial, y0, ldy, N - n0,
                           b0, dense_tiles.data(), static_cast<const T*>(nullptr));
      }
    }
  });
}

// x [M, K] against every panel: bf16 in the block-sum form (or AMX), fp32 one of the two ways.
template <typename F, typename T>
void run(const T* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed, int64_t num_panels,
         int64_t N, T* y, int64_t ldy, const float* bias, int64_t dense_min_rows) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(TESSERA_HAVE_AMX)
    if (amx_ready()) return run_amx<F>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias);
#endif
#if defined(__AVX512BF16__)
    return run_blocksum<F>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias);
#endif
  } else {
    run_f32<F>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias, dense_min_rows);
  }
}


template <typename T>
void dispatch(int64_t fmt, const T* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
              int64_t num_panels, int64_t N, T* y, int64_t ldy, const float* bias,
              int64_t dense_min_rows) {
  switch (fmt) {
    case kQ4Half: return run<Q4Half, T>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias, dense_min_rows);
    case kQ4Float: return run<Q4Float, T>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias, dense_min_rows);
    case kQ8Half: return run<Q8Half, T>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias, dense_min_rows);
    case kQ8Float16: return run<Q8Float16, T>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias, dense_min_rows);
  }
  TORCH_CHECK(false, "unknown quant format id ", fmt);
}

#endif  // __AVX512F__

}  // namespace

// Which activation dtypes this build serves ("float32", "bfloat16"); empty without AVX-512.
std::vector<std::string> supported_dtypes() {
  std::vector<std::string> out;
#if defined(__AVX512F__)
  out.push_back("float32");
#if defined(__AVX512BF16__)
  out.push_back("bfloat16");
#endif
#endif
  return out;
}

int64_t packed_record_bytes(int64_t fmt) { return record_bytes(fmt); }

// Whether bf16 activations read weights packed in the pairs layout (the block-sum form): yes,
// unless this CPU runs them on AMX tiles (natural layout, exact dequantization).
bool bf16_reads_pairs() {
#if defined(__AVX512F__) && defined(TESSERA_HAVE_AMX)
  return !amx_ready();
#else
  return true;
#endif
}

// y (an [M, N] view with a contiguous last dim, e.g. a column slice of a fused output) =
// x [M, K] @ W^T (+ bias). `packed` holds ceil(N / 48) panels of format `fmt`; `bias` is float32
// padded to the panel width. Rows >= dense_min_rows (when > 0) take the dense-panel way.
void quant_linear_out(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N,
                      c10::optional<torch::Tensor> bias, torch::Tensor y, int64_t dense_min_rows) {
#if defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with a contiguous last dim");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) && y.size(1) == N,
              "y must be [M, N] with a contiguous last dim");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "x and y dtypes differ");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be uint8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % block_size(fmt) == 0, "K (", K, ") is not a multiple of the block size");
  const int64_t num_panels = round_up(N, kPanel) / kPanel;
  TORCH_CHECK(packed.numel() == num_panels * (K / block_size(fmt)) * record_bytes(fmt),
              "packed weight does not match N, K and the format");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == num_panels * kPanel,
                "bias must be float32, padded to the panel width");
    b = bias->data_ptr<float>();
  }
  if (M == 0) return;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == torch::kFloat32) {
    dispatch<float>(fmt, x.data_ptr<float>(), x.stride(0), M, K, w, num_panels, N,
                    y.data_ptr<float>(), y.stride(0), b, dense_min_rows);
    return;
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    dispatch<at::BFloat16>(fmt, x.data_ptr<at::BFloat16>(), x.stride(0), M, K, w, num_panels, N,
                           y.data_ptr<at::BFloat16>(), y.stride(0), b, dense_min_rows);
    return;
  }
#endif
#endif
  TORCH_CHECK(false, "quant linear kernel: unsupported dtype or CPU");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported_dtypes", &supported_dtypes, "activation dtypes this build serves");
  m.def("packed_record_bytes", &packed_record_bytes, "bytes of one block record of a panel");
  m.def("bf16_reads_pairs", &bf16_reads_pairs, "bf16 activations read the pairs code layout");
  m.def("quant_linear_out", &quant_linear_out, "y = x @ W^T (+ bias) on packed GGUF blocks");
}
