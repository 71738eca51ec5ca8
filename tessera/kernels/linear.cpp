// Linear layers for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 or bf16, any M.
//
// Why by hand: decode steps multiply a few rows by every weight of the model, so they are bound by
// how fast the weights stream from memory and by per-call overhead. oneDNN's packed GEMV reaches
// ~19 GB/s here against ~33 GB/s of memory bandwidth; this kernel streams each weight once per call
// in one contiguous pass and keeps up to kMaxRows rows of x in registers against it. At prefill
// sizes it stays within ~5% of oneDNN (benchmarks/linear.py).
//
// Layout: W is packed once into panels of kPanel (48) output features. fp32: [N/48][K][48]; bf16:
// [N/48][K/2][48][2] (pairs along K, the operand layout of vdpbf16ps). N is padded to a multiple
// of 48 with zero rows. Each output is one dot product accumulated in K order in fp32, whatever M
// is: a row's result does not depend on the rows batched with it, which is what keeps greedy
// decoding invariant under batching, chunking and prefix caching in bf16 as well as fp32.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <array>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#ifndef TESSERA_LINEAR_VECS
#define TESSERA_LINEAR_VECS 3
#endif
#ifndef TESSERA_LINEAR_ROWS
#define TESSERA_LINEAR_ROWS 8
#endif
constexpr int kVecs = TESSERA_LINEAR_VECS;     // 16-lane vectors per panel
constexpr int64_t kPanel = 16 * kVecs;         // output features per panel
constexpr int64_t kMaxRows = TESSERA_LINEAR_ROWS;  // rows per micro-tile: kVecs * rows accumulators
// 3 x 8 measured best of 2x12, 3x8, 4x6 on Zen4 (fewer x broadcasts per FMA than 2x12, and 48-wide
// panels still split evenly over two threads for the default model's shapes).
constexpr int64_t kRowsPerBlock = 96;  // rows of x kept in L2 while the panels stream past them
static_assert(kRowsPerBlock % kMaxRows == 0, "row blocks must hold whole micro-tiles");

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

#if defined(__AVX512F__)

inline __mmask16 lanes(int64_t n_valid, int v) {
  const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, n_valid - 16 * v));
  return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

// One row of a tile's result: bias (padded to the panel width) added in fp32, then stored.
inline void store_row(float* y, int64_t n_valid, __m512* acc, const float* bias) {
  for (int v = 0; v < kVecs; ++v) {
    __m512 a = acc[v];
    if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + 16 * v));
    _mm512_mask_storeu_ps(y + 16 * v, lanes(n_valid, v), a);
  }
}

// R rows of x, packed [K][R], against one fp32 panel [K][kPanel].
template <int R>
void tile_f32(const float* x, const float* panel, int64_t K, float* y, int64_t ldy,
              int64_t n_valid, const float* bias) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    __m512 wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[k * R + r]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, acc[r], bias);
}

#if defined(__AVX512BF16__)
inline void store_row(at::BFloat16* y, int64_t n_valid, __m512* acc, const float* bias) {
  for (int v = 0; v < kVecs; ++v) {
    __m512 a = acc[v];
    if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + 16 * v));
    _mm256_mask_storeu_epi16(y + 16 * v, lanes(n_valid, v), (__m256i)_mm512_cvtneps_pbh(a));
  }
}

// R rows of x, packed [K/2][R][2], against one bf16 panel [K/2][kPanel][2].
template <int R>
void tile_bf16(const at::BFloat16* x, const at::BFloat16* panel, int64_t K,
               at::BFloat16* y, int64_t ldy, int64_t n_valid, const float* bias) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t K2 = K / 2;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const at::BFloat16* w = panel + k2 * 2 * kPanel;
    __m512bh wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (k2 * R + r) * 2, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, n_valid, acc[r], bias);
}
#endif  // __AVX512BF16__

// Table of tile functions indexed by row count 1..kMaxRows (entry 0 unused).
struct F32Tile {
  template <int R>
  static constexpr auto fn = tile_f32<R>;
};
#if defined(__AVX512BF16__)
struct Bf16Tile {
  template <int R>
  static constexpr auto fn = tile_bf16<R>;
};
#endif
template <typename Fn, typename Tile, size_t... R>
std::array<Fn, kMaxRows + 1> make_tiles_impl(std::index_sequence<R...>) {
  return {nullptr, Tile::template fn<static_cast<int>(R) + 1>...};
}
template <typename Fn, typename Tile>
std::array<Fn, kMaxRows + 1> make_tiles() {
  return make_tiles_impl<Fn, Tile>(std::make_index_sequence<kMaxRows>{});
}

// Rows of x regrouped in tiles of kMaxRows (the last one shorter), each tile [K/P][R][P] with
// P = 1 (fp32) or 2 (bf16 pairs): the R values a k-step broadcasts share one cache line, so the
// weight stream passing through L1 does not evict them.
template <typename T, int P>
void pack_rows(const T* x, int64_t ldx, int64_t M, int64_t K, T* out) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t R = std::min<int64_t>(kMaxRows, M - m0);
    T* tile = out + m0 * K;
    for (int64_t r = 0; r < R; ++r) {
      const T* row = x + (m0 + r) * ldx;
      for (int64_t g = 0; g < K / P; ++g)
        for (int p = 0; p < P; ++p) tile[(g * R + r) * P + p] = row[g * P + p];
    }
  }
}

