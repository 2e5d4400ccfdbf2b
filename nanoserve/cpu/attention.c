/* Paged decode attention on the CPU, reading K/V in place through the block table.

   The same contract as `reference.decode_attention` (kernels/reference.py):
   one query token per sequence, grouped-query attention, K/V found through
   the block table. The torch path has to *gather* each sequence's blocks
   into a contiguous copy before torch's attention can read them; this loop
   reads every K and V row exactly once, where it lies in the pool, and
   writes nothing but the output. No copies, no padding.

   For every sequence b (the loop OpenMP spreads over the threads torch uses;
   with fewer sequences than twice the threads, each of a sequence's KV heads
   is a piece of its own, so one chat's attention runs on every thread too),
   with G = Hq / Hkv query heads reading each KV head:

       slot[t] = block_tables[b][t / bs] * bs + t % bs       0. where token t lies
       s[hq][t] = scale * dot(q[b][hq], K[slot[t]][hq / G])  1. scores, every query head
       p[hq][t] = exp(s[hq][t] - max_t s[hq]) / sum_t exp(...)   2. softmax over t
       out[b][hq] = sum_t p[hq][t] * V[slot[t]][hq / G]      3. weighted sum of V

   Tokens go in order, so a block's 16 rows are read front to back with all
   their heads: the memory system sees long runs, not scattered reads.

   Prefill rows too: query i of a prefill chunk of Tq queries over ctx tokens
   may see exactly the first ctx - Tq + i + 1 tokens (causal attention), so it
   is this loop with that length and the chunk's block table. The CPU
   backend (cpu/backend.py, `kernel_rows`) hands every row of a
   step here that way: one call per layer, no causal mask, no work above the
   diagonal. paged_store_kv at the end of the file writes the step's K/V.

   How it is fast (each measured on an AMD EPYC, docs/benchmarks.md and
   docs/benchmarks-notebook.md):
   - pass 1 takes eight tokens at a time in 8-float vectors (`f8`, the
     compiler's vector extension: AVX on x86, NEON on Arm), and makes eight
     dot products' 8-lane sums into one vector of eight scores with a few
     shuffles (`sum_lanes8`), not one lane-by-lane sum per token: the sums
     were half the time of the scores;
   - pass 3 keeps whole output rows in registers, in the CPU's widest
     vectors (`fv`: 16 floats with AVX-512, else 8), one multiply-add per
     vector per token and no chain through memory (it read and wrote the
     output row for every eight tokens before: 10-25 % slower at a decode
     step's 32 sequences on a Zen 4 core);
   - passes 1 and 3 serve up to three query heads of one KV head at once
     where the registers hold their sums (HEADS_PER_PASS: 3 with AVX-512's
     32 registers, 1 with AVX2's 16), so each K and V vector is loaded, and
     widened from bf16, once for all of them;
   - both fetch the rows 16 tokens ahead into the L2 cache (`fetch`): a
     step's K/V is read from memory, scattered in blocks the CPU's own
     prefetcher does not follow across. With these two, the 30 layers of a
     decode step at 32 sequences, read from memory, took 31 ms instead of
     50 (float32) and 24 instead of 52 (bf16) on a Zen 4 core
     (benchmarks/bench_decode_attention.py, "a whole step");
   - a bf16 cache is read as pairs of values (`load16_split`, below): a
     shift and a mask widen 2n values, where widening them in order took a
     shuffle per vector, half of pass 1's instructions. One layer at 32
     sequences, in the caches: 0.43 ms before, 0.34 after (bf16, Zen 4);
   - the exp of pass 2 is cpu_math.h's polynomial, eight at a time (libm's
     expf is a call per number);
   - the slots are found once per sequence (no division per row read).
   A head_dim that is not a multiple of 8 (in pass 3: of two vectors), and
   the last 0-7 tokens, take the same steps one token at a time.

   The cache holds float32, or bfloat16 when compiled with -DCACHE_BF16: a
   bf16 value is the top half of a float32, so widening it is a shift. The
   arithmetic is float32 either way. q comes in, and the output goes out, in
   the cache's dtype (the output rounded once, to nearest even, as torch's
   `.to` rounds), so a bf16 model converts nothing around the call.
   cpu/attention.py compiles this file with the system's C compiler on first
   use and calls it through ctypes.   */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"    /* f8, load8, store8, exp_f32 */

