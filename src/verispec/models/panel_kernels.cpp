// Few-row linear layers on AVX2 CPUs: y[M, N] = x[M, K] . W[N, K]^T * scale[N] + bias[N].
//
// Why: decoding multiplies a weight by 1 row (a plain step, a draft step) or by gamma+1 rows (a
// verification pass). BLAS kernels are built for many rows; with a few rows they either stream the
// weight at memory speed but waste the FMA units, or compute well but stall on memory. Here every
// weight element is loaded once and used for all rows of x at once (up to 12 rows per pass over the
// weight), so the weight stream and the arithmetic overlap.
//
// Layout: W is packed once into panels of 8 output columns, [ceil(N/8)][K][8], so one 32-byte load
// is 8 columns at one k, and a panel is one contiguous stream. The int8 variant stores the same
// panels as int8 (8 bytes per k) and converts to float in registers; scale[n] is applied at the end
// (per-output-row weight scales), so the result is x . (int8 weight * scale)^T without quantising x.
//
// Where the compiler targets a CPU with 8-bit dot-product instructions (AVX-VNNI, or AVX512-VNNI
// with VL; the library is built per machine), int8 weights are multiplied by 8-bit activations
// instead, as fbgemm does: each row of x is quantised once per product (symmetric, one scale per
// row, stored +128 as uint8) and vpdpbusd sums 4 byte products per lane, 32 weights per
// instruction. The float conversion above costs ~3 instructions per 8 weights and was compute-bound
// on a 2-core Xeon (a 151,936 x 896 LM head: 11.5 ms against fbgemm's 5.1 ms). Layout for it:
// [ceil(N/8)][ceil(K/4)][8][4], four consecutive k of one column in one 32-bit lane.
//
// Where the CPU has AVX-512 (the library is built per machine), float32 weights use wider panels,
// [ceil(N/32)][K][32]: two 64-byte loads per k, each broadcast of x feeds two FMAs, and every
// cache line of the panel is prefetched into L2 8 KB ahead. On a 2-core Xeon (2026-11-30, the
// Qwen2.5-1.5B body shapes, 1.1 GB of weights, 2 threads) that streamed 26-29 GB/s at 1 row and
// 22-24 GB/s at 9 rows, against 15 / 13.5 GB/s for the same loop without the prefetch and 23 /
// 12 GB/s for the AVX2 8-column panels: with more arithmetic per byte the out-of-order window
// alone no longer keeps enough cache misses in flight. (A plain 2-thread read peaks at ~29 GB/s.)
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>
#include <vector>

#define PANEL 8  // int8 panels (float32 ones: F32_PANEL)
#define MAX_CHUNK_ROWS 12
#define PREFETCH_BYTES 8192
// float32 panels are two vectors wide (F32_PANEL columns) and take up to F32_MAX_ROWS rows a chunk
// (two accumulators a row, the weights and a broadcast in the registers); F32_K_BLOCK: k steps per
// block when two row chunks share a panel pass (16 KB of panel); the float32 and bfloat16 kernels
// continue sums across k blocks, the int8 ones take the whole k range.
#if defined(__AVX512F__)
#define F32_PANEL 32
#define F32_MAX_ROWS 12
#else
#define F32_PANEL 16
#define F32_MAX_ROWS 6
#endif
#define F32_K_BLOCK (16384 / (F32_PANEL * 4))
#define MAX_VNNI_CHUNK_ROWS 8

#if defined(__AVXVNNI__)
#define VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#else
#define VNNI 0
#endif

// An int8 panel's 8 weights at k, as floats.
static inline __attribute__((always_inline)) __m256 load_int8_weights(const int8_t* panel, int64_t k) {
  const __m128i bytes = _mm_loadl_epi64((const __m128i*)(panel + k * PANEL));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// ROWS rows of x against one int8 panel (float32 panels take wide_rows below), one accumulator (one
// chain of FMAs over k) per row: each row's sum is then the same chain whether it is computed alone
// or beside up to 11 others, so a verification pass gives bit for bit what a 1-token step gives (the
// prefix cache and branch rows rely on it). More chains for few rows (8 for 1 row, as this kernel
// had until 2026-12-04) summed k in a row-count-dependent order.
//
// The sums are named registers stored one by one. Written as an array with a store loop (which gcc
// turns into a copy of the array), gcc 12 kept the array on the stack too and stored every sum to it
// on every k (12 stores beside 12 FMAs): ~0.6 FMA a cycle for a 12-row float32 product on a Zen 3
// EPYC (2026-12-07: 59 GFLOP/s on 2 cores, 8 rows costing 1.65x 1 row; float32 panels went through
// this kernel then). vnni_rows below is still written the array way; built for AVX-VNNI without
// AVX-512 its k loops show such stores too (not measured: no VNNI CPU at hand).
template <int ROWS>
static inline __attribute__((always_inline)) void panel_rows(const float* x, int64_t K, const int8_t* panel, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w = load_int8_weights(panel, k);
    const float* xk = x + k;
#define ROW_FMA(m, acc) \
  if (ROWS > m) acc = _mm256_fmadd_ps(w, _mm256_broadcast_ss(xk + m * K), acc);
    ROW_FMA(0, a0) ROW_FMA(1, a1) ROW_FMA(2, a2) ROW_FMA(3, a3) ROW_FMA(4, a4) ROW_FMA(5, a5)
    ROW_FMA(6, a6) ROW_FMA(7, a7) ROW_FMA(8, a8) ROW_FMA(9, a9) ROW_FMA(10, a10) ROW_FMA(11, a11)
#undef ROW_FMA
  }
#define ROW_STORE(m, acc) \
  if (ROWS > m) _mm256_storeu_ps(out + m * PANEL, acc);
  ROW_STORE(0, a0) ROW_STORE(1, a1) ROW_STORE(2, a2) ROW_STORE(3, a3) ROW_STORE(4, a4) ROW_STORE(5, a5)
  ROW_STORE(6, a6) ROW_STORE(7, a7) ROW_STORE(8, a8) ROW_STORE(9, a9) ROW_STORE(10, a10) ROW_STORE(11, a11)
#undef ROW_STORE
}

