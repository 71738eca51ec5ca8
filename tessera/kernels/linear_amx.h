// bf16 tiles on AMX (Intel's tile matrix unit), shared by linear.cpp and quant_linear.cpp.
//
// Why: on this CPU (Sapphire/Emerald Rapids) vdpbf16ps on zmm reaches ~100 GFLOP/s on two cores
// at M = 16-64 in these kernels, while tdpbf16ps does a 16x16x32 product per instruction: oneDNN's
// bf16 linear (which uses it) was 1.6-8x faster than our vdpbf16ps tiles at M = 16-256.
//
// Layout: the bf16 panels of linear_tiles.h ([K/2][kPanel][2]) are already AMX's B operand: a B
// tile is 16 pair-rows (32 K positions) of 16 outputs, 64 bytes a row, 192 bytes apart. x is
// copied into a zero-padded row-major [M rounded up to 16][K] buffer (the A operand: 16 rows of 32
// K positions). C tiles hold fp32 [16][16] sums, three per panel.
//
// Row independence: every M goes through the same tiles. An output's sum is built from the same
// tdpbf16ps sequence over the K steps whatever rows share its tile (padding rows are zeros and
// never stored), and the K tail (K % 32) is added after in K order with vdpbf16ps, per row. So a
// row's result is bitwise the same alone, in a decode batch or in a prefill. It is not the same
// bits as the vdpbf16ps tiles, so a process uses one or the other for every bf16 linear (amx_ready
// decides once, for the whole process).
#pragma once

#include "linear_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TESSERA_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
#endif