typedef int32_t i8 __attribute__((vector_size(32)));
#if defined(__clang__)                                /* pick lanes of (a, b): 0-7 are a's, 8-15 are b's */
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i8){__VA_ARGS__})
#endif

/* Reading the cache two vectors at a time. A bf16 value is the top half of a float32, so 2n bf16 values
   read as n 32-bit lanes hold n pairs: shifting each lane left by 16 gives the first value of every pair
   (the even dims, as float32), and clearing its low 16 bits gives the second (the odd dims). That is a
   load and two one-instruction steps for 2n values; widening them in order takes a shuffle per n (measured:
   the order-keeping widening was half of pass 1's instructions). A dot product does not care in which
   order its terms come, as long as q's are in the same order: `split_q` puts each 2n-dim chunk of q as
   its even dims, then its odd dims. Pass 3's sums come out in that order; values_heads interleaves them
   back as it stores them.
   A float32 cache needs none of this: its "two vectors" are the chunk's first n values and the next n,
   and q's order is unchanged. */
#ifdef CACHE_BF16
typedef uint16_t cache_t;
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32xv __attribute__((vector_size(4 * VEC_LANES)));
static inline float widen(cache_t x) {           /* one bf16 value -> float32: put the 16 bits on top */
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline cache_t narrow(float f) {          /* float32 -> bf16, to nearest even, as torch's .to rounds */
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (cache_t)((b >> 16) | 0x40);    /* NaN stays NaN */
    return (cache_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static inline f8 load8_cache(const cache_t *p) { /* eight bf16 values in order (a head_dim's last 8) */
    float f[8];
    for (int j = 0; j < 8; j++) f[j] = widen(p[j]);
    return load8(f);
}
static inline void load16_split(const cache_t *p, f8 *even, f8 *odd) {    /* 16 values: dims 0,2,..,14; 1,3,..,15 */
    u32x8 bits, lo, hi;
    memcpy(&bits, p, sizeof bits);
    lo = bits << 16;
    hi = bits & 0xffff0000u;
    memcpy(even, &lo, sizeof lo);
    memcpy(odd, &hi, sizeof hi);
}
static inline void loadv2_split(const cache_t *p, fv *even, fv *odd) {    /* 2 VEC_LANES values, the same way */
    u32xv bits, lo, hi;
    memcpy(&bits, p, sizeof bits);
    lo = bits << 16;
    hi = bits & 0xffff0000u;
    memcpy(even, &lo, sizeof lo);
    memcpy(odd, &hi, sizeof hi);
}
#define SPLIT 1            /* q's chunks are split into even and odd dims; pass 3's sums come out so */
#else
typedef float cache_t;
static inline float widen(cache_t x) { return x; }
static inline cache_t narrow(float x) { return x; }
static inline f8 load8_cache(const cache_t *p) { return load8(p); }
static inline void load16_split(const cache_t *p, f8 *a, f8 *b) { *a = load8(p); *b = load8(p + 8); }
static inline void loadv2_split(const cache_t *p, fv *a, fv *b) { *a = loadv(p); *b = loadv(p + VEC_LANES); }
#define SPLIT 0
#endif

/* q's D values, as float32, in the order pass 1 reads K: each whole 16-dim chunk as its 8 even dims then
   its 8 odd ones (a bf16 cache; the last D % 16 dims, and every dim of a float32 cache, stay in place).
   q comes in the cache's dtype, so a bf16 model's q is widened here, not by a torch call per layer. */
static void split_q(const cache_t *q, float *qs, int64_t D) {
    int64_t d = 0;
    if (SPLIT)
        for (; d + 16 <= D; d += 16)
            for (int j = 0; j < 8; j++) {
                qs[d + j] = widen(q[d + 2 * j]);
                qs[d + 8 + j] = widen(q[d + 2 * j + 1]);
            }
    for (; d < D; d++) qs[d] = widen(q[d]);
}

/* dot(q, K row) over n dims, one token at a time, q in split_q's order (eight running sums: vector
   registers, no serial chain). */
static inline float dot(const float *q, const cache_t *k, int64_t n) {
    float acc[8] = {0};
    int64_t d = 0;
    if (SPLIT)
        for (; d + 16 <= n; d += 16)
            for (int j = 0; j < 8; j++)
                acc[j] += q[d + j] * widen(k[d + 2 * j]) + q[d + 8 + j] * widen(k[d + 2 * j + 1]);
    for (; d + 8 <= n; d += 8)
        for (int j = 0; j < 8; j++) acc[j] += q[d + j] * widen(k[d + j]);
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += acc[j];
    for (; d < n; d++) sum += q[d] * widen(k[d]);       /* the rest, when n is not a multiple of 8 */
    return sum;
}

/* r[j] = the sum of a[j]'s eight lanes, for j = 0..7: three rounds of "add neighbouring lanes of two
   vectors", each round halving the vectors (8 -> 4 -> 2 -> 1), instead of eight separate 8-lane sums. */
static inline f8 sum_lanes8(const f8 a[8]) {
    f8 b[4], c[2];
    for (int i = 0; i < 4; i++)      /* b[i]: lanes alternate a[2i], a[2i+1]; each the sum of a lane pair */
        b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)      /* c[i]: a[4i..4i+3] twice over, each the sum of two pairs */
        c[i] = SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* How many query heads share one pass over their KV head's rows. Each keeps its own running sums in
   vector registers while every K (or V) vector is loaded, and widened from bf16, once for all of them: the
   CPU's 32 vector registers (AVX-512) hold three heads' sums, 16 (AVX2) hold one. */
#ifndef HEADS_PER_PASS     /* (-DHEADS_PER_PASS=1 and -DAHEAD=0 undo these two choices, to compare) */
#define HEADS_PER_PASS (VEC_LANES == 16 ? 3 : 1)
#endif
#if HEADS_PER_PASS < 1 || HEADS_PER_PASS > 3
#error "HEADS_PER_PASS: 1 to 3 (the passes below have a copy for each)"
#endif
#define SUM_VECTORS (VEC_LANES == 16 ? 24 : 12)   /* registers the values pass may fill with sums */
#ifndef AHEAD
#define AHEAD 16           /* tokens: rows are fetched this far ahead of the one being read (0: not at all) */
#endif

/* How many of the query heads from hq on share the next pass: up to `most`, all reading hq's KV head
   (head hq reads KV head hq / G). */
static inline int64_t heads_in_pass(int64_t hq, int64_t G, int64_t most) {
    const int64_t left = G - hq % G;                 /* hq's KV head's heads not yet served */
    return left < most ? left : most;
}

/* Ask for the D values of the KV head at `kv` in token `t`'s row now, into the core's L2 cache: the block
   table scatters a sequence's rows over the pool, and the CPU's own prefetcher stops at every 4 KB page
   and block edge. At a step's 32 sequences, read from memory, this made the layer's attention 1.4x (float32)
   to 1.6x (bf16) faster on a Zen 4 core. */
static inline void fetch(const cache_t *cache, const int64_t *slot, int64_t t, int64_t L, int64_t kv, int64_t D) {
    if (AHEAD > 0 && t < L)
        for (int64_t d = 0; d < D; d += 64 / sizeof(cache_t))        /* one 64-byte cache line at a time */
            __builtin_prefetch(cache + slot[t] + kv + d, 0, 2);      /* 0: to read; 2: keep in L2 */
}

/* 1. s[h * Lp + t] = scale * q[h] . K row of token t, for t < L, for the n query heads q[0..n-1] that read
   the KV head starting at `kv` in a row. Eight tokens at a time, eight dot products per head at once.
   `first`: the first pass over this KV head's rows (the one that fetches them ahead). */
static inline __attribute__((always_inline)) void scores_heads(const float *q, const cache_t *k_cache,
        const int64_t *slot, int64_t L, int64_t Lp, int64_t kv, int64_t D, float scale, float *s, const int n,
        int first) {
    int64_t t = 0;
    if (D % 8 == 0) {
        for (; t + 8 <= L; t += 8) {
            if (first)                               /* a later pass over the same rows finds them fetched */
                for (int64_t j = 0; j < 8; j++) fetch(k_cache, slot, t + AHEAD + j, L, kv, D);
            f8 acc[3][8];                           /* acc[h][j]: head h, token t + j's products, 8 lanes */
            for (int h = 0; h < n; h++)
                for (int j = 0; j < 8; j++) acc[h][j] = (f8){0};
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) {           /* 16 dims: two vectors of K, q's in the same order */
                f8 qa[3], qb[3];
                for (int h = 0; h < n; h++) {
                    qa[h] = load8(q + h * D + d);
                    qb[h] = load8(q + h * D + d + 8);
                }
                for (int j = 0; j < 8; j++) {
                    f8 ka, kb;
                    load16_split(k_cache + slot[t + j] + kv + d, &ka, &kb);        /* once for the n heads */
                    for (int h = 0; h < n; h++) acc[h][j] += qa[h] * ka + qb[h] * kb;
                }
            }
            for (; d < D; d += 8) {                  /* the last 8 dims, when D is not a multiple of 16 */
                f8 qv[3];
                for (int h = 0; h < n; h++) qv[h] = load8(q + h * D + d);
                for (int j = 0; j < 8; j++) {
                    const f8 k = load8_cache(k_cache + slot[t + j] + kv + d);
                    for (int h = 0; h < n; h++) acc[h][j] += qv[h] * k;
                }
            }
            for (int h = 0; h < n; h++) store8(s + h * Lp + t, sum_lanes8(acc[h]) * scale);
        }
    }
    for (; t < L; t++)                               /* the rest, one token at a time */
        for (int h = 0; h < n; h++) s[h * Lp + t] = dot(q + h * D, k_cache + slot[t] + kv, D) * scale;
}

/* 1. for all Hq heads: head hq reads KV head hq / G; up to HEADS_PER_PASS of a KV head's heads per pass. */
static void scores(const float *q, const cache_t *k_cache, const int64_t *slot, int64_t L, int64_t Lp,
                   int64_t Hq, int64_t G, int64_t D, float scale, float *s) {
    for (int64_t hq = 0; hq < Hq;) {
        const int64_t n = heads_in_pass(hq, G, HEADS_PER_PASS);
        const float *qh = q + hq * D;
        const int64_t kv = (hq / G) * D;             /* their KV head, inside a token's row */
        const int first = hq % G == 0;
        switch (n) {                                 /* n a constant in each copy: the sums stay in registers */
        case 1: scores_heads(qh, k_cache, slot, L, Lp, kv, D, scale, s + hq * Lp, 1, first); break;
        case 2: scores_heads(qh, k_cache, slot, L, Lp, kv, D, scale, s + hq * Lp, 2, first); break;
        default: scores_heads(qh, k_cache, slot, L, Lp, kv, D, scale, s + hq * Lp, 3, first); break;
        }
        hq += n;
    }
}

/* 2. Each head's L scores become probabilities (minus the max first, so exp never overflows). */
static void softmax(float *s, int64_t L, int64_t Lp, int64_t Hq) {
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sh = s + hq * Lp;
        float mx[8], acc[8] = {0};                   /* eight running maxima, then sums: vectorised */
        for (int j = 0; j < 8; j++) mx[j] = sh[0];
        int64_t t = 0;
        for (; t + 8 <= L; t += 8)
            for (int j = 0; j < 8; j++) mx[j] = sh[t + j] > mx[j] ? sh[t + j] : mx[j];
        float max = sh[0];
        for (int j = 0; j < 8; j++) max = mx[j] > max ? mx[j] : max;
        for (; t < L; t++) max = sh[t] > max ? sh[t] : max;

        #pragma omp simd
        for (t = 0; t < L; t++) sh[t] = exp_f32(sh[t] - max);
        for (t = 0; t + 8 <= L; t += 8)
            for (int j = 0; j < 8; j++) acc[j] += sh[t + j];
        float sum = 0.0f;
        for (int j = 0; j < 8; j++) sum += acc[j];
        for (; t < L; t++) sum += sh[t];
        const float inv = 1.0f / sum;
        for (t = 0; t < L; t++) sh[t] *= inv;
    }
}

/* 3. out[h] = sum over t of p[h * Lp + t] * V row of token t (read in the same order as K), for the n
   query heads of one KV head. Their whole output rows (n * C vectors of the CPU's widest kind, `fv`: 16
   floats with AVX-512, else 8) stay in registers over all L tokens: n * C independent running sums, one
   multiply-add per vector per token and no chain through memory; each V vector is loaded once for the
   n heads. `first` as in scores_heads. */
static inline __attribute__((always_inline)) void values_heads(const float *p, int64_t Lp, const cache_t *v_cache,
        const int64_t *slot, int64_t L, int64_t kv, float *out, const int n, const int C, int first) {
    fv acc[3][16];
    for (int h = 0; h < n; h++)
        for (int c = 0; c < C; c++) acc[h][c] = (fv){0};
    for (int64_t t = 0; t < L; t++) {
        if (first)
            fetch(v_cache, slot, t + AHEAD, L, kv, C * VEC_LANES);
        const cache_t *vr = v_cache + slot[t] + kv;
        for (int c = 0; c < C; c += 2) {             /* two vectors at a time (the order split_q explains) */
            fv va, vb;
            loadv2_split(vr + c * VEC_LANES, &va, &vb);
            for (int h = 0; h < n; h++) {
                acc[h][c] += p[h * Lp + t] * va;
                acc[h][c + 1] += p[h * Lp + t] * vb;
            }
        }
    }
    for (int h = 0; h < n; h++)
        for (int c = 0; c < C; c += 2) {
            float *o = out + (h * C + c) * VEC_LANES;
            if (SPLIT) {                             /* even dims in acc[c], odd in acc[c + 1]: interleave */
                float a[VEC_LANES], b[VEC_LANES];
                storev(a, acc[h][c]);
                storev(b, acc[h][c + 1]);
                for (int j = 0; j < VEC_LANES; j++) {
                    o[2 * j] = a[j];
                    o[2 * j + 1] = b[j];
                }
            } else {
                storev(o, acc[h][c]);
                storev(o + VEC_LANES, acc[h][c + 1]);
            }
        }
}

#define VALUES(C, N) case 4 * C + N: values_heads(ph, Lp, v_cache, slot, L, kv, oh, N, C, first); break;

static void weighted_values(const float *p, const cache_t *v_cache, const int64_t *slot, int64_t L,
                            int64_t Lp, int64_t Hq, int64_t G, int64_t D, float *out) {
    const int64_t C = D % (2 * VEC_LANES) == 0 ? D / VEC_LANES : 0;  /* vectors per output row, read in pairs
                                                                      (0: D not a multiple of two) */
    int64_t most = C == 0 ? 1 : SUM_VECTORS / C;                    /* heads per pass whose sums fit */
    most = most < 1 ? 1 : (most > HEADS_PER_PASS ? HEADS_PER_PASS : most);
    for (int64_t hq = 0; hq < Hq;) {
        const int64_t n = heads_in_pass(hq, G, most);
        const float *ph = p + hq * Lp;
        const int64_t kv = (hq / G) * D;
        const int first = hq % G == 0;
        float *oh = out + hq * D;
        switch (4 * C + n) {                         /* C and n constants in each copy */
        VALUES(2, 1) VALUES(2, 2) VALUES(2, 3) VALUES(4, 1) VALUES(4, 2) VALUES(4, 3)
        VALUES(8, 1) VALUES(8, 2) VALUES(8, 3) VALUES(16, 1) VALUES(16, 2) VALUES(16, 3)
        default:                                     /* any other head_dim: one value at a time */
            for (int64_t h = 0; h < n; h++) {
                memset(oh + h * D, 0, sizeof(float) * D);
                for (int64_t t = 0; t < L; t++) {
                    const cache_t *vh = v_cache + slot[t] + kv;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) oh[h * D + d] += ph[h * Lp + t] * widen(vh[d]);
                }
            }
        }
        hq += n;
    }
}