// ROWS rows of x against PANELS consecutive int8 panels, out [ROWS][out_stride]: each output the
// same one chain of FMAs over k as in panel_rows (the same sums, bit for bit), PANELS chains a row.
// Why: one row against one panel is a single chain, one FMA per FMA latency; a 1-row product (a
// draft model's step, without VNNI) ran at a quarter of the FMA rate, 2 rows cost what 1 did. (Split
// over k instead, as until 2026-12-04, the sums' order depended on the row count.) The int8 0.5B
// draft's products of one step on 2 threads (Zen 4 without AVX-512): 43.7 -> 13.9 ms for 1 row.
template <int ROWS, int PANELS>
static inline __attribute__((always_inline)) void panels_rows(const float* x, int64_t K, const int8_t* panel, float* out, int64_t out_stride) {
  __m256 acc[ROWS][PANELS];
#pragma GCC unroll 8
  for (int i = 0; i < PANELS; ++i)
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) acc[r][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xk[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) xk[r] = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
    for (int i = 0; i < PANELS; ++i) {
      const __m256 w = load_int8_weights(panel + i * K * PANEL, k);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) acc[r][i] = _mm256_fmadd_ps(w, xk[r], acc[r][i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < PANELS; ++i)
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(out + r * out_stride + i * PANEL, acc[r][i]);
}

// Panels side by side for products of 1 or 2 rows (the most the int8 kernel takes without VNNI:
// MAX_INT8_KERNEL_ROWS in panel_linear.py; from 3 rows fbgemm's 8-bit products are faster): 8
// chains in flight either way.
static constexpr int int8_side_panels(int rows) { return rows == 1 ? 8 : 4; }

// rows (1 or 2) of x against `count` consecutive panels from `panel` (all int8_side_panels(rows) of
// a group, or fewer at the end of the weight), out [rows][int8_side_panels(rows) * PANEL].
template <int ROWS>
static void side_panel_rows(const float* x, int64_t K, const int8_t* panel, int64_t count, float* out) {
  constexpr int PANELS = int8_side_panels(ROWS);
  if (count == PANELS) return panels_rows<ROWS, PANELS>(x, K, panel, out, PANELS * PANEL);
  for (int64_t i = 0; i < count; ++i) panels_rows<ROWS, 1>(x, K, panel + i * K * PANEL, out + i * PANEL, PANELS * PANEL);
}

// kernel(std::integral_constant<int, ROWS>) for rows 1..12 (12 for more): one instantiation per row count.
template <typename Kernel>
static inline void with_rows(int rows, Kernel kernel) {
  switch (rows) {
    case 1: kernel(std::integral_constant<int, 1>()); break;
    case 2: kernel(std::integral_constant<int, 2>()); break;
    case 3: kernel(std::integral_constant<int, 3>()); break;
    case 4: kernel(std::integral_constant<int, 4>()); break;
    case 5: kernel(std::integral_constant<int, 5>()); break;
    case 6: kernel(std::integral_constant<int, 6>()); break;
    case 7: kernel(std::integral_constant<int, 7>()); break;
    case 8: kernel(std::integral_constant<int, 8>()); break;
    case 9: kernel(std::integral_constant<int, 9>()); break;
    case 10: kernel(std::integral_constant<int, 10>()); break;
    case 11: kernel(std::integral_constant<int, 11>()); break;
    default: kernel(std::integral_constant<int, 12>()); break;
  }
}

static void chunk_rows(int rows, const float* x, int64_t K, const int8_t* panel, float* out) {
  with_rows(rows, [&](auto count) { panel_rows<decltype(count)::value>(x, K, panel, out); });
}

// float32 vectors of 8 lanes (AVX2) and 16 (AVX-512), for the kernels written once over either:
// wide_rows below, and the attention's value sums.
struct Lanes8 {
  using V = __m256;
  static constexpr int LANES = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V broadcast(float value) { return _mm256_set1_ps(value); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int LANES = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V broadcast(float value) { return _mm512_set1_ps(value); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
using F32Vector = Lanes16;  // the float32 panels' vector
#else
using F32Vector = Lanes8;
#endif
#define F32_HALF (F32_PANEL / 2)

// ROWS rows of x against one float32 panel of two vectors: one accumulator chain per row and
// half-panel. Two chains already cover the FMA latency at memory speed (AVX-512: 128 bytes per 4
// cycles), and one chain per output makes every row's sum the same sequence of operations
// whatever the number of rows: a verification pass gives bit for bit the products a 1-token step
// gives. Each 64-byte line of the panel is prefetched into L2 PREFETCH_BYTES ahead (prefetches
// past the end of the weight are harmless: they never fault).
//
// Without AVX-512 the panels were one vector (8 columns) wide, up to 12 rows a chunk, until
// 2026-12-07: each k then loaded 32 bytes of weights beside one broadcast of x per row, so an
// 8-row pass read as many bytes of x as of weights (x's rows from L2 for every panel). On a Zen 4
// EPYC without AVX-512 a 1.5B-target pass over 8 rows cost 2.2-2.7x a 1-row pass at 300 cached
// tokens (now 1.1-1.45x).
// Two vectors a k halve the broadcasts per weight; 16 registers hold the sums of 6 rows, so more
// rows go in chunks of at most 6, two chunks at a time per k block (for_panel_chunks), the block
// read from L1 by the second. Every output's chain of FMAs is what it was: the sums are too.
//
// k0..k1: one block of the k range; a block after the first continues the sums left in out, so a
// product split into k blocks performs every output's chain of FMAs exactly as one pass does.
// A panel's sums for ROWS rows, two vectors a row: zero at the first k block, else continued from
// what the previous block left in out [ROWS][F32_PANEL]; and stored back there.
template <int ROWS>
static inline __attribute__((always_inline)) void start_sums(F32Vector::V (&acc)[2][ROWS], const float* out, int64_t k0) {
  for (int m = 0; m < ROWS; ++m) {
    acc[0][m] = k0 == 0 ? F32Vector::zero() : F32Vector::load(out + m * F32_PANEL);
    acc[1][m] = k0 == 0 ? F32Vector::zero() : F32Vector::load(out + m * F32_PANEL + F32_HALF);
  }
}

template <int ROWS>
static inline __attribute__((always_inline)) void store_sums(const F32Vector::V (&acc)[2][ROWS], float* out) {
  for (int m = 0; m < ROWS; ++m) {
    F32Vector::store(out + m * F32_PANEL, acc[0][m]);
    F32Vector::store(out + m * F32_PANEL + F32_HALF, acc[1][m]);
  }
}

template <int ROWS>
static inline __attribute__((always_inline)) void wide_rows(const float* x, int64_t K, const float* panel, float* out, int64_t k0, int64_t k1) {
  F32Vector::V acc[2][ROWS];
  start_sums<ROWS>(acc, out, k0);
  for (int64_t k = k0; k < k1; ++k) {
    const float* line = panel + k * F32_PANEL;
    for (int byte = 0; byte < F32_PANEL * 4; byte += 64) _mm_prefetch((const char*)line + PREFETCH_BYTES + byte, _MM_HINT_T2);
    const F32Vector::V w0 = F32Vector::load(line), w1 = F32Vector::load(line + F32_HALF);
    for (int m = 0; m < ROWS; ++m) {
      const F32Vector::V b = F32Vector::broadcast(x[m * K + k]);
      acc[0][m] = F32Vector::fma(w0, b, acc[0][m]);
      acc[1][m] = F32Vector::fma(w1, b, acc[1][m]);
    }
  }
  store_sums<ROWS>(acc, out);
}

// rows <= F32_MAX_ROWS (for_panel_chunks never passes more); no kernel is built for more rows, whose
// sums would not fit in the registers.
static void f32_chunk_rows(int rows, const float* x, int64_t K, const float* panel, float* out, int64_t k0, int64_t k1) {
  with_rows(rows, [&](auto count) {
    if constexpr (decltype(count)::value <= F32_MAX_ROWS) wide_rows<decltype(count)::value>(x, K, panel, out, k0, k1);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16 1
// bfloat16 weights (a bfloat16 target): panels of 32 columns over k pairs, [ceil(N/32)][ceil(K/2)][32][2],
// one 128-byte line per k pair as in the float32 layout. vdpbf16ps multiplies two bf16 pairs and
// adds both products to a float32 lane, so a line costs two instructions per row whatever its
// content: half the bytes of float32 and twice the multiply-adds per instruction. x comes as bf16
// pairs (one 32-bit word per k pair, rounded once by the caller). As in wide_rows, one chain of
// dot products per output and k range: every row's sums are the same operations whatever the
// number of rows, so a verification pass gives bit for bit what a 1-token step gives.
template <int ROWS>
static inline __attribute__((always_inline)) void bf16_rows(const uint32_t* x, int64_t K2, const uint16_t* panel, float* out, int64_t k0, int64_t k1) {
  __m512 acc[2][ROWS];
  start_sums<ROWS>(acc, out, k0);
  for (int64_t k = k0; k < k1; ++k) {
    const uint16_t* line = panel + k * 2 * F32_PANEL;
    _mm_prefetch((const char*)line + PREFETCH_BYTES, _MM_HINT_T2);
    _mm_prefetch((const char*)line + PREFETCH_BYTES + 64, _MM_HINT_T2);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(line), w1 = (__m512bh)_mm512_loadu_si512(line + F32_PANEL);
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32((int)x[m * K2 + k]);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], w0, b);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], w1, b);
    }
  }
  store_sums<ROWS>(acc, out);
}

static void bf16_chunk_rows(int rows, const uint32_t* x, int64_t K2, const uint16_t* panel, float* out, int64_t k0, int64_t k1) {
  with_rows(rows, [&](auto count) { bf16_rows<decltype(count)::value>(x, K2, panel, out, k0, k1); });
}
#define BF16_MAX_ROWS MAX_CHUNK_ROWS
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define BF16 1
// bfloat16 weights without bfloat16 products (AVX2): the same layout at this build's panel width,
// [ceil(N/16)][ceil(K/2)][16][2], one 64-byte line per k pair. A bfloat16 is the top half of a
// float32, so widening is exact and costs one shift (the even k of each pair) or one mask (the odd
// k) per 8 weights; the products are float32 FMAs, even k then odd k into each output's one chain,
// so as above every row's sums are the same operations whatever the number of rows. Why: PyTorch
// ran a bfloat16 target's products here at 139-165 ms for a 1-token step and 443-545 ms for a
// 4-token pass (Zen 4 without AVX-512, 300 cached tokens), so speculation could not pay; these stream half
// the float32 panels' bytes. x comes as bf16 pairs, rounded as for vdpbf16ps, each pair broadcast
// from memory and widened in the vector unit as the weights are (scalar shifts, a move and a
// register broadcast per row cost 4-row passes 109 against 78 ms for 1 row).
// Sums of up to F32_MAX_ROWS rows: the even half's two weight vectors and one broadcast live at a
// time, then the odd half's.
template <int ROWS>
static inline __attribute__((always_inline)) void bf16_rows(const uint32_t* x, int64_t K2, const uint16_t* panel, float* out, int64_t k0, int64_t k1) {
  __m256 acc[2][ROWS];
  start_sums<ROWS>(acc, out, k0);
  const __m256i odd_half = _mm256_set1_epi32((int)0xffff0000u);
  for (int64_t k = k0; k < k1; ++k) {
    const uint16_t* line = panel + k * 2 * F32_PANEL;
    _mm_prefetch((const char*)line + PREFETCH_BYTES, _MM_HINT_T2);
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)line), w1 = _mm256_loadu_si256((const __m256i*)(line + F32_PANEL));
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), even1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    for (int m = 0; m < ROWS; ++m) {
      const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32((int)x[m * K2 + k]), 16));
      acc[0][m] = _mm256_fmadd_ps(even0, b, acc[0][m]);
      acc[1][m] = _mm256_fmadd_ps(even1, b, acc[1][m]);
    }
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(w0, odd_half)), odd1 = _mm256_castsi256_ps(_mm256_and_si256(w1, odd_half));
    for (int m = 0; m < ROWS; ++m) {
      const __m256 b = _mm256_castsi256_ps(_mm256_and_si256(_mm256_set1_epi32((int)x[m * K2 + k]), odd_half));
      acc[0][m] = _mm256_fmadd_ps(odd0, b, acc[0][m]);
      acc[1][m] = _mm256_fmadd_ps(odd1, b, acc[1][m]);
    }
  }
  store_sums<ROWS>(acc, out);
}

static void bf16_chunk_rows(int rows, const uint32_t* x, int64_t K2, const uint16_t* panel, float* out, int64_t k0, int64_t k1) {
  with_rows(rows, [&](auto count) {
    if constexpr (decltype(count)::value <= F32_MAX_ROWS) bf16_rows<decltype(count)::value>(x, K2, panel, out, k0, k1);
  });
}
#define BF16_MAX_ROWS F32_MAX_ROWS
#else
#define BF16 0
#endif

#if defined(__AMX_TILE__) && ((BF16 && defined(__AMX_BF16__)) || (VNNI && defined(__AMX_INT8__)))
#define AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
// AMX tiles (the library is built with them where the CPU has them): one tile multiply takes 16
// rows of activations by a 64-byte run of k by 16 weight lines, where a dot-product instruction
// takes one row, so passes over a few dozen rows stay at the cost of streaming the weight (bfloat16
// below, int8 after the VNNI kernel). Each row's sums depend on that row alone, so a pass over n rows
// gives every row what a 1-row pass gives (tested). Where a width does not fill the tiles, or the
// kernel cannot get the tile state, the dot-product kernels run instead.
#define AMX_CHUNK_ROWS 16
#define AMX_PAD_ROWS 16  // a chunk's tile reads the largest chunk's rows: row buffers carry readable rows past the last
static int amx_enabled = 0;

// A tile configuration per row count: a tile multiply takes time per configured row, so a 1-row
// step configures 1 row. They live in memory outside the functions: GCC's ldtilecfg intrinsic tells
// the compiler it reads only the first 8 bytes, so a configuration built on the stack could be
// loaded half-written. An unused tile has rows and colsb both zero.
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles `sums` (each `sum_bytes` wide) and `inputs` (rows of x, 64 bytes) with `rows` rows;
// `weights` (each `weight_bytes` wide) with 16 rows.
static void amx_make_configs(TileConfig (&configs)[17], std::initializer_list<int> sums, int sum_bytes, std::initializer_list<int> inputs,
                             std::initializer_list<int> weights, int weight_bytes) {
  for (int rows = 1; rows <= 16; ++rows) {
    TileConfig& config = configs[rows];
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t : sums) config.rows[t] = (uint8_t)rows, config.colsb[t] = (uint16_t)sum_bytes;
    for (int t : inputs) config.rows[t] = (uint8_t)rows, config.colsb[t] = 64;
    for (int t : weights) config.rows[t] = 16, config.colsb[t] = (uint16_t)weight_bytes;
  }
}

// Loads the configuration whose tiles hold the largest chunk of a pass over M rows (chunks of at most
// AMX_CHUNK_ROWS, balanced as for_panel_chunks makes them). Every thread of a region loads its own.
static inline void amx_configure(const TileConfig (&configs)[17], int64_t M) {
  const int64_t chunks = (M + AMX_CHUNK_ROWS - 1) / AMX_CHUNK_ROWS;
  _tile_loadconfig(&configs[(M + chunks - 1) / chunks]);
}
#else
#define AMX_TILES 0
#define AMX_PAD_ROWS 0
#endif

#if AMX_TILES && BF16 && defined(__AMX_BF16__)
#define AMX_BF16 1
// bfloat16 products on tiles. Why: a vdpbf16ps line costs two instructions per row, so a
// verification pass over 17 rows of the 1.5B target cost 2.6x a 1-row step on a 2-core Xeon
// (2026-12-03, `verispec costs --target-dtype bfloat16`). The bf16 panels are already what a tile of
// weights wants: pair-lines of 128 bytes, the first 64 bytes of 16 lines one tile (columns 0-15),
// the last 64 bytes the next (columns 16-31). Where k pairs are not a multiple of 16 the vdpbf16ps
// kernel above runs.
// Tiles 0, 1: sums (column halves) and 4: rows of x; 6, 7: weight halves; all 64 bytes wide.
static TileConfig amx_bf16_configs[17] __attribute__((aligned(64)));

