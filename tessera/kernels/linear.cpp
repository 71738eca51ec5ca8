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
//
// Tiles by M (same sums either way, see linear_tiles.h): M <= 8 rows run one register tile over
// the whole panel; more rows run every 8-row tile over each 64-wide K slice of the panel in turn,
// so a panel is read from memory once per step, not once per 8 rows. bf16 on a CPU with AMX runs
// every M on tdpbf16ps tiles instead (linear_amx.h).
//
// The panel layout and the tiles live in linear_tiles.h, shared with quant_linear.cpp. The avx2
// and portable builds run linear_generic.h's fp32 tiles (at::vec) over the same panels.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <type_traits>

#include "linear_amx.h"
#include "linear_tiles.h"
#if !defined(__AVX512F__)
#include "linear_generic.h"
#endif

namespace {

using namespace tessera_tiles;

bool kernel_supports(const torch::Tensor& w) {
#if defined(__AVX512F__)
  if (w.scalar_type() == torch::kFloat32) return true;
#if defined(__AVX512BF16__)
  if (w.scalar_type() == torch::kBFloat16) return w.size(1) % 2 == 0;
#endif
#else  // avx2 and portable builds: linear_generic.h, every fp32 and bf16 weight
  if (w.scalar_type() == torch::kFloat32) return true;
  if (w.scalar_type() == torch::kBFloat16) return w.size(1) % 2 == 0;
#endif
  return false;
}

}  // namespace

#if !defined(__AVX512F__)
torch::Tensor linear_generic(torch::Tensor x, torch::Tensor packed, int64_t N,
                             c10::optional<torch::Tensor> bias);
#endif

bool available(torch::Tensor weight) { return kernel_supports(weight); }

// Whether bf16 runs on AMX tiles in this process (linear_amx.h: the CPU has AMX, the kernel was
// built for it, the OS granted the tile state and TESSERA_DISABLE_AMX is unset).
bool amx_active() { return amx_ready(); }

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
#if !defined(__AVX512F__)
  return linear_generic(x, packed, N, bias);
#else
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
    using Fn = void (*)(const float*, const float*, int64_t, const Span&, float*, int64_t, int64_t,
                        const float*, const float*);
    static const auto tiles = make_tiles<Fn, F32Tile>();
    run(x.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), tiles.data(),
        K * kPanel);
    return y;
  }
#if defined(TESSERA_HAVE_AMX)
  if (x.scalar_type() == torch::kBFloat16 && amx_ready()) {
    auto xa = torch::empty({round_up(M, kAmxRows) * K}, x.options());
    const at::BFloat16* xa_ptr = xa.data_ptr<at::BFloat16>();
    amx_pack_rows(x.data_ptr<at::BFloat16>(), ldx, M, K, xa.data_ptr<at::BFloat16>());
    const at::BFloat16* w_ptr = packed.data_ptr<at::BFloat16>();
    at::BFloat16* y_ptr = y.data_ptr<at::BFloat16>();
    const AmxRowBlocks blocks(M);
    at::parallel_for(0, blocks.count * num_panels, 1, [&](int64_t begin, int64_t end) {
      amx_configure(M);  // tile state is per thread
      for (int64_t u = begin; u < end; ++u) {
        // row-block-major: a block's rows stay in L2 while every panel streams past them
        const int64_t p = u % num_panels, m0 = u / num_panels * blocks.rows;
        const int64_t n0 = p * kPanel;
        amx_rows_against_panel(xa_ptr + m0 * K, std::min(blocks.rows, M - m0),
                               w_ptr + p * K * kPanel, K, y_ptr + m0 * N + n0, N, N - n0,
                               b ? b + n0 : nullptr);
      }
      _tile_release();
    });
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    using Fn = void (*)(const at::BFloat16*, const at::BFloat16*, int64_t, const Span&,
                        at::BFloat16*, int64_t, int64_t, const float*, const at::BFloat16*);
    static const auto tiles = make_tiles<Fn, Bf16Tile>();
    run(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
        tiles.data(), K * kPanel);
    return y;
  }
#endif
#endif
  TORCH_CHECK(false, "linear kernel: unsupported dtype or CPU");
}

#if !defined(__AVX512F__)
// The avx2 and portable builds (linear_generic.h): fp32 panels are read in place; bf16 panels
// ([K/2][48][2]) are widened slice by slice into this thread's fp32 buffer.
torch::Tensor linear_generic(torch::Tensor x, torch::Tensor packed, int64_t N,
                             c10::optional<torch::Tensor> bias) {
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
  if (x.scalar_type() == torch::kFloat32) {
    const float* w = packed.data_ptr<float>();
    tessera_generic::linear_panels(
        x.data_ptr<float>(), x.stride(0), M, K, num_panels, N, y.data_ptr<float>(), N, b,
        [&](int64_t p) {
          const float* panel = w + p * K * kPanel;
          return [panel](int64_t k0, int64_t) { return panel + k0 * kPanel; };
        });
    return y;
  }
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "linear kernel: x must be fp32 or bf16");
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  tessera_generic::linear_panels(
      x.data_ptr<at::BFloat16>(), x.stride(0), M, K, num_panels, N, y.data_ptr<at::BFloat16>(), N,
      b, [&](int64_t p) {
        const at::BFloat16* panel = w + p * K * kPanel;
        return [panel, K](int64_t k0, int64_t k1) {
          float* buf = thread_scratch<float, Scratch::kDequantPanel>(K * kPanel);
          for (int64_t k = k0; k < k1; ++k) {
            const at::BFloat16* src = panel + (k / 2) * 2 * kPanel + (k & 1);
            float* dst = buf + (k - k0) * kPanel;
            for (int64_t n = 0; n < kPanel; ++n) dst[n] = static_cast<float>(src[2 * n]);
          }
          return static_cast<const float*>(buf);
        };
      });
  return y;
}
#endif

// bias [N] -> float32 [N rounded up to the panel width], zero-padded: added in fp32 before rounding.
torch::Tensor pack_bias(torch::Tensor bias) {
  const int64_t n = bias.numel();
  auto out = torch::zeros({round_up(n, kPanel)}, bias.options().dtype(torch::kFloat32));
  out.narrow(0, 0, n).copy_(bias.reshape({n}));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build serves the weight's dtype/shape");
  m.def("amx_active", &amx_active, "whether bf16 runs on AMX tiles in this process");
  m.def("pack_weight", &pack_weight, "pack W [N, K] into kPanel-wide panels");
  m.def("pack_bias", &pack_bias, "bias as float32 padded to the panel width");
  m.def("linear", &linear, "y = x @ W^T (+ bias) on packed W");
}