/* What the call returns: 0, or which argument was wrong (nothing is read before the checks). */
enum { OK = 0, NO_MEMORY = -1, BAD_SEQ_LEN = -2, BAD_BLOCK = -3 };

int paged_decode_attention(
    /* inputs */
    const cache_t *q,              /* [B, Hq, D] the newest token's query, one per sequence; row b at q + b * q_stride */
    const cache_t *k_cache,        /* [N, bs, Hkv, D] this layer's K pool */
    const cache_t *v_cache,        /* [N, bs, Hkv, D] this layer's V pool */
    const int64_t *block_tables,   /* [B, max_blocks] physical block of each logical block */
    const int64_t *seq_lens,       /* [B] tokens of each sequence, the new one included */
    /* output */
    cache_t *out,                  /* [B, Hq, D] (the cache's dtype, as q: rounded once from float32 sums) */
    /* sizes */
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks, int64_t N,
    int64_t q_stride, float scale,
    int64_t window)                /* 0: every token; W > 0: only each row's last W tokens (a sliding window) */
{
    /* The indices come from the caller: check every one this call would follow before reading any K/V
       (a few hundred integer compares; in Python they were four tensor reductions per layer). */
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * bs)
            return BAD_SEQ_LEN;
        for (int64_t i = 0; i < (seq_lens[b] + bs - 1) / bs; i++)
            if (block_tables[b * max_blocks + i] < 0 || block_tables[b * max_blocks + i] >= N)
                return BAD_BLOCK;
    }

    const int64_t G = Hq / Hkv;                    /* query heads per KV head: head hq reads KV head hq / G */
    const int64_t row = Hkv * D;                   /* one slot's K (or V) row: every KV head of one token */
    int failed = 0;
    /* Fewer sequences than twice the threads (a learner's one chat: one): each KV head of a sequence is a
       piece of work of its own, so the threads share even one sequence's attention. Otherwise a sequence
       is one piece. The sums per head are the same either way. */
    const int64_t parts = B < 2 * omp_get_max_threads() ? Hkv : 1;   /* pieces per sequence */
    const int64_t Hkv_part = Hkv / parts, Hq_part = Hkv_part * G;     /* KV heads and query heads per piece */

    /* One piece per iteration; threads take the next piece when they finish one. */
    #pragma omp parallel for schedule(dynamic)
    for (int64_t piece = 0; piece < B * parts; piece++) {
        const int64_t b = piece / parts, kv0 = piece % parts * Hkv_part;   /* its sequence, its first KV head */
        /* A sliding window skips the row's first seq_len - W tokens: the rest is the same over L tokens. */
        const int64_t first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
        const int64_t L = seq_lens[b] - first;
        const int64_t Lp = (L + 7) / 8 * 8;        /* a head's scores start 8-aligned: eight stored at once */
        const int64_t *table = block_tables + b * max_blocks;
        /* scratch: scores, then probabilities [Hq_part, Lp]; q in pass 1's order [Hq_part, D]; the output in
           float32 [Hq_part, D]; then each attended token's row offset in the pools [L] */
        float *s = malloc(sizeof(float) * (Hq_part * Lp + 2 * Hq_part * D) + sizeof(int64_t) * L);
        if (s == NULL) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qs = s + Hq_part * Lp, *o = qs + Hq_part * D;
        int64_t *slot = (int64_t *)(o + Hq_part * D);
        const cache_t *qb = q + b * q_stride + kv0 * G * D;          /* this piece's first query head */
        for (int64_t h = 0; h < Hq_part; h++) split_q(qb + h * D, qs + h * D, D);

        /* 0. where each attended token lies: block by block through the table from the window's first
           token (position first + t), no division per token */
        for (int64_t t = 0, blk = first / bs, i = first % bs; t < L; blk++, i = 0)
            for (; i < bs && t < L; i++, t++) slot[t] = (table[blk] * bs + i) * row;

        /* the piece's KV heads start kv0 * D into each row: from there its query heads read as heads 0, 1, ... */
        scores(qs, k_cache + kv0 * D, slot, L, Lp, Hq_part, G, D, scale, s);
        softmax(s, L, Lp, Hq_part);
        weighted_values(s, v_cache + kv0 * D, slot, L, Lp, Hq_part, G, D, o);
        for (int64_t i = 0; i < Hq_part * D; i++) out[b * Hq * D + kv0 * G * D + i] = narrow(o[i]);
        free(s);
    }
    return failed ? NO_MEMORY : OK;
}

/* The step's new K/V rows to their slots: what `reference.store_kv` does with two index_copy_ calls, here
   one pass (at a decode step's 32 rows the two torch calls cost ~25 us in dispatch, the copy ~1 us).
   k and v are rows of the merged q/k/v matmul output, so each has its own row stride (in elements). */
int paged_store_kv(const cache_t *k, const cache_t *v, int64_t k_stride, int64_t v_stride,
                   cache_t *k_cache, cache_t *v_cache, const int64_t *slots, int64_t T, int64_t row,
                   int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)                /* every slot inside the pool before writing any */
        if (slots[t] < 0 || slots[t] >= num_slots)
            return BAD_BLOCK;
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * row, k + t * k_stride, sizeof(cache_t) * row);
        memcpy(v_cache + slots[t] * row, v + t * v_stride, sizeof(cache_t) * row);
    }
    return OK;
}
