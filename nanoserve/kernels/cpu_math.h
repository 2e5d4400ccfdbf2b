/* Math the CPU kernels share (cpu_ops.c, cpu_decode.c), written so a compiler can vectorise it.
   Included, not linked: each kernel file is compiled alone (kernels/cpu_build.py). */

#ifndef NANOSERVE_CPU_MATH_H
#define NANOSERVE_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x in float32, written so the compiler can run 8 of them at once in vector registers (libm's expf
   is one call per number). Cephes' method: x = n ln2 + r with |r| <= ln2 / 2, e^r from a degree-7
   polynomial, times 2^n built directly in the exponent bits. Within 2 ulp of the exact value for x in
   [-87.3, 88.3]; outside, x is clamped there (e^x of a finite x never overflows to inf). */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);   /* 2^n stays a normal float */
    const float n = floorf(x * 1.44269504f + 0.5f);   /* round(x / ln2) */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;   /* x - n ln2, ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;    /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}


#endif
