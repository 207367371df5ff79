/* Paged attention on CPU, keys and values read in place from the block pool (no gathered
 * copy, no upcast copy), softmax in float32: the decodes (one query token per sequence) and
 * the prefill chunks (each query token attending to its sequence's keys up to its own
 * position).
 *
 * Built and loaded by cpu_build.py (gcc -O3 -march=native -ffast-math -fopenmp). Its
 * OpenMP runtime is the one torch already loaded (same soname), so the threads are torch's.
 * A prefill task is one (sequence, KV head, tile of query tokens): the scores of the
 * tile's rows (its tokens times the KV head's query heads) against TILE_KEYS keys at a
 * time, transposed so that vectors hold a row's scores, then the softmax and the weighted
 * sum of the values, in register blocks of ROW_BLOCK rows. A decode task is one (sequence,
 * KV head) run as a tile of one token, so that a token's attention has the same bits
 * whether it was decoded or prefilled, and whatever the chunk around it.
 * Element strides throughout; a row's head_dim values are contiguous.
 *
 * The pool holds the query's dtype, or float8 e4m3 (kv_format): each byte read through
 * fp8_values (its float32 value, as torch converts it), K's scale per KV head folded into
 * the query's scale and V's applied to the output sums.
 *
 * With a sliding window W (sliding_window > 0) a token at position p sees the keys
 * p - W < k <= p. A tile reads the keys from its first token's first one; each row's
 * softmax covers its own window, the keys before it weighted 0 (an exact no-op in the value
 * sums, as the keys past its position), so a token's bits still do not depend on its tile.
 *
 * With attention sinks (sinks: a logit per query head) each row's softmax takes its head's
 * sink as one more term of its maximum and its sum, which weights no value. With a soft cap
 * (softcap > 0) each score a row sees becomes softcap * tanh(score / softcap) first. Both are
 * per row, on the row's own columns from its window's first key, so a token's bits still do
 * not depend on its tile.
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

struct attention_args {
    const void *query;        /* [query tokens, num_heads, head_dim], strides below */
    void *output;             /* the same shape and dtype, strides below */
    const void *k_cache;      /* [num_blocks, block_size, num_kv_heads, head_dim] by strides */
    const void *v_cache;
    const int64_t *block_tables;   /* [num_seqs, block_table_stride] */
    const int64_t *context_lens;   /* [num_seqs] */
    const int64_t *query_starts;   /* [num_seqs + 1]: each sequence's first query row */
    const float *k_scale, *v_scale; /* [num_kv_heads]; an FP8 pool's only, else NULL */
    const float *fp8_values;       /* [256]: each e4m3 byte's value; an FP8 pool's only */
    const float *sinks;            /* [num_heads]: each query head's sink logit, or NULL */
    int64_t block_table_stride;
    int64_t query_stride_seq, query_stride_head;
    int64_t output_stride_seq, output_stride_head;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    int64_t cache_stride_block, cache_stride_token, cache_stride_head;
    int64_t sliding_window; /* W: a token sees its last W positions; 0: all before it */
    float scale;
    float softcap;     /* the scores' soft cap; 0: none */
    int32_t bf16;      /* the query and output: FORMAT_FLOAT32 or FORMAT_BFLOAT16 */
    int32_t kv_format; /* the pool: the query's format, or FORMAT_FP8_E4M3 */
};

enum { FORMAT_FLOAT32 = 0, FORMAT_BFLOAT16 = 1, FORMAT_FP8_E4M3 = 2 };

/* Row `index` (an element offset) of `base`, of `format`, as float32: the row itself for
 * float32, else converted into `scratch` (e4m3 through the table `fp8_values`). */
static inline const float *row_at(const void *base, int64_t index, int32_t format,
                                  const float *fp8_values, int64_t head_dim, float *scratch) {
    if (format == FORMAT_FLOAT32)
        return (const float *)base + index;
    if (format == FORMAT_FP8_E4M3) {
        const uint8_t *row = (const uint8_t *)base + index;
        for (int64_t d = 0; d < head_dim; d++)
            scratch[d] = fp8_values[row[d]];
        return scratch;
    }
    const uint16_t *row = (const uint16_t *)base + index;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++)
        scratch[d] = bf16_to_float(row[d]);
    return scratch;
}

