// Linear layers on GGUF-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x fp32 or bf16.
//
// Why: batch-1 decode is bound by the bytes of weight it streams. Q4_1 is 5 bits a weight against
// 16 for bf16, so the kernel streams the quantized blocks and dequantizes them in registers.
//
// fp32 activations: exact dequantization (quant_exact.h), bit for bit the dense kernel on
// gguf-dequantized weights, whatever M is.
//
// bf16 activations: the block-sum form of quant_blocksum.h, on the codes themselves (closer to
// the fp32 reference than dense bf16, which rounds every weight; the two no longer agree bit for
// bit). On a CPU with AMX the bf16 path is run_amx, exact dequantization into AMX tiles.
//
// avx2 and portable builds: each 64-row K slice of a panel is dequantized into an L1 buffer
// (few rows) or the whole panel into L2 (many rows), and linear_generic.h's fp32 tiles run over
// it: the same values, never a dequantized copy kept beyond the call.
// The integer path (--quantization gguf_int8, every build): quant_int8.h, its entry points
// quant_int8_ops.h.
//
// Block formats and the packed layout: quant_formats.h.
// Embedding rows: quant_rows.h.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <type_traits>
#include <utility>
#include <vector>

#include "linear_amx.h"
#include "linear_tiles.h"
#include "quant_blocksum.h"
#include "quant_exact.h"
#include "quant_formats.h"
#include "quant_int8_ops.h"
#include "quant_rows.h"
#if !defined(__AVX512F__)
#include "linear_generic.h"
#endif

namespace {

using namespace tessera_quant;

#if defined(__AVX512F__)

#if defined(TESSERA_HAVE_AMX)
// bf16 activations on AMX (linear_amx.h), for every M, as the dense kernel's AMX path does (so
// the two agree bit for bit). One row group (decode, M <= 16): each K step's block is dequantized
// into a 3 KB buffer just before its tiles load it, so the quantized bytes are the only stream
// from memory. More rows: each (row block, panel) unit dequantizes its panel into a dense bf16
// panel in L2 and runs the block's row groups over it; up to kAmxRowsPerBlock rows that is once
// per panel.
template <typename F>
void run_amx(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
             int64_t num_panels, int64_t N, at::BFloat16* y, int64_t ldy, const float* bias) {
  at::BFloat16* const xa = align64(
      thread_scratch<at::BFloat16, Scratch::kPackedRows>(round_up(M, kAmxRows) * K + kAlignElems));
  amx_pack_rows(x, ldx, M, K, xa);
  const AmxRowBlocks blocks(M);
  const int64_t panel_bytes = (K / F::kBlock) * F::kRecord;
  at::parallel_for(0, blocks.count * num_panels, 1, [&](int64_t begin, int64_t end) {
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
    at::BFloat16* const buf =
        align64(thread_scratch<at::BFloat16, Scratch::kDequantPanel>(K * kPanel + kAlignElems));
    for (int64_t u = begin; u < end; ++u) {
      // row-block-major, as the dense kernel's AMX path (linear_amx.h: AmxRowBlocks)
      const int64_t p = u % num_panels, m0 = u / num_panels * blocks.rows;
      const int64_t n0 = p * kPanel;
      dequant_panel<F>(packed + p * panel_bytes, 0, K / F::kBlock, buf);
      amx_rows_against_panel(xa + m0 * K, std::min(blocks.rows, M - m0), buf, K,
                             y + m0 * ldy + n0, ldy, N - n0, bias ? bias + n0 : nullptr);
    }
    _tile_release();
  });
}
#endif


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
  with_format(fmt, [&](auto f) {
    run<decltype(f), T>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias, dense_min_rows);
  });
}

#else  // avx2 and portable builds: linear_generic.h's fp32 tiles over dequantized slices

// Blocks [b0, b1) of a panel (natural layout) dequantized to fp32 rows [(b1 - b0) * block][48]:
// gguf's values, q * d + m with q * d exact, as dequantize_packed.
template <typename F>
void dequant_slice(const uint8_t* panel, int64_t b0, int64_t b1, float* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* rec = panel + b * F::kRecord;
    const auto* sc = reinterpret_cast<const typename F::Scale*>(rec + F::kCodeBytes);
    float d[kPanel], m[kPanel];
    for (int64_t n = 0; n < kPanel; ++n) {
      d[n] = static_cast<float>(sc[n]);
      m[n] = F::kHasMin ? static_cast<float>(sc[kPanel + n]) : 0.f;
    }
    for (int64_t k = 0; k < F::kBlock; ++k) {
      float* row = out + ((b - b0) * F::kBlock + k) * kPanel;
      if constexpr (F::kBits == 4) {
        const uint8_t* c = rec + (k / 2) * kPanel;  // byte (k/2)*48 + n, nibble k % 2
        const int shift = 4 * (k % 2);
        for (int64_t n = 0; n < kPanel; ++n)
          row[n] = static_cast<float>((c[n] >> shift) & 15) * d[n] + m[n];
      } else {
        const int8_t* c = reinterpret_cast<const int8_t*>(rec) + k * kPanel;
        for (int64_t n = 0; n < kPanel; ++n) row[n] = static_cast<float>(c[n]) * d[n] + m[n];
      }
    }
  }
}

