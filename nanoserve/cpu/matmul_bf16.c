/* y = x @ W.T (+ b) for bf16 x and W on a CPU with AVX512-BF16: matmul.c's panels, two k at a time.

   matmul.c explains the plan (read it first): W packed once into panels of
   NR output columns, a tile of up to MR rows of x keeping its MR x NR sums in
   registers while one panel row after another streams in, and the next panel
   prefetched a few lines per step so memory keeps pace. This file is the same
   loop for bf16, built only where the CPU multiplies bf16 in hardware
   (AVX512-BF16: AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and
   later; cpu/matmul.py does not try it elsewhere).

   The instruction that does the work, VDPBF16PS (`_mm512_dpbf16_ps`), takes
   16 lanes of 32 bits, each holding a *pair* of bf16 values, and adds both
   pairs' products to a float32 sum:

       acc[j] += a[j].lo * b[j].lo + a[j].hi * b[j].hi        (j = 0 .. 15)

   So the panels hold W's columns in pairs along k,

       packed[p][q][j][e] = W[NR p + j][2 q + e]      (e = 0, 1; NR = 32 columns = two 16-lane vectors)

   and x's row r, whose bf16 values at 2q and 2q + 1 already sit side by side
   in memory, is broadcast as one 32-bit value: a step of q is two k at once,
   2 MR instructions, each 32 multiply-adds. The sums are float32; each output
   is rounded to bf16 once at the end, to nearest even, as torch's bf16 matmul
   rounds (the sums' order differs: results agree to bf16 rounding).

   Why not oneDNN's packed bf16 matmul (torch.ops.mkldnn, cpu/linear.py)? It
   is as fast on a matrix that stays in the caches, but a decode step streams
   every weight from memory, and there this loop's prefetching keeps the
   multiply units busier: SmolLM2's projections at 32 rows, the weights
   coming from memory, on one Zen 4 core, 1.17-1.29x oneDNN's GFLOP/s; the
   same at 128 and 512 rows (benchmarks/bench_matmul.py --dtype bfloat16,
   docs/benchmarks-notebook.md). */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#ifndef __AVX512BF16__
#error "matmul_bf16.c needs AVX512-BF16 (cpu/matmul.py builds it only on such a CPU)"
#endif

#define NR 32                /* output columns per panel: two vectors of 16 float32 sums */
#define MR 8                 /* rows per tile: 8 x 2 sums of AVX-512's 32 registers, as in matmul.c */
#define BLOCK_BYTES 393216   /* bytes of x's rows one block holds (L2 is 512 KB and more) */
#define PAIR_ROW 64          /* bf16 values in one packed step q: NR columns x 2 = 128 bytes, two cache lines */

typedef uint16_t bf16;       /* a bf16 value's 16 bits: the top half of a float32 */

int panel_width(void) { return NR; }

/* bf16 -> float32: put the 16 bits on top. float32 -> bf16: round to nearest even (NaN stays NaN). */
static inline float widen(bf16 x) { uint32_t b = (uint32_t)x << 16; float f; memcpy(&f, &b, 4); return f; }
static inline bf16 round_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (bf16)((b >> 16) | 0x40);
    return (bf16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* w [n, k] -> packed [ceil(n/NR), ceil(k/2), NR, 2]; past n (the last panel's tail) and past k: zeros. */
void pack_weight(const bf16 *w, bf16 *packed, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR, steps = (k + 1) / 2;
    #pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t q = 0; q < steps; q++)
            for (int64_t j = 0; j < NR; j++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t col = p * NR + j, kk = 2 * q + e;
                    packed[((p * steps + q) * NR + j) * 2 + e] = col < n && kk < k ? w[col * k + kk] : 0;
                }
}

/* x's values at k = 2q and 2q + 1 of one row, as one 32-bit lane broadcast 16 times. `last_odd`: k is odd and
   this is its last step, which has only the first (the packed weight's second is 0; nothing read past the row). */
static inline __m512bh pair(const bf16 *row, int64_t q, const int last_odd) {
    uint32_t two;
    if (last_odd)
        two = row[2 * q];
    else
        memcpy(&two, row + 2 * q, sizeof two);
    return (__m512bh)_mm512_set1_epi32((int32_t)two);
}

/* One step q of a tile: the panel's columns 0-15 and 16-31 at k = 2q, 2q + 1, into every row's sums. */
static inline __attribute__((always_inline)) void step(__m512 acc[][2], const int mr, const bf16 *x, int64_t ldx,
                                                       const bf16 *panel, int64_t q, const int last_odd) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + q * PAIR_ROW);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + q * PAIR_ROW + 32);
    for (int r = 0; r < mr; r++) {
        const __m512bh xr = pair(x + r * ldx, q, last_odd);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
}

