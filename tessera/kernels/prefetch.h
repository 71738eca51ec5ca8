// Software prefetch of a weight stream, shared by the exact (quant_formats.h) and integer
// (quant_int8.h) quantized kernels; each decides how far ahead of its reads to pull, and where.
#pragma once

#include <cstdint>

namespace tessera_prefetch {

// One prefetch a 64-byte line over [p, p + bytes). Locality 3 (prefetcht0) pulls into L1,
// 1 (prefetcht2) into L2 only.
template <int Locality = 3>
inline void prefetch_lines(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, Locality);
}

}  // namespace tessera_prefetch
