/* A linear layer in float32 or bfloat16: out = x W^T (+ bias), W stored in panels, in the
 * activations' dtype or in 8 bits (int8 or fp8 e4m3, one float32 scale per output channel).
 *
 * The weight is stored as panels of PANEL output rows, each panel `[in][PANEL]` contiguous
 * (panel_layout in cpu_linear.py), so one pass streams it front to back: each thread takes
 * whole panels, and every row of x multiplies a panel while it is in cache. At 1 to 16 rows
 * a projection is bound by reading its weight, which oneDNN's packed matmul reads at well
 * under the machine's bandwidth (about 40% on a 2-core EPYC); at more rows it is bound by
 * the multiply-adds, which a register block of BLOCK_ROWS rows x PAIRED panels feeds. Those
 * rows are first packed side by side (pack_rows), so that one pointer feeds the block's
 * broadcasts (12 row pointers took more registers than x86 has: the loop reloaded them
 * from the stack, 11 more loads per 24 multiply-adds), and outputs are stored a vector at
 * a time. Both together took the panels from 0.78 to 0.88 of F.linear's rate at 512 and
 * 4096 rows on a 2-core Xeon (AVX-512), leaving every output's bits as they were.
 *
 * bfloat16 (x, W, bias and out all bfloat16) is converted to float32 as it is loaded and
 * rounded once at the store, as torch's bfloat16 matmul does: on a CPU without bfloat16
 * instructions (AVX2) torch's own bfloat16 F.linear ran at 13-18 GFLOP/s, a tenth of this.
 *
 * 8-bit weights (quantized weights, kernels/quantization.py) are converted to float32 in
 * registers as they are loaded: int8 by sign extension and conversion, fp8 e4m3 by moving its
 * bits into a float16 and converting that (fp8_to_float: exact, subnormals included, with no
 * float32 denormal anywhere, which -ffast-math may flush). The products sum in float32 in
 * the same K blocks; each output is multiplied by its channel's scale once, at the end, then
 * the bias is added. A decode step of a few rows is bound by reading the weights, so a
 * quarter of float32's bytes is the point; a single row multiplies WIDE panels at once, so
 * the conversions do not leave the multiply-adds waiting on one chain.
 *
 * Each output is a sum over `in` accumulated in blocks of K_BLOCK products, the blocks then
 * added: a rounding chain of K_BLOCK + in / K_BLOCK additions instead of `in` (one long
 * chain is what made oneDNN's LM head 1.6x further from float64 than F.linear's). Built and
 * loaded by cpu_build.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu_bf16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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
/* Panels side by side for a single row: each output sums its own products in order, so
 * more panels at once only means more independent chains of fused multiply-adds, which a
 * row of 8-bit weights (converted in registers, not waiting on memory) needs to keep the
 * FMA units busy; the bits are those of any other grouping. */
#define WIDE (2 * PAIRED)

/* The weights' formats, as cpu_linear.py's WEIGHT_FORMATS. */
#define F32 0
#define BF16 1
#define INT8 2
#define FP8 3

typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef uint32_t vuint __attribute__((vector_size(LANES * 4)));
typedef int32_t vint __attribute__((vector_size(LANES * 4)));
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));
typedef int8_t vchar __attribute__((vector_size(LANES)));
typedef uint8_t vbyte __attribute__((vector_size(LANES)));

/* LANES bytes from `from`, each sign-extended to 32 bits: one vpmovsxbd on x86 (gcc 12
 * builds __builtin_convertvector of bytes lane by lane). */
static inline vint widen_signed(const int8_t *from) {
#if defined(__AVX512F__)
    return (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)from));
#elif defined(__AVX2__)
    return (vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)from));
#else
    vchar small;
    memcpy(&small, from, sizeof small);
    return __builtin_convertvector(small, vint);
#endif
}

