/* exp, tanh, SiLU and GELU written with float arithmetic only, so loops over them vectorize
 * (libm's expf is a call per value). v_exp is within 2 ulp of the correctly rounded result
 * over [-87, 88]; below -87 it is 0, and above 88 it stays at e^88. */
#ifndef LLORCH_VMATH_H
#define LLORCH_VMATH_H

#include <stdint.h>
#include <string.h>

static inline float v_exp(float x) {
    const float keep = x >= -87.0f ? 1.0f : 0.0f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* x = n ln2 + r, |r| <= ln2 / 2; e^x = 2^n e^r */
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    /* e^r by its Taylor series to r^7 (truncation below 2^-26 on this interval) */
    float p = 1.98412698412698413e-4f;
    p = p * r + 1.38888888888888889e-3f;
    p = p * r + 8.33333333333333333e-3f;
    p = p * r + 4.16666666666666667e-2f;
    p = p * r + 1.66666666666666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * keep;
}

static inline float v_tanh(float x) {
    /* tanh x = 1 - 2 / (e^{2x} + 1): exact at both ends, absolute error ~1e-7 near 0 */
    return 1.0f - 2.0f / (v_exp(2.0f * x) + 1.0f);
}

static inline float v_silu(float x) { return x / (1.0f + v_exp(-x)); }

static inline float v_gelu_tanh(float x) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + v_tanh(inner));
}

#endif
