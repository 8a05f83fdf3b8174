/* Batch-invariant paged attention for CPU decoding (AVX2 + FMA), built by cpu_build.py, loaded by attention_kernel.py.

Each query row t (one new token, one head h) attends to its own list of key slots, in order, straight from the
layer's paged cache (no gather copy, no padding):

    s_j = scale * <q[t, h], K[slot_j, h / G]>,   p_j = exp(s_j - max_j s_j),
    out[t, h] = sum_j p_j V[slot_j, h / G] / sum_j p_j          (G = query heads per KV head)

where slot_j = key_slots[row_start[t] + j] for j < row_len[t]. Every sum runs in one fixed order that depends only on
the row's own keys: a token's output is bit-identical whatever else shares the forward, whichever thread computes it,
and whether its keys come from a chain (context, then the new tokens before it) or a tree path (context, then its
ancestors): the same keys in the same order give the same numbers. Built without -ffast-math.
*/

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* exp on 8 lanes (Cephes expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n); inputs here are <= 0. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/* Lanes summed in a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* <a, b> over d floats (d a multiple of 8): four FMA chains (vector i goes to chain i % 4), joined in a fixed tree. */
static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), a3);
    }
    if (i + 8 <= d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    if (i + 16 <= d) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    if (i + 24 <= d) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* probs [n] <- softmax numerators exp(s - max) of the scores in probs; returns their sum (8 lanes, in order). */
static float exp_scores(float *probs, int64_t n, float max_score) {
    const __m256 m = _mm256_set1_ps(max_score);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(probs + j), m));
        _mm256_storeu_ps(probs + j, p);
        total = _mm256_add_ps(total, p);
    }
    if (j < n) {                         /* the tail through the same vector code; lanes past n count 0 */
        float tail[8] = {0};
        for (int64_t i = 0; j + i < n; i++) tail[i] = probs[j + i];
        const __m256 lane = _mm256_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f);
        const __m256 inside = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(n - j)), _CMP_LT_OQ);
        const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), m)), inside);
        _mm256_storeu_ps(tail, p);
        for (int64_t i = 0; j + i < n; i++) probs[j + i] = tail[i];
        total = _mm256_add_ps(total, p);
    }
    return hsum8(total);
}

#define HEAD_TILE 6         /* query heads of one KV head done together: each key and value row is read once */

/* out[h, 0 : 8 * width] = sum_j probs[h, j] * V[slot_j, 0 : 8 * width] * inv[h] for the nh heads (width 1 or 2):
   each value chunk is loaded once for all heads; one FMA chain per (head, vector), keys in order. */
static inline __attribute__((always_inline)) void weighted_values(
        const int nh, const int width, const float *value_cache, const int32_t *slots, int64_t n, int64_t kv_stride,
        const float *probs, int64_t probs_stride, const float *inv, float *out, int64_t d) {
    __m256 acc[HEAD_TILE][2];
    for (int h = 0; h < nh; h++)
        for (int v = 0; v < width; v++) acc[h][v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *v_row = value_cache + (int64_t)slots[j] * kv_stride;
        __m256 vals[2];
        for (int v = 0; v < width; v++) vals[v] = _mm256_loadu_ps(v_row + 8 * v);
        for (int h = 0; h < nh; h++) {
            const __m256 p = _mm256_set1_ps(probs[h * probs_stride + j]);
            for (int v = 0; v < width; v++) acc[h][v] = _mm256_fmadd_ps(p, vals[v], acc[h][v]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int v = 0; v < width; v++)
            _mm256_storeu_ps(out + h * d + 8 * v, _mm256_mul_ps(acc[h][v], _mm256_set1_ps(inv[h])));
}

/* One row, `nh` query heads sharing one KV head: scores, softmax, then values in 16-dim chunks (2 vectors x nh heads
   of accumulators: 12 of AVX2's 16 registers). Every head's numbers go through the same operations in the same order
   whatever nh is. */
static inline __attribute__((always_inline)) void attend_heads(
        const float *q, const int nh, const float *key_cache, const float *value_cache, const int32_t *slots,
        int64_t n, int64_t kv_stride, int64_t d, float scale, float *probs, int64_t probs_stride, float *out) {
    float max_score[HEAD_TILE];
    for (int h = 0; h < nh; h++) max_score[h] = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *k_row = key_cache + (int64_t)slots[j] * kv_stride;
        for (int h = 0; h < nh; h++) {
            const float s = dot(q + h * d, k_row, d) * scale;
            probs[h * probs_stride + j] = s;
            max_score[h] = s > max_score[h] ? s : max_score[h];
        }
    }
    float inv[HEAD_TILE];
    for (int h = 0; h < nh; h++) inv[h] = 1.0f / exp_scores(probs + h * probs_stride, n, max_score[h]);
    for (int64_t c = 0; c + 16 <= d; c += 16)
        weighted_values(nh, 2, value_cache + c, slots, n, kv_stride, probs, probs_stride, inv, out + c, d);
    if (d % 16)
        weighted_values(nh, 1, value_cache + d - 8, slots, n, kv_stride, probs, probs_stride, inv, out + d - 8, d);
}

/* query [T, H, D], caches [slots, kvH, D], out [T, H, D]; D a multiple of 8, H a multiple of kvH; scratch holds
   HEAD_TILE * max(row_len) floats. Query heads h of KV head h / G (G = H / kvH) go in tiles of up to HEAD_TILE. */
void sm_paged_attention(const float *query, const float *key_cache, const float *value_cache,
                        const int32_t *key_slots, const int64_t *row_start, const int64_t *row_len, int64_t rows,
                        int64_t heads, int64_t kv_heads, int64_t d, float scale, float *scratch, float *out) {
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * d;
    int64_t max_len = 1;
    for (int64_t t = 0; t < rows; t++) max_len = row_len[t] > max_len ? row_len[t] : max_len;
    for (int64_t t = 0; t < rows; t++)
        for (int64_t g = 0; g < kv_heads; g++)
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HEAD_TILE) {
                const int64_t left = (g + 1) * group - h0;
                const float *q = query + (t * heads + h0) * d;
                float *o = out + (t * heads + h0) * d;
#define HEADS(NH) attend_heads(q, NH, key_cache + g * d, value_cache + g * d, key_slots + row_start[t], row_len[t], \
                               kv_stride, d, scale, scratch, max_len, o)
                switch (left < HEAD_TILE ? left : HEAD_TILE) {
                    case 1: HEADS(1); break;
                    case 2: HEADS(2); break;
                    case 3: HEADS(3); break;
                    case 4: HEADS(4); break;
                    case 5: HEADS(5); break;
                    default: HEADS(6); break;
                }
#undef HEADS
            }
}

int sm_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
