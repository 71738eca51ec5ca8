// What this machine can do at most, for benchmarks/w1_ceiling.py: the FMA peak (fp32 FMAs and
// bf16 dot products) with every operand in registers, and the DRAM read bandwidth of a plain
// streaming sum. Each runs on every thread torch uses (at::parallel_for), so the figures are those
// of the cores a benchmark runs on. An upper bound on the arithmetic, not a kernel: nothing here
// serves a request.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kChains = 16;  // independent accumulators: covers the FMA latency x ports

#if defined(__AVX512F__)
// `iters` rounds of kChains independent acc = op(acc) on every thread; returns the FLOPs done,
// `flops_per_op` a call of op. op captures its operands by value: by reference, the fp32 loop
// reloaded them from memory and measured half the peak (230 against 454-467 GFLOP/s here).
template <typename Op>
int64_t register_loop(int64_t iters, int64_t flops_per_op, Op op) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads, 0.f);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m512 acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(0.001f * c);
      for (int64_t i = 0; i < iters; ++i)
        for (int c = 0; c < kChains; ++c) acc[c] = op(acc[c]);
      __m512 s = acc[0];
      for (int c = 1; c < kChains; ++c) s = _mm512_add_ps(s, acc[c]);
      sink[t] = _mm512_reduce_add_ps(s);  // keeps the loop alive
    }
  });
  volatile float keep = sink[0];
  (void)keep;
  return threads * iters * kChains * flops_per_op;
}
#endif

// FLOPs done: fp32 FMAs (16 lanes, 2 FLOPs each); -1 without AVX-512 (the caller measures
// torch.mm instead).
int64_t fma_fp32(int64_t iters) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.0001f);
  return register_loop(iters, 16 * 2, [=](__m512 acc) { return _mm512_fmadd_ps(acc, a, b); });
#else
  (void)iters;
  return -1;
#endif
}

// FLOPs done: bf16 dot products (vdpbf16ps: 32 products and 32 adds a vector).
int64_t dot_bf16(int64_t iters) {
#if defined(__AVX512BF16__)
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-4f), _mm512_set1_ps(2e-4f));
  return register_loop(iters, 32 * 2, [=](__m512 acc) { return _mm512_dpbf16_ps(acc, a, b); });
#else
  (void)iters;
  return -1;
#endif
}

// Sum of a large fp32 tensor, each thread streaming its contiguous share with 8 accumulators
// (independent loads in flight); returns the sum so the reads cannot be dropped.
double stream_sum(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32, "contiguous fp32 only");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  const int64_t threads = at::get_num_threads();
  std::vector<double> part(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      int64_t i = lo;
      double total = 0.0;
#if defined(__AVX512F__)
      __m512 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm512_setzero_ps();
      for (; i + 128 <= hi; i += 128)
        for (int c = 0; c < 8; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_loadu_ps(p + i + 16 * c));
      for (int c = 0; c < 8; ++c) total += _mm512_reduce_add_ps(acc[c]);
#endif
      for (; i < hi; ++i) total += p[i];
      part[t] = total;
    }
  });
  double s = 0.0;
  for (double v : part) s += v;
  return s;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fma_fp32", &fma_fp32, "fp32 FMA loop on every thread; FLOPs done (-1: no AVX-512)");
  m.def("dot_bf16", &dot_bf16, "vdpbf16ps loop on every thread; FLOPs done (-1: no AVX512_BF16)");
  m.def("stream_sum", &stream_sum, "streaming sum of a contiguous fp32 tensor on every thread");
}