/* Value row `index` of the pool as float32 (row_at). */
static inline const float *value_at(const struct attention_args *a, int64_t index,
                                    float *scratch) {
    return row_at(a->v_cache, index, a->kv_format, a->fp8_values, a->head_dim, scratch);
}

/* The element offset in the pool of each of `seq`'s tokens [first, end)'s rows, into rows[0]
 * on: the blocks before the one holding token `first` are never read. */
static void token_rows(const struct attention_args *a, int64_t seq, int64_t kv_head,
                       int64_t first, int64_t end, int64_t *rows) {
    const int64_t *table = a->block_tables + seq * a->block_table_stride;
    for (int64_t t = first; t < end;) {
        const int64_t base = kv_head * a->cache_stride_head
            + table[t / a->block_size] * a->cache_stride_block;
        for (int64_t offset = t % a->block_size; offset < a->block_size && t < end; offset++, t++)
            rows[t - first] = base + offset * a->cache_stride_token;
    }
}

/* The first key position the token at `position` sees (its window's, or 0). */
static inline int64_t first_key(const struct attention_args *a, int64_t position) {
    const int64_t first = position - a->sliding_window + 1;
    return a->sliding_window > 0 && first > 0 ? first : 0;
}

/* Query token `token`'s head `head`, times `scale`, into `out`. */
static void load_query(const struct attention_args *a, int64_t token, int64_t head,
                       float scale, float *out) {
    float scratch[MAX_HEAD_DIM];
    int64_t index = token * a->query_stride_seq + head * a->query_stride_head;
    const float *row = row_at(a->query, index, a->bf16, NULL, a->head_dim, scratch);
    for (int64_t d = 0; d < a->head_dim; d++)
        out[d] = row[d] * scale;
}

/* `sums` into query token `token`'s head `head` of the output, in its dtype. */
static void store_output(const struct attention_args *a, int64_t token, int64_t head,
                         const float *sums) {
    int64_t index = token * a->output_stride_seq + head * a->output_stride_head;
    if (a->bf16) {
        uint16_t *out = (uint16_t *)a->output + index;
        for (int64_t d = 0; d < a->head_dim; d++)
            out[d] = float_to_bf16(sums[d]);
    } else {
        memcpy((float *)a->output + index, sums, a->head_dim * sizeof(float));
    }
}

/* One hardware vector: a wider generic vector is lowered through memory. On an AVX2 Zen 3
 * the 16-lane version took 32 ms a layer for a 564-token prefill (SDPA: 8), 8 lanes 8.7. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
/* A register block: ROW_BLOCK query rows times KEY_VECTORS vectors of keys (or of value
 * elements), 12 sums. On the Zen 3 a 564-token prefill's attention ran at 140 GFLOP/s a
 * layer with 4 x 3, 120 with 6 x 2 and 80 with 4 x 1 (the earlier kernel). */
#define KEY_VECTORS 3
#define TILE_KEYS (KEY_VECTORS * LANES)
#define ROW_BLOCK 4
/* Vector sums a weighted-values block holds in registers (of the 16 AVX2 has, 32 AVX-512):
 * ROW_BLOCK rows times 3 vectors, or fewer rows (a decode's query heads) times more. */
#ifdef __AVX512F__
#define VALUE_SUMS 24
#else
#define VALUE_SUMS 12
#endif
#define MAX_TILE_ROWS 64 /* query rows (tokens times query heads) a prefill task holds */

typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef int32_t vint __attribute__((vector_size(LANES * 4)));

static inline vfloat load_vector(const float *from) {
    vfloat value;
    memcpy(&value, from, sizeof value);
    return value;
}

static inline vfloat splat(float value) {
    return (vfloat){0} + value;
}

