/* A linear layer in float32 or bfloat16: out = x W^T (+ bias), W stored in panels.
 *
 * The weight is stored as panels of PANEL output rows, each panel `[in][PANEL]` contiguous
 * (panel_layout in cpu_linear.py), so one pass streams it front to back: each thread takes
 * whole panels, and every row of x multiplies a panel while it is in cache. At 1 to 16 rows
 * a projection is bound by reading its weight, which oneDNN's packed matmul reads at well
 * under the machine's bandwidth (about 40% on a 2-core EPYC); at more rows it is bound by
 * the multiply-adds, which a register block of BLOCK_ROWS rows x PANEL outputs feeds.
 *
 * bfloat16 (x, W, bias and out all bfloat16) is converted to float32 as it is loaded and
 * rounded once at the store, as torch's bfloat16 matmul does: on a CPU without bfloat16
 * instructions (AVX2) torch's own bfloat16 F.linear ran at 13-18 GFLOP/s, a tenth of this.
 *
 * Each output is a sum over `in` accumulated in blocks of K_BLOCK products, the blocks then
 * added: a rounding chain of K_BLOCK + in / K_BLOCK additions instead of `in` (one long
 * chain is what made oneDNN's LM head 1.6x further from float64 than F.linear's). Built and
 * loaded by cpu_build.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define PANEL 16
#define K_BLOCK 64

/* One hardware vector (as in cpu_attention.c: wider generic vectors go through memory). */
#ifdef __AVX512F__
#define LANES 16
#define BLOCK_ROWS 12 /* 12 rows x 2 panels of 1 vector: 24 sums, of the 32 registers */
#define PAIRED 2      /* panels multiplied side by side, sharing each row's broadcast */
#else
#define LANES 8
#define BLOCK_ROWS 6 /* 6 rows x 2 vectors: 12 sums in registers, of the 16 AVX2 has */
#define PAIRED 1
#endif
#define VECTORS (PANEL / LANES)

typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef uint32_t vuint __attribute__((vector_size(LANES * 4)));
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));

/* LANES elements from element `index` of `from` (bfloat16 when `bf16`), as float32. */
static inline vfloat load_vector(const void *from, int64_t index, const int bf16) {
    vfloat value;
    if (!bf16) {
        memcpy(&value, (const float *)from + index, sizeof value);
        return value;
    }
    vhalf half;
    memcpy(&half, (const uint16_t *)from + index, sizeof half);
    const vuint wide = __builtin_convertvector(half, vuint) << 16;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline float load_scalar(const void *from, int64_t index, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)from)[index]) : ((const float *)from)[index];
}

static inline void store_scalar(void *to, int64_t index, float value, const int bf16) {
    if (bf16)
        ((uint16_t *)to)[index] = float_to_bf16(value);
    else
        ((float *)to)[index] = value;
}

/* Rows [0, rows) of float32 x (row m at x + m * x_stride; rows <= BLOCK_ROWS) times
 * `count` adjacent panels (at most PAIRED), the first at element `panel` of `panels`:
 * out[m][column + j] (row m at element out_first + m * out_stride) for j < width (the last
 * panel may be partial: its padding columns are zero weights, never written). Each output
 * is its products summed in K_BLOCK blocks, the blocks then added in order: the same bits
 * whatever `rows`, `count` or the row's place in the block. `rows`, `count` and `bf16` are
 * constants once inlined. */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, const void *panels, int64_t panel,
        int64_t in, const void *bias, int64_t column, void *out, int64_t out_first,
        int64_t out_stride, int width, const int rows, const int count, const int bf16) {
    vfloat total[BLOCK_ROWS][PAIRED * VECTORS];
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < count * VECTORS; v++)
            total[m][v] = (vfloat){0};
    for (int64_t start = 0; start < in; start += K_BLOCK) {
        const int64_t stop = start + K_BLOCK < in ? start + K_BLOCK : in;
        vfloat block[BLOCK_ROWS][PAIRED * VECTORS];
        for (int m = 0; m < rows; m++)
            for (int v = 0; v < count * VECTORS; v++)
                block[m][v] = (vfloat){0};
        for (int64_t k = start; k < stop; k++) {
            vfloat w[PAIRED * VECTORS];
            for (int q = 0; q < count; q++)
                for (int v = 0; v < VECTORS; v++)
                    w[q * VECTORS + v] = load_vector(
                        panels, panel + q * in * PANEL + k * PANEL + v * LANES, bf16);
            for (int m = 0; m < rows; m++) {
                const vfloat value = (vfloat){0} + x[m * x_stride + k];
                for (int v = 0; v < count * VECTORS; v++)
                    block[m][v] += value * w[v];
            }
        }
        for (int m = 0; m < rows; m++)
            for (int v = 0; v < count * VECTORS; v++)
                total[m][v] += block[m][v];
    }
    for (int m = 0; m < rows; m++) {
        float sums[PAIRED * PANEL];
        memcpy(sums, total[m], count * PANEL * sizeof(float));
        for (int j = 0; j < width; j++) {
            const float b = bias ? load_scalar(bias, column + j, bf16) : 0.0f;
            store_scalar(out, out_first + m * out_stride + column + j, sums[j] + b, bf16);
        }
    }
}

/* Rows [first, first + rows) of x times `count` panels from p, BLOCK_ROWS at a time, then
 * 4, 2, 1. */