static inline vfloat as_float(vuint bits) {
    vfloat value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline vuint as_bits(vfloat value) {
    vuint bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* LANES fp8 e4m3 values (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities)
 * as float32. On x86 through half precision: the byte's bits moved into a float16's (sign
 * to bit 15, exponent and mantissa to bits 13..7) are the value times 2^-8 (bias 15
 * against 7), a subnormal e4m3 (exponent field 0) becoming a subnormal float16, which the
 * hardware conversion (vcvtph2ps) takes exactly whatever MXCSR's denormal flags say; the
 * float32 is then scaled by 2^8, exactly. Elsewhere in float32 integers: a normal value is
 * the float32 of exponent e + 120 and its mantissa bits; a subnormal one, m 2^-9, is the
 * normal float32 2^-6 (1 + m / 8) less 2^-6 (exact). Neither meets a float32 denormal. */
static inline vfloat fp8_to_float(const uint8_t *from) {
#if defined(__AVX512F__)
    const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)from));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(words, 7),
                                          _mm256_set1_epi16((short)0xbf80));
    return (vfloat)_mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
#elif defined(__AVX2__) && defined(__F16C__)
    const __m128i words = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)from));
    const __m128i half = _mm_and_si128(_mm_slli_epi16(words, 7), _mm_set1_epi16((short)0xbf80));
    return (vfloat)_mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
#else
    vbyte bytes;
    memcpy(&bytes, from, sizeof bytes);
    const vuint wide = __builtin_convertvector(bytes, vuint);
    const vuint magnitude = wide & 0x7f;
    const vuint bits = (magnitude << 20) + (120u << 23);
    const vfloat normal = as_float(bits);
    const vfloat subnormal = as_float(bits + (1u << 23)) - 0x1p-6f;
    const vuint is_subnormal = (vuint)(magnitude < 8); /* all ones where the exponent is 0 */
    const vuint chosen = (as_bits(subnormal) & is_subnormal) | (as_bits(normal) & ~is_subnormal);
    return as_float(chosen | ((wide & 0x80) << 24));
#endif
}

/* LANES weights from element `index` of `from`, stored in `format`, as float32. */
static inline vfloat load_vector(const void *from, int64_t index, const int format) {
    vfloat value;
    if (format == F32) {
        memcpy(&value, (const float *)from + index, sizeof value);
        return value;
    }
    if (format == INT8)
        return __builtin_convertvector(widen_signed((const int8_t *)from + index), vfloat);
    if (format == FP8)
        return fp8_to_float((const uint8_t *)from + index);
    vhalf half;
    memcpy(&half, (const uint16_t *)from + index, sizeof half);
    const vuint wide = __builtin_convertvector(half, vuint) << 16;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline float load_scalar(const void *from, int64_t index, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)from)[index]) : ((const float *)from)[index];
}

/* The first `lanes` of `value` to element `index` of `to`: float32, or bfloat16 when `bf16`
 * (rounded to nearest even as float_to_bf16, NaN to its quiet NaN), whole vectors stored at
 * once. */
static inline void store_vector(void *to, int64_t index, vfloat value, int lanes, const int bf16) {
    if (!bf16) {
        if (lanes == LANES)
            memcpy((float *)to + index, &value, sizeof value);
        else
            memcpy((float *)to + index, &value, lanes * sizeof(float));
        return;
    }
    const vuint bits = as_bits(value);
    const vuint nan = (vuint)((bits & 0x7fffffffu) > 0x7f800000u);
    const vuint rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const vhalf half = __builtin_convertvector((rounded & ~nan) | (0x7fc0u & nan), vhalf);
    memcpy((uint16_t *)to + index, &half, lanes * sizeof(uint16_t));
}

