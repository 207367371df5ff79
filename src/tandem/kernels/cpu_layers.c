/* A decoder layer's per-token operations on CPU, one pass each: RMSNorm with the residual add
 * fused in (Llama's, or Gemma's scaling by 1 + weight), rotary embedding in place, the SiLU-
 * and GELU-tanh-gated products, and the write of K/V rows into the block pool. Each replaces
 * several torch operations (each a pass over memory and a dispatch), which at a few rows per
 * step cost more than their arithmetic.
 *
 * The arithmetic is the torch references' (layers.py, attention.py): every value a torch
 * bfloat16 operation would round is rounded here too (round_bf16), so bfloat16 results match
 * them but for the order of RMSNorm's sum of squares and GELU's form (gelu_tanh: nearer
 * float64 than torch's where the two differ). Element strides throughout; the last
 * dimension of every tensor is contiguous. Built and loaded by cpu_build.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

/* Below this many elements a call stays on the calling thread: forking costs more. */
#define PARALLEL_MIN_ELEMENTS 65536

static inline float load(const void *base, int64_t index, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

static inline void store(void *base, int64_t index, float value, int bf16) {
    if (bf16)
        ((uint16_t *)base)[index] = float_to_bf16(value);
    else
        ((float *)base)[index] = value;
}

/* `value` as the model dtype holds it. */
static inline float in_dtype(float value, int bf16) {
    return bf16 ? round_bf16(value) : value;
}

/* With `unit_offset` (Gemma's norm) the normalised value is scaled by 1 + weight in float32
 * and rounded once; else (Llama's) it is rounded, then scaled by the weight. */
static inline void rms_norm_row(const void *x, const void *residual, const void *weight,
                                void *out, void *sum_out, int64_t cols, float eps, int bf16,
                                int unit_offset) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < cols; c++) {
        float value = load(x, c, bf16);
        if (residual) {
            value = in_dtype(value + load(residual, c, bf16), bf16);
            store(sum_out, c, value, bf16);
        }
        squares += value * value;
    }
    /* In double: -ffast-math would take 1/sqrtf from an approximate reciprocal root. */
    const float mean = squares / (float)cols;
    const float inverse = (float)(1.0 / sqrt((double)(mean + eps)));
    const void *source = residual ? sum_out : x;
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) {
        const float normed = load(source, c, bf16) * inverse, scale = load(weight, c, bf16);
        store(out, c, unit_offset ? normed * (1.0f + scale) : scale * in_dtype(normed, bf16),
              bf16);
    }
}

/* out[r] = weight * x[r] / rms(x[r]) over `rows` rows of `cols`; with `residual`,
 * x[r] + residual[r] is normalised instead and written to sum_out[r]; with `unit_offset`
 * scaled by 1 + weight (Gemma's norm). `out` and `sum_out` are contiguous; x and residual
 * rows `x_stride`, `residual_stride` elements apart. */
void tandem_rms_norm(const void *x, int64_t x_stride, const void *residual,
                     int64_t residual_stride, const void *weight, void *out, void *sum_out,
                     int64_t rows, int64_t cols, float eps, int32_t bf16, int32_t unit_offset,
                     int32_t num_threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const char *x_row = (const char *)x + r * x_stride * size;
        const char *residual_row = residual ? (const char *)residual + r * residual_stride * size
                                            : NULL;
        char *out_row = (char *)out + r * cols * size;
        char *sum_row = sum_out ? (char *)sum_out + r * cols * size : NULL;
        if (bf16)
            rms_norm_row(x_row, residual_row, weight, out_row, sum_row, cols, eps, 1,
                         unit_offset);
        else
            rms_norm_row(x_row, residual_row, weight, out_row, sum_row, cols, eps, 0,
                         unit_offset);
    }
}

/* GELU's tanh approximation, 0.5 g (1 + tanh(u)) with u = sqrt(2/pi) (g + 0.044715 g^3),
 * written as g sigmoid(2u): one exp, and no cancellation in 1 + tanh(u) where tanh(u) is
 * near -1. With e = exp(-2|u|) <= 1, which never overflows (exp(-2u) does from g < -8.6,
 * and -ffast-math assumes no infinities), sigmoid(2u) is 1 / (1 + e) for u >= 0, else
 * e / (1 + e). */