// out [R][32] (row stride 128 bytes) for x's rows from 0 (R as configured, readable) over k pairs k0..k1
// (multiples of 16), continuing out's sums after the first k block as bf16_rows does. Passes over
// 17-32 rows run as two chunks, the second reading the weight block from cache: on the 2-core Xeon
// (24 copies of the 1.5B target's [8960, 1536] weight, 2 threads) 1 / 16 / 17 / 32 rows took
// 50 / 56 / 75 / 74 ms (vdpbf16ps: 49 / 113 / 130 / 208); two row tiles sharing the weight tiles
// were slower at 17 rows (1.5x 16 rows), and so was alternating two sets of tiles (1.45x at 1 row).
// Without the software prefetch 1 row took 71 ms.
static void amx_bf16_chunk_rows(const uint32_t* x, int64_t K2, const uint16_t* panel, float* out, int64_t k0, int64_t k1) {
  const int64_t x_stride = K2 * 4, out_stride = F32_PANEL * 4;
  if (k0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
  } else {
    _tile_loadd(0, out, out_stride);
    _tile_loadd(1, out + 16, out_stride);
  }
  for (int64_t k = k0; k < k1; k += 16) {
    const uint16_t* lines = panel + k * 2 * F32_PANEL;  // 16 pair-lines, 2 KB
    for (int line = 0; line < 32; ++line) _mm_prefetch((const char*)lines + PREFETCH_BYTES + 64 * line, _MM_HINT_T2);
    _tile_loadd(6, lines, 128);
    _tile_loadd(7, lines + F32_PANEL, 128);
    _tile_loadd(4, x + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, out, out_stride);
  _tile_stored(1, out + 16, out_stride);
}

static inline bool amx_bf16_runs(int64_t K2) { return amx_enabled && K2 % 16 == 0; }
#else
#define AMX_BF16 0
#endif

// One weight as the kernels take it: packed panels, per-output scales (int8) and, for the VNNI
// layout, per-output sums of the int8 weights (to undo the +128 offset of the activations).
struct Weight {
  const void* packed;
  int64_t N, K;
  const float* scale;    // [N] or null
  const int32_t* colsum; // [N] or null
  const float* bias;     // [N] or null
};

// Rows of x quantised for the VNNI kernel: xq [M][K4] uint8 (round(x / xscale) + 128), xscale [M].
struct Quantized {
  uint8_t* xq;
  float* xscale;
};

static inline int64_t round_up4(int64_t k) { return (k + 3) & ~(int64_t)3; }

// Output (m, n) of an int8 product in the VNNI layout from its integer sum over the offset rows of x:
// the +128 offset undone with the column sum, both scales applied, the bias added. One definition for
// the product and for the 4-bit screen's recomputed panels, which must be bit for bit its values.
static inline float vnni_output(const Weight& w, const Quantized& q, int32_t dot, int64_t m, int64_t n) {
  const float value = (float)(dot - 128 * w.colsum[n]) * q.xscale[m] * w.scale[n];
  return w.bias ? value + w.bias[n] : value;
}

#if VNNI
static void quantize_rows(const float* x, int64_t M, int64_t K, Quantized q) {
  const int64_t K4 = round_up4(K);
  const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    uint8_t* out = q.xq + m * K4;
    __m256 top = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(row + k), sign_mask));
    float amax = 0.0f, lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; ++j) amax = lanes[j] > amax ? lanes[j] : amax;
    for (; k < K; ++k) amax = fabsf(row[k]) > amax ? fabsf(row[k]) : amax;
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f, inverse = 1.0f / scale;
    q.xscale[m] = scale;
    const __m256 inv = _mm256_set1_ps(inverse);
    k = 0;
    for (; k + 32 <= K; k += 32) {  // 32 floats -> 32 bytes: pack with saturation, then undo the lane interleave
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 8), inv));
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 16), inv));
      const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 24), inv));
      __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
      bytes = _mm256_permutevar8x32_epi32(bytes, order);
      _mm256_storeu_si256((__m256i*)(out + k), _mm256_xor_si256(bytes, _mm256_set1_epi8((char)0x80)));
    }
    for (; k < K; ++k) out[k] = (uint8_t)((int)lrintf(row[k] * inverse) + 128);
    for (; k < K4; ++k) out[k] = 128;  // zero after the offset; the padded weights are zero too
  }
}

// ROWS quantised rows against one VNNI panel: out[m][j] = sum_k xq[m][k] * w[j][k] (int32).
template <int ROWS, int SETS>
static inline __attribute__((always_inline)) void vnni_rows(const uint8_t* xq, int64_t K4, const int8_t* panel, int32_t* out) {
  __m256i acc[SETS][ROWS];
  for (int s = 0; s < SETS; ++s)
    for (int m = 0; m < ROWS; ++m) acc[s][m] = _mm256_setzero_si256();
  const int64_t groups = K4 / 4;
  int64_t g = 0;
  for (; g + SETS <= groups; g += SETS) {
    for (int s = 0; s < SETS; ++s) {
      _mm_prefetch((const char*)(panel + (g + s) * 32) + PREFETCH_BYTES, _MM_HINT_T2);
      const __m256i w = _mm256_loadu_si256((const __m256i*)(panel + (g + s) * 32));
      for (int m = 0; m < ROWS; ++m)
        acc[s][m] = dpbusd(acc[s][m], _mm256_set1_epi32(*(const int32_t*)(xq + m * K4 + 4 * (g + s))), w);
    }
  }
  for (; g < groups; ++g) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(panel + g * 32));
    for (int m = 0; m < ROWS; ++m) acc[0][m] = dpbusd(acc[0][m], _mm256_set1_epi32(*(const int32_t*)(xq + m * K4 + 4 * g)), w);
  }
  for (int m = 0; m < ROWS; ++m) {
    __m256i sum = acc[0][m];
    for (int s = 1; s < SETS; ++s) sum = _mm256_add_epi32(sum, acc[s][m]);
    _mm256_storeu_si256((__m256i*)(out + m * PANEL), sum);
  }
}

static void vnni_chunk_rows(int rows, const uint8_t* xq, int64_t K4, const int8_t* panel, int32_t* out) {
  switch (rows) {
    case 1: vnni_rows<1, 8>(xq, K4, panel, out); break;
    case 2: vnni_rows<2, 4>(xq, K4, panel, out); break;
    case 3: vnni_rows<3, 3>(xq, K4, panel, out); break;
    case 4: vnni_rows<4, 2>(xq, K4, panel, out); break;
    case 5: vnni_rows<5, 2>(xq, K4, panel, out); break;
    case 6: vnni_rows<6, 2>(xq, K4, panel, out); break;
    case 7: vnni_rows<7, 1>(xq, K4, panel, out); break;
    default: vnni_rows<8, 1>(xq, K4, panel, out); break;
  }
}
#endif

#if AMX_TILES && VNNI && defined(__AMX_INT8__)
#define AMX_INT8 1
// int8 products on tiles (tdpbusd: unsigned 8-bit activations by signed 8-bit weights into int32),
// the same integer sums as vnni_rows (exact either way), so every output is bit for bit the dot
// products' value. Why: a dot-product instruction takes one row, so the int8 kernel was kept to 16
// rows and a draft's prompt pass went op by op through PyTorch's int8 products (a 100-token prompt
// of the 0.5B draft: 165-183 ms against 88-90 ms now, 2-core Xeon, 2026-12-03). A VNNI panel is 8
// columns, a quad-line of 32 bytes per 4 k, so 16 quad-lines (64 k) are one 32-byte-wide weight
// tile. One tile of x rows serves four panels' weight tiles: with one panel per x tile, loading the
// x rows (16 lines from L2) took most of the time (perf); two panels per x tile were 0.84x one at
// 128 rows, and with four the draft's products over 128 rows took 67.5 against 250.7 ms on the dot
// products (one-off timings).
static TileConfig amx_int8_configs[17] __attribute__((aligned(64)));

#define AMX_INT8_PANELS 4  // panels per weight-tile group: one tile of x rows serves four weight tiles
// out [R][AMX_INT8_PANELS PANEL] (R as configured, readable rows of xq) = xq rows . `count` panels
// from `panel` (1..AMX_INT8_PANELS; the other columns are left as they are), over all of K4 (a
// multiple of 64). Tiles 0-3: sums; 4: rows of x; 5-7: weights (the fourth panel reuses tile 5).
static void amx_int8_chunk_rows(const uint8_t* xq, int64_t K4, const int8_t* panel, int count, int32_t* out) {
  const int64_t panel_bytes = K4 * PANEL;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K4; k += 64) {
    const int8_t* lines = panel + k * PANEL;  // 16 quad-lines of the first panel, 512 bytes
    for (int c = 0; c < count; ++c)
      for (int line = 0; line < 8; ++line) _mm_prefetch((const char*)(lines + c * panel_bytes) + PREFETCH_BYTES + 64 * line, _MM_HINT_T2);
    _tile_loadd(4, xq + k, K4);
    _tile_loadd(5, lines, PANEL * 4);
    _tile_dpbusd(0, 4, 5);
    if (count > 1) {
      _tile_loadd(6, lines + panel_bytes, PANEL * 4);
      _tile_dpbusd(1, 4, 6);
    }
    if (count > 2) {
      _tile_loadd(7, lines + 2 * panel_bytes, PANEL * 4);
      _tile_dpbusd(2, 4, 7);
    }
    if (count > 3) {
      _tile_loadd(5, lines + 3 * panel_bytes, PANEL * 4);
      _tile_dpbusd(3, 4, 5);
    }
  }
  const int64_t stride = AMX_INT8_PANELS * PANEL * 4;
  _tile_stored(0, out, stride);
  if (count > 1) _tile_stored(1, out + PANEL, stride);
  if (count > 2) _tile_stored(2, out + 2 * PANEL, stride);
  if (count > 3) _tile_stored(3, out + 3 * PANEL, stride);
}

// From this many rows: below it the dot products were 4-5% faster (the 0.5B draft's products, 1-4
// rows, paired timings in one process), from 6 rows the tiles (0.89x at 6, 0.72x at 8).
#define AMX_INT8_MIN_ROWS 6
static inline bool amx_int8_runs(int64_t M, int64_t K4) { return amx_enabled && M >= AMX_INT8_MIN_ROWS && K4 % 64 == 0; }
#else
#define AMX_INT8 0
#endif

static inline void store(float* y, float value, bool accumulate) {
  if (accumulate) *y += value;
  else *y = value;
}

// The loop every product shares: panels of y [M, N] split over the threads of the enclosing parallel
// region (an orphaned `omp for`: called outside one, it runs on the calling thread), rows in balanced
// chunks of at most MAX_ROWS (13 rows -> 7 + 6, not 12 + 1; a panel stays in cache between the
// chunks of one product). compute(rows, m0, p, out, k0, k1) fills out [rows][WIDTH] for panel p
// from row m0 over k0..k1 (continuing out's sums after the first block); value(entry, m, n) turns an
// entry into y[m, n] (row stride ldy), stored or, with ACCUMULATE, added (a residual).
//
// K_BLOCK > 0: chunks go in pairs, k block by k block (both chunks' rows of one block of the panel
// while it is in L1), so a pass over 13-24 rows streams each panel from memory once with the
// arithmetic of all its rows. One chunk after the other, the second chunk re-read the panel from
// L2 after the first had streamed it: on the 2-core Xeon (2026-12-01, 1.5 GB of the target's body
// shapes, 2 threads) 13 rows then cost 1.21x 12 rows (93 against 77 ms), a 14-token verification
// pass 1.37x an 11-token one. Together: 13 / 14 / 17 rows 4-7% cheaper (89 / 91 / 99 ms against
// 95 / 98 / 103, interleaved), 24-128 rows (prefill) unchanged; the rest of the gap to 12 rows is the
// extra arithmetic, which does not overlap the weight stream (README, Performance). Every output's
// chain of FMAs is unchanged, so the sums are too.
template <int WIDTH, int MAX_ROWS, typename Entry, bool ACCUMULATE, int64_t K_BLOCK = 0, typename Compute, typename Value>
static inline void for_panel_chunks(int64_t M, int64_t N, int64_t K, float* y, int64_t ldy, Compute compute, Value value) {
  constexpr int GROUP = K_BLOCK > 0 ? 2 : 1;
  const int64_t num_panels = (N + WIDTH - 1) / WIDTH, num_chunks = (M + MAX_ROWS - 1) / MAX_ROWS;
  const int64_t block = K_BLOCK > 0 ? K_BLOCK : K;
#pragma omp for schedule(static)
  for (int64_t p = 0; p < num_panels; ++p) {
    const int64_t n0 = p * WIDTH, cols = N - n0 < WIDTH ? N - n0 : WIDTH;
    Entry out[GROUP][MAX_ROWS * WIDTH] __attribute__((aligned(64)));
    int64_t m0 = 0;
    for (int64_t c = 0; c < num_chunks; c += GROUP) {
      const int group = num_chunks - c < GROUP ? (int)(num_chunks - c) : GROUP;
      int64_t rows[GROUP], first[GROUP];
      for (int g = 0; g < group; ++g) {
        const int64_t left = M - m0, remaining = num_chunks - c - g;
        rows[g] = (left + remaining - 1) / remaining;
        first[g] = m0;
        m0 += rows[g];
      }
      for (int64_t k0 = 0; k0 < K; k0 += block) {
        const int64_t k1 = k0 + block < K ? k0 + block : K;
        for (int g = 0; g < group; ++g) compute((int)rows[g], first[g], p, out[g], k0, k1);
      }
      for (int g = 0; g < group; ++g)
        for (int64_t m = 0; m < rows[g]; ++m)
          for (int64_t j = 0; j < cols; ++j)
            store(y + (first[g] + m) * ldy + n0 + j, value(out[g][m * WIDTH + j], first[g] + m, n0 + j), ACCUMULATE);
    }
  }
}

