// The vector layer the kernels share between instruction sets (build.py: TESSERA_CPU_ISA).
//
// One source, three builds. Each kernel is compiled once per instruction set it runs on:
//
//   avx512    -march=native: the hand-written AVX-512 paths (#if __AVX512F__ ...), VNNI, bf16, AMX
//   avx2      -march=x86-64-v3: this layer at 8 lanes, plus AVX2 intrinsics where one instruction
//             is the point (vpmaddubsw/vpmaddwd integer dot products, quant_int8.h)
//   portable  no -march, no intrinsics: this layer's scalar fallback; correct on any CPU (aarch64)
//
// What we chose and why: at::vec (ATen/cpu/vec), not a layer of our own. It ships with the torch
// the kernels already link against (no new dependency, no copy to keep), its Vectorized<float>
// is 16 lanes under CPU_CAPABILITY_AVX512, 8 under CPU_CAPABILITY_AVX2 and a plain array loop
// otherwise (build.py sets the macro with the flags), and it brings a vector exp (exp_u20, a
// polynomial with no library call) that the elementwise ops need. What it does not do well we
// keep out of it: integer dot products (it has no vpmaddubsw/vpdpbusd) and bf16 loads (done here
// through a widening copy). The AVX-512 paths predate it and stay hand-written, measured as they
// are; the avx2 and portable paths are written once on top of this header, so they are the same
// code at two widths, and the tests run each build (tests/kernels/isa.py).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

namespace tessera_vec {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t kLanes = VecF::size();

// n (<= kLanes, may be fewer at a row's tail) values widened to fp32; lanes past n are 0.
inline VecF load(const float* p, int64_t n) {
  return n >= kLanes ? VecF::loadu(p) : VecF::loadu(p, n);
}
inline VecF load(const c10::BFloat16* p, int64_t n) {
  alignas(64) float buf[kLanes] = {};
  const int64_t m = std::min(n, kLanes);
  for (int64_t i = 0; i < m; ++i) buf[i] = static_cast<float>(p[i]);
  return VecF::loadu(buf);
}

// The first n lanes of v; bf16 rounds to nearest even, as torch's cast does.
inline void store(float* p, const VecF& v, int64_t n) {
  if (n >= kLanes) {
    v.store(p);
  } else {
    v.store(p, n);
  }
}
inline void store(c10::BFloat16* p, const VecF& v, int64_t n) {
  alignas(64) float buf[kLanes];
  v.store(buf);
  const int64_t m = std::min(n, kLanes);
  for (int64_t i = 0; i < m; ++i) p[i] = c10::BFloat16(buf[i]);
}

// The sum of v's lanes (at::vec's base reduce_add does not compile in torch 2.13's portable build).
inline float hsum(const VecF& v) {
  alignas(64) float buf[kLanes];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += buf[i];
  return s;
}

}  // namespace tessera_vec