/* Rows [0, rows) of float32 x times `count` adjacent panels (at most PAIRED; WIDE for one
 * row), the first at element `panel` of `panels`: out[m][column + j] (row m at element
 * out_first + m * out_stride) for j < width (the last panel may be partial: its padding
 * columns are zero weights, never written). Row m, element k of x is x[m * x_stride + k],
 * or x[k * BLOCK_ROWS + m] when `interleaved` (a packed block: rows == BLOCK_ROWS). Each
 * output is its products summed in K_BLOCK blocks, the blocks then added in order: the same
 * bits whatever `rows`, `count`, the row's place in the block or where x is read from;
 * 8-bit weights' sums are then multiplied by their channel's scale (scales[column + j]).
 * The bias and out are bfloat16 when `bf16`. `rows`, `count`, `interleaved` and `format`
 * are constants once inlined. */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, const int interleaved, const void *panels,
        int64_t panel, int64_t in, const float *scales, const void *bias, int64_t column,
        void *out, int64_t out_first, int64_t out_stride, int width, const int rows,
        const int count, const int format, const int bf16) {
    vfloat total[BLOCK_ROWS][WIDE * VECTORS];
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < count * VECTORS; v++)
            total[m][v] = (vfloat){0};
    for (int64_t start = 0; start < in; start += K_BLOCK) {
        const int64_t stop = start + K_BLOCK < in ? start + K_BLOCK : in;
        vfloat block[BLOCK_ROWS][WIDE * VECTORS];
        for (int m = 0; m < rows; m++)
            for (int v = 0; v < count * VECTORS; v++)
                block[m][v] = (vfloat){0};
        for (int64_t k = start; k < stop; k++) {
            vfloat w[WIDE * VECTORS];
            for (int q = 0; q < count; q++)
                for (int v = 0; v < VECTORS; v++)
                    w[q * VECTORS + v] = load_vector(
                        panels, panel + q * in * PANEL + k * PANEL + v * LANES, format);
            for (int m = 0; m < rows; m++) {
                const float element = interleaved ? x[k * BLOCK_ROWS + m] : x[m * x_stride + k];
                const vfloat value = (vfloat){0} + element;
                for (int v = 0; v < count * VECTORS; v++)
                    block[m][v] += value * w[v];
            }
        }
        for (int m = 0; m < rows; m++)
            for (int v = 0; v < count * VECTORS; v++)
                total[m][v] += block[m][v];
    }
    /* the scales and bias of the panels' columns, zero past `width` (a partial panel) */
    vfloat scale[WIDE * VECTORS], shift[WIDE * VECTORS];
    for (int v = 0; v < count * VECTORS; v++) {
        float lanes[LANES] = {0}, biases[LANES] = {0};
        for (int j = 0; j < LANES && v * LANES + j < width; j++) {
            const int64_t at = column + v * LANES + j;
            lanes[j] = format >= INT8 ? scales[at] : 1.0f;
            biases[j] = bias ? load_scalar(bias, at, bf16) : 0.0f;
        }
        memcpy(&scale[v], lanes, sizeof(vfloat));
        memcpy(&shift[v], biases, sizeof(vfloat));
    }
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < count * VECTORS; v++) {
            const vfloat value = format >= INT8 ? total[m][v] * scale[v] + shift[v]
                                                : total[m][v] + shift[v];
            const int64_t at = out_first + m * out_stride + column + v * LANES;
            const int lanes = width - v * LANES < LANES ? width - v * LANES : LANES;
            if (lanes > 0)
                store_vector(out, at, value, lanes, bf16);
        }
}

/* A run of rows as the panels read them: `blocks` packed blocks of BLOCK_ROWS rows (block b
 * at packed + b * BLOCK_ROWS * in, interleaved), then `rest` rows (row i at rest_x + i *
 * rest_stride), written to out from row `row` on. */
typedef struct {
    const float *packed;
    int64_t blocks;
    const float *rest_x;
    int64_t rest_stride, rest, row;
} rows_t;

/* The rows of `run` times `count` panels from p: the packed blocks, then the rest 4, 2, 1 at
 * a time (more than PAIRED panels: one row only, never packed). */