// Rows [0, M) of packed x (M a multiple of kMaxRows unless it is the last run) against a panel.
template <typename T, typename TileFn>
void rows_against_panel(const T* xp, int64_t M, const T* panel, int64_t K, T* y, int64_t ldy,
                        int64_t n_valid, const float* bias, TileFn tiles[]) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int64_t r = std::min<int64_t>(kMaxRows, M - m);
    tiles[r](xp + m * K, panel, K, y + m * ldy, ldy, n_valid, bias);
  }
}

#endif  // __AVX512F__

bool kernel_supports(const torch::Tensor& w) {
#if defined(__AVX512F__)
  if (w.scalar_type() == torch::kFloat32) return true;
#if defined(__AVX512BF16__)
  if (w.scalar_type() == torch::kBFloat16) return w.size(1) % 2 == 0;
#endif
#endif
  return false;
}

}  // namespace

bool available(torch::Tensor weight) { return kernel_supports(weight); }

// W [N, K] -> panels (see the header comment). Zero rows pad N to a multiple of kPanel.
torch::Tensor pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D");
  TORCH_CHECK(kernel_supports(weight), "unsupported weight dtype/shape for the linear kernel");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t n_pad = round_up(N, kPanel);
  auto w = torch::zeros({n_pad, K}, weight.options());
  w.narrow(0, 0, N).copy_(weight);
  if (weight.scalar_type() == torch::kFloat32) {
    // [P, kPanel, K] -> [P, K, kPanel]
    return w.view({n_pad / kPanel, kPanel, K}).transpose(1, 2).contiguous();
  }
  // [P, kPanel, K/2, 2] -> [P, K/2, kPanel, 2]
  return w.view({n_pad / kPanel, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] (last dim contiguous) -> y [M, N]. `packed` from pack_weight; bias from pack_bias.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                     c10::optional<torch::Tensor> bias) {
#if defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with a contiguous last dim");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and weight dtypes differ");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t num_panels = packed.size(0);
  TORCH_CHECK(num_panels * kPanel >= N && num_panels * kPanel < N + kPanel, "N does not match");
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == num_panels * K * kPanel,
              "K does not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == num_panels * kPanel,
                "bias must be float32, padded to the panel width (pack_bias)");
    b = bias->data_ptr<float>();
  }
  const int64_t ldx = x.stride(0);
  // M == 1 with a contiguous row is already in the packed layout.
  torch::Tensor xp = (M == 1) ? x : torch::empty({M * K}, x.options());
  const int64_t rows_per_block = std::min(M, kRowsPerBlock);
  const int64_t num_row_blocks = (M + rows_per_block - 1) / rows_per_block;
  const int64_t units = num_row_blocks * num_panels;

  auto run = [&](auto* x_ptr, auto* w_ptr, auto* y_ptr, auto tiles, int64_t panel_elems) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(x_ptr)>>;
    constexpr int P = std::is_same_v<T, float> ? 1 : 2;
    if (M > 1) {
      pack_rows<T, P>(x_ptr, ldx, M, K, xp.data_ptr<T>());
      x_ptr = xp.data_ptr<T>();
    }
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        // panel-major: each thread streams its own share of the weights once, every row against it
        const int64_t p = u / num_row_blocks, rb = u % num_row_blocks;
        const int64_t m0 = rb * rows_per_block;
        const int64_t rows = std::min(rows_per_block, M - m0);
        const int64_t n0 = p * kPanel;
        rows_against_panel(x_ptr + m0 * K, rows, w_ptr + p * panel_elems, K,
                           y_ptr + m0 * N + n0, N, N - n0, b ? b + n0 : nullptr, tiles);
      }
    });
  };

  if (x.scalar_type() == torch::kFloat32) {
    using Fn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, const float*);
    static const auto tiles = make_tiles<Fn, F32Tile>();
    run(x.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), tiles.data(),
        K * kPanel);
    return y;
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    using Fn = void (*)(const at::BFloat16*, const at::BFloat16*, int64_t, at::BFloat16*, int64_t,
                        int64_t, const float*);
    static const auto tiles = make_tiles<Fn, Bf16Tile>();
    run(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
        tiles.data(), K * kPanel);
    return y;
  }
#endif
#endif
  TORCH_CHECK(false, "linear kernel: unsupported dtype or CPU");
}

// bias [N] -> float32 [N rounded up to the panel width], zero-padded: added in fp32 before rounding.
torch::Tensor pack_bias(torch::Tensor bias) {
  const int64_t n = bias.numel();
  auto out = torch::zeros({round_up(n, kPanel)}, bias.options().dtype(torch::kFloat32));
  out.narrow(0, 0, n).copy_(bias.reshape({n}));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build serves the weight's dtype/shape");
  m.def("pack_weight", &pack_weight, "pack W [N, K] into kPanel-wide panels");
  m.def("pack_bias", &pack_bias, "bias as float32 padded to the panel width");
  m.def("linear", &linear, "y = x @ W^T (+ bias) on packed W");
}
