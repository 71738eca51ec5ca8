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
// bf16 activations: the block-sum form of quant_blocksum.h, on the codes themselves (closer to
// the fp32 reference than dense bf16, which rounds every weight; the two no longer agree bit for
// bit). On a CPU with AMX the bf16 path is run_amx, exact dequantization into AMX tiles.
//
// Block formats and the packed layout: quant_formats.h.
//
// Two ways through a panel for fp32, with the same result:
// - registers (few rows): each block is dequantized in registers and used by every row at once;
// - dense (many rows, prefill): the panel is dequantized once into an L2-resident fp32/bf16 dense
//   panel and the dense tiles run over it, at the dense matmul's rate.
// The row count where "dense" starts is chosen by measurement (quant_linear.py, benchmarks/linear.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "linear_amx.h"
#include "linear_tiles.h"
#include "quant_blocksum.h"
#include "quant_formats.h"
#include "quant_rows.h"

namespace {

using namespace tessera_quant;

#if defined(__AVX512F__)

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
  with_format(fmt, [&](auto f) {
    run<decltype(f), T>(x, ldx, M, K, packed, num_panels, N, y, ldy, bias, dense_min_rows);
  });
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
  m.def("dequantize_rows_out", &dequantize_rows_out, "rows `ids` of a packed weight, dequantized");
}