static inline __attribute__((always_inline)) void panel_times_rows(
        const rows_t *run, int64_t in, const void *panels, int64_t p, const int count,
        int64_t out_features, const float *scales, const void *bias, void *out,
        int64_t out_stride, const int format, const int bf16) {
    const int64_t panel = p * in * PANEL, column = p * PANEL;
    const int64_t left = out_features - column;
    const int width = left < count * PANEL ? (int)left : count * PANEL;
    if (count <= PAIRED)
        for (int64_t b = 0; b < run->blocks; b++)
            panel_rows(run->packed + b * BLOCK_ROWS * in, 0, 1, panels, panel, in, scales,
                       bias, column, out, (run->row + b * BLOCK_ROWS) * out_stride,
                       out_stride, width, BLOCK_ROWS, count, format, bf16);
    const float *x = run->rest_x;
    const int64_t x_stride = run->rest_stride, first = run->row + run->blocks * BLOCK_ROWS;
    int64_t r = 0;
#define ROWS(N)                                                                               \
    panel_rows(x + r * x_stride, x_stride, 0, panels, panel, in, scales, bias, column, out,  \
               (first + r) * out_stride, out_stride, width, N, count, format, bf16)
    if (count <= PAIRED) {
        for (; r + 4 <= run->rest; r += 4)
            ROWS(4);
        for (; r + 2 <= run->rest; r += 2)
            ROWS(2);
    }
    for (; r < run->rest; r++)
        ROWS(1);
#undef ROWS
}

/* The rows of `run` times panels [lo, hi): WIDE at a time for a single row, else PAIRED at
 * a time, then one by one. */
static inline __attribute__((always_inline)) void panels_times_rows(
        const rows_t *run, int64_t in, const void *panels, int64_t lo, int64_t hi,
        int64_t out_features, const float *scales, const void *bias, void *out,
        int64_t out_stride, const int format, const int bf16) {
    int64_t p = lo;
    if (run->blocks == 0 && run->rest == 1)
        for (; p + WIDE <= hi; p += WIDE)
            panel_times_rows(run, in, panels, p, WIDE, out_features, scales, bias, out,
                             out_stride, format, bf16);
    for (; p + PAIRED <= hi; p += PAIRED)
        panel_times_rows(run, in, panels, p, PAIRED, out_features, scales, bias, out,
                         out_stride, format, bf16);
    for (; p < hi; p++)
        panel_times_rows(run, in, panels, p, 1, out_features, scales, bias, out, out_stride,
                         format, bf16);
}

/* panels_times_rows for the weight format given at run time, each format compiled as a
 * constant (the activations' dtype only matters at the stores). */
static void panels_times_rows_as(
        const rows_t *run, int64_t in, const void *panels, int64_t lo, int64_t hi,
        int64_t out_features, const float *scales, const void *bias, void *out,
        int64_t out_stride, const int format, const int bf16) {
#define TIMES_ROWS(FORMAT)                                                                    \
    panels_times_rows(run, in, panels, lo, hi, out_features, scales, bias, out, out_stride,  \
                      FORMAT, bf16)
    if (format == F32)
        TIMES_ROWS(F32);
    else if (format == BF16)
        TIMES_ROWS(BF16);
    else if (format == INT8)
        TIMES_ROWS(INT8);
    else
        TIMES_ROWS(FP8);
#undef TIMES_ROWS
}

/* Rows [first, first + rows) of x (float32, or bfloat16 when `bf16`) into `to` as float32,
 * as panel_rows reads them fastest: each whole block of BLOCK_ROWS rows interleaved
 * ([in][BLOCK_ROWS]: one pointer feeds the block's broadcasts, where 12 rows apart needed
 * more registers than x86 has), then the rest row after row. The threads of the enclosing
 * parallel region share the work and wait for each other at its end. Returns the run. */
static rows_t pack_rows(const void *x, int64_t x_stride, int64_t first, int64_t rows,
                        int64_t in, const int bf16, float *to) {
    const int64_t blocks = rows / BLOCK_ROWS, packed_rows = blocks * BLOCK_ROWS;
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < blocks + rows - packed_rows; unit++) {
        if (unit < blocks) { /* a block, element by element in the order it is stored */
            const int64_t from = (first + unit * BLOCK_ROWS) * x_stride;
            float *block = to + unit * BLOCK_ROWS * in;
            for (int64_t k = 0; k < in; k++)
                for (int m = 0; m < BLOCK_ROWS; m++)
                    block[k * BLOCK_ROWS + m] = load_scalar(x, from + m * x_stride + k, bf16);
        } else {
            const int64_t r = packed_rows + unit - blocks, from = (first + r) * x_stride;
            for (int64_t k = 0; k < in; k++)
                to[r * in + k] = load_scalar(x, from + k, bf16);
        }
    }
    return (rows_t){to, blocks, to + packed_rows * in, in, rows - packed_rows, first};
}

