/* Paged decode attention on CPU: one query token per sequence, keys and values read in place
 * from the block pool (no gathered copy, no upcast copy), softmax in float32.
 *
 * Built and loaded by cpu_build.py (gcc -O3 -march=native -ffast-math -fopenmp). Its
 * OpenMP runtime is the one torch already loaded (same soname), so the threads are torch's.
 * A task is one (sequence, KV head): its query heads' scores against every context token,
 * then the softmax-weighted sum of the values. Element strides throughout; a row's head_dim
 * values are contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

/* The limits, defined once in cpu_build.py and passed as -D flags. */
#ifndef MAX_HEAD_DIM
#error "build with -DMAX_HEAD_DIM=... (cpu_build.py does)"
#endif
#ifndef MAX_GROUP
#error "build with -DMAX_GROUP=... (cpu_build.py does)"
#endif

struct decode_args {
    const void *query;        /* [num_seqs, num_heads, head_dim], strides below */
    void *output;             /* the same shape and dtype, strides below */
    const void *k_cache;      /* [num_blocks, block_size, num_kv_heads, head_dim] by strides */
    const void *v_cache;
    const int64_t *block_tables;   /* [num_seqs, block_table_stride] */
    const int64_t *context_lens;   /* [num_seqs] */
    int64_t block_table_stride;
    int64_t query_stride_seq, query_stride_head;
    int64_t output_stride_seq, output_stride_head;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    int64_t cache_stride_block, cache_stride_token, cache_stride_head;
    float scale;
    int32_t bf16;
};

/* Row `index` (an element offset) of `base` as float32: the row itself for a float32 pool,
 * else converted into `scratch`. */
static inline const float *row_at(const void *base, int64_t index, int32_t bf16,
                                  int64_t head_dim, float *scratch) {
    if (!bf16)
        return (const float *)base + index;
    const uint16_t *row = (const uint16_t *)base + index;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++)
        scratch[d] = bf16_to_float(row[d]);
    return scratch;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* The element offset in the pool of each of `seq`'s first `context_len` tokens' rows. */
static void token_rows(const struct decode_args *a, int64_t seq, int64_t kv_head,
                       int64_t context_len, int64_t *rows) {
    const int64_t *table = a->block_tables + seq * a->block_table_stride;
    for (int64_t block = 0, t = 0; t < context_len; block++) {
        const int64_t base = kv_head * a->cache_stride_head + table[block] * a->cache_stride_block;
        for (int64_t offset = 0; offset < a->block_size && t < context_len; offset++, t++)
            rows[t] = base + offset * a->cache_stride_token;
    }
}

static void load_queries(const struct decode_args *a, int64_t seq, int64_t kv_head,
                         int64_t group, float queries[][MAX_HEAD_DIM]) {
    float scratch[MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++) {
        int64_t index = seq * a->query_stride_seq + (kv_head * group + g) * a->query_stride_head;
        const float *row = row_at(a->query, index, a->bf16, a->head_dim, scratch);
        for (int64_t d = 0; d < a->head_dim; d++)
            queries[g][d] = row[d] * a->scale;
    }
}

/* Each row of scores in place becomes its softmax. */
static void softmax_rows(float *scores, int64_t group, int64_t context_len) {
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * context_len;
        float max = row[0];
        for (int64_t t = 1; t < context_len; t++)
            max = row[t] > max ? row[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < context_len; t++) {
            row[t] = expf(row[t] - max);
            sum += row[t];
        }
        float inverse = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < context_len; t++)
            row[t] *= inverse;
    }
}

static void store_outputs(const struct decode_args *a, int64_t seq, int64_t kv_head,
                          int64_t group, float sums[][MAX_HEAD_DIM]) {
    for (int64_t g = 0; g < group; g++) {
        int64_t index = seq * a->output_stride_seq + (kv_head * group + g) * a->output_stride_head;
        if (a->bf16) {
            uint16_t *out = (uint16_t *)a->output + index;
            for (int64_t d = 0; d < a->head_dim; d++)
                out[d] = float_to_bf16(sums[g][d]);
        } else {
            memcpy((float *)a->output + index, sums[g], a->head_dim * sizeof(float));
        }
    }
}

static void attend(const struct decode_args *a, int64_t seq, int64_t kv_head, float *scores,
                   int64_t *rows) {
    const int64_t group = a->num_heads / a->num_kv_heads, head_dim = a->head_dim;
    const int64_t context_len = a->context_lens[seq];
    float queries[MAX_GROUP][MAX_HEAD_DIM], sums[MAX_GROUP][MAX_HEAD_DIM];
    float scratch[MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++) /* only the rows used: the arrays are 32 KiB each */
        memset(sums[g], 0, head_dim * sizeof(float));
    if (context_len <= 0) { /* nothing to attend: zeros, as the Triton kernel writes */
        store_outputs(a, seq, kv_head, group, sums);
        return;
    }
    load_queries(a, seq, kv_head, group, queries);
    token_rows(a, seq, kv_head, context_len, rows);
    for (int64_t t = 0; t < context_len; t++) {
        const float *key = row_at(a->k_cache, rows[t], a->bf16, head_dim, scratch);
        for (int64_t g = 0; g < group; g++)
            scores[g * context_len + t] = dot(queries[g], key, head_dim);
    }
    softmax_rows(scores, group, context_len);
    for (int64_t t = 0; t < context_len; t++) {
        const float *value = row_at(a->v_cache, rows[t], a->bf16, head_dim, scratch);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * context_len + t];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                sums[g][d] += p * value[d];
        }
    }
    store_outputs(a, seq, kv_head, group, sums);
}

/* Attend every (sequence, KV head) of `num_seqs` decodes, over `num_threads` threads.
 * Returns 0, or -1 when its scratch memory could not be allocated (no output written then
 * for some tasks). */
int32_t tandem_decode_attention(const struct decode_args *a, int64_t num_seqs,
                                int32_t num_threads) {
    int64_t longest = 1;
    for (int64_t s = 0; s < num_seqs; s++)
        longest = a->context_lens[s] > longest ? a->context_lens[s] : longest;
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t num_tasks = num_seqs * a->num_kv_heads;
    int32_t status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * group * longest);
        int64_t *rows = malloc(sizeof(int64_t) * longest);
        if (scores == NULL || rows == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++)
            if (scores != NULL && rows != NULL)
                attend(a, task / a->num_kv_heads, task % a->num_kv_heads, scores, rows);
        free(scores);
        free(rows);
    }
    return status;
}
