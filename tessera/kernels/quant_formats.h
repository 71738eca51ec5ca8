// GGUF block formats as the quantized kernels (quant_linear.cpp, quant_blocksum.h) pack them.
//
// Layout (packed once at load by quant_layout.py): panels of kPanel (48) output features, each a
// run of records, one per block of `kBlock` K-positions:
//
//   record = codes (4-bit: kBlock * 48 / 2 bytes; 8-bit: kBlock * 48 int8)
//            scales [48] (fp16 or fp32), mins [48] (the formats with a min)
//
// so a panel streams as one contiguous pass, 16 outputs a vector, like the dense panels. The codes
// come in one of two orders (quant_layout.py, code_positions): "natural" for fp32 activations and
// AMX (one K position of 16 outputs per 16-byte load; 4-bit: low nibble k = 2j, high k = 2j + 1)
// and "pairs" for the block-sum form, in the lane order of vdpbf16ps's operand (code_pairs).
#pragma once

#include <torch/extension.h>

#include <type_traits>

#include "linear_tiles.h"
#include "prefetch.h"

namespace tessera_quant {

using namespace tessera_tiles;

// Kernel format ids, shared with quant_layout.py's QuantFormat.kernel_id.
enum FormatId : int64_t { kQ4Half = 0, kQ4Float = 1, kQ8Half = 2, kQ8Float16 = 3, kQ8FloatMin = 4 };

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
using Q8FloatMin = Fmt<8, 32, float, true>;    // Q5_K (d * sc, -dmin * m per 32), Q5_1: codes 0..31

// fn(F{}) for the format `fmt` names: the one place a runtime format id becomes a type.
template <typename Fn>
decltype(auto) with_format(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case kQ4Half: return fn(Q4Half{});
    case kQ4Float: return fn(Q4Float{});
    case kQ8Half: return fn(Q8Half{});
    case kQ8Float16: return fn(Q8Float16{});
    case kQ8FloatMin: return fn(Q8FloatMin{});
  }
  TORCH_CHECK(false, "unknown quant format id ", fmt);
}

inline int64_t record_bytes(int64_t fmt) {
  return with_format(fmt, [](auto f) { return decltype(f)::kRecord; });
}

inline int64_t block_size(int64_t fmt) { return (fmt == kQ8Float16) ? 16 : 32; }

#if defined(__AVX512F__)

template <typename S>
inline __m512 load_scales(const uint8_t* p, int v) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + 16 * v);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + v));
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
  tessera_prefetch::prefetch_lines(rec + kPrefetchBlocks * F::kRecord, F::kRecord);
}

#endif  // __AVX512F__

}  // namespace tessera_quant
