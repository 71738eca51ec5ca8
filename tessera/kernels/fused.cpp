// Fused elementwise ops of a Llama layer for the CPU, fp32 or bf16 tensors, computed in fp32.
//
// Why: between the matmuls a layer runs RMSNorm (twice), the residual adds, RoPE and SiLU*up. In
// torch each is several dispatches, each a full pass over memory with a temporary; at batch 1 the
// dispatches, at batch 64 the passes, cost 10-15% of a decode step (torch profiler, see
// tessera/kernels/fused.py). Each op here is one pass, one call.
//
//   rms_norm(x, w, eps)              -> x / sqrt(mean(x^2) + eps) * w
//   add_rms_norm_(h, d, w, eps)      -> h += d (in place); returns rms_norm(h, w, eps)
//   silu_mul(gu)                     -> silu(gu[:, :I]) * gu[:, I:]
//   rope_(qkv, cos, signed_sin, nh, D) rotates the first nh heads of each row in place
//   argmax_lse(logits)               -> (argmax, logsumexp) of each fp32 row: the greedy sampler's
//                                       token and its raw logprob (logit - lse) in two reads of the
//                                       row, instead of argmax + a log_softmax written out [R, V]
//
// Paths: hand-written AVX-512 (exp16, masked tails), and for the avx2 and portable builds the same
// ops on at::vec (kernel_vec.h), 8 lanes or scalar.
//
// Rows are [n, width] with a contiguous last dim (any row stride). bf16 values are widened to fp32,
// and results rounded once to bf16 (round to nearest even).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TESSERA_FUSED_AVX512 1
#include <immintrin.h>
#else
#include "kernel_vec.h"
#endif

namespace {

#ifdef TESSERA_FUSED_AVX512

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else  // round to nearest even by hand (no NaN special case: activations here are finite)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
  _mm256_mask_storeu_epi16(p, m, h);
}

// exp(x) for fp32 lanes: Cephes' expf polynomial after range reduction by ln 2 (~1 ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

template <typename T>
float sum_of_squares(const T* x, int64_t width) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    const __m512 v = load16(x + i, tail_mask(width - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <typename T>
void scale_row(const T* x, const T* w, float inv_rms, int64_t width, T* out) {
  const __m512 s = _mm512_set1_ps(inv_rms);
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 m = tail_mask(width - i);
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i, m), s), load16(w + i, m)), m);
  }
}

template <typename T>
void add_in_place(T* h, const T* d, int64_t width) {
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 m = tail_mask(width - i);
    store16(h + i, _mm512_add_ps(load16(h + i, m), load16(d + i, m)), m);
  }
}

template <typename T>
void silu_mul_row(const T* gu, int64_t inter, T* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = tail_mask(inter - i);
    const __m512 g = load16(gu + i, m);
    const __m512 u = load16(gu + inter + i, m);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store16(out + i, _mm512_mul_ps(silu, u), m);
  }
}

template <typename T>
void rope_row(T* x, const T* cos, const T* sin, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    T* v = x + h * head_dim;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail_mask(half - i);
      const __m512 x1 = load16(v + i, m), x2 = load16(v + half + i, m);
      // sin's first half is stored negated (RotaryEmbedding), so both halves are x*cos + other*sin
      const __m512 o1 = _mm512_fmadd_ps(x2, load16(sin + i, m), _mm512_mul_ps(x1, load16(cos + i, m)));
      const __m512 o2 =
          _mm512_fmadd_ps(x1, load16(sin + half + i, m), _mm512_mul_ps(x2, load16(cos + half + i, m)));
      store16(v + i, o1, m);
      store16(v + half + i, o2, m);
    }
  }
}