/* One tile, as matmul.c's tile(): `mr` rows of x times one panel -> y's NR columns, `cols` of them real;
   `bias` NR floats or NULL; `lines` steps of the next panel to prefetch, spread over the k steps. */
static inline __attribute__((always_inline)) void tile(const int mr, const bf16 *x, int64_t ldx,
                                                       const bf16 *panel, const float *bias, const bf16 *ahead,
                                                       int64_t lines, int64_t k, bf16 *y, int64_t ldy, int64_t cols) {
    const int64_t steps = (k + 1) / 2;
    __m512 acc[MR][2];
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) {
        acc[r][0] = b0;
        acc[r][1] = b1;
    }
    const int64_t every = lines > 0 && steps / lines > 1 ? steps / lines : 1;
    for (int64_t q = 0, line = 0, next_ask = 0; q < k / 2; q++) {     /* the whole pairs */
        if (q == next_ask && line < lines) {                     /* one step (two cache lines) of the next panel */
            __builtin_prefetch(ahead + line * PAIR_ROW, 0, 3);
            __builtin_prefetch(ahead + line * PAIR_ROW + PAIR_ROW / 2, 0, 3);
            line++;
            next_ask += every;
        }
        step(acc, mr, x, ldx, panel, q, 0);
    }
    if (k % 2)                                                   /* an odd k's last value */
        step(acc, mr, x, ldx, panel, k / 2, 1);
    for (int r = 0; r < mr; r++) {
        float out[NR];
        _mm512_storeu_ps(out, acc[r][0]);
        _mm512_storeu_ps(out + 16, acc[r][1]);
        for (int64_t j = 0; j < cols; j++) y[r * ldy + j] = round_bf16(out[j]);
    }
}

static void tile_rows(int mr, const bf16 *x, int64_t ldx, const bf16 *panel, const float *bias, const bf16 *ahead,
                      int64_t lines, int64_t k, bf16 *y, int64_t ldy, int64_t cols) {
    switch (mr) {           /* one specialised copy of tile() per row count up to MR */
    case 8: tile(8, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 7: tile(7, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 6: tile(6, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 5: tile(5, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 4: tile(4, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 3: tile(3, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 2: tile(2, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    default: tile(1, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    }
}

static int64_t tile_height(int64_t left) {      /* as matmul.c: never a thin last tile */
    if (left <= MR) return left;
    if (left < 2 * MR) return (left + 1) / 2;
    return MR;
}

/* y [m, n] bf16 (row stride ldy) = x [m, k] bf16 (row stride ldx) @ W.T + bias (float32, or NULL). */
void panel_linear(const bf16 *x, int64_t ldx, const bf16 *packed, const float *bias, bf16 *y, int64_t ldy,
                  int64_t m, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR, panel_size = (k + 1) / 2 * PAIR_ROW;
    int64_t block = k > 0 ? BLOCK_BYTES / ((int64_t)sizeof(bf16) * k) : m;
    block = block < MR ? MR : block;
    #pragma omp parallel if (m * n * k >= 65536)
    for (int64_t r0 = 0; r0 < m; r0 += block) {
        const int64_t rows = m - r0 < block ? m - r0 : block;
        int64_t tiles = 0;
        for (int64_t i = 0; i < rows; i += tile_height(rows - i))
            tiles++;
        const int64_t steps = (k + 1) / 2;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const bf16 *panel = packed + p * panel_size;
            const bf16 *next = p + 1 < panels ? panel + panel_size : 0;
            const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            const float *pb = bias ? bias + p * NR : 0;
            float padded_bias[NR];
            if (pb && cols < NR) {                           /* the bias ends inside this panel */
                memset(padded_bias, 0, sizeof padded_bias);
                memcpy(padded_bias, pb, (size_t)cols * sizeof(float));
                pb = padded_bias;
            }
            for (int64_t i = 0, t = 0; i < rows; t++) {      /* tile t prefetches steps lo .. hi-1 of next */
                const int64_t mr = tile_height(rows - i);
                const int64_t lo = steps * t / tiles, hi = steps * (t + 1) / tiles;
                tile_rows((int)mr, x + (r0 + i) * ldx, ldx, panel, pb, next ? next + lo * PAIR_ROW : 0,
                          next ? hi - lo : 0, k, y + (r0 + i) * ldy + p * NR, ldy, cols);
                i += mr;
            }
        }
    }
}