// The weights a product (and the lean stack) multiplies by: float32, int8 or bfloat16 panels.
enum WeightKind { F32_WEIGHTS = 0, INT8_WEIGHTS = 1, BF16_WEIGHTS = 2 };

#if BF16
// Rows of x as bfloat16 pairs for bf16_rows: pairs [M][ceil(K/2)] 32-bit words, rounded to nearest
// even as PyTorch's .to(torch.bfloat16) rounds (finite values), an odd K padded with a zero.
static void bf16_pairs(const float* x, int64_t M, int64_t K, uint32_t* pairs) {
  const int64_t K2 = (K + 1) / 2;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
#else
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
#endif
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    uint16_t* out = (uint16_t*)(pairs + m * K2);
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= K; k += 16) {
      __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(row + k));
      bits = _mm512_add_epi32(bits, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
      _mm256_storeu_si256((__m256i*)(out + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
    }
#else
    const auto rounded = [&](const float* from) {  // 8 floats' bfloat16 bits, in the low halves
      const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(from));
      return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(bits, 16), one))), 16);
    };
    for (; k + 16 <= K; k += 16)  // packus interleaves the two halves' 128-bit lanes; the permute restores the order
      _mm256_storeu_si256((__m256i*)(out + k), _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded(row + k), rounded(row + k + 8)), 0xD8));
#endif
    for (; k < K; ++k) {
      uint32_t bits;
      memcpy(&bits, row + k, 4);
      out[k] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
    if (K % 2) out[K] = 0;
  }
}
#endif

// One product y (+)= x . W^T * scale + bias, y with row stride ldy (0: N). The VNNI int8 path first
// quantises x into q (one thread; the others wait at the barrier; skipped when q already holds this
// x) and undoes the +128 activation offset with the column sums; the bfloat16 path rounds x into q
// as bfloat16 pairs the same way.
template <int KIND, bool ACCUMULATE = false>
static void panel_linear_for(const float* x, int64_t M, const Weight& w, float* y, Quantized q, int64_t ldy = 0, bool x_quantized = false) {
  constexpr bool INT8 = KIND == INT8_WEIGHTS;
  const int64_t N = w.N, K = w.K;
  ldy = ldy ? ldy : N;
#if BF16
  if (KIND == BF16_WEIGHTS) {
    const int64_t K2 = (K + 1) / 2, panel_words = K2 * 2 * F32_PANEL;
    const uint32_t* pairs = (const uint32_t*)q.xq;
    if (!x_quantized) {
#pragma omp single
      bf16_pairs(x, M, K, (uint32_t*)q.xq);
    }
    const auto with_bias = [&](float entry, int64_t, int64_t n) { return w.bias ? entry + w.bias[n] : entry; };
#if AMX_BF16
    if (M > 0 && amx_bf16_runs(K2)) {
      amx_configure(amx_bf16_configs, M);
      for_panel_chunks<F32_PANEL, AMX_CHUNK_ROWS, float, ACCUMULATE, F32_K_BLOCK>(
          M, N, K2, y, ldy,
          [&](int, int64_t m0, int64_t p, float* out, int64_t k0, int64_t k1) {  // a chunk's rows: the configured tile rows
            amx_bf16_chunk_rows(pairs + m0 * K2, K2, (const uint16_t*)w.packed + p * panel_words, out, k0, k1);
          },
          with_bias);
      _tile_release();
      return;
    }
#endif
    for_panel_chunks<F32_PANEL, BF16_MAX_ROWS, float, ACCUMULATE, F32_K_BLOCK>(
        M, N, K2, y, ldy,
        [&](int rows, int64_t m0, int64_t p, float* out, int64_t k0, int64_t k1) {
          bf16_chunk_rows(rows, pairs + m0 * K2, K2, (const uint16_t*)w.packed + p * panel_words, out, k0, k1);
        },
        with_bias);
    return;
  }
#endif
#if VNNI
  if (INT8) {
    const int64_t K4 = round_up4(K);
    if (!x_quantized) {
#pragma omp single
      quantize_rows(x, M, K, q);
    }
    const auto scaled = [&](int32_t dot, int64_t m, int64_t n) { return vnni_output(w, q, dot, m, n); };
#if AMX_INT8
    if (amx_int8_runs(M, K4)) {
      amx_configure(amx_int8_configs, M);
      const int64_t num_panels = (N + PANEL - 1) / PANEL;
      for_panel_chunks<AMX_INT8_PANELS * PANEL, AMX_CHUNK_ROWS, int32_t, ACCUMULATE>(
          M, N, K, y, ldy,
          [&](int, int64_t m0, int64_t g, int32_t* out, int64_t, int64_t) {  // a chunk's rows: the configured tile rows
            const int64_t first = AMX_INT8_PANELS * g, count = num_panels - first < AMX_INT8_PANELS ? num_panels - first : AMX_INT8_PANELS;
            amx_int8_chunk_rows(q.xq + m0 * K4, K4, (const int8_t*)w.packed + first * K4 * PANEL, (int)count, out);
          },
          scaled);
      _tile_release();
      return;
    }
#endif
    for_panel_chunks<PANEL, MAX_VNNI_CHUNK_ROWS, int32_t, ACCUMULATE>(
        M, N, K, y, ldy,
        [&](int rows, int64_t m0, int64_t p, int32_t* out, int64_t, int64_t) {
          vnni_chunk_rows(rows, q.xq + m0 * K4, K4, (const int8_t*)w.packed + p * K4 * PANEL, out);
        },
        scaled);
    return;
  }
#endif
  (void)q;
  (void)x_quantized;
  const auto scaled = [&](float entry, int64_t, int64_t n) {
    const float value = w.scale ? entry * w.scale[n] : entry;
    return w.bias ? value + w.bias[n] : value;
  };
  if (INT8 && (M == 1 || M == 2)) {  // groups of panels side by side (side_panel_rows)
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const auto groups = [&](auto rows) {
      constexpr int ROWS = decltype(rows)::value, PANELS = int8_side_panels(ROWS);
      for_panel_chunks<PANELS * PANEL, ROWS, float, ACCUMULATE>(
          M, N, K, y, ldy,
          [&](int, int64_t, int64_t g, float* out, int64_t, int64_t) {
            const int64_t first = g * PANELS;
            side_panel_rows<ROWS>(x, K, (const int8_t*)w.packed + first * K * PANEL, std::min<int64_t>(PANELS, num_panels - first), out);
          },
          scaled);
    };
    if (M == 1) groups(std::integral_constant<int, 1>());
    else groups(std::integral_constant<int, 2>());
    return;
  }
  constexpr int WIDTH = INT8 ? PANEL : F32_PANEL, MAX_ROWS = INT8 ? MAX_CHUNK_ROWS : F32_MAX_ROWS;
  const int64_t panel_bytes = K * WIDTH * (INT8 ? 1 : 4);
  constexpr int64_t K_BLOCK = INT8 ? 0 : F32_K_BLOCK;
  for_panel_chunks<WIDTH, MAX_ROWS, float, ACCUMULATE, K_BLOCK>(
      M, N, K, y, ldy,
      [&](int rows, int64_t m0, int64_t p, float* out, int64_t k0, int64_t k1) {
        const void* panel = (const char*)w.packed + p * panel_bytes;
        if (INT8) chunk_rows(rows, x + m0 * K, K, (const int8_t*)panel, out);
        else f32_chunk_rows(rows, x + m0 * K, K, (const float*)panel, out, k0, k1);
      },
      scaled);
}

// Scratch for quantised rows (VNNI int8: bytes 1) or bfloat16 pairs (bytes 2): M rows of width K.
struct QuantizedBuffer {
  Quantized q;
  QuantizedBuffer(int64_t M, int64_t K, int64_t bytes = 1) {
    const int64_t padded = M > 0 ? M + AMX_PAD_ROWS : M;  // rows a tile may read past the last
    q.xq = (uint8_t*)calloc(padded * round_up4(K) * bytes + 64, 1);
    q.xscale = (float*)malloc(sizeof(float) * M);
  }
  ~QuantizedBuffer() {
    free(q.xq);
    free(q.xscale);
  }
};

template <bool INT8>
static void panel_linear(const float* x, int64_t M, const Weight& w, float* y, int num_threads) {
  QuantizedBuffer buffer(INT8 ? M : 0, INT8 ? w.K : 0);
#pragma omp parallel num_threads(num_threads)
  panel_linear_for<INT8 ? INT8_WEIGHTS : F32_WEIGHTS>(x, M, w, y, buffer.q);
}

// ---------------------------------------------------------------------------------------------
// A whole Llama/Qwen2-family decoder stack for a few new tokens, in one call.
//
// Why: a 1-token step of the 0.5B draft spends ~20 ms in its products but ~8 ms more dispatching
// ~700 small PyTorch ops around them (norms, rotary, cache writes, attention, SiLU, residuals),
// one parallel region each. Here the whole stack is one parallel region: the products split their
// panels over the threads, the small steps between them run on one thread or split by head/element,
// with a barrier between phases. Same arithmetic as lean_lm.LeanDecoder.forward (to rounding).
//
// Per layer l (h = hidden, H/KV heads of size D, I = intermediate; weights are panels as above):
//   a = rmsnorm(x) * norms[2l];  qkv = a . W_qkv^T;  q, k <- rotary(q, k);  cache[l] <- k, v;
//   x += softmax(q k^T / sqrt(D), causal) v . W_o^T;
//   a = rmsnorm(x) * norms[2l+1];  [g, u] = a . W_gu^T;  x += (silu(g) * u) . W_down^T
// and out = rmsnorm(x) * final_norm.
// W_qkv may come as one stacked weight or as q, k, v (qkv_parts 3), W_gu as one or as gate, up
// (gate_up_parts 2): the parts write side by side into one output row, so a model's own weights
// run without a stacked copy.
struct LeanStackDims {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, qkv_parts, gate_up_parts;
  float eps;
};

// The sequences a pass extends: its n rows are, in order, rows[0] new tokens of sequence 0, rows[1]
// of sequence 1, ... Sequence s holds starts[s] cached positions; its KV buffers for layer l are
// caches[2 (l count + s)] (keys) and caches[2 (l count + s) + 1] (values) [kv_heads, capacity, head_dim]
// with capacity = capacities[l count + s]. The products run over all n rows at once (each row computed
// as it is alone); attention reads each row's own sequence only.
struct Segments {
  int64_t count;
  const int64_t* rows;
  const int64_t* starts;
  const int64_t* capacities;
  float* const* caches;
  // Per row (null: every row is a chain row), a branch row's prefix: it sees cache positions
  // 0..prefix-1 and then its own slot, as if it sat at position prefix (a draft tree's alternative
  // token, stored after the chain). -1 for a chain row: it sees every position up to its own slot.
  const int64_t* row_prefix;
  // Per row (null: no branch has a parent), a branch row's parent branch row (a deeper draft tree:
  // the row continues that branch), or -1: between the prefix and its own slot the row sees its
  // ancestors' slots, root first, as positions prefix, prefix + 1, ... (so it sits at prefix + depth).
  const int64_t* row_parent;
};

// Products whose outputs sit side by side in y [M, sum of the parts' N]; x is quantised once (VNNI).
template <int KIND>
static void grouped_linear_for(const float* x, int64_t M, const Weight* parts, int64_t count, float* y, Quantized q) {
  int64_t width = 0, offset = 0;
  for (int64_t j = 0; j < count; ++j) width += parts[j].N;
  for (int64_t j = 0; j < count; ++j) {
    panel_linear_for<KIND>(x, M, parts[j], y + offset, q, width, j > 0);
    offset += parts[j].N;
  }
}

static void rms_norm_rows(const float* x, int64_t rows, int64_t width, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * width;
    double sum = 0.0;
    for (int64_t j = 0; j < width; ++j) sum += (double)row[j] * row[j];
    const float inv = 1.0f / sqrtf((float)(sum / width) + eps);
    for (int64_t j = 0; j < width; ++j) out[r * width + j] = row[j] * inv * weight[j];
  }
}