/* exp(x) for x <= 0, in every lane: 2^-k e^r with k = round(-x / ln 2) and |r| <= ln 2 / 2,
 * e^r by Cephes' expf polynomial (about 1 ulp). Written out because the C library's vector
 * exp is not always called (gcc calls its scalar expf in some loops), and that call was
 * half of a prefill's attention. x below -87.3 gives 2^-126, not 0. */
static inline vfloat exp_nonpositive(vfloat x) {
    const vfloat lowest = splat(-87.3f);
    const vint below = x < lowest;
    x = (vfloat)(((vint)x & ~below) | ((vint)lowest & below));
    const vint k = __builtin_convertvector(x * splat(-1.44269504f) + splat(0.5f), vint);
    const vfloat kf = __builtin_convertvector(k, vfloat);
    const vfloat r = x + kf * splat(0.693359375f) + kf * splat(-2.12194440e-4f);
    vfloat p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    return p * (vfloat)((127 - k) << 23);
}

/* The n scores of `row` in place become their softmax; with a `sink` (else NULL), the
 * softmax with *sink as one more score, whose probability is dropped. */
static void softmax_row(float *row, int64_t n, const float *sink) {
    float max = sink && *sink > row[0] ? *sink : row[0];
#pragma omp simd reduction(max : max)
    for (int64_t t = 1; t < n; t++)
        max = row[t] > max ? row[t] : max;
    vfloat sums = {0};
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) {
        vfloat e = exp_nonpositive(load_vector(row + t) - max);
        memcpy(row + t, &e, sizeof e);
        sums += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++)
        sum += sums[i];
    for (; t < n; t++) {
        row[t] = expf(row[t] - max);
        sum += row[t];
    }
    if (sink)
        sum += expf(*sink - max);
    float inverse = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; t++)
        row[t] *= inverse;
}

/* tanh(x) in every lane: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 1. The sign is
 * moved as a bit (under -ffast-math a -0.0f constant need not keep its sign). */
static inline vfloat tanh_vector(vfloat x) {
    const vint sign_bit = (vint){0} + INT32_MIN;
    const vint sign = (vint)x & sign_bit;
    const vfloat e = exp_nonpositive((vfloat)((vint)x | sign_bit) * 2.0f);
    const vfloat magnitude = (1.0f - e) / (1.0f + e);
    return (vfloat)((vint)magnitude | sign);
}

/* The n scores of `row` in place become softcap * tanh(score / softcap), LANES at a time,
 * the last ones through a padded vector: every score takes the same arithmetic. */
static void soft_cap(float *row, int64_t n, float softcap) {
    for (int64_t t = 0; t < n; t += LANES) {
        const int64_t count = n - t < LANES ? n - t : LANES;
        vfloat x = {0};
        memcpy(&x, row + t, count * sizeof(float));
        x = tanh_vector(x / softcap) * softcap;
        memcpy(row + t, &x, count * sizeof(float));
    }
}

/* Row `row` of a tile's scores (num_keys columns) in place becomes query head `head`'s
 * probabilities: its columns [from, seen) soft-capped and softmaxed with the head's sink,
 * the others 0. A row that sees no key stays 0. */
static void row_probabilities(const struct attention_args *a, float *row, int64_t from,
                              int64_t seen, int64_t num_keys, int64_t head) {
    memset(row, 0, from * sizeof(float));
    if (seen > from) {
        if (a->softcap > 0.0f)
            soft_cap(row + from, seen - from, a->softcap);
        softmax_row(row + from, seen - from, a->sinks ? a->sinks + head : NULL);
    }
    memset(row + seen, 0, (num_keys - seen) * sizeof(float));
}

/* The query tokens of one prefill task: at most MAX_TILE_ROWS rows of `group` heads each. */
static int64_t tile_tokens(int64_t group) {
    return group >= MAX_TILE_ROWS ? 1 : MAX_TILE_ROWS / group;
}

/* The scores of `count` rows from r0 (a constant once inlined, at most ROW_BLOCK) against
 * the TILE_KEYS transposed keys of `keys`, held in registers: per element of the head,
 * KEY_VECTORS loads and `count` broadcasts feed count * KEY_VECTORS multiply-adds. Each
 * score is its products summed in head order, whatever the rows around it. */
