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

#define PANEL 16
#define K_BLOCK 64

/* Rows [0, MR) of x times one panel: out[m][j] for j < width (the last panel may be
 * partial: its padding columns are zero weights, never written). */
#define DEFINE_PANEL(MR)                                                                     \
    static void panel_##MR(const float *x, int64_t x_stride, const float *panel, int64_t in, \
                           const float *bias, float *out, int64_t out_stride, int width) {   \
        float total[MR][PANEL] = {{0}};                                                      \
        for (int64_t start = 0; start < in; start += K_BLOCK) {                              \
            const int64_t stop = start + K_BLOCK < in ? start + K_BLOCK : in;                \
            float block[MR][PANEL] = {{0}};                                                  \
            for (int64_t k = start; k < stop; k++) {                                         \
                const float *w = panel + k * PANEL;                                          \
                for (int m = 0; m < MR; m++) {                                               \
                    const float value = x[m * x_stride + k];                                 \
                    _Pragma("omp simd") for (int j = 0; j < PANEL; j++)                      \
                        block[m][j] += value * w[j];                                         \
                }                                                                            \
            }                                                                                \
            for (int m = 0; m < MR; m++)                                                     \
                _Pragma("omp simd") for (int j = 0; j < PANEL; j++) total[m][j] += block[m][j]; \
        }                                                                                    \
        for (int m = 0; m < MR; m++)                                                         \
            for (int j = 0; j < width; j++)                                                  \
                out[m * out_stride + j] = total[m][j] + (bias ? bias[j] : 0.0f);             \
    }

DEFINE_PANEL(1)
DEFINE_PANEL(2)
DEFINE_PANEL(4)
DEFINE_PANEL(8)

/* out [rows, out_features] (rows out_stride apart) = x [rows, in] (x_stride apart) times the
 * panels of W [out_features, in], plus bias (NULL: none). */
void tandem_panel_linear(const float *x, int64_t x_stride, int64_t rows, int64_t in,
                         const float *panels, int64_t out_features, const float *bias,
                         float *out, int64_t out_stride, int32_t num_threads) {
    const int64_t num_panels = (out_features + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        const float *panel = panels + p * in * PANEL;
        const float *panel_bias = bias ? bias + p * PANEL : 0;
        const int64_t column = p * PANEL;
        const int width = out_features - column < PANEL ? (int)(out_features - column) : PANEL;
        int64_t r = 0;
        for (; r + 8 <= rows; r += 8)
            panel_8(x + r * x_stride, x_stride, panel, in, panel_bias,
                    out + r * out_stride + column, out_stride, width);
        for (; r + 4 <= rows; r += 4)
            panel_4(x + r * x_stride, x_stride, panel, in, panel_bias,
                    out + r * out_stride + column, out_stride, width);
        for (; r + 2 <= rows; r += 2)
            panel_2(x + r * x_stride, x_stride, panel, in, panel_bias,
                    out + r * out_stride + column, out_stride, width);
        for (; r < rows; r++)
            panel_1(x + r * x_stride, x_stride, panel, in, panel_bias,
                    out + r * out_stride + column, out_stride, width);
    }
}