namespace tessera_tiles {

#if defined(TESSERA_HAVE_AMX)

// Linux hands out the 8 KB of tile state only to processes that ask (arch_prctl), once.
// TESSERA_DISABLE_AMX=1 runs the vdpbf16ps tiles instead, so an AMX machine can test the path
// that CPUs without AMX (Zen4) take.
inline bool amx_ready() {
  static const bool ok = [] {
    const char* off = std::getenv("TESSERA_DISABLE_AMX");
    if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of a configuration built on the stack. GCC 12 does not see that the instruction reads
// the bytes it points at: where the caller was not inlined it dropped their stores as dead, and
// ldtilecfg faulted (SIGSEGV) on the half-written bytes. The empty asm with a memory clobber makes
// every store land first.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Tiles 0-2: C (fp32 [rows][16]); 3: A (rows x 32 bf16); 4-6: B (16 pair-rows x 16 outputs).
// `rows` = min(M, 16): a tdpbf16ps costs by its rows, and a lone decode row needs one, not 16
// (each C element's sum is the same whatever the tile's row count).
inline void amx_configure(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = t < 4 ? static_cast<uint8_t>(std::min<int64_t>(rows, 16)) : 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

constexpr int64_t kAmxRows = 16;   // rows of x per A tile

// Tile rows are 64-byte loads: A and B buffers start on a cache line, or every row load splits in
// two. kAlignElems is the slack a buffer needs for align64 to find a line start inside it.
constexpr int64_t kAlignElems = 64 / sizeof(at::BFloat16);
inline at::BFloat16* align64(at::BFloat16* p) {
  const auto a = (reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63};
  return reinterpret_cast<at::BFloat16*>(a);
}
constexpr int64_t kAmxK = 32;      // K positions per tdpbf16ps

// x [M, K] (rows ldx apart) -> [round_up(M, 16)][K], padding rows zero.
inline void amx_pack_rows(const at::BFloat16* x, int64_t ldx, int64_t M, int64_t K,
                          at::BFloat16* out) {
  const int64_t m_pad = round_up(M, kAmxRows);
  for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * K, x + m * ldx, K * sizeof(at::BFloat16));
  std::memset(static_cast<void*>(out + M * K), 0, (m_pad - M) * K * sizeof(at::BFloat16));
}

// Elements of one K step of B (32 K positions = 16 pair-rows of a panel): the three B tiles.
constexpr int64_t kAmxStepElems = kAmxK * kPanel;
// K steps ahead that a tile group prefetches while it streams a panel from memory. A tile load
// stalls on a miss, and with few rows (decode) there is too little TMUL work to hide it.
constexpr int64_t kAmxPrefetchSteps = 4;

// Rows of x per block when M is large: blocks run row-block-major (each block against every panel
// in turn), so a block's packed rows (kAmxRowsPerBlock * K * 2 bytes, 1.2 MB at K = 1536) stay in
// L2 while the panels stream past, and the weights are read once per block. Panel-major order (all
// M rows against one panel, then the next) re-streams every packed row from L3 for each 48
// outputs: at M = 2048 that cost ~30% (benchmarks/linear.py). Up to kAmxRowsPerBlock rows are one
// block, so for those the two orders are the same.
constexpr int64_t kAmxRowsPerBlock = 384;

// M rows cut into blocks of at most kAmxRowsPerBlock, evened out (whole row groups each) so that
// the two threads' shares of (block, panel) units hold about the same number of rows.
struct AmxRowBlocks {
  int64_t rows, count;
  explicit AmxRowBlocks(int64_t M) {
    const int64_t n = (M + kAmxRowsPerBlock - 1) / kAmxRowsPerBlock;
    rows = round_up((M + n - 1) / n, kAmxRows);
    count = (M + rows - 1) / rows;
  }
};

// B pair-rows of a dense bf16 panel, read in place (prefetching ahead when asked).
struct DensePanelB {
  const at::BFloat16* panel;
  int64_t K;
  bool prefetch;
  const at::BFloat16* operator()(int64_t k0) const {
    const at::BFloat16* b = panel + k0 * kPanel;  // pair-row k0 / 2
    const int64_t ahead = k0 + kAmxPrefetchSteps * kAmxK;
    if (prefetch && ahead < K)
      for (int64_t l = 0; l < kAmxStepElems * 2; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(panel + ahead * kPanel) + l, _MM_HINT_T0);
    return b;
  }
};

// Rows [0, M) of x (amx_pack_rows) against one bf16 panel [K/2][kPanel][2]; the caller has
// configured the tiles on this thread (amx_configure with the batch's row count; a smaller last
// group computes zero padding rows it never stores). `b_at(k0)` gives the 16 pair-rows of K step
// k0 in the panel layout: the dense panel itself, or a block dequantized into L1 just before
// (quant_linear.cpp); the K tail (K % 32, dense panels only) is read from `panel`.
//
// One row group per pass. Two groups per pass (six C tiles; one A and one B tile reloaded in the
// order A0 B0 B1 B2 A1 B1 B0, so B is read once per 32 rows) gives the same bits but measured no
// faster on Sapphire Rapids (in-process A/B at M = 17-2048, within the +-5% noise of two shared
// cores), likely because with two operand tiles each load waits for the product still reading
// that tile, while here the four loads of a K step are independent.
template <typename BAt>
inline void amx_rows_against_panel(const at::BFloat16* xp, int64_t M, const at::BFloat16* panel,
                                   int64_t K, at::BFloat16* y, int64_t ldy, int64_t n_valid,
                                   const float* bias, const BAt& b_at) {
  alignas(64) float c[kAmxRows * kPanel];  // [16][kPanel] fp32 sums of one row group
  const int64_t k_main = K / kAmxK * kAmxK;
  constexpr int64_t kBStride = 2 * kPanel * sizeof(at::BFloat16);  // bytes between pair-rows
  const int64_t a_stride = K * sizeof(at::BFloat16);
  for (int64_t g = 0; g < M; g += kAmxRows) {
    const at::BFloat16* xg = xp + g * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k0 = 0; k0 < k_main; k0 += kAmxK) {
      const at::BFloat16* b = b_at(k0);
      _tile_loadd(3, xg + k0, a_stride);
      _tile_loadd(4, b, kBStride);
      _tile_loadd(5, b + 32, kBStride);
      _tile_loadd(6, b + 64, kBStride);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(1, 3, 5);
      _tile_dpbf16ps(2, 3, 6);
    }
    constexpr int64_t kCStride = kPanel * sizeof(float);
    _tile_stored(0, c, kCStride);
    _tile_stored(1, c + 16, kCStride);
    _tile_stored(2, c + 32, kCStride);
    const int64_t rows = std::min(kAmxRows, M - g);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc[kVecs];
      for (int v = 0; v < kVecs; ++v) acc[v] = _mm512_loadu_ps(c + r * kPanel + 16 * v);
      const int32_t* xpairs = reinterpret_cast<const int32_t*>(xg + r * K);
      for (int64_t k2 = k_main / 2; k2 < K / 2; ++k2) {  // the K tail, in K order
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(xpairs[k2]);
        for (int v = 0; v < kVecs; ++v)
          acc[v] = _mm512_dpbf16_ps(
              acc[v], xv, (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * kPanel + 32 * v));
      }
      store_row(y + (g + r) * ldy, n_valid, acc, bias);
    }
  }
}

// A dense panel: streamed from memory with prefetch when one row group reads it once (decode);
// several groups re-read it from cache, and the first one's misses are hidden by the others' work.
inline void amx_rows_against_panel(const at::BFloat16* xp, int64_t M, const at::BFloat16* panel,
                                   int64_t K, at::BFloat16* y, int64_t ldy, int64_t n_valid,
                                   const float* bias) {
  amx_rows_against_panel(xp, M, panel, K, y, ldy, n_valid, bias,
                         DensePanelB{panel, K, M <= kAmxRows});
}

#else

inline bool amx_ready() { return false; }

#endif  // TESSERA_HAVE_AMX

}  // namespace tessera_tiles