// Half-split rotary (rotate_half): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos/sin [D] per row.
static void rotate(float* v, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = v[j], x2 = v[j + half];
    v[j] = x1 * cos[j] - x2 * sin[j];
    v[j + half] = x2 * cos[j + half] + x1 * sin[j + half];
  }
}

// out[0..3] = the sums of the lanes of w0..w3, by one fixed tree:
// hadd(hadd(w0, w1), hadd(w2, w3)) holds each vector's partial sums, one per lane and half.
static inline void sum_lanes4(__m256 w0, __m256 w1, __m256 w2, __m256 w3, float* out) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(w0, w1), _mm256_hadd_ps(w2, w3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
}

#if defined(__AVX512F__)
// The same for 16 lanes: each folded to 8 lanes (lane j + lane j+8), then the 8-lane tree.
static inline void sum_lanes4(__m512 w0, __m512 w1, __m512 w2, __m512 w3, float* out) {
  const auto fold = [](__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))); };
  sum_lanes4(fold(w0), fold(w1), fold(w2), fold(w3), out);
}
#endif

// The dot products of a with four vectors b[0..3]: four independent chains of FMAs instead of one
// (one chain waits on each FMA's latency: ~75 cycles a key at head_dim 128), reduced together. Every
// attention score is this function of its query and key alone (a lone key passes itself four times:
// the same lanes and sums), so it does not depend on which keys were computed beside it.
static inline void dot4(const float* a, const float* const* b, int64_t n, float* out) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {  // 16 lanes: half the instructions; each half-sum then reduced as below
    __m512 wide0 = _mm512_setzero_ps(), wide1 = _mm512_setzero_ps(), wide2 = _mm512_setzero_ps(), wide3 = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __m512 x = _mm512_loadu_ps(a + j);
      wide0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[0] + j), wide0);
      wide1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[1] + j), wide1);
      wide2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[2] + j), wide2);
      wide3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[3] + j), wide3);
    }
    sum_lanes4(wide0, wide1, wide2, wide3, out);
    return;
  }
#endif
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(a + j);
    acc0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[0] + j), acc0);
    acc1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[1] + j), acc1);
    acc2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[2] + j), acc2);
    acc3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[3] + j), acc3);
  }
  sum_lanes4(acc0, acc1, acc2, acc3, out);
  for (int64_t k = 0; k < 4; ++k)
    for (int64_t tail = j; tail < n; ++tail) out[k] += a[tail] * b[k][tail];
}

// e^x for 8 floats (Cephes' expf: e^x = 2^n e^r with n = round(x log2 e), r = x - n ln 2 in two
// steps, e^r by a degree-7 polynomial; within 2 ulp of expf). Why not expf: the SiLU of a pass over n
// rows takes n x intermediate exponentials a layer and the softmax n x heads x cached positions; one
// call each was ~10 ms of a 12-row verification pass of the 1.5B target. Every lane is computed alone,
// the same whatever its neighbours, so a row's outputs stay independent of the rows beside it.
// x is clamped to [-87, 88] (no overflow, no denormals: e^-87 ~ 1.6e-38 stands in for smaller
// values); NaN passes through.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e_r = _mm256_add_ps(_mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e_r, _mm256_castsi256_ps(exponent));
}

// out[j] = lanes(a[j], b[j]) for j < count, 8 floats at a time (b null: zeros); a tail shorter than 8
// goes through the same lanes, zero-padded, so each value's result does not depend on where it sits.
template <typename Lanes>
static inline void map_lanes(const float* a, const float* b, float* out, int64_t count, Lanes lanes) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) _mm256_storeu_ps(out + j, lanes(_mm256_loadu_ps(a + j), b ? _mm256_loadu_ps(b + j) : _mm256_setzero_ps()));
  if (j < count) {
    float a_tail[8] = {0}, b_tail[8] = {0};
    memcpy(a_tail, a + j, sizeof(float) * (count - j));
    if (b) memcpy(b_tail, b + j, sizeof(float) * (count - j));
    _mm256_storeu_ps(a_tail, lanes(_mm256_loadu_ps(a_tail), _mm256_loadu_ps(b_tail)));
    memcpy(out + j, a_tail, sizeof(float) * (count - j));
  }
}

// y[j] = e^x[j] for j < count.
static inline void exp_into(const float* x, float* y, int64_t count) {
  map_lanes(x, nullptr, y, count, [](__m256 xv, __m256) { return exp8(xv); });
}

// act[j] = silu(g[j]) * u[j] = g / (1 + e^-g) * u for j < count.
static inline void silu_mul_into(const float* g, const float* u, float* act, int64_t count) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  map_lanes(g, u, act, count, [&](__m256 gv, __m256 uv) {
    return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)))), uv);
  });
}

// score[0..count) <- softmax(score * scaling), 8 lanes at a time: every step is elementwise or a
// fixed order of sums over the row (8 lane sums, then lanes 0..7), so a row's weights depend on
// its scores alone. Returns the log of the normaliser, log sum_t e^(score[t] scaling).
static float softmax_row(float* score, int64_t count, float scaling) {
  const __m256 scale = _mm256_set1_ps(scaling);
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(score + t), scale);
    _mm256_storeu_ps(score + t, scaled);
    top8 = _mm256_max_ps(top8, scaled);
  }
  float lanes[8], top = -INFINITY;
  _mm256_storeu_ps(lanes, top8);
  for (int j = 0; j < 8; ++j) top = lanes[j] > top ? lanes[j] : top;
  for (; t < count; ++t) {
    score[t] *= scaling;
    top = score[t] > top ? score[t] : top;
  }
  const __m256 top_lanes = _mm256_set1_ps(top);
  map_lanes(score, nullptr, score, count, [&](__m256 x, __m256) { return exp8(_mm256_sub_ps(x, top_lanes)); });
  __m256 sum8 = _mm256_setzero_ps();
  for (t = 0; t + 8 <= count; t += 8) sum8 = _mm256_add_ps(sum8, _mm256_loadu_ps(score + t));
  _mm256_storeu_ps(lanes, sum8);
  float total = 0.0f;
  for (int j = 0; j < 8; ++j) total += lanes[j];
  for (; t < count; ++t) total += score[t];
  const __m256 total_lanes = _mm256_set1_ps(total);
  map_lanes(score, nullptr, score, count, [&](__m256 x, __m256) { return _mm256_div_ps(x, total_lanes); });
  return top + logf(total);
}

// score[t] = dot4(query, key t) for t in t0..t1 (multiples of 4). With AVX-512 and head_dim 64 or
// 128 the query stays in registers across the keys (the same operations as dot4): reloading it
// per key kept a block's keys from staying in L1 while a few dozen tasks took turns.
#if defined(__AVX512F__)
template <int V>
static inline void scores_in_registers(const float* query, const float* key_rows, int64_t t0, int64_t t1, float* score) {
  constexpr int64_t D = 16 * V;
  __m512 x[V];
  for (int v = 0; v < V; ++v) x[v] = _mm512_loadu_ps(query + 16 * v);
  for (int64_t t = t0; t < t1; t += 4) {
    const float* keys = key_rows + t * D;
    __m512 wide0 = _mm512_setzero_ps(), wide1 = _mm512_setzero_ps(), wide2 = _mm512_setzero_ps(), wide3 = _mm512_setzero_ps();
    for (int v = 0; v < V; ++v) {
      wide0 = _mm512_fmadd_ps(x[v], _mm512_loadu_ps(keys + 16 * v), wide0);
      wide1 = _mm512_fmadd_ps(x[v], _mm512_loadu_ps(keys + D + 16 * v), wide1);
      wide2 = _mm512_fmadd_ps(x[v], _mm512_loadu_ps(keys + 2 * D + 16 * v), wide2);
      wide3 = _mm512_fmadd_ps(x[v], _mm512_loadu_ps(keys + 3 * D + 16 * v), wide3);
    }
    sum_lanes4(wide0, wide1, wide2, wide3, score + t);
  }
}
#endif

// Positions a tile's first pass prefetches ahead, into L2 (see the AVX2 tiles below).
#define ATTENTION_PREFETCH 128

// ctx[r][first..first + LANES V) (+)= sum_t score[r][t] value[t][first..] for each of TASKS tasks r
// and t in t0..t1 (continuing ctx unless t0 is 0), or for the one slot `own` (>= 0) with weight
// score[r][t0]: V vectors of each task's head in registers, one chain of FMAs per element, the
// tasks sharing each value vector loaded (TASKS > 1: the AVX2 tiles below). PREFETCH: also whole
// value rows ATTENTION_PREFETCH positions ahead. Why registers: with a run-time column count gcc
// kept the sums in memory, a load and a store beside every FMA. AVX2 (8 lanes: 16 registers hold
// half of a 128-wide head), one kv group of the 1.5B target (6 query heads) over 16K positions, one
// core, timed alone (2026-12-07, a Zen 4 EPYC without AVX-512): 8 rows 10.5 -> 7.8 ms a layer, 1 row
// 1.32 -> 1.03 ms; inside 60 real 8-row passes at 16K (perf, cpu-clock) the attention's share fell
// less, 41 -> 36 CPU-seconds.
template <typename Vec, int TASKS, int V, bool PREFETCH = false>
static inline __attribute__((always_inline)) void weighted_values(const float* const* score, const float* value_rows, int64_t D, int64_t first, int64_t t0,
                                                                  int64_t t1, int64_t own, float* const* ctx) {
  typename Vec::V acc[TASKS][V];
  for (int r = 0; r < TASKS; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = t0 == 0 ? Vec::zero() : Vec::load(ctx[r] + first + Vec::LANES * v);
  for (int64_t t = t0; t < t1; ++t) {
    if (PREFETCH)
      for (int64_t line = 0; line < D; line += 16) _mm_prefetch((const char*)(value_rows + (t + ATTENTION_PREFETCH) * D + line), _MM_HINT_T1);
    typename Vec::V weight[TASKS];
    for (int r = 0; r < TASKS; ++r) weight[r] = Vec::broadcast(score[r][t]);
    const float* value_row = value_rows + (own >= 0 ? own : t) * D + first;
    for (int v = 0; v < V; ++v) {
      const typename Vec::V value = Vec::load(value_row + Vec::LANES * v);
      for (int r = 0; r < TASKS; ++r) acc[r][v] = Vec::fma(weight[r], value, acc[r][v]);
    }
  }
  for (int r = 0; r < TASKS; ++r)
    for (int v = 0; v < V; ++v) Vec::store(ctx[r] + first + Vec::LANES * v, acc[r][v]);
}

static inline void scores_of(const float* query, const float* key_rows, int64_t t0, int64_t t1, int64_t D, float* score) {
#if defined(__AVX512F__)
  if (D == 128) return scores_in_registers<8>(query, key_rows, t0, t1, score);
  if (D == 64) return scores_in_registers<4>(query, key_rows, t0, t1, score);
#endif
  for (int64_t t = t0; t < t1; t += 4) {
    const float* keys[4] = {key_rows + t * D, key_rows + (t + 1) * D, key_rows + (t + 2) * D, key_rows + (t + 3) * D};
    dot4(query, keys, D, score + t);
  }
}

#if !defined(__AVX512F__)
// Three tasks at a time (AVX2 without AVX-512). Why: a Zen 4 EPYC whose VM shows AVX2 only issues
// ~1.3 256-bit loads a cycle beside its two FMAs, and one task's loops load once per FMA (a key
// or value vector beside the query, or beside the broadcast weight): scores and value sums ran at
// ~21 and ~23 of its 45.6 G multiply-adds/s a core (2026-12-07). Three tasks share each key and
// value vector they load, 7 loads to 12 FMAs: ~39 and ~41 (scores3 here, weighted_values above with
// three tasks). Each score and context element is still the operations the one-task kernels perform,
// in the same order (dot4's chains and sum_lanes4, one chain of FMAs per element over the
// positions), so a task computes what it computes alone.
//
// The first tile of a block also asks for the rows ATTENTION_PREFETCH positions ahead to be brought
// into L2. Why: with fewer passes over each block in L1 the hardware prefetcher fell behind — a
// 1-row pass's attention over 16K positions got slower (63 -> 72 ms, 28 layers, 2 threads) while
// 8 rows got faster; with the prefetch 1 row takes 46 ms and 8 rows 209 (from 312), and every
// distance from 64 to 512 rows measured alike.
#define ATTENTION_TILE 3

// score[r][t] = dot4(query[r], key t) for r < 3 and t in t0..t1 (multiples of 4); D a multiple of 8.
// PREFETCH: also the keys ATTENTION_PREFETCH positions ahead (prefetches past the cache never fault).
template <bool PREFETCH>
static inline void scores3(const float* const* query, const float* key_rows, int64_t t0, int64_t t1, int64_t D, float* const* score) {
  for (int64_t t = t0; t < t1; t += 4) {
    const float* keys = key_rows + t * D;
    if (PREFETCH)
      for (int64_t line = 0; line < 4 * D; line += 16) _mm_prefetch((const char*)(keys + ATTENTION_PREFETCH * D + line), _MM_HINT_T1);
    __m256 acc[3][4];
    for (int r = 0; r < 3; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; j += 8) {
      const __m256 x0 = _mm256_loadu_ps(query[0] + j), x1 = _mm256_loadu_ps(query[1] + j), x2 = _mm256_loadu_ps(query[2] + j);
      for (int k = 0; k < 4; ++k) {
        const __m256 key = _mm256_loadu_ps(keys + k * D + j);
        acc[0][k] = _mm256_fmadd_ps(x0, key, acc[0][k]);
        acc[1][k] = _mm256_fmadd_ps(x1, key, acc[1][k]);
        acc[2][k] = _mm256_fmadd_ps(x2, key, acc[2][k]);
      }
    }
    for (int r = 0; r < 3; ++r) sum_lanes4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], score[r] + t);
  }
}

