/* A linear layer in float32 or bfloat16: out = x W^T (+ bias), W stored in panels, in the
 * activations' dtype or in 8 bits (int8 or fp8 e4m3, one float32 scale per output channel).
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

static inline void store_scalar(void *to, int64_t index, float value, const int bf16) {
    if (bf16)
        ((uint16_t *)to)[index] = float_to_bf16(value);
    else
        ((float *)to)[index] = value;
}

/* Rows [0, rows) of float32 x (row m at x + m * x_stride; rows <= BLOCK_ROWS) times
 * `count` adjacent panels (at most PAIRED; WIDE for one row), the first at element `panel` of `panels`:
 * out[m][column + j] (row m at element out_first + m * out_stride) for j < width (the last
 * panel may be partial: its padding columns are zero weights, never written). Each output
 * is its products summed in K_BLOCK blocks, the blocks then added in order: the same bits
 * whatever `rows`, `count` or the row's place in the block; 8-bit weights' sums are then
 * multiplied by their channel's scale (scales[column + j]). The bias and out are bfloat16
 * when `bf16`. `rows`, `count` and `format` are constants once inlined. */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, const void *panels, int64_t panel,
        int64_t in, const float *scales, const void *bias, int64_t column, void *out,
        int64_t out_first, int64_t out_stride, int width, const int rows, const int count,
        const int format, const int bf16) {
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
        float sums[WIDE * PANEL];
        memcpy(sums, total[m], count * PANEL * sizeof(float));
        for (int j = 0; j < width; j++) {
            const float b = bias ? load_scalar(bias, column + j, bf16) : 0.0f;
            const float sum = format >= INT8 ? sums[j] * scales[column + j] : sums[j];
            store_scalar(out, out_first + m * out_stride + column + j, sum + b, bf16);
        }
    }
}

/* Rows [first, first + rows) of x times `count` panels from p, BLOCK_ROWS at a time, then
 * 4, 2, 1 (more than PAIRED panels: one row only). */
static inline __attribute__((always_inline)) void panel_times_rows(
        const float *x, int64_t x_stride, int64_t first, int64_t rows, int64_t in,
        const void *panels, int64_t p, const int count, int64_t out_features,
        const float *scales, const void *bias, void *out, int64_t out_stride,
        const int format, const int bf16) {
    const int64_t panel = p * in * PANEL, column = p * PANEL, stop = first + rows;
    const int64_t left = out_features - column;
    const int width = left < count * PANEL ? (int)left : count * PANEL;
    int64_t r = first;
    if (count <= PAIRED) {
        for (; r + BLOCK_ROWS <= stop; r += BLOCK_ROWS)
            panel_rows(x + r * x_stride, x_stride, panels, panel, in, scales, bias, column,
                       out, r * out_stride, out_stride, width, BLOCK_ROWS, count, format,
                       bf16);
        for (; r + 4 <= stop; r += 4)
            panel_rows(x + r * x_stride, x_stride, panels, panel, in, scales, bias, column,
                       out, r * out_stride, out_stride, width, 4, count, format, bf16);
        for (; r + 2 <= stop; r += 2)
            panel_rows(x + r * x_stride, x_stride, panels, panel, in, scales, bias, column,
                       out, r * out_stride, out_stride, width, 2, count, format, bf16);
    }
    for (; r < stop; r++)
        panel_rows(x + r * x_stride, x_stride, panels, panel, in, scales, bias, column,
                   out, r * out_stride, out_stride, width, 1, count, format, bf16);
}

/* Rows [first, first + rows) times panels [lo, hi): WIDE at a time for a single row, else
 * PAIRED at a time, then one by one. */
static inline __attribute__((always_inline)) void panels_times_rows(
        const float *x, int64_t x_stride, int64_t first, int64_t rows, int64_t in,
        const void *panels, int64_t lo, int64_t hi, int64_t out_features,
        const float *scales, const void *bias, void *out, int64_t out_stride,
        const int format, const int bf16) {
    int64_t p = lo;
    if (rows == 1)
        for (; p + WIDE <= hi; p += WIDE)
            panel_times_rows(x, x_stride, first, rows, in, panels, p, WIDE, out_features,
                             scales, bias, out, out_stride, format, bf16);
    for (; p + PAIRED <= hi; p += PAIRED)
        panel_times_rows(x, x_stride, first, rows, in, panels, p, PAIRED, out_features,
                         scales, bias, out, out_stride, format, bf16);
    for (; p < hi; p++)
        panel_times_rows(x, x_stride, first, rows, in, panels, p, 1, out_features, scales,
                         bias, out, out_stride, format, bf16);
}

/* panels_times_rows for the weight format given at run time, each format compiled as a
 * constant (the activations' dtype only matters at the stores). */
static void panels_times_rows_as(
        const float *x, int64_t x_stride, int64_t first, int64_t rows, int64_t in,
        const void *panels, int64_t lo, int64_t hi, int64_t out_features,
        const float *scales, const void *bias, void *out, int64_t out_stride,
        const int format, const int bf16) {
#define TIMES_ROWS(FORMAT)                                                                    \
    panels_times_rows(x, x_stride, first, rows, in, panels, lo, hi, out_features, scales,     \
                      bias, out, out_stride, FORMAT, bf16)
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

/* The experts of a mixture, each its own rows of x times its own panels: rows
 * [offsets[e], offsets[e + 1]) of x [offsets[num_experts], in] (x_stride apart; offsets[0]
 * is 0) times the panels of expert e's W [out_features, in] (at element e * expert_stride of `panels`),
 * plus bias (NULL: none), into the same rows of out (out_stride apart). x, bias and out are
 * float32, or bfloat16 when `bf16`: then x is converted to float32 first, once (converting
 * each element where it is multiplied, once per panel, held the kernel to half its float32
 * speed). The panels are in `format` (F32 or BF16: the activations' dtype; INT8 or FP8 with
 * expert e's scales [out_features] at scales + e * out_features). The
 * rows go in tiles of about X_TILE_BYTES, so that every panel multiplies a tile that stays
 * in the core's L2 cache. A row's outputs have the same bits in any group, tile or expert's
 * batch (panel_rows). Returns 0, or -1 when the float32 copy of x could not be allocated. */
#define X_TILE_BYTES (256 * 1024)
int32_t tandem_grouped_panel_linear(const void *x, int64_t x_stride, const int64_t *offsets,
                                    int64_t num_experts, int64_t in, const void *panels,
                                    int64_t expert_stride, int64_t out_features,
                                    const float *scales, const void *bias, void *out,
                                    int64_t out_stride, int32_t bf16, int32_t format,
                                    int32_t num_threads) {
    const int64_t num_panels = (out_features + PANEL - 1) / PANEL, rows = offsets[num_experts];
    const int64_t element = format == F32 ? 4 : format == BF16 ? 2 : 1;
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
                panels_times_rows_as(x32, x_stride, first, count, in, own, lo, hi,
                                     out_features, own_scales, bias, out, out_stride, format,
                                     bf16);
            }
        }
    }
    free(converted);
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