static inline float gelu_tanh(float g) {
    const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    const float e = expf(-2.0f * fabsf(inner));
    return g * (inner >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* With `gelu` the GELU-tanh-gated product, else the SiLU-gated one: the activation rounded
 * to the model dtype, then multiplied by up. */
static inline void gated_row(const void *gate, const void *up, void *out, int64_t cols, int bf16,
                             int gelu) {
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) {
        const float g = load(gate, c, bf16);
        const float act = in_dtype(gelu ? gelu_tanh(g) : g / (1.0f + expf(-g)), bf16);
        store(out, c, act * load(up, c, bf16), bf16);
    }
}

/* out[r] = act(gate[r]) * up[r] over `rows` rows of `cols` (act: SiLU, or GELU-tanh with
 * `gelu`); `out` contiguous. */
void tandem_gated_activation(const void *gate, int64_t gate_stride, const void *up,
                             int64_t up_stride, void *out, int64_t rows, int64_t cols,
                             int32_t bf16, int32_t gelu, int32_t num_threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate_row = (const char *)gate + r * gate_stride * size;
        const char *up_row = (const char *)up + r * up_stride * size;
        char *out_row = (char *)out + r * cols * size;
        if (bf16)
            gated_row(gate_row, up_row, out_row, cols, 1, gelu);
        else
            gated_row(gate_row, up_row, out_row, cols, 0, gelu);
    }
}

/* Rotate one head's row in place (rotate-half layout), with the reference's roundings. */
static inline void rotate_row(void *row, const float *cos, const float *sin, int64_t half,
                              int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float c = in_dtype(cos[i], bf16), s = in_dtype(sin[i], bf16);
        const float first = load(row, i, bf16), second = load(row, i + half, bf16);
        const float rotated = in_dtype(first * s, bf16);
        store(row, i, in_dtype(first * c, bf16) - in_dtype(second * s, bf16), bf16);
        store(row, i + half, in_dtype(second * c, bf16) + rotated, bf16);
    }
}

/* Rotate `num_heads` head rows of one token, `stride_head` elements apart. */
static void rotate_heads(char *token, int64_t num_heads, int64_t stride_head, const float *cos,
                         const float *sin, int64_t half, int32_t bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t h = 0; h < num_heads; h++) {
        if (bf16)
            rotate_row(token + h * stride_head * size, cos, sin, half, 1);
        else
            rotate_row(token + h * stride_head * size, cos, sin, half, 0);
    }
}

struct rotary_args {
    const int64_t *positions;    /* [num_tokens] */
    void *query, *key;           /* [num_tokens, heads, head_dim] by strides */
    const float *cos_cache, *sin_cache; /* [max_position, cache_stride]; first head_dim/2 used */
    int64_t num_tokens, head_dim, cache_stride;
    int64_t query_stride_token, query_stride_head, num_query_heads;
    int64_t key_stride_token, key_stride_head, num_key_heads;
    int32_t bf16;
};

/* Rotate every query and key head of every token in place by its position. */
void tandem_rotary_embedding(const struct rotary_args *a, int32_t num_threads) {
    const int64_t size = a->bf16 ? 2 : 4, half = a->head_dim / 2;
    const int64_t elements = a->num_tokens * (a->num_query_heads + a->num_key_heads) * a->head_dim;
#pragma omp parallel for num_threads(num_threads) if (elements >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < a->num_tokens; t++) {
        const float *cos = a->cos_cache + a->positions[t] * a->cache_stride;
        const float *sin = a->sin_cache + a->positions[t] * a->cache_stride;
        rotate_heads((char *)a->query + t * a->query_stride_token * size, a->num_query_heads,
                     a->query_stride_head, cos, sin, half, a->bf16);
        rotate_heads((char *)a->key + t * a->key_stride_token * size, a->num_key_heads,
                     a->key_stride_head, cos, sin, half, a->bf16);
    }
}

struct store_kv_args {
    const void *key, *value;     /* [num_tokens, num_kv_heads, head_dim] by strides */
    void *k_cache, *v_cache;     /* [num_blocks, block_size, num_kv_heads, head_dim] by strides */
    const int64_t *slot_mapping; /* [num_tokens]; -1 skips a token (padding) */
    int64_t num_tokens, num_kv_heads, head_dim, block_size, element_size;
    int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;
    int64_t cache_stride_block, cache_stride_token, cache_stride_head;
};

/* Copy each token's key and value rows into its slot of the pool. */
void tandem_store_kv(const struct store_kv_args *a) {
    const int64_t row_bytes = a->head_dim * a->element_size;
    for (int64_t t = 0; t < a->num_tokens; t++) {
        const int64_t slot = a->slot_mapping[t];
        if (slot < 0)
            continue;
        const int64_t base = (slot / a->block_size) * a->cache_stride_block
                             + (slot % a->block_size) * a->cache_stride_token;
        for (int64_t h = 0; h < a->num_kv_heads; h++) {
            const int64_t to = (base + h * a->cache_stride_head) * a->element_size;
            memcpy((char *)a->k_cache + to,
                   (const char *)a->key
                       + (t * a->key_stride_token + h * a->key_stride_head) * a->element_size,
                   row_bytes);
            memcpy((char *)a->v_cache + to,
                   (const char *)a->value
                       + (t * a->value_stride_token + h * a->value_stride_head) * a->element_size,
                   row_bytes);
        }
    }
}
