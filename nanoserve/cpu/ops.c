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
   cpu/llama.py calls these through cpu/ops.py.               */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"    /* exp_f32 */

/* Rows are spread over threads only when there is enough work to pay for waking them. */
#define PARALLEL_MIN_ELEMS 16384

static void norm_row(const float *h, const float *w, float *out, int64_t dim, float eps) {
    float acc[8] = {0};                     /* eight running sums: vector registers, no serial chain */
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8)
        for (int j = 0; j < 8; j++) acc[j] += h[d + j] * h[d + j];
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += acc[j];
    for (; d < dim; d++) sum += h[d] * h[d];
    const float r = 1.0f / sqrtf(sum / (float)dim + eps);
    for (d = 0; d < dim; d++) out[d] = w[d] * (h[d] * r);    /* weight * (x * rsqrt(...)), as HF */
}

/* h [rows, dim] += a (skipped when a is NULL); out [rows, dim] = w * h / rms(h). */
void add_rms_norm(float *h, const float *a, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    #pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * dim;
        if (a != 0) {
            const float *ar = a + r * dim;
            for (int64_t d = 0; d < dim; d++) hr[d] += ar[d];
        }
        norm_row(hr, w, out + r * dim, dim, eps);
    }
}

/* x: rows of `heads` vectors of `dim` floats, row r starting at x + r * row_stride (q and k side by side
   in the merged qkv output). Each vector's pairs (i, i + dim/2) turn by their row's angle:
       x[i]         <- x[i] * cos[i]                - x[i + dim/2] * sin[i]
       x[i + dim/2] <- x[i + dim/2] * cos[i + dim/2] + x[i] * sin[i + dim/2]
   which is x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1). cos, sin: [rows, dim]. */
void rotary(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows, int64_t heads,
            int64_t dim) {
    const int64_t half = dim / 2;
    #pragma omp parallel for if (rows * heads * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] + (-x2) * s[i];
                v[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* gate_up [rows, 2 * inter] = [gate | up] -> out [rows, inter] = silu(gate) * up, silu(g) = g / (1 + e^-g). */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    #pragma omp parallel for if (rows * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}