// First index of the largest value (torch.argmax's rule) and log(sum(exp(x))) of one row.
// Pass 1: per-lane max with a strict compare, so each lane keeps its first maximum; lanes then
// reduce to the largest value and, among equal ones, the smallest index. Pass 2: sum of
// exp(x - max), reading the row again from cache (a 49k-vocab fp32 row is 196 KB).
inline void argmax_lse_row(const float* x, int64_t width, int64_t* idx, float* lse) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_i = _mm512_set1_epi32(0);
  __m512i lane_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 m = tail_mask(width - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + i);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_i = _mm512_mask_mov_epi32(best_i, gt, lane_i);
    lane_i = _mm512_add_epi32(lane_i, step);
  }
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  _mm512_store_ps(bv, best);
  _mm512_store_epi32(bi, best_i);
  float mx = bv[0];
  int32_t mi = bi[0];
  for (int l = 1; l < 16; ++l) {
    if (bv[l] > mx || (bv[l] == mx && bi[l] < mi)) {
      mx = bv[l];
      mi = bi[l];
    }
  }
  *idx = mi;
  if (!std::isfinite(mx)) {  // a row of -inf (or with +inf): leave it to the caller's checks
    *lse = mx;
    return;
  }
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 m = tail_mask(width - i);
    const __m512 e = exp16(_mm512_sub_ps(load16(x + i, m), vmx));
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
  }
  *lse = mx + std::log(_mm512_reduce_add_ps(acc));
}

#else  // the avx2 and portable builds: the same ops on at::vec (kernel_vec.h)

using tessera_vec::kLanes;
using tessera_vec::load;
using tessera_vec::store;
using tessera_vec::VecF;

template <typename T>
float sum_of_squares(const T* x, int64_t width) {
  VecF acc(0.f);
  for (int64_t i = 0; i < width; i += kLanes) {
    const VecF v = load(x + i, width - i);
    acc = at::vec::fmadd(v, v, acc);
  }
  return tessera_vec::hsum(acc);
}

template <typename T>
void scale_row(const T* x, const T* w, float inv_rms, int64_t width, T* out) {
  const VecF s(inv_rms);
  for (int64_t i = 0; i < width; i += kLanes)
    store(out + i, load(x + i, width - i) * s * load(w + i, width - i), width - i);
}

template <typename T>
void add_in_place(T* h, const T* d, int64_t width) {
  for (int64_t i = 0; i < width; i += kLanes)
    store(h + i, load(h + i, width - i) + load(d + i, width - i), width - i);
}

template <typename T>
void silu_mul_row(const T* gu, int64_t inter, T* out) {
  const VecF one(1.f), lo(-88.3762626647949f), hi(88.3762626647949f);
  for (int64_t i = 0; i < inter; i += kLanes) {
    const VecF g = load(gu + i, inter - i), u = load(gu + inter + i, inter - i);
    const VecF e = at::vec::clamp(VecF(0.f) - g, lo, hi).exp_u20();
    store(out + i, g / (one + e) * u, inter - i);
  }
}

template <typename T>
void rope_row(T* x, const T* cos, const T* sin, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    T* v = x + h * head_dim;
    for (int64_t i = 0; i < half; i += kLanes) {
      const int64_t n = half - i;
      const VecF x1 = load(v + i, n), x2 = load(v + half + i, n);
      // sin's first half is stored negated (RotaryEmbedding), so both halves are x*cos + other*sin
      const VecF o1 = at::vec::fmadd(x2, load(sin + i, n), x1 * load(cos + i, n));
      const VecF o2 = at::vec::fmadd(x1, load(sin + half + i, n), x2 * load(cos + half + i, n));
      store(v + i, o1, n);
      store(v + half + i, o2, n);
    }
  }
}

// As the AVX-512 version: the first index of the largest value, then log(sum(exp(x - max))).
inline void argmax_lse_row(const float* x, int64_t width, int64_t* idx, float* lse) {
  float mx = -INFINITY;
  int64_t mi = 0;
  for (int64_t i = 0; i < width; ++i) {
    if (x[i] > mx) {
      mx = x[i];
      mi = i;
    }
  }
  *idx = mi;
  if (!std::isfinite(mx)) {  // a row of -inf (or with +inf): leave it to the caller's checks
    *lse = mx;
    return;
  }
  const VecF vmx(mx), lo(-88.3762626647949f);
  VecF acc(0.f);
  for (int64_t i = 0; i < width; i += kLanes) {
    const int64_t n = std::min(kLanes, width - i);
    const VecF e = at::vec::maximum(VecF::loadu(x + i, n) - vmx, lo).exp_u20();
    acc = acc + (n == kLanes ? e : VecF::set(VecF(0.f), e, n));
  }
  *lse = mx + std::log(tessera_vec::hsum(acc));
}

