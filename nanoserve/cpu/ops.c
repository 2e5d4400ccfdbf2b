/* A decoder layer's small steps on the CPU, each in one pass over its rows.

   Between its matmuls a Llama layer does elementwise work: RMSNorm, the
   residual adds, RoPE on q and k, silu(gate) * up. In torch each of those is
   several ops (RMSNorm alone is pow, mean, add, rsqrt, mul, mul), and each op
   costs a dispatch, a fresh output tensor and a pass over memory. On a CPU, at
   a decode step's 32 rows, the dispatches cost more than the arithmetic:
   about 10 us each, 25 times per layer. Here each step is one C call that
   reads its rows once and writes them once.

       add_rms_norm   h += a (the residual add, in place; none when a is NULL),
                      then out = w * h / rms(h)             rms(h) = sqrt(mean(h^2) + eps)
       rotary         RoPE in place on q and k (Hugging Face's rotate_half layout)
       silu_mul       out = silu(gate) * up, from the merged [gate | up] matmul output

   The arithmetic is float32, in the order models/llama.py writes it (the
   file is compiled with -ffp-contract=off, so a * b + c is never fused into
   one rounding): RoPE is bit-equal to torch's. RMSNorm adds its squares in
   another order than torch, and SiLU's exp is a polynomial (exp_f32, cpu_math.h),
   so those agree to float32 rounding, not bit for bit.

   The same file builds for bfloat16 tensors (-DELEM_BF16): every value is
   read as a float32, the arithmetic is the same, and a result is rounded to
   bf16 (RND, to nearest even) exactly where torch rounds when models/llama.py
   runs in bf16: after the residual add, after the normalisation and again
   after the weight's multiply, after each of RoPE's products and their sum,
   after silu and after its multiply by up. In the float32 build RND is
   nothing, and the code is the float32 code above.
   cpu/llama.py calls these through cpu/ops.py.               */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"    /* exp_f32 */

#ifdef ELEM_BF16
typedef uint16_t elem_t;
static inline float LD(elem_t x) {              /* bf16 -> float32: the 16 bits on top */
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline elem_t ST(float f) {              /* float32 -> bf16, rounded to nearest even (NaN stays NaN) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return (elem_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);   /* a select: vectorises */
}
static inline float RND(float f) { return LD(ST(f)); }   /* what torch stores between two bf16 ops */
#else
typedef float elem_t;
#define LD(x) (x)
#define ST(x) (x)
#define RND(x) (x)
#endif

/* Rows are spread over threads only when there is enough work to pay for waking them. */
#define PARALLEL_MIN_ELEMS 16384

static void norm_row(const elem_t *h, const elem_t *w, elem_t *out, int64_t dim, float eps) {
    float acc[8] = {0};                     /* eight running sums: vector registers, no serial chain */
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8)
        for (int j = 0; j < 8; j++) acc[j] += LD(h[d + j]) * LD(h[d + j]);
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += acc[j];
    for (; d < dim; d++) sum += LD(h[d]) * LD(h[d]);
    const float r = 1.0f / sqrtf(sum / (float)dim + eps);
    #pragma omp simd
    for (d = 0; d < dim; d++) out[d] = ST(LD(w[d]) * RND(LD(h[d]) * r));   /* weight * (x * rsqrt(...)), as HF */
}

/* h [rows, dim] += a (skipped when a is NULL); out [rows, dim] = w * h / rms(h). */
void add_rms_norm(elem_t *h, const elem_t *a, const elem_t *w, elem_t *out, int64_t rows, int64_t dim,
                  float eps) {
    #pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        elem_t *hr = h + r * dim;
        if (a != 0) {
            const elem_t *ar = a + r * dim;
            #pragma omp simd
            for (int64_t d = 0; d < dim; d++) hr[d] = ST(LD(hr[d]) + LD(ar[d]));
        }
        norm_row(hr, w, out + r * dim, dim, eps);
    }
}

/* x: rows of `heads` vectors of `dim` values, row r starting at x + r * row_stride (q and k side by side
   in the merged qkv output). Each vector's pairs (i, i + dim/2) turn by their row's angle:
       x[i]         <- x[i] * cos[i]                - x[i + dim/2] * sin[i]
       x[i + dim/2] <- x[i + dim/2] * cos[i + dim/2] + x[i] * sin[i + dim/2]
   which is x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1). cos, sin: [rows, dim] float32
   (rounded to the values' dtype first, as llama.py's apply_rotary does). */
void rotary(elem_t *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows, int64_t heads,
            int64_t dim) {
    const int64_t half = dim / 2;
    #pragma omp parallel for if (rows * heads * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            elem_t *v = x + r * row_stride + h * dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = LD(v[i]), x2 = LD(v[i + half]);
                v[i] = ST(RND(x1 * RND(c[i])) + RND((-x2) * RND(s[i])));
                v[i + half] = ST(RND(x2 * RND(c[i + half])) + RND(x1 * RND(s[i + half])));
            }
        }
    }
}

/* gate_up [rows, 2 * inter] = [gate | up] -> out [rows, inter] = silu(gate) * up, silu(g) = g / (1 + e^-g). */
void silu_mul(const elem_t *gate_up, elem_t *out, int64_t rows, int64_t inter) {
    #pragma omp parallel for if (rows * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *g = gate_up + r * 2 * inter, *u = g + inter;
        elem_t *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float gi = LD(g[i]);
            o[i] = ST(RND(gi / (1.0f + exp_f32(-gi))) * LD(u[i]));
        }
    }
}
