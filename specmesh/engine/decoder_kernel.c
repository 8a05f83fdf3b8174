/* The small per-layer steps of specmesh's Qwen2 forward (qwen2_decoder.py), built by cpu_build.py: the residual add
with RMSNorm, and rotary position embedding with the KV store. Each costs a few microseconds here against 40 us for
one torch.rms_norm call on a 1-token row.

RMSNorm of a row h (after h += delta, in place, when delta is given):

    out[i] = w[i] * (h[i] * r),   r = 1 / sqrt(sum_i h[i]^2 / dim + eps)

with the sum of squares in 8 lanes over i = 8j + l, then the lanes in a fixed tree (then a scalar tail): one order
per row length, so a row's numbers never depend on the other rows.

Rotary embedding and KV store:

Input: a fused projection row per new token, qkv[t] = q heads | k heads | v heads (H + 2 kvH heads of D floats).
For each head x of q and k, with c = cos[t, i], s = sin[t, i] of the token's position (i < D/2):

    out[i]       = x[i] * c - x[i + D/2] * s
    out[i + D/2] = x[i + D/2] * c + x[i] * s

which is transformers' `q * cos + rotate_half(q) * sin` bit for bit (negation is exact, and GCC contracts nothing into
an FMA under -std=c11). The rotated queries go to query_out [T, H, D]; the rotated keys and the values go straight to
their slots of the layer's paged cache ([num_slots, kvH, D] viewed flat), so no key tensor is ever materialised.
Elementwise: every token's numbers are independent of what shares the forward.
*/

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void sm_add_rms_norm(float *hidden, const float *delta, const float *w, int64_t rows, int64_t dim, float eps,
                     float *out) {
    for (int64_t t = 0; t < rows; t++) {
        float *h = hidden + t * dim;
        if (delta)
            for (int64_t i = 0; i < dim; i++) h[i] += delta[t * dim + i];
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(h + i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        float sum = _mm_cvtss_f32(s);
        for (; i < dim; i++) sum += h[i] * h[i];
        const float r = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i < dim; i++) out[t * dim + i] = w[i] * (h[i] * r);
    }
}

static inline void rotate(const float *x, const float *c, const float *s, int64_t half, float *out) {
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        out[i] = a * c[i] - b * s[i];
        out[i + half] = b * c[i] + a * s[i];
    }
}

void sm_rope_store(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                   const float *sin, const int64_t *slots, float *key_cache, float *value_cache, float *query_out) {
    const int64_t half = d / 2, width = (heads + 2 * kv_heads) * d, kv_stride = kv_heads * d;
    for (int64_t t = 0; t < rows; t++) {
        const float *x = qkv + t * width, *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++)
            rotate(x + h * d, c, s, half, query_out + (t * heads + h) * d);
        float *k = key_cache + slots[t] * kv_stride;
        for (int64_t h = 0; h < kv_heads; h++)
            rotate(x + (heads + h) * d, c, s, half, k + h * d);
        memcpy(value_cache + slots[t] * kv_stride, x + (heads + kv_heads) * d, (size_t)kv_stride * sizeof(float));
    }
}

int sm_cpu_supported(void) {     /* built with -mavx2 like the other kernels */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