template <typename T>
void dispatch(int64_t fmt, const T* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
              int64_t num_panels, int64_t N, T* y, int64_t ldy, const float* bias, int64_t) {
  with_format(fmt, [&](auto f) {
    using F = decltype(f);
    const int64_t panel_bytes = (K / F::kBlock) * F::kRecord;
    tessera_generic::linear_panels(x, ldx, M, K, num_panels, N, y, ldy, bias, [&](int64_t p) {
      const uint8_t* panel = packed + p * panel_bytes;
      return [panel, K](int64_t k0, int64_t k1) {
        float* buf = thread_scratch<float, Scratch::kDequantPanel>(K * kPanel);
        dequant_slice<F>(panel, k0 / F::kBlock, k1 / F::kBlock, buf);
        return static_cast<const float*>(buf);
      };
    });
  });
}

#endif  // __AVX512F__

}  // namespace

// Which activation dtypes this build serves ("float32", "bfloat16").
std::vector<std::string> supported_dtypes() {
  std::vector<std::string> out;
  out.push_back("float32");
#if !defined(__AVX512F__) || defined(__AVX512BF16__)
  out.push_back("bfloat16");
#endif
  return out;
}

int64_t packed_record_bytes(int64_t fmt) { return record_bytes(fmt); }

// out [T, K] (float32 or bfloat16) = rows `ids` [T] of a packed weight, gguf's values (rounded to
// bf16 as torch's cast does): the quantized embedding lookup. In torch ops (gathers, shifts, a
// mul and an add over [T, K]) it cost 40 ms for a 2048-token prefill step; here it is a pass
// over the rows' bytes.
void dequantize_rows_out(torch::Tensor packed, int64_t fmt, int64_t K, torch::Tensor ids,
                         torch::Tensor positions, torch::Tensor out) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be uint8");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "ids must be a contiguous int64 vector");
  TORCH_CHECK(positions.scalar_type() == torch::kInt32 && positions.is_contiguous() &&
                  positions.numel() == block_size(fmt) * kPanel,
              "positions must be int32 [block * 48]");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == ids.numel() && out.size(1) == K,
              "out must be a contiguous [T, K]");
  TORCH_CHECK(K % block_size(fmt) == 0, "K (", K, ") is not a multiple of the block size");
  const int64_t rows = packed.numel() / ((K / block_size(fmt)) * record_bytes(fmt)) * kPanel;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "id ", id[t], " is outside the packed rows");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int32_t* pos = positions.data_ptr<int32_t>();
  if (out.scalar_type() == torch::kFloat32)
    return dequantize_ids_fmt<float>(fmt, w, K, id, ids.numel(), pos, out.data_ptr<float>());
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16, "out must be float32 or bfloat16");
  dequantize_ids_fmt<at::BFloat16>(fmt, w, K, id, ids.numel(), pos, out.data_ptr<at::BFloat16>());
}

// Whether bf16 activations read weights packed in the pairs layout (the block-sum form): yes,
// unless this CPU runs them on AMX tiles (natural layout, exact dequantization).
bool bf16_reads_pairs() {
#if defined(__AVX512F__) && defined(TESSERA_HAVE_AMX)
  return !amx_ready();
#elif defined(__AVX512BF16__)
  return true;
#else
  return false;  // the avx2 and portable builds dequantize the natural layout
#endif
}

// y (an [M, N] view with a contiguous last dim, e.g. a column slice of a fused output) =
// x [M, K] @ W^T (+ bias). `packed` holds ceil(N / 48) panels of format `fmt`; `bias` is float32
// padded to the panel width. Rows >= dense_min_rows (when > 0) take the dense-panel way.
void quant_linear_out(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N,
                      c10::optional<torch::Tensor> bias, torch::Tensor y, int64_t dense_min_rows) {
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
#if !defined(__AVX512F__) || defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    dispatch<at::BFloat16>(fmt, x.data_ptr<at::BFloat16>(), x.stride(0), M, K, w, num_panels, N,
                           y.data_ptr<at::BFloat16>(), y.stride(0), b, dense_min_rows);
    return;
  }
#endif
  TORCH_CHECK(false, "quant linear kernel: unsupported dtype or CPU");
}


using namespace tessera_int8_ops;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_record_bytes", &int8_record_bytes,
        "bytes of one block record of a group of 8 rows of an int8 kind");
  m.def("int8_dot_instruction", &int8_dot_instruction, "the integer dot product of this build");
  m.def("int8_amx_min_rows", &int8_amx_min_rows,
        "rows from which the integer path runs AMX-INT8 tiles (0: never)");
  m.def("quant_linear_int8_out", &quant_linear_int8_out,
        "y = x @ W^T (+ bias): x quantized per row to Q8 blocks, integer products");
  m.def("supported_dtypes", &supported_dtypes, "activation dtypes this build serves");
  m.def("packed_record_bytes", &packed_record_bytes, "bytes of one block record of a panel");
  m.def("bf16_reads_pairs", &bf16_reads_pairs, "bf16 activations read the pairs code layout");
  m.def("quant_linear_out", &quant_linear_out, "y = x @ W^T (+ bias) on packed GGUF blocks");
  m.def("dequantize_rows_out", &dequantize_rows_out, "rows `ids` of a packed weight, dequantized");
  m.def("int8_rows_out", &int8_rows_out, "rows `ids` of an int8-path weight, dequantized");
}