#else
#define ATTENTION_TILE 0  // AVX-512: one task at a time, as before (its loads are a whole line per FMA; not measured)
#endif

// Attention of one pass, one work item: kv group g of one sequence and a slice of its tasks (task =
// one of its rows x one of the group's query heads). Why this shape: one task per (row, head), each
// reading the whole cache, streamed a group's keys and values group size x rows times a layer; at
// 8,192 cached positions (8 MB a task in the 1.5B target) a pass over 8 rows cost ~3x a 1-row step
// (2026-12-03, 2 threads). Here the item walks the cache in blocks of ATTENTION_BLOCK positions and
// every task of the item uses a block while it is in cache: each key and value is read from memory
// once per item (8 rows at 8K positions: ~1.9x a 1-row step, which itself got ~20% cheaper). Every
// score is dot4 of its query and key, and every context element one chain of FMAs over the
// positions in order (continued across blocks through ctx), so a row's outputs do not depend on the
// rows or blocks beside it.
//
// A task sees positions 0..prefix-1 of the cache and then the slots of its tail as positions
// prefix, prefix + 1, ...: a chain row has prefix = its position and tail = {its own slot}; a branch
// row (a draft tree's alternative token, stored after the chain) has its own prefix and tail = its
// ancestor branches' slots, then its own, and computes exactly what its path fed in the chain at
// position prefix computes.
#define ATTENTION_BLOCK 32
struct AttentionTask {
  const float* query;  // [D]
  float* score;        // [prefix + tail_len]: raw scores, then the softmax weights
  float* ctx;          // [D] output
  int64_t prefix;
  const int64_t* tail;  // [tail_len] cache slots, the last one the row's own
  int64_t tail_len;
  float* lse = nullptr;  // if set, receives the log of the softmax's normaliser (see softmax_row)
};

static void attend(const AttentionTask* tasks, int64_t count, const float* key_rows, const float* value_rows, int64_t D, float scaling) {
  int64_t widest = 0;
  for (int64_t task = 0; task < count; ++task) widest = tasks[task].prefix > widest ? tasks[task].prefix : widest;
  // Scores of positions below prefix, four at a time, block by block; then the last prefix % 4 of
  // them and the tail's slots, four at a time (padded by repeating the own key).
  // Tasks in tiles of three (AVX2) over the positions all three see in the block, each then alone
  // over the rest of its own; the last count % 3 alone.
#if ATTENTION_TILE
  const int64_t tiled = D % 8 == 0 ? count - count % ATTENTION_TILE : 0;
#else
  const int64_t tiled = 0;
#endif
  for (int64_t t0 = 0; t0 < widest; t0 += ATTENTION_BLOCK) {
    const auto end_of = [&](const AttentionTask& a) { return std::min(t0 + ATTENTION_BLOCK, a.prefix & ~(int64_t)3); };
#if ATTENTION_TILE
    for (int64_t task = 0; task < tiled; task += ATTENTION_TILE) {
      const AttentionTask* a = tasks + task;
      const int64_t common = std::min({end_of(a[0]), end_of(a[1]), end_of(a[2])});
      const float* queries[3] = {a[0].query, a[1].query, a[2].query};
      float* scores[3] = {a[0].score, a[1].score, a[2].score};
      if (task == 0) scores3<true>(queries, key_rows, t0, common, D, scores);
      else scores3<false>(queries, key_rows, t0, common, D, scores);
      for (int r = 0; r < 3; ++r) scores_of(a[r].query, key_rows, std::max(t0, common), end_of(a[r]), D, a[r].score);
    }
#endif
    for (int64_t task = tiled; task < count; ++task) scores_of(tasks[task].query, key_rows, t0, end_of(tasks[task]), D, tasks[task].score);
  }
  for (int64_t task = 0; task < count; ++task) {
    const AttentionTask& a = tasks[task];
    const int64_t visible = a.prefix + a.tail_len;
    const auto slot = [&](int64_t t) { return t < a.prefix ? t : a.tail[(t < visible ? t : visible - 1) - a.prefix]; };
    for (int64_t first = a.prefix & ~(int64_t)3; first < visible; first += 4) {
      const float* keys[4];
      float last[4];
      for (int64_t b = 0; b < 4; ++b) keys[b] = key_rows + slot(first + b) * D;
      dot4(a.query, keys, D, last);
      memcpy(a.score + first, last, sizeof(float) * (visible - first < 4 ? visible - first : 4));
    }
    const float lse = softmax_row(a.score, visible, scaling);
    if (a.lse) *a.lse = lse;
  }
  // ctx = sum_t score[t] value[t], positions block by block, then the tail's slots: a head of 64 or
  // 128 in 16-lane registers (AVX-512), else 64 columns at a time in 8-lane registers and the last
  // head_dim % 64 (a multiple of 8, checked by the caller) 8 at a time. `slot` >= 0: the one
  // position t0 reads that cache slot's value.
  const auto accumulate = [&](const AttentionTask& a, int64_t t0, int64_t t1, int64_t slot) {
#if defined(__AVX512F__)
    if (D == 128) return weighted_values<Lanes16, 1, 8>(&a.score, value_rows, D, 0, t0, t1, slot, &a.ctx);
    if (D == 64) return weighted_values<Lanes16, 1, 4>(&a.score, value_rows, D, 0, t0, t1, slot, &a.ctx);
#endif
    int64_t first = 0;
    for (; first + 64 <= D; first += 64) weighted_values<Lanes8, 1, 8>(&a.score, value_rows, D, first, t0, t1, slot, &a.ctx);
    for (; first < D; first += 8) weighted_values<Lanes8, 1, 1>(&a.score, value_rows, D, first, t0, t1, slot, &a.ctx);
  };
  for (int64_t t0 = 0; t0 < widest; t0 += ATTENTION_BLOCK) {
    const auto end_of = [&](const AttentionTask& a) { return std::min(t0 + ATTENTION_BLOCK, a.prefix); };
#if ATTENTION_TILE
    for (int64_t task = 0; task < tiled; task += ATTENTION_TILE) {
      const AttentionTask* a = tasks + task;
      const int64_t common = std::min({end_of(a[0]), end_of(a[1]), end_of(a[2])});
      if (common > t0) {
        const float* scores[3] = {a[0].score, a[1].score, a[2].score};
        float* ctx[3] = {a[0].ctx, a[1].ctx, a[2].ctx};
        int64_t first = 0;
        if (task == 0 && D >= 32) weighted_values<Lanes8, 3, 4, true>(scores, value_rows, D, 0, t0, common, -1, ctx), first = 32;
        for (; first + 32 <= D; first += 32) weighted_values<Lanes8, 3, 4>(scores, value_rows, D, first, t0, common, -1, ctx);
        for (; first < D; first += 8) weighted_values<Lanes8, 3, 1>(scores, value_rows, D, first, t0, common, -1, ctx);
      }
      for (int r = 0; r < 3; ++r)
        if (std::max(t0, common) < end_of(a[r])) accumulate(a[r], std::max(t0, common), end_of(a[r]), -1);
    }
#endif
    for (int64_t task = tiled; task < count; ++task)
      if (t0 < tasks[task].prefix) accumulate(tasks[task], t0, end_of(tasks[task]), -1);
  }
  for (int64_t task = 0; task < count; ++task)
    for (int64_t i = 0; i < tasks[task].tail_len; ++i) accumulate(tasks[task], tasks[task].prefix + i, tasks[task].prefix + i + 1, tasks[task].tail[i]);
}

// Slices per kv group when attention's work items are `groups` kv groups: a group is split only
// when there are fewer groups than threads (each slice reads the group's cache once).
static inline int64_t attention_slices(int64_t groups, int num_threads) { return std::max<int64_t>(1, (num_threads + groups - 1) / groups); }