static inline __attribute__((always_inline)) void score_rows(
        float keys[][TILE_KEYS], float queries[][MAX_HEAD_DIM], int64_t head_dim, int64_t r0,
        const int count, float *scores, int64_t stride, int64_t t0, int64_t n) {
    vfloat sums[ROW_BLOCK][KEY_VECTORS] = {{{0}}};
    for (int64_t d = 0; d < head_dim; d++) {
        vfloat key[KEY_VECTORS];
        for (int v = 0; v < KEY_VECTORS; v++)
            key[v] = load_vector(keys[d] + v * LANES);
        for (int i = 0; i < count; i++) {
            const vfloat query = splat(queries[r0 + i][d]);
            for (int v = 0; v < KEY_VECTORS; v++)
                sums[i][v] += query * key[v];
        }
    }
    for (int i = 0; i < count; i++)
        memcpy(scores + (r0 + i) * stride + t0, sums[i], n * sizeof(float));
}

/* Key `rows[t]` of the pool into column j of the transposed tile, as float32. */
static inline void transpose_key(const struct attention_args *a, int64_t row,
                                 float keys[][TILE_KEYS], int64_t j) {
    if (a->kv_format == FORMAT_FP8_E4M3) {
        const uint8_t *key = (const uint8_t *)a->k_cache + row;
        for (int64_t d = 0; d < a->head_dim; d++)
            keys[d][j] = a->fp8_values[key[d]];
    } else if (a->kv_format == FORMAT_BFLOAT16) {
        const uint16_t *key = (const uint16_t *)a->k_cache + row;
        for (int64_t d = 0; d < a->head_dim; d++)
            keys[d][j] = bf16_to_float(key[d]);
    } else {
        const float *key = (const float *)a->k_cache + row;
        for (int64_t d = 0; d < a->head_dim; d++)
            keys[d][j] = key[d];
    }
}

/* scores[r * stride + t] = the tile's row r (scaled query) . key t, for keys [0, num_keys),
 * TILE_KEYS keys at a time through a transposed copy, ROW_BLOCK rows at a time, then the
 * rest (score_rows). */
static void tile_scores(const struct attention_args *a, const int64_t *rows, int64_t num_keys,
                        int64_t num_rows, float queries[][MAX_HEAD_DIM], float *scores,
                        int64_t stride) {
    const int64_t head_dim = a->head_dim;
    float keys[MAX_HEAD_DIM][TILE_KEYS];
    for (int64_t t0 = 0; t0 < num_keys; t0 += TILE_KEYS) {
        const int64_t n = num_keys - t0 < TILE_KEYS ? num_keys - t0 : TILE_KEYS;
        for (int64_t j = 0; j < TILE_KEYS; j++)
            transpose_key(a, rows[t0 + (j < n ? j : 0)], keys, j);
        int64_t r0 = 0;
        for (; r0 + ROW_BLOCK <= num_rows; r0 += ROW_BLOCK)
            score_rows(keys, queries, head_dim, r0, ROW_BLOCK, scores, stride, t0, n);
        switch (num_rows - r0) {
        case 3: score_rows(keys, queries, head_dim, r0, 3, scores, stride, t0, n); break;
        case 2: score_rows(keys, queries, head_dim, r0, 2, scores, stride, t0, n); break;
        case 1: score_rows(keys, queries, head_dim, r0, 1, scores, stride, t0, n); break;
        }
    }
}

/* sums[r][d0 + e] for e < vectors * LANES and the `count` rows from r0 (constants once
 * inlined): the sum over t of scores[r * stride + t] * value t's element d0 + e, in key
 * order, held in registers. */
