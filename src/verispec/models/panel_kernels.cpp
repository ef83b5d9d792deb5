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
#include <immintrin.h>
#include <stdint.h>

#define PANEL 8
#define MAX_CHUNK_ROWS 12

template <bool INT8>
static inline __attribute__((always_inline)) __m256 load_weights(const void* panel, int64_t k) {
  if (INT8) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i*)((const int8_t*)panel + k * PANEL));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
  return _mm256_loadu_ps((const float*)panel + k * PANEL);
}

// ROWS rows of x against one panel. SETS independent accumulator sets over k, so that at least ~8
// FMA dependency chains are in flight (one chain per row would wait on the FMA latency).
template <int ROWS, int SETS, bool INT8>
static inline __attribute__((always_inline)) void panel_rows(const float* x, int64_t K, const void* panel, float* out) {
  __m256 acc[SETS][ROWS];
  for (int s = 0; s < SETS; ++s)
    for (int m = 0; m < ROWS; ++m) acc[s][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + SETS <= K; k += SETS) {
    for (int s = 0; s < SETS; ++s) {
      const __m256 w = load_weights<INT8>(panel, k + s);
      for (int m = 0; m < ROWS; ++m) acc[s][m] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + m * K + k + s), acc[s][m]);
    }
  }
  for (; k < K; ++k) {
    const __m256 w = load_weights<INT8>(panel, k);
    for (int m = 0; m < ROWS; ++m) acc[0][m] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + m * K + k), acc[0][m]);
  }
  for (int m = 0; m < ROWS; ++m) {
    __m256 sum = acc[0][m];
    for (int s = 1; s < SETS; ++s) sum = _mm256_add_ps(sum, acc[s][m]);
    _mm256_storeu_ps(out + m * PANEL, sum);
  }
}

template <bool INT8>
static void chunk_rows(int rows, const float* x, int64_t K, const void* panel, float* out) {
  switch (rows) {
    case 1: panel_rows<1, 8, INT8>(x, K, panel, out); break;
    case 2: panel_rows<2, 4, INT8>(x, K, panel, out); break;
    case 3: panel_rows<3, 3, INT8>(x, K, panel, out); break;
    case 4: panel_rows<4, 2, INT8>(x, K, panel, out); break;
    case 5: panel_rows<5, 2, INT8>(x, K, panel, out); break;
    case 6: panel_rows<6, 2, INT8>(x, K, panel, out); break;
    case 7: panel_rows<7, 1, INT8>(x, K, panel, out); break;
    case 8: panel_rows<8, 1, INT8>(x, K, panel, out); break;
    case 9: panel_rows<9, 1, INT8>(x, K, panel, out); break;
    case 10: panel_rows<10, 1, INT8>(x, K, panel, out); break;
    case 11: panel_rows<11, 1, INT8>(x, K, panel, out); break;
    default: panel_rows<12, 1, INT8>(x, K, panel, out); break;
  }
}

template <bool INT8>
static void panel_linear(const float* x, int64_t M, int64_t K, const void* packed, int64_t N, const float* scale,
                         const float* bias, float* y, int num_threads) {
  const int64_t num_panels = (N + PANEL - 1) / PANEL, panel_bytes = K * PANEL * (INT8 ? 1 : 4);
  // Rows in balanced chunks of at most 12 (13 rows -> 7 + 6, not 12 + 1); a panel stays in cache
  // between the chunks of one product.
  const int64_t num_chunks = (M + MAX_CHUNK_ROWS - 1) / MAX_CHUNK_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t p = 0; p < num_panels; ++p) {
    const void* panel = (const char*)packed + p * panel_bytes;
    const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    float out[MAX_CHUNK_ROWS * PANEL] __attribute__((aligned(32)));
    int64_t m0 = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t left = M - m0, rows = (left + (num_chunks - c) - 1) / (num_chunks - c);
      chunk_rows<INT8>((int)rows, x + m0 * K, K, panel, out);
      for (int64_t m = 0; m < rows; ++m) {
        float* y_row = y + (m0 + m) * N + n0;
        for (int64_t j = 0; j < cols; ++j) {
          float value = out[m * PANEL + j];
          if (scale) value *= scale[n0 + j];
          if (bias) value += bias[n0 + j];
          y_row[j] = value;
        }
      }
      m0 += rows;
    }
  }
}

extern "C" {
int verispec_panel_width(void) { return PANEL; }

void verispec_panel_linear_f32(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, const float* bias,
                               float* y, int num_threads) {
  panel_linear<false>(x, M, K, packed, N, nullptr, bias, y, num_threads);
}

void verispec_panel_linear_i8(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N, const float* scale,
                              const float* bias, float* y, int num_threads) {
  panel_linear<true>(x, M, K, packed, N, scale, bias, y, num_threads);
}
}