static inline __attribute__((always_inline)) void panel_times_rows(
        const float *x, int64_t x_stride, int64_t first, int64_t rows, int64_t in,
        const void *panels, int64_t p, const int count, int64_t out_features,
        const void *bias, void *out, int64_t out_stride, const int bf16) {
    const int64_t panel = p * in * PANEL, column = p * PANEL, stop = first + rows;
    const int64_t left = out_features - column;
    const int width = left < count * PANEL ? (int)left : count * PANEL;
    int64_t r = first;
    for (; r + BLOCK_ROWS <= stop; r += BLOCK_ROWS)
        panel_rows(x + r * x_stride, x_stride, panels, panel, in, bias, column, out,
                   r * out_stride, out_stride, width, BLOCK_ROWS, count, bf16);
    for (; r + 4 <= stop; r += 4)
        panel_rows(x + r * x_stride, x_stride, panels, panel, in, bias, column, out,
                   r * out_stride, out_stride, width, 4, count, bf16);
    for (; r + 2 <= stop; r += 2)
        panel_rows(x + r * x_stride, x_stride, panels, panel, in, bias, column, out,
                   r * out_stride, out_stride, width, 2, count, bf16);
    for (; r < stop; r++)
        panel_rows(x + r * x_stride, x_stride, panels, panel, in, bias, column, out,
                   r * out_stride, out_stride, width, 1, count, bf16);
}

/* Rows [first, first + rows) times the panels of group g: PAIRED panels from g * PAIRED,
 * or the one left at the end. */
static inline __attribute__((always_inline)) void group_times_rows(
        const float *x, int64_t x_stride, int64_t first, int64_t rows, int64_t in,
        const void *panels, int64_t g, int64_t num_panels, int64_t out_features,
        const void *bias, void *out, int64_t out_stride, const int bf16) {
    int64_t p = g * PAIRED;
    if (p + PAIRED <= num_panels)
        panel_times_rows(x, x_stride, first, rows, in, panels, p, PAIRED, out_features, bias,
                         out, out_stride, bf16);
    else
        for (; p < num_panels; p++) /* PAIRED > 1 only: the odd one out */
            panel_times_rows(x, x_stride, first, rows, in, panels, p, 1, out_features, bias,
                             out, out_stride, bf16);
}

/* The experts of a mixture, each its own rows of x times its own panels: rows
 * [offsets[e], offsets[e + 1]) of x [offsets[num_experts], in] (x_stride apart; offsets[0]
 * is 0) times the panels of expert e's W [out_features, in] (at element e * expert_stride of `panels`),
 * plus bias (NULL: none), into the same rows of out (out_stride apart); all float32, or all
 * bfloat16 when `bf16`: then x is converted to float32 first, once (converting each element
 * where it is multiplied, once per panel, held the kernel to half its float32 speed). The
 * rows go in tiles of about X_TILE_BYTES, so that every panel multiplies a tile that stays
 * in the core's L2 cache. A row's outputs have the same bits in any group, tile or expert's
 * batch (panel_rows). Returns 0, or -1 when the float32 copy of x could not be allocated. */
#define X_TILE_BYTES (256 * 1024)
int32_t tandem_grouped_panel_linear(const void *x, int64_t x_stride, const int64_t *offsets,
                                    int64_t num_experts, int64_t in, const void *panels,
                                    int64_t expert_stride, int64_t out_features,
                                    const void *bias, void *out, int64_t out_stride,
                                    int32_t bf16, int32_t num_threads) {
    const int64_t num_panels = (out_features + PANEL - 1) / PANEL, rows = offsets[num_experts];
    const int64_t element = bf16 ? 2 : 4;
    int64_t tile = X_TILE_BYTES / (in * (int64_t)sizeof(float)) / BLOCK_ROWS * BLOCK_ROWS;
    tile = tile < BLOCK_ROWS ? BLOCK_ROWS : tile;
    float *converted = NULL;
    if (bf16) {
        converted = malloc(sizeof(float) * (rows > 0 ? rows : 1) * in);
        if (converted == NULL)
            return -1;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < in; k++)
                converted[r * in + k] = load_scalar(x, r * x_stride + k, 1);
        x_stride = in;
    }
    const float *x32 = bf16 ? converted : (const float *)x;
    const int64_t num_groups = (num_panels + PAIRED - 1) / PAIRED;
#pragma omp parallel num_threads(num_threads)
    for (int64_t e = 0; e < num_experts; e++) {
        const void *own = (const char *)panels + e * expert_stride * element;
        for (int64_t first = offsets[e]; first < offsets[e + 1]; first += tile) {
            const int64_t count = offsets[e + 1] - first < tile ? offsets[e + 1] - first : tile;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < num_groups; g++) {
                if (bf16)
                    group_times_rows(x32, x_stride, first, count, in, own, g, num_panels,
                                     out_features, bias, out, out_stride, 1);
                else
                    group_times_rows(x32, x_stride, first, count, in, own, g, num_panels,
                                     out_features, bias, out, out_stride, 0);
            }
        }
    }
    free(converted);
    return 0;
}

/* out [rows, out_features] = x [rows, in] times the panels of W [out_features, in], plus
 * bias: one expert's worth of tandem_grouped_panel_linear. */
int32_t tandem_panel_linear(const void *x, int64_t x_stride, int64_t rows, int64_t in,
                            const void *panels, int64_t out_features, const void *bias,
                            void *out, int64_t out_stride, int32_t bf16, int32_t num_threads) {
    const int64_t offsets[2] = {0, rows};
    return tandem_grouped_panel_linear(x, x_stride, offsets, 1, in, panels, 0, out_features,
                                       bias, out, out_stride, bf16, num_threads);
}