static inline __attribute__((always_inline)) void weighted_block(
        const struct attention_args *a, const int64_t *rows, int64_t num_keys,
        const float *scores, int64_t stride, int64_t r0, const int count, int64_t d0,
        const int vectors, float sums[][MAX_HEAD_DIM]) {
    float scratch[MAX_HEAD_DIM];
    vfloat acc[ROW_BLOCK][VALUE_SUMS] = {{{0}}};
    for (int64_t t = 0; t < num_keys; t++) {
        const float *value = value_at(a, rows[t], scratch) + d0;
        vfloat v[VALUE_SUMS];
        for (int j = 0; j < vectors; j++)
            v[j] = load_vector(value + j * LANES);
        for (int i = 0; i < count; i++) {
            const vfloat p = splat(scores[(r0 + i) * stride + t]);
            for (int j = 0; j < vectors; j++)
                acc[i][j] += p * v[j];
        }
    }
    for (int i = 0; i < count; i++)
        memcpy(sums[r0 + i] + d0, acc[i], vectors * sizeof(vfloat));
}

/* weighted_block over the `count` rows from r0: VALUE_SUMS / count vectors of elements at
 * a time (at most the head's), then one vector, then the elements past a multiple of LANES
 * one by one. */
static inline __attribute__((always_inline)) void weighted_rows(
        const struct attention_args *a, const int64_t *rows, int64_t num_keys,
        const float *scores, int64_t stride, int64_t r0, const int count,
        float sums[][MAX_HEAD_DIM]) {
    const int64_t head_dim = a->head_dim, vector_dim = head_dim / LANES * LANES;
    const int wide = VALUE_SUMS / count;
    float scratch[MAX_HEAD_DIM];
    int64_t d0 = 0;
    for (; d0 + wide * LANES <= head_dim; d0 += wide * LANES)
        weighted_block(a, rows, num_keys, scores, stride, r0, count, d0, wide, sums);
    for (; d0 + 4 * LANES <= vector_dim; d0 += 4 * LANES)
        weighted_block(a, rows, num_keys, scores, stride, r0, count, d0, 4, sums);
    for (; d0 < vector_dim; d0 += LANES)
        weighted_block(a, rows, num_keys, scores, stride, r0, count, d0, 1, sums);
    for (int64_t d = vector_dim; d < head_dim; d++)
        for (int i = 0; i < count; i++) {
            float sum = 0.0f;
            for (int64_t t = 0; t < num_keys; t++)
                sum += scores[(r0 + i) * stride + t] * value_at(a, rows[t], scratch)[d];
            sums[r0 + i][d] = sum;
        }
}

/* sums[r][d] = sum over t of scores[r * stride + t] * value t's element d, ROW_BLOCK rows
 * at a time, then the rest. */
static void weighted_values(const struct attention_args *a, const int64_t *rows,
                            int64_t num_keys, int64_t num_rows, const float *scores,
                            int64_t stride, float sums[][MAX_HEAD_DIM]) {
    int64_t r0 = 0;
    for (; r0 + ROW_BLOCK <= num_rows; r0 += ROW_BLOCK)
        weighted_rows(a, rows, num_keys, scores, stride, r0, ROW_BLOCK, sums);
    switch (num_rows - r0) {
    case 3: weighted_rows(a, rows, num_keys, scores, stride, r0, 3, sums); break;
    case 2: weighted_rows(a, rows, num_keys, scores, stride, r0, 2, sums); break;
    case 1: weighted_rows(a, rows, num_keys, scores, stride, r0, 1, sums); break;
    }
}

/* The task's query tokens [first, first + count) of prefill `seq`, all of KV head
 * `kv_head`'s query heads: row r is token first + r / group, head r % group. */
