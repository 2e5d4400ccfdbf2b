/* y = x @ W.T (+ b) on the CPU: the linear layers' matmul, from a weight packed once into panels.

   A decode step multiplies ~32 rows of activations by every weight matrix of
   the model. The weights (hundreds of MB in float32) do not fit in any cache,
   so every step streams them from memory, and the question is how well the
   multiply keeps the CPU's multiply-add units busy while the weights arrive.

   The weight W [n, k] is packed once (pack_weight) into panels of NR output
   columns, NR being two of this CPU's widest float vectors (cpu_math.h's
   VEC_LANES: 16 columns with AVX2 or NEON, 32 with AVX-512): panel p holds
   W's rows NR p .. NR p + NR - 1 interleaved by k,

       packed[p][kk][j] = W[NR p + j][kk]        (NR floats = one or two 64-byte cache lines per kk)

   so a panel is one contiguous stretch of memory read front to back. For one
   panel, a tile of up to MR rows of x keeps its MR x NR outputs in 2 MR
   vector registers (MR 6 with AVX2's 16 registers, 8 with AVX-512's 32);
   each kk loads one row of the panel (two vectors) and does 2 MR
   multiply-adds with x's MR values broadcast:

       acc[r][0..NR-1] += x[r][kk] * panel[kk][0..NR-1]     for r < MR, kk = 0 .. k-1

   The panel stays in the core's caches for the remaining tiles of x's rows.
   Meanwhile the next panel is prefetched: each of the panel's tiles asks for
   its share of the next panel's lines, one line every few kk, so the lines
   arrive at about the rate memory can deliver them while the multiply-adds
   go on (asking for all of them in the first tile stalls it on memory; not
   asking leaves the CPU idle at the start of every panel). Threads split the
   panels (OpenMP), each writing its own columns of y.

   Each output is one running sum over kk = 0 .. k-1 in that order (a fused
   multiply-add per term where the CPU has FMA), whatever the number of rows
   or threads: a row's result does not depend on what else is in the batch.
   It differs from torch's (oneDNN's) order by float32 rounding only.

   Many rows (a prefill chunk) are taken in blocks of rows that fit in the
   core's L2 cache with room to spare, each block sweeping all panels.
   cpu/linear.py's PanelLinear calls this through cpu/matmul.py. */

#include <stdint.h>
#include <string.h>

#include "cpu_math.h"    /* fv, loadv, storev: the CPU's widest float vector, VEC_LANES floats */

/* Output columns per panel: two vectors, 16 floats with 256-bit vectors (AVX2, NEON), 32 with AVX-512. */
#define NR (2 * VEC_LANES)
/* Rows per tile: MR x 2 accumulators stay in registers, with room for the panel's two vectors and x's
   broadcast value: 6 x 2 = 12 of AVX2's 16 registers, 8 x 2 = 16 of AVX-512's 32. With AVX-512, 8 rows
   measured better than 6 (one tile for an 8-row decode step: 57 against 44 GFLOP/s on one Zen 4 core) and
   than 12 (which lost 4-6 % at 128-512 rows); docs/benchmarks-notebook.md. (-DMR=... overrides.) */
#ifndef MR
#define MR (VEC_LANES == 16 ? 8 : 6)
#endif
#if MR < 1 || MR > 14
#error "MR must be 1 to 14 (tile_rows has a case for each)"
#endif
#define BLOCK_BYTES 393216   /* bytes of x's rows one block holds (L2 is 512 KB and more) */
#define LINE_FLOATS 16       /* floats per 64-byte cache line: a panel row is NR / 16 lines */

/* The panel width this library was built with (cpu/matmul.py reads it: the packed layout depends on it). */
int panel_width(void) { return NR; }