/* The experts of a mixture, each its own rows of x times its own panels: rows
 * [offsets[e], offsets[e + 1]) of x [offsets[num_experts], in] (x_stride apart; offsets[0]
 * is 0) times the panels of expert e's W [out_features, in] (at element e * expert_stride
 * of `panels`), plus bias (NULL: none), into the same rows of out (out_stride apart). x,
 * bias and out are float32, or bfloat16 when `bf16`. The panels are in `format` (F32 or
 * BF16: the activations' dtype; INT8 or FP8 with expert e's scales [out_features] at scales
 * + e * out_features). The rows go in tiles of about X_TILE_BYTES, so that every panel
 * multiplies a tile that stays in the core's L2 cache; a tile is packed first (pack_rows:
 * bfloat16 converted to float32 once there, where converting each element as it is
 * multiplied, once per panel, held the kernel to half its float32 speed), except a float32
 * tile of fewer than BLOCK_ROWS rows, read in place. A row's outputs have the same bits in
 * any group, tile or expert's batch (panel_rows). Returns 0, or -1 when the tile's buffer
 * could not be allocated. */
#define X_TILE_BYTES (256 * 1024)
int32_t tandem_grouped_panel_linear(const void *x, int64_t x_stride, const int64_t *offsets,
                                    int64_t num_experts, int64_t in, const void *panels,
                                    int64_t expert_stride, int64_t out_features,
                                    const float *scales, const void *bias, void *out,
                                    int64_t out_stride, int32_t bf16, int32_t format,
                                    int32_t num_threads) {
    const int64_t num_panels = (out_features + PANEL - 1) / PANEL;
    const int64_t element = format == F32 ? 4 : format == BF16 ? 2 : 1;
    int64_t tile = X_TILE_BYTES / (in * (int64_t)sizeof(float)) / BLOCK_ROWS * BLOCK_ROWS;
    tile = tile < BLOCK_ROWS ? BLOCK_ROWS : tile;
    float *buffer = malloc(sizeof(float) * tile * in);
    if (buffer == NULL)
        return -1;
#pragma omp parallel num_threads(num_threads)
    {
        /* each thread its own run of panels, the same for every tile and expert */
        const int64_t id = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t lo = num_panels * id / threads, hi = num_panels * (id + 1) / threads;
        for (int64_t e = 0; e < num_experts; e++) {
            const void *own = (const char *)panels + e * expert_stride * element;
            const float *own_scales = scales ? scales + e * out_features : NULL;
            for (int64_t first = offsets[e]; first < offsets[e + 1]; first += tile) {
                const int64_t count = offsets[e + 1] - first < tile ? offsets[e + 1] - first
                                                                    : tile;
                const int in_place = !bf16 && count < BLOCK_ROWS;
                const rows_t run =
                    in_place ? (rows_t){NULL, 0, (const float *)x + first * x_stride,
                                        x_stride, count, first}
                             : pack_rows(x, x_stride, first, count, in, bf16, buffer);
                panels_times_rows_as(&run, in, own, lo, hi, out_features, own_scales, bias,
                                     out, out_stride, format, bf16);
                if (!in_place) {
#pragma omp barrier /* every thread done with the buffer before the next tile's packing */
                }
            }
        }
    }
    free(buffer);
    return 0;
}

/* out [rows, out_features] = x [rows, in] times the panels of W [out_features, in] (and
 * its scales), plus bias: one expert's worth of tandem_grouped_panel_linear. */
int32_t tandem_panel_linear(const void *x, int64_t x_stride, int64_t rows, int64_t in,
                            const void *panels, int64_t out_features, const float *scales,
                            const void *bias, void *out, int64_t out_stride, int32_t bf16,
                            int32_t format, int32_t num_threads) {
    const int64_t offsets[2] = {0, rows};
    return tandem_grouped_panel_linear(x, x_stride, offsets, 1, in, panels, 0, out_features,
                                       scales, bias, out, out_stride, bf16, format,
                                       num_threads);
}