static void attend_tile(const struct attention_args *a, int64_t seq, int64_t kv_head,
                        int64_t first, int64_t count, float *scores, int64_t *rows) {
    const int64_t group = a->num_heads / a->num_kv_heads, head_dim = a->head_dim;
    const int64_t start = a->query_starts[seq];
    const int64_t num_query = a->query_starts[seq + 1] - start;
    /* Token first + i sits at this position: it sees keys [first_key, position]. The tile
     * reads keys [first_read, first_position + count), column t of its scores key
     * first_read + t. */
    const int64_t first_position = a->context_lens[seq] - num_query + first;
    const int64_t first_read = first_key(a, first_position);
    const int64_t num_keys = first_position + count - first_read, num_rows = count * group;
    /* An FP8 pool's key scale folds into the query's: q . (k s) = (q s) . k. */
    const float scale = a->k_scale ? a->scale * a->k_scale[kv_head] : a->scale;
    float queries[MAX_TILE_ROWS][MAX_HEAD_DIM], sums[MAX_TILE_ROWS][MAX_HEAD_DIM];
    for (int64_t r = 0; r < num_rows; r++)
        load_query(a, start + first + r / group, kv_head * group + r % group, scale,
                   queries[r]);
    token_rows(a, seq, kv_head, first_read, first_position + count, rows);
    tile_scores(a, rows, num_keys, num_rows, queries, scores, num_keys);
    for (int64_t r = 0; r < num_rows; r++) { /* row r sees its columns [from, seen) */
        const int64_t position = first_position + r / group;
        row_probabilities(a, scores + r * num_keys, first_key(a, position) - first_read,
                          position + 1 - first_read, num_keys, kv_head * group + r % group);
    }
    weighted_values(a, rows, num_keys, num_rows, scores, num_keys, sums);
    if (a->v_scale) /* and the value scale into the sums: sum p (v s) = s sum p v */
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t d = 0; d < head_dim; d++)
                sums[r][d] *= a->v_scale[kv_head];
    for (int64_t r = 0; r < num_rows; r++)
        store_output(a, start + first + r / group, kv_head * group + r % group, sums[r]);
}

/* Attend the query tokens of sequences [first_seq, num_seqs), each a prefill chunk of its
 * sequence's last tokens, over `num_threads` threads. Returns 0, or -1 when its scratch
 * memory could not be allocated (no output written then for some tasks). */
int32_t tandem_prefill_attention(const struct attention_args *a, int64_t first_seq,
                                 int64_t num_seqs, int32_t num_threads) {
    const int64_t group = a->num_heads / a->num_kv_heads, tokens = tile_tokens(group);
    int64_t *first_task = malloc(sizeof(int64_t) * (num_seqs - first_seq + 1));
    if (first_task == NULL)
        return -1;
    int64_t longest = 1;
    first_task[0] = 0;
    for (int64_t s = first_seq; s < num_seqs; s++) {
        const int64_t num_query = a->query_starts[s + 1] - a->query_starts[s];
        const int64_t tiles = (num_query + tokens - 1) / tokens;
        first_task[s - first_seq + 1] = first_task[s - first_seq] + tiles * a->num_kv_heads;
        longest = a->context_lens[s] > longest ? a->context_lens[s] : longest;
    }
    const int64_t num_tasks = first_task[num_seqs - first_seq];
    int32_t status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * MAX_TILE_ROWS * longest);
        int64_t *rows = malloc(sizeof(int64_t) * longest);
        if (scores == NULL || rows == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (scores == NULL || rows == NULL)
                continue;
            int64_t s = 0;
            while (task >= first_task[s + 1])
                s++;
            const int64_t local = task - first_task[s];
            const int64_t tile = local / a->num_kv_heads, kv_head = local % a->num_kv_heads;
            const int64_t seq = first_seq + s;
            const int64_t num_query = a->query_starts[seq + 1] - a->query_starts[seq];
            const int64_t first = tile * tokens;
            const int64_t count = num_query - first < tokens ? num_query - first : tokens;
            attend_tile(a, seq, kv_head, first, count, scores, rows);
        }
        free(scores);
        free(rows);
    }
    free(first_task);
    return status;
}

/* Attend every (sequence, KV head) of the first `num_seqs` sequences, one query token each,
 * over `num_threads` threads: each is a prefill tile of one token, the prefill's own task,
 * so a decode and the same position inside a prefill chunk run the very same arithmetic,
 * in the same order, and give the same bits (exact log-probs: a token's log-prob never
 * depends on whether it was decoded or prefilled, nor on the chunk around it).
 * Returns 0, or -1 when its scratch memory could not be allocated. */
int32_t tandem_decode_attention(const struct attention_args *a, int64_t num_seqs,
                                int32_t num_threads) {
    return tandem_prefill_attention(a, 0, num_seqs, num_threads);
}