/* w [n, k] row-major -> packed [ceil(n/NR), k, NR]; columns past n (the last panel's tail) are zeros. */
void pack_weight(const float *w, float *packed, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                packed[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* One tile: `mr` rows of x (row stride ldx) times one panel -> y's NR columns (row stride ldy), of which
   `cols` are real (the last panel may hold fewer). `bias` (NR floats) or NULL. `ahead`: `lines` rows of the
   next panel to prefetch (NR / 16 cache lines each), spread evenly over the k steps (none: lines = 0).
   Inlined with a constant mr, so the loops over r unroll and acc lives in registers. */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx,
                                                       const float *panel, const float *bias,
                                                       const float *ahead, int64_t lines, int64_t k,
                                                       float *y, int64_t ldy, int64_t cols) {
    fv acc[MR][2];
    const fv b0 = bias ? loadv(bias) : (fv){0}, b1 = bias ? loadv(bias + VEC_LANES) : (fv){0};
    for (int r = 0; r < mr; r++) {
        acc[r][0] = b0;
        acc[r][1] = b1;
    }
    const int64_t every = lines > 0 && k / lines > 1 ? k / lines : 1;    /* k steps per prefetched line */
    for (int64_t kk = 0, line = 0, next_ask = 0; kk < k; kk++) {
        if (kk == next_ask && line < lines) {                        /* one row (NR floats) of the next panel */
            for (int l = 0; l < NR; l += LINE_FLOATS)
                __builtin_prefetch(ahead + line * NR + l, 0, 3);
            line++;
            next_ask += every;
        }
        const fv w0 = loadv(panel + kk * NR), w1 = loadv(panel + kk * NR + VEC_LANES);
        for (int r = 0; r < mr; r++) {
            const float xr = x[r * ldx + kk];
            acc[r][0] += xr * w0;
            acc[r][1] += xr * w1;
        }
    }
    for (int r = 0; r < mr; r++) {
        if (cols == NR) {
            storev(y + r * ldy, acc[r][0]);
            storev(y + r * ldy + VEC_LANES, acc[r][1]);
        } else {                                                 /* the last panel: only its real columns */
            float out[NR];
            storev(out, acc[r][0]);
            storev(out + VEC_LANES, acc[r][1]);
            memcpy(y + r * ldy, out, (size_t)cols * sizeof(float));
        }
    }
}

static void tile_rows(int mr, const float *x, int64_t ldx, const float *panel, const float *bias,
                      const float *ahead, int64_t lines, int64_t k, float *y, int64_t ldy, int64_t cols) {
    switch (mr) {           /* one specialised copy of tile() per row count up to MR */
#if MR >= 14
    case 14: tile(14, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
#if MR >= 13
    case 13: tile(13, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
#if MR >= 12
    case 12: tile(12, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
#if MR >= 11
    case 11: tile(11, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
#if MR >= 10
    case 10: tile(10, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
#if MR >= 9
    case 9: tile(9, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
#if MR >= 8
    case 8: tile(8, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
#if MR >= 7
    case 7: tile(7, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
#endif
    case 6: tile(6, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 5: tile(5, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 4: tile(4, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 3: tile(3, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    case 2: tile(2, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    default: tile(1, x, ldx, panel, bias, ahead, lines, k, y, ldy, cols); break;
    }
}

/* Rows of the next tile when `left` rows remain: MR at a time, but never a thin last tile when two tiles
   can share the rest (MR 6, 8 left -> 4 + 4, not 6 + 2: a thin tile wastes the loaded panel line). */
static int64_t tile_height(int64_t left) {
    if (left <= MR) return left;
    if (left < 2 * MR) return (left + 1) / 2;
    return MR;
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W.T + bias (NULL: none), W packed by pack_weight. */
void panel_linear(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                  int64_t m, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR;
    int64_t block = k > 0 ? BLOCK_BYTES / ((int64_t)sizeof(float) * k) : m;   /* k = 0: y is the bias */
    block = block < MR ? MR : block;
    #pragma omp parallel if (m * n * k >= 65536)
    for (int64_t r0 = 0; r0 < m; r0 += block) {          /* every thread walks the same row blocks */
        const int64_t rows = m - r0 < block ? m - r0 : block;
        int64_t tiles = 0;                                   /* tiles per panel: they share the prefetching */
        for (int64_t i = 0; i < rows; i += tile_height(rows - i))
            tiles++;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {               /* ... and takes its share of the panels */
            const float *panel = packed + p * k * NR;
            const float *next = p + 1 < panels ? panel + k * NR : 0;
            const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            const float *pb = bias ? bias + p * NR : 0;
            float padded_bias[NR];
            if (pb && cols < NR) {                           /* the bias ends inside this panel */
                memset(padded_bias, 0, sizeof padded_bias);
                memcpy(padded_bias, pb, (size_t)cols * sizeof(float));
                pb = padded_bias;
            }
            for (int64_t i = 0, t = 0; i < rows; t++) {         /* tile t prefetches lines lo .. hi-1 of next */
                const int64_t mr = tile_height(rows - i);
                const int64_t lo = k * t / tiles, hi = k * (t + 1) / tiles;
                tile_rows((int)mr, x + (r0 + i) * ldx, ldx, panel, pb, next ? next + lo * NR : 0,
                          next ? hi - lo : 0, k, y + (r0 + i) * ldy + p * NR, ldy, cols);
                i += mr;
            }
        }
    }
}
