/* A linear layer for the few rows of a decode step, in float32: out = x W^T (+ bias).
 *
 * At 1 to 16 rows a projection is bound by reading its weight, and oneDNN's packed matmul
 * reads it at well under the machine's bandwidth (about 40% on a 2-core EPYC). Here the
 * weight is stored as panels of PANEL output rows, each panel `[in][PANEL]` contiguous
 * (panel_layout in cpu_linear.py), so one pass streams it front to back: each thread takes
 * whole panels, and every row of x multiplies a panel while it is in cache.
 *
 * Each output is a sum over `in` accumulated in blocks of K_BLOCK products, the blocks then
 * added: a rounding chain of K_BLOCK + in / K_BLOCK additions instead of `in` (one long
 * chain is what made oneDNN's LM head 1.6x further from float64 than F.linear's). Built and
 * loaded by cpu_build.py.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define K_BLOCK 64

/* One hardware vector (as in cpu_attention.c: wider generic vectors go through memory). */
#ifdef __AVX512F__
#define LANES 16
#define BLOCK_ROWS 8
#else
#define LANES 8
#define BLOCK_ROWS 6 /* 6 rows x 2 vectors: 12 sums in registers, of the 16 AVX2 has */
#endif
#define VECTORS (PANEL / LANES)

typedef float vfloat __attribute__((vector_size(LANES * 4)));

static inline vfloat load_vector(const float *from) {
    vfloat value;
    memcpy(&value, from, sizeof value);
    return value;
}

/* Rows [0, rows) of x (rows <= BLOCK_ROWS, a constant once inlined) times one panel:
 * out[m][j] for j < width (the last panel may be partial: its padding columns are zero
 * weights, never written). */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, const float *panel, int64_t in, const float *bias,
        float *out, int64_t out_stride, int width, const int rows) {
    vfloat total[BLOCK_ROWS][VECTORS] = {{{0}}};
    for (int64_t start = 0; start < in; start += K_BLOCK) {
        const int64_t stop = start + K_BLOCK < in ? start + K_BLOCK : in;
        vfloat block[BLOCK_ROWS][VECTORS] = {{{0}}};
        for (int64_t k = start; k < stop; k++) {
            vfloat w[VECTORS];
            for (int v = 0; v < VECTORS; v++)
                w[v] = load_vector(panel + k * PANEL + v * LANES);
            for (int m = 0; m < rows; m++) {
                const vfloat value = (vfloat){0} + x[m * x_stride + k];
                for (int v = 0; v < VECTORS; v++)
                    block[m][v] += value * w[v];
            }
        }
        for (int m = 0; m < rows; m++)
            for (int v = 0; v < VECTORS; v++)
                total[m][v] += block[m][v];
    }
    for (int m = 0; m < rows; m++) {
        float sums[PANEL];
        memcpy(sums, total[m], sizeof sums);
        for (int j = 0; j < width; j++)
            out[m * out_stride + j] = sums[j] + (bias ? bias[j] : 0.0f);
    }
}

/* Rows [0, rows) of x times panel p of W, BLOCK_ROWS at a time, then the tail. */
static void panel_times_rows(const float *x, int64_t x_stride, int64_t rows, int64_t in,
                             const float *panels, int64_t p, int64_t out_features,
                             const float *bias, float *out, int64_t out_stride) {
    const float *panel = panels + p * in * PANEL;
    const float *panel_bias = bias ? bias + p * PANEL : 0;
    const int64_t column = p * PANEL;
    const int width = out_features - column < PANEL ? (int)(out_features - column) : PANEL;
    out += column;
    int64_t r = 0;
    for (; r + BLOCK_ROWS <= rows; r += BLOCK_ROWS)
        panel_rows(x + r * x_stride, x_stride, panel, in, panel_bias, out + r * out_stride,
                   out_stride, width, BLOCK_ROWS);
    for (; r + 4 <= rows; r += 4)
        panel_rows(x + r * x_stride, x_stride, panel, in, panel_bias, out + r * out_stride,
                   out_stride, width, 4);
    for (; r + 2 <= rows; r += 2)
        panel_rows(x + r * x_stride, x_stride, panel, in, panel_bias, out + r * out_stride,
                   out_stride, width, 2);
    for (; r < rows; r++)
        panel_rows(x + r * x_stride, x_stride, panel, in, panel_bias, out + r * out_stride,
                   out_stride, width, 1);
}

/* out [rows, out_features] (rows out_stride apart) = x [rows, in] (x_stride apart) times the
 * panels of W [out_features, in], plus bias (NULL: none). The rows go in tiles of about
 * X_TILE_BYTES, so that every panel multiplies a tile that stays in the core's L2 cache: a
 * prefill's 564 x 576 floats do not, and streaming them once per panel from L3 cost 10%. */
#define X_TILE_BYTES (256 * 1024)
void tandem_panel_linear(const float *x, int64_t x_stride, int64_t rows, int64_t in,
                         const float *panels, int64_t out_features, const float *bias,
                         float *out, int64_t out_stride, int32_t num_threads) {
    const int64_t num_panels = (out_features + PANEL - 1) / PANEL;
    int64_t tile = X_TILE_BYTES / (in * (int64_t)sizeof(float)) / BLOCK_ROWS * BLOCK_ROWS;
    tile = tile < BLOCK_ROWS ? BLOCK_ROWS : tile;
#pragma omp parallel num_threads(num_threads)
    for (int64_t first = 0; first < rows; first += tile) {
        const int64_t count = rows - first < tile ? rows - first : tile;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++)
            panel_times_rows(x + first * x_stride, x_stride, count, in, panels, p,
                             out_features, bias, out + first * out_stride, out_stride);
    }
}