template <int KIND>
static void lean_stack(const LeanStackDims& d, const Segments& seq, int64_t n, float* x, const float* cos, const float* sin,
                       const Weight* weights, const float* const* norms, const float* final_norm, float* out, int num_threads) {
  const int64_t H = d.heads, KV = d.kv_heads, D = d.head_dim, I = d.intermediate, h = d.hidden;
  const int64_t qkv_width = (H + 2 * KV) * D, group = H / KV;
  // Per row: its sequence and its position in that sequence (what it sees: positions 0..position).
  int64_t* row_seq = (int64_t*)malloc(sizeof(int64_t) * 2 * n);
  int64_t* row_pos = row_seq + n;
  std::vector<int64_t> seq_first(seq.count);  // each sequence's first row
  int64_t end = 0;  // the longest sequence after the pass: the width of a row's scores
  for (int64_t s = 0, i = 0; s < seq.count; ++s) {
    seq_first[s] = i;
    for (int64_t j = 0; j < seq.rows[s]; ++j, ++i) row_seq[i] = s, row_pos[i] = seq.starts[s] + j;
    end = seq.starts[s] + seq.rows[s] > end ? seq.starts[s] + seq.rows[s] : end;
  }
  // Each row's tail (see AttentionTask): its branch ancestors' slots, root first, then its own.
  std::vector<int64_t> tail_first(n + 1, 0), tails;
  for (int64_t i = 0; i < n; ++i) {
    tail_first[i] = (int64_t)tails.size();
    for (int64_t row = i; row >= 0; row = seq.row_parent ? seq.row_parent[row] : -1) tails.push_back(row_pos[row]);
    std::reverse(tails.begin() + tail_first[i], tails.end());
  }
  tail_first[n] = (int64_t)tails.size();
  float* buffer = (float*)malloc(sizeof(float) * (n * (h + qkv_width + H * D + 3 * I) + n * H * end));
  float* normed = buffer;                  // [n, h]
  float* qkv = normed + n * h;             // [n, (H + 2 KV) D]
  float* context = qkv + n * qkv_width;    // [n, H D]
  float* gate_up = context + n * H * D;    // [n, 2 I]
  float* act = gate_up + n * 2 * I;        // [n, I]
  float* scores = act + n * I;             // [n H, end]
  int64_t widest = h > I ? h : I;
  widest = widest > H * D ? widest : H * D;
  QuantizedBuffer quantized(KIND != F32_WEIGHTS ? n : 0, KIND != F32_WEIGHTS ? widest : 0, KIND == BF16_WEIGHTS ? 2 : 1);
  const Quantized q = quantized.q;
  const float scaling = 1.0f / sqrtf((float)D);
  // Attention work items: each sequence's kv groups (attention_slices).
  const int64_t slices = attention_slices(seq.count * KV, num_threads);
#pragma omp parallel num_threads(num_threads)
  for (int64_t l = 0; l < d.num_layers; ++l) {
    // qkv (qkv_parts weights), o, gate_up (gate_up_parts weights), down
    const Weight* qkv_w = weights + l * (d.qkv_parts + d.gate_up_parts + 2);
    const Weight& o_w = qkv_w[d.qkv_parts];
    const Weight* gate_up_w = qkv_w + d.qkv_parts + 1;
    const Weight& down_w = gate_up_w[d.gate_up_parts];
    // Sequence s's keys / values of this layer [KV, capacity, D] and their capacity.
    float* const* layer_caches = seq.caches + 2 * l * seq.count;
    const int64_t* layer_capacities = seq.capacities + l * seq.count;
#pragma omp single
    rms_norm_rows(x, n, h, norms[2 * l], d.eps, normed);
    grouped_linear_for<KIND>(normed, n, qkv_w, d.qkv_parts, qkv, q);
#pragma omp single
    for (int64_t i = 0; i < n; ++i) {
      float* row = qkv + i * qkv_width;
      float* keys = layer_caches[2 * row_seq[i]];
      float* values = layer_caches[2 * row_seq[i] + 1];
      const int64_t capacity = layer_capacities[row_seq[i]];
      for (int64_t head = 0; head < H + KV; ++head) rotate(row + head * D, D, cos + i * D, sin + i * D);
      for (int64_t g = 0; g < KV; ++g) {
        memcpy(keys + (g * capacity + row_pos[i]) * D, row + (H + g) * D, sizeof(float) * D);
        memcpy(values + (g * capacity + row_pos[i]) * D, row + (H + KV + g) * D, sizeof(float) * D);
      }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < seq.count * KV * slices; ++item) {
      const int64_t s = item / (KV * slices), g = item / slices % KV, slice = item % slices;
      const int64_t count = seq.rows[s] * group, first = count * slice / slices, last = count * (slice + 1) / slices;
      const int64_t capacity = layer_capacities[s];
      std::vector<AttentionTask> tasks(last - first);
      for (int64_t task = first; task < last; ++task) {
        const int64_t i = seq_first[s] + task / group, head = g * group + task % group, own = row_pos[i];
        tasks[task - first] = {qkv + i * qkv_width + head * D, scores + (i * H + head) * end, context + i * H * D + head * D,
                               seq.row_prefix && seq.row_prefix[i] >= 0 ? seq.row_prefix[i] : own, tails.data() + tail_first[i],
                               tail_first[i + 1] - tail_first[i]};
      }
      attend(tasks.data(), last - first, layer_caches[2 * s] + g * capacity * D, layer_caches[2 * s + 1] + g * capacity * D, D, scaling);
    }
    panel_linear_for<KIND, true>(context, n, o_w, x, q);
#pragma omp single
    rms_norm_rows(x, n, h, norms[2 * l + 1], d.eps, normed);
    grouped_linear_for<KIND>(normed, n, gate_up_w, d.gate_up_parts, gate_up, q);
    // In blocks of 64 per row: split over the threads, each element computed the same either way.
    const int64_t blocks_per_row = (I + 63) / 64;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n * blocks_per_row; ++b) {
      const int64_t i = b / blocks_per_row, j = (b % blocks_per_row) * 64;
      const int64_t count = I - j < 64 ? I - j : 64;
      silu_mul_into(gate_up + i * 2 * I + j, gate_up + i * 2 * I + I + j, act + i * I + j, count);
    }
    panel_linear_for<KIND, true>(act, n, down_w, x, q);
  }
  rms_norm_rows(x, n, h, final_norm, d.eps, out);
  free(buffer);
  free(row_seq);
}

#if VNNI
// A 4-bit screen of an int8 LM head, for a greedy draft model's steps. Why: a draft step of the
// int8 0.5B draft streams 494 MB, 136 MB of it the head [151,936 x 896], and all a greedy draft
// needs from the head is its top token and that token's probability (the path stop). The draft's
// choice never touches exactness (verification does), so a cheaper head only has to pick what the
// int8 head picks nearly always: every logit comes from 4-bit weights (half the bytes), then the
// panels holding each row's `candidates` largest are recomputed by the int8 head's own kernel, bit
// for bit its values. Measured over 516 positions of the draft's answers to HumanEval problems
// 8-15 (one-off script): the int8 head's argmax was among the 4-bit top 64 at every one, and the
// top token's probability moved by at most 0.0004.
//
// Layout: panels of 8 columns over pairs of k-quads, [ceil(N/8)][ceil(K4/8)][8][4] bytes; byte i of
// column c in pair j holds the weight at k = 8j + i in its low nibble and k = 8j + 4 + i in its high
// one, each stored + 8 (1..15; a padded k or column stores 8, weight 0). The stored nibbles are the
// unsigned operand of vpdpbusd and the activations (the int8 rows, offset removed) the signed one,
// so a sum is sum_k (w_k + 8) x_k, and 8 sum_k x_k comes off once per row.
#define MAX_INT4_CHUNK_ROWS 4
template <int ROWS, int SETS>
static inline __attribute__((always_inline)) void int4_rows(const int8_t* xs, int64_t K4, const uint8_t* panel, int32_t* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i low[SETS][ROWS], high[SETS][ROWS];
  for (int s = 0; s < SETS; ++s)
    for (int m = 0; m < ROWS; ++m) low[s][m] = high[s][m] = _mm256_setzero_si256();
  const int64_t pairs = K4 / 8;  // full pairs of quads; a last lone quad (K4 % 8 == 4) after them
  const auto quad = [&](int m, int64_t q) { return _mm256_set1_epi32(*(const int32_t*)(xs + m * K4 + 4 * q)); };
  int64_t j = 0;
  for (; j + SETS <= pairs; j += SETS) {
    for (int s = 0; s < SETS; ++s) {
      _mm_prefetch((const char*)(panel + (j + s) * 32) + PREFETCH_BYTES, _MM_HINT_T2);
      const __m256i bytes = _mm256_loadu_si256((const __m256i*)(panel + (j + s) * 32));
      const __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      for (int m = 0; m < ROWS; ++m) {
        low[s][m] = dpbusd(low[s][m], lo, quad(m, 2 * (j + s)));
        high[s][m] = dpbusd(high[s][m], hi, quad(m, 2 * (j + s) + 1));
      }
    }
  }
  for (; j < pairs; ++j) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(panel + j * 32));
    const __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    for (int m = 0; m < ROWS; ++m) {
      low[0][m] = dpbusd(low[0][m], lo, quad(m, 2 * j));
      high[0][m] = dpbusd(high[0][m], hi, quad(m, 2 * j + 1));
    }
  }
  if (K4 % 8) {  // the lone quad: low nibbles only (the high ones would read past the row)
    const __m256i lo = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(panel + pairs * 32)), nibble);
    for (int m = 0; m < ROWS; ++m) low[0][m] = dpbusd(low[0][m], lo, quad(m, 2 * pairs));
  }
  for (int m = 0; m < ROWS; ++m) {
    __m256i sum = _mm256_add_epi32(low[0][m], high[0][m]);
    for (int s = 1; s < SETS; ++s) sum = _mm256_add_epi32(sum, _mm256_add_epi32(low[s][m], high[s][m]));
    _mm256_storeu_si256((__m256i*)(out + m * PANEL), sum);
  }
}

static void int4_chunk_rows(int rows, const int8_t* xs, int64_t K4, const uint8_t* panel, int32_t* out) {
  switch (rows) {
    case 1: int4_rows<1, 4>(xs, K4, panel, out); break;
    case 2: int4_rows<2, 2>(xs, K4, panel, out); break;
    case 3: int4_rows<3, 1>(xs, K4, panel, out); break;
    default: int4_rows<4, 1>(xs, K4, panel, out); break;
  }
}

// y [M, N]: x's logits through the 4-bit panels, then the panels holding each row's `candidates`
// largest (ties at the threshold included) through the int8 head w, stored as the int8 product
// stores them. Each thread picks the largest of its share of a row's logits (a heap: copying the
// share and partitioning it took ~1 ms of a 1-row call), one thread merges them.
static void screened_head_i8(const float* x, int64_t M, const uint8_t* packed4, const float* scale4, const Weight& w, int64_t candidates,
                             float* y, int num_threads) {
  const int64_t N = w.N, K = w.K, K4 = round_up4(K), num_panels = (N + PANEL - 1) / PANEL;
  QuantizedBuffer buffer(M, K);
  const Quantized q = buffer.q;
  std::vector<int8_t> signed_rows(M * K4 + 64);  // + 64: a quad load never leaves the buffer
  std::vector<float> offsets(M);                // 8 sum_k x_k per row, in the sum's units
  std::vector<std::vector<float>> shares(num_threads);
  std::vector<float> thresholds(M);
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp single
    {
      quantize_rows(x, M, K, q);
      for (int64_t m = 0; m < M; ++m) {
        int64_t sum = 0;
        for (int64_t k = 0; k < K4; ++k) sum += (signed_rows[m * K4 + k] = (int8_t)(q.xq[m * K4 + k] ^ 0x80));
        offsets[m] = (float)(8 * sum);
      }
    }
    const int8_t* xs = signed_rows.data();
    const int64_t pairs = (K4 + 7) / 8;
    for_panel_chunks<PANEL, MAX_INT4_CHUNK_ROWS, int32_t, false>(
        M, N, K, y, N,
        [&](int rows, int64_t m0, int64_t p, int32_t* out, int64_t, int64_t) {
          int4_chunk_rows(rows, xs + m0 * K4, K4, packed4 + p * pairs * 32, out);
        },
        [&](int32_t dot, int64_t m, int64_t n) {
          const float value = ((float)dot - offsets[m]) * q.xscale[m] * scale4[n];
          return w.bias ? value + w.bias[n] : value;
        });
    // The `candidates` largest of each row: each thread's largest over its share of the row, then
    // the candidates-th largest of those is the row's threshold.
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t keep = candidates < N ? candidates : N;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t first = N * thread / threads, last = N * (thread + 1) / threads;
      // A min-heap of the largest `keep` so far: after the first few hundred logits nearly every one
      // fails the comparison with its smallest, so the scan costs about one compare per logit.
      std::vector<float>& share = shares[thread];
      share.clear();
      for (int64_t n = first; n < last; ++n) {
        const float value = y[m * N + n];
        if ((int64_t)share.size() < keep) {
          share.push_back(value);
          std::push_heap(share.begin(), share.end(), std::greater<float>());
        } else if (value > share.front()) {
          std::pop_heap(share.begin(), share.end(), std::greater<float>());
          share.back() = value;
          std::push_heap(share.begin(), share.end(), std::greater<float>());
        }
      }
#pragma omp barrier
#pragma omp single
      {
        std::vector<float> merged;
        for (int t = 0; t < threads; ++t) merged.insert(merged.end(), shares[t].begin(), shares[t].end());
        std::nth_element(merged.begin(), merged.begin() + (keep - 1), merged.end(), std::greater<float>());
        thresholds[m] = merged[keep - 1];
      }
    }
    // The candidates' panels through the int8 head, rows split over the threads.
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      float* row = y + m * N;
      int32_t sums[PANEL] __attribute__((aligned(32)));
      for (int64_t p = 0; p < num_panels; ++p) {
        const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
        bool holds = false;
        for (int64_t j = 0; j < cols; ++j) holds |= row[n0 + j] >= thresholds[m];
        if (!holds) continue;
        vnni_chunk_rows(1, q.xq + m * K4, K4, (const int8_t*)w.packed + p * K4 * PANEL, sums);
        for (int64_t j = 0; j < cols; ++j) row[n0 + j] = vnni_output(w, q, sums[j], m, n0 + j);
      }
    }
  }
}
#endif