#endif  // TESSERA_FUSED_AVX512

// Run `fn(row)` over rows, on several threads only when there is enough work to pay for waking them.
template <typename Fn>
void for_rows(int64_t rows, int64_t width, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with a contiguous last dim");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16,
              name, " must be float32 or bfloat16");
}

#define TESSERA_DISPATCH(dtype, ...)                 \
  if ((dtype) == torch::kFloat32) {                  \
    using scalar_t = float;                          \
    __VA_ARGS__();                                   \
  } else {                                           \
    using scalar_t = at::BFloat16;                   \
    __VA_ARGS__();                                   \
  }

}  // namespace

bool available() { return true; }


torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type() && w.numel() == x.size(1));
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty({rows, width}, x.options());
  TESSERA_DISPATCH(x.scalar_type(), [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t ld = x.stride(0);
    for_rows(rows, width, [&](int64_t r) {
      const float inv = 1.0f / std::sqrt(sum_of_squares(xp + r * ld, width) / width + (float)eps);
      scale_row(xp + r * ld, wp, inv, width, op + r * width);
    });
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor h, torch::Tensor d, torch::Tensor w, double eps) {
  check_rows(h, "h");
  check_rows(d, "delta");
  TORCH_CHECK(h.sizes() == d.sizes() && h.scalar_type() == d.scalar_type());
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == h.scalar_type() && w.numel() == h.size(1));
  const int64_t rows = h.size(0), width = h.size(1);
  auto out = torch::empty({rows, width}, h.options());
  TESSERA_DISPATCH(h.scalar_type(), [&] {
    scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* dp = d.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t ldh = h.stride(0), ldd = d.stride(0);
    for_rows(rows, width, [&](int64_t r) {
      add_in_place(hp + r * ldh, dp + r * ldd, width);
      const float inv = 1.0f / std::sqrt(sum_of_squares(hp + r * ldh, width) / width + (float)eps);
      scale_row(hp + r * ldh, wp, inv, width, op + r * width);
    });
  });
  return out;
}

torch::Tensor silu_mul(torch::Tensor gu) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up width must be even");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto out = torch::empty({rows, inter}, gu.options());
  TESSERA_DISPATCH(gu.scalar_type(), [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t ld = gu.stride(0);
    for_rows(rows, 2 * inter, [&](int64_t r) { silu_mul_row(gp + r * ld, inter, op + r * inter); });
  });
  return out;
}

void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "bad rope head layout");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type() && cos.numel() == qkv.size(0) * head_dim &&
                  sin.numel() == cos.numel(),
              "cos/sin must be contiguous [rows, head_dim] of the same dtype");
  const int64_t rows = qkv.size(0);
  TESSERA_DISPATCH(qkv.scalar_type(), [&] {
    scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t ld = qkv.stride(0);
    for_rows(rows, num_heads * head_dim, [&](int64_t r) {
      rope_row(xp + r * ld, cp + r * head_dim, sp + r * head_dim, num_heads, head_dim);
    });
  });
}

std::tuple<torch::Tensor, torch::Tensor> argmax_lse(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == torch::kFloat32,
              "logits must be float32 [rows, vocab] with a contiguous last dim");
  const int64_t rows = logits.size(0), width = logits.size(1);
  TORCH_CHECK(width > 0 && width < (int64_t(1) << 31), "vocab must fit in int32");
  auto idx = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  auto lse = torch::empty({rows}, logits.options());
  const float* xp = logits.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  for_rows(rows, width, [&](int64_t r) { argmax_lse_row(xp + r * ld, width, ip + r, lp + r); });
  return {idx, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build serves the ops (every build does)");
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("silu_mul", &silu_mul);
  m.def("rope_", &rope_);
  m.def("argmax_lse", &argmax_lse);
}
