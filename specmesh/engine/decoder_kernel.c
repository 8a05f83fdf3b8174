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
their slots of the layer's paged cache ([num_slots, kvH, D] viewed flat; floats, or half floats rounded to nearest
even), so no key tensor is ever materialised.
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

/* n floats to dst: as they are (float cache), or rounded to IEEE half floats, to nearest even (half cache: the
   rounding torch's .to(torch.float16) does, so both forwards store the same bits). */
static void store_row(const float *src, void *dst, int64_t n, int half) {
    if (!half) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *out = dst;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* kv_half: the caches hold IEEE half floats (EngineConfig.kv_cache_dtype "float16"), else floats. */
void sm_rope_store(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                   const float *sin, const int64_t *slots, void *key_cache, void *value_cache, float *query_out,
                   int kv_half) {
    const int64_t half = d / 2, width = (heads + 2 * kv_heads) * d, kv_stride = kv_heads * d;
    const size_t element = kv_half ? sizeof(uint16_t) : sizeof(float);
    float rotated[d];
    for (int64_t t = 0; t < rows; t++) {
        const float *x = qkv + t * width, *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++)
            rotate(x + h * d, c, s, half, query_out + (t * heads + h) * d);
        char *k = (char *)key_cache + (size_t)(slots[t] * kv_stride) * element;
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate(x + (heads + h) * d, c, s, half, rotated);
            store_row(rotated, k + (size_t)(h * d) * element, d, kv_half);
        }
        store_row(x + (heads + kv_heads) * d, (char *)value_cache + (size_t)(slots[t] * kv_stride) * element,
                  kv_stride, kv_half);
    }
}

int sm_cpu_supported(void) {     /* built with -mavx2 like the other kernels */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
