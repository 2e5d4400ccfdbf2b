/* Paged decode attention on the CPU, reading K/V in place through the block table.

   The same contract as `reference.decode_attention` (kernels/reference.py):
   one query token per sequence, grouped-query attention, K/V found through
   the block table. The torch path has to *gather* each sequence's blocks
   into a contiguous copy before torch's attention can read them; this loop
   reads every K and V row exactly once, where it lies in the pool, and
   writes nothing but the output. That is the whole speed-up: less memory
   traffic, no padding, no copies.

   For every sequence b (the loop OpenMP spreads over the threads torch uses),
   with G = Hq / Hkv query heads reading each KV head:

       for each token t < seq_lens[b]:                       1. scores
           slot = block_tables[b][t / bs] * bs + t % bs      (where token t lies)
           s[hq][t] = scale * dot(q[b][hq], K[slot][hq / G])   for every query head hq
       for each hq:                                          2. softmax over t
           p[hq][t] = exp(s[hq][t] - max_t s[hq]) / sum_t exp(...)
       for each token t:                                     3. weighted sum of V
           out[b][hq] += p[hq][t] * V[slot][hq / G]

   Tokens go in order, so a block's 16 rows are read front to back with all
   their heads: the memory system sees long runs, not scattered reads (that
   order was 1.3x faster than a loop per KV head, measured on an AMD EPYC).
   The loops over head_dim are vectorised by the compiler.

   The cache holds float32, or bfloat16 when compiled with -DCACHE_BF16: a
   bf16 value is the top half of a float32, so widening it is a shift. The
   arithmetic is float32 either way. kernels/cpu_decode.py compiles this file
   with the system's C compiler on first use and calls it through ctypes.   */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef CACHE_BF16
typedef uint16_t cache_t;
static inline float widen(cache_t x) {           /* bf16 -> float32: put the 16 bits on top */
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#else
typedef float cache_t;
static inline float widen(cache_t x) { return x; }
#endif

/* dot(a, b) over n floats. Eight running sums instead of one: the compiler keeps them in vector
   registers, and the additions do not all wait on each other (eight measured faster than sixteen
   here: fewer to add up at the end of a 64-float head). */
static inline float dot(const float *a, const cache_t *b, int64_t n) {
    float acc[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[d + j] * widen(b[d + j]);
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += acc[j];
    for (; d < n; d++) sum += a[d] * widen(b[d]);       /* the rest, when n is not a multiple of 8 */
    return sum;
}

/* Token t's row (every KV head) in a cache, found through the sequence's block table. */
static inline const cache_t *token_row(const cache_t *cache, const int64_t *table, int64_t t, int64_t bs,
                                       int64_t row) {
    return cache + (table[t / bs] * bs + t % bs) * row;
}

/* Returns 0, or -1 if a scratch buffer could not be allocated. */
int paged_decode_attention(
    /* inputs */
    const float *q,                /* [B, Hq, D] the newest token's query, one per sequence */
    const cache_t *k_cache,        /* [N, bs, Hkv, D] this layer's K pool */
    const cache_t *v_cache,        /* [N, bs, Hkv, D] this layer's V pool */
    const int64_t *block_tables,   /* [B, max_blocks] physical block of each logical block */
    const int64_t *seq_lens,       /* [B] tokens of each sequence, the new one included */
    /* output */
    float *out,                    /* [B, Hq, D] */
    /* sizes */
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks,
    float scale)
{
    const int64_t G = Hq / Hkv;                    /* query heads per KV head: head hq reads KV head hq / G */
    const int64_t row = Hkv * D;                   /* one slot's K (or V) row: every KV head of one token */
    int failed = 0;

    /* One sequence per iteration; threads take the next sequence when they finish one. */
    #pragma omp parallel for schedule(dynamic)
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_lens[b];
        const int64_t *table = block_tables + b * max_blocks;
        const float *qb = q + b * Hq * D;          /* [Hq, D] */
        float *o = out + b * Hq * D;               /* [Hq, D] */
        float *s = malloc(sizeof(float) * Hq * L); /* scores, then probabilities: [Hq, L] */
        if (s == NULL) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }

        /* 1. scores. Tokens in order, so each block's rows are read front to back, all heads at once. */
        for (int64_t t = 0; t < L; t++) {
            const cache_t *k = token_row(k_cache, table, t, bs, row);
            for (int64_t hq = 0; hq < Hq; hq++)
                s[hq * L + t] = dot(qb + hq * D, k + (hq / G) * D, D) * scale;
        }

        /* 2. softmax over the L scores of each query head (minus the max, so exp never overflows) */
        for (int64_t hq = 0; hq < Hq; hq++) {
            float *sh = s + hq * L;
            float max = sh[0];
            for (int64_t t = 1; t < L; t++) max = sh[t] > max ? sh[t] : max;
            float sum = 0.0f;
            for (int64_t t = 0; t < L; t++) { sh[t] = expf(sh[t] - max); sum += sh[t]; }
            for (int64_t t = 0; t < L; t++) sh[t] /= sum;
        }

        /* 3. out[hq] = sum over t of p[hq][t] * V row of token t (read in the same order as K), four
              tokens at a time: out is read and written once per four V rows, not once per row. */
        memset(o, 0, sizeof(float) * Hq * D);
        int64_t t = 0;
        for (; t + 4 <= L; t += 4) {
            const cache_t *v0 = token_row(v_cache, table, t, bs, row);
            const cache_t *v1 = token_row(v_cache, table, t + 1, bs, row);
            const cache_t *v2 = token_row(v_cache, table, t + 2, bs, row);
            const cache_t *v3 = token_row(v_cache, table, t + 3, bs, row);
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float *p = s + hq * L + t;
                const int64_t kv = (hq / G) * D;
                float *oh = o + hq * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++)
                    oh[d] += p[0] * widen(v0[kv + d]) + p[1] * widen(v1[kv + d])
                           + p[2] * widen(v2[kv + d]) + p[3] * widen(v3[kv + d]);
            }
        }
        for (; t < L; t++) {                                  /* the last 0-3 tokens, one at a time */
            const cache_t *v = token_row(v_cache, table, t, bs, row);
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float p = s[hq * L + t];
                const cache_t *vh = v + (hq / G) * D;
                float *oh = o + hq * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += p * widen(vh[d]);
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