extern "C" {
int verispec_panel_width(void) { return PANEL; }
// Columns per float32 panel: 32 where built with AVX-512, else PANEL.
int verispec_f32_panel_width(void) { return F32_PANEL; }

// 0: int8 weights as float-converted panels [ceil(N/8)][K][8]; 1: VNNI panels [ceil(N/8)][ceil(K/4)][8][4]
// with column sums (pack_int8_panels in panel_linear.py packs what this says).
int verispec_int8_layout(void) { return VNNI; }

void verispec_panel_linear_f32(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, const float* bias,
                               float* y, int num_threads) {
  panel_linear<false>(x, M, Weight{packed, N, K, nullptr, nullptr, bias}, y, num_threads);
}

// The float32 product over some of a weight's panels: y [M][num_ids * F32_PANEL], column block j
// holding the outputs of panel panel_ids[j] (no bias). The kernel computes every output with its own
// chain of FMAs, the same whichever panels run beside it, so these are bit for bit the values the
// product over all panels gives (screened_head.py computes only the logits that can be the argmax).
void verispec_panel_linear_f32_panels(const float* x, int64_t M, int64_t K, const float* packed, const int64_t* panel_ids,
                                      int64_t num_ids, float* y, int num_threads) {
  const int64_t panel_floats = K * F32_PANEL;
#pragma omp parallel num_threads(num_threads)
  for_panel_chunks<F32_PANEL, F32_MAX_ROWS, float, false, F32_K_BLOCK>(
      M, num_ids * F32_PANEL, K, y, num_ids * F32_PANEL,
      [&](int rows, int64_t m0, int64_t p, float* out, int64_t k0, int64_t k1) {
        f32_chunk_rows(rows, x + m0 * K, K, packed + panel_ids[p] * panel_floats, out, k0, k1);
      },
      [](float entry, int64_t, int64_t) { return entry; });
}

// The lean stack's exponential and SiLU gate, for tests: y = e^x; act = silu(g) * u (count floats each).
void verispec_exp(const float* x, float* y, int64_t count) { exp_into(x, y, count); }
void verispec_silu_mul(const float* g, const float* u, float* act, int64_t count) { silu_mul_into(g, u, act, count); }

// A drafting head's far memory (drafters/far_memory.py), all of its rows at once: row r of query
// head j of kv head g (query [kv_heads][group][rows][D]) attends to keys and values 0..ends[r]-1 of
// kv head g (keys / values: kv_heads rows of positions key_stride / value_stride floats apart, D
// floats a position). ctx (as query) = the softmax of scaling q.k over them times the values, lse
// [kv_heads][group][rows] = the log of that softmax's normaliser, for the caller to weigh the memory
// against the local window; a row with ends[r] = 0 gets ctx 0 and lse -inf. D a multiple of 8. Why
// not PyTorch: its two products of one head step over 16K memory keys (12 heads, 2 kv heads, head
// size 128) ran at ~14 GMAC/s on 2 threads; attend reads each key once for all of a kv head's rows
// and heads. Timed alone (keys in cache) a step over 16K keys went 10.5 -> 6.8 ms; inside decoding,
// where the memory returns from DRAM after each target pass, both wait on memory (2026-12-07, Zen 4
// without AVX-512): fewer bytes (a half-precision memory) is what would make that step cheaper.
void verispec_memory_attention(const float* query, int64_t kv_heads, int64_t group, int64_t rows, int64_t D, const float* keys,
                               int64_t key_stride, const float* values, int64_t value_stride, const int64_t* ends, float scaling,
                               float* ctx, float* lse, int num_threads) {
  std::vector<int64_t> last(rows), score_first(rows + 1, 0);  // each row's last memory slot; its scores' offset in a head's block
  for (int64_t r = 0; r < rows; ++r) last[r] = ends[r] - 1, score_first[r + 1] = score_first[r] + ends[r];
  const int64_t tasks_per_kv = group * rows, scores_per_head = score_first[rows];
  float* scores = (float*)malloc(sizeof(float) * (kv_heads * group * scores_per_head + 1));
  const int64_t slices = attention_slices(kv_heads, num_threads);  // work items: kv heads
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t item = 0; item < kv_heads * slices; ++item) {
    const int64_t g = item / slices, slice = item % slices;
    std::vector<AttentionTask> tasks;
    for (int64_t task = tasks_per_kv * slice / slices; task < tasks_per_kv * (slice + 1) / slices; ++task) {
      const int64_t head = g * group + task / rows, r = task % rows, row = head * rows + r;
      if (ends[r] <= 0) {
        memset(ctx + row * D, 0, sizeof(float) * D);
        lse[row] = -INFINITY;
        continue;
      }
      tasks.push_back({query + row * D, scores + head * scores_per_head + score_first[r], ctx + row * D, last[r], &last[r], 1, lse + row});
    }
    attend(tasks.data(), (int64_t)tasks.size(), keys + g * key_stride, values + g * value_stride, D, scaling);
  }
  free(scores);
}

// 1 where built with AVX512-BF16 (dot products) or AVX2 without AVX-512 (widened to float32): verispec_panel_linear_bf16 runs.
int verispec_has_bf16(void) { return BF16; }

// 1 while products run on AMX tiles (bfloat16 ones where built with AMX-BF16, int8 ones with AMX-INT8).
int verispec_amx_enabled(void) {
#if AMX_TILES
  return amx_enabled;
#else
  return 0;
#endif
}

// Which weight kinds the library can run on tiles: 1 bfloat16, 2 int8 (bits).
int verispec_amx_kinds(void) { return AMX_BF16 | (AMX_INT8 << 1); }

// Products on AMX tiles: enable (asking Linux for the tile state first) or disable them for this
// process; returns whether they run now (0 where built without AMX or refused the state).
int verispec_use_amx(int enable) {
#if AMX_TILES
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
#if AMX_BF16
  amx_make_configs(amx_bf16_configs, {0, 1}, 64, {4}, {6, 7}, 64);
#endif
#if AMX_INT8
  amx_make_configs(amx_int8_configs, {0, 1, 2, 3}, PANEL * 4, {4}, {5, 6, 7}, PANEL * 4);
#endif
  amx_enabled = enable && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return amx_enabled;
#else
  (void)enable;
  return 0;
#endif
}

// y [M, N] (float32) = x [M, K2 pairs] (bf16, K padded to even with zeros) . W^T + bias, W packed as
// bf16_rows reads it. A no-op where built without bfloat16 kernels (verispec_has_bf16 says so first).
void verispec_panel_linear_bf16(const uint32_t* x, int64_t M, int64_t K2, const uint16_t* packed, int64_t N, const float* bias,
                                float* y, int num_threads) {
#if BF16
  // The pairs go through the product's own buffer (with the rows a tile may read past the last).
  QuantizedBuffer pairs(M, 2 * K2, 2);
  memcpy(pairs.q.xq, x, sizeof(uint32_t) * M * K2);
  const Weight w = {packed, N, 2 * K2, nullptr, nullptr, bias};
#pragma omp parallel num_threads(num_threads)
  panel_linear_for<BF16_WEIGHTS>(nullptr, M, w, y, pairs.q, 0, true);
#else
  (void)x, (void)M, (void)K2, (void)packed, (void)N, (void)bias, (void)y, (void)num_threads;
#endif
}

void verispec_panel_linear_i8(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N, const float* scale,
                              const int32_t* colsum, const float* bias, float* y, int num_threads) {
  panel_linear<true>(x, M, Weight{packed, N, K, scale, colsum, bias}, y, num_threads);
}

// A greedy draft's LM-head logits through a 4-bit screen (screened_head_i8 above): y [M, N] from
// x [M, K], packed4 / scale4 the 4-bit panels and per-output scales, packed8 ... bias the int8 head
// in the VNNI layout. Returns 0 (and leaves y) where built without 8-bit dot products.
int verispec_screened_head_i8(const float* x, int64_t M, int64_t K, const uint8_t* packed4, const float* scale4, const int8_t* packed8,
                              int64_t N, const float* scale8, const int32_t* colsum8, const float* bias, int64_t candidates, float* y,
                              int num_threads) {
#if VNNI
  if (M <= 0 || candidates <= 0) return 1;
  screened_head_i8(x, M, packed4, scale4, Weight{packed8, N, K, scale8, colsum8, bias}, candidates, y, num_threads);
  return 1;
#else
  (void)x, (void)M, (void)K, (void)packed4, (void)scale4, (void)packed8, (void)N, (void)scale8, (void)colsum8, (void)bias,
      (void)candidates, (void)y, (void)num_threads;
  return 0;
#endif
}

// dims: num_layers, hidden, heads, kv_heads, head_dim, intermediate, qkv_parts (1: stacked, 3: q, k,
// v), gate_up_parts (1: stacked, 2: gate, up); per layer l, P = qkv_parts + gate_up_parts + 2 entries
// from P·l of weights/scales/colsums/biases: the qkv parts, o, the gate_up parts, down (scales and
// colsums null for float32 and bfloat16, colsums null unless the int8 layout is VNNI, biases may be
// null); kind: the WeightKind of every product (bfloat16 only where built with BF16: the activations
// stay float32, rounded to bfloat16 pairs at each product's input, the KV cache is float32);
// norms[2l], norms[2l+1] = input and post-attention RMSNorm. The pass extends num_seqs sequences
// (Segments above: seq_rows, seq_starts, capacities [num_layers][num_seqs], caches
// [num_layers][num_seqs][keys, values], positions < start filled); n = the sum of seq_rows. x [n,
// hidden] (the token embeddings, sequence by sequence) is the residual stream, overwritten; cos / sin
// [n, head_dim] each row's rotary angles; out [n, hidden] receives the final-normed features.
void verispec_lean_stack(const int64_t* dims, float eps, int kind, int64_t num_seqs, const int64_t* seq_rows,
                         const int64_t* seq_starts, const int64_t* capacities, float* const* caches, float* x,
                         const float* cos, const float* sin, const void* const* weights, const float* const* scales,
                         const int32_t* const* colsums, const float* const* biases, const float* const* norms,
                         const float* final_norm, float* out, const int64_t* row_prefix, const int64_t* row_parent,
                         int num_threads) {
  const LeanStackDims d = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], eps};
  const Segments seq = {num_seqs, seq_rows, seq_starts, capacities, caches, row_prefix, row_parent};
  int64_t n = 0;
  for (int64_t s = 0; s < num_seqs; ++s) n += seq_rows[s];
  const int64_t H = d.heads, KV = d.kv_heads, D = d.head_dim, I = d.intermediate, h = d.hidden;
  // Output and input widths of each entry of a layer, in order.
  int64_t outputs[7], inputs[7], per_layer = 0;
  const auto add = [&](int64_t out_width, int64_t in_width) { outputs[per_layer] = out_width, inputs[per_layer++] = in_width; };
  if (d.qkv_parts == 3) add(H * D, h), add(KV * D, h), add(KV * D, h);
  else add((H + 2 * KV) * D, h);
  add(h, H * D);
  if (d.gate_up_parts == 2) add(I, h), add(I, h);
  else add(2 * I, h);
  add(h, I);
  Weight* layers = (Weight*)malloc(sizeof(Weight) * per_layer * d.num_layers);
  for (int64_t i = 0; i < per_layer * d.num_layers; ++i)
    layers[i] = Weight{weights[i], outputs[i % per_layer], inputs[i % per_layer], scales[i], colsums[i], biases[i]};
  if (kind == INT8_WEIGHTS)
    lean_stack<INT8_WEIGHTS>(d, seq, n, x, cos, sin, layers, norms, final_norm, out, num_threads);
#if BF16
  else if (kind == BF16_WEIGHTS)
    lean_stack<BF16_WEIGHTS>(d, seq, n, x, cos, sin, layers, norms, final_norm, out, num_threads);
#endif
  else
    lean_stack<F32_WEIGHTS>(d, seq, n, x, cos, sin, layers, norms, final_norm, out, num_threads);
  free(layers);
}
}
