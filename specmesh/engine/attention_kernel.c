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
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_pool.h"

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

#define SCORE_KEYS 8        /* keys scored together: one FMA chain each, then one transposed reduction */
#define PREFETCH_KEYS 8     /* key and value rows are asked for this many keys ahead, into L2: a 16-slot KV block spans 4
                               pages (1 KiB a slot for 2 KV heads of 128), too few for the hardware prefetcher */

static inline void prefetch_row(const float *row, int64_t num_floats) {
    for (int64_t i = 0; i < num_floats; i += 16) _mm_prefetch((const char *)(row + i), _MM_HINT_T1);
}

/* Lane k: the sum of v[k]'s 8 lanes, as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
static inline __m256 transpose_sum8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores[k] = scale * <q, K[slots[k]]> for the m <= SCORE_KEYS keys slots[0 .. m): one FMA chain per key over its d / 8
   vectors in order, then transpose_sum8 (a short block repeats its last key in the unused lanes). A key's score
   depends on q and its own key row only, not on the keys beside it. */
/* The key rows of a block of m <= SCORE_KEYS keys; a short block repeats its last key in the unused places. */
static inline void key_rows(const float *key_cache, const int32_t *slots, int m, int64_t kv_stride,
                            const float **rows) {
    for (int k = 0; k < SCORE_KEYS; k++) rows[k] = key_cache + (int64_t)slots[k < m ? k : m - 1] * kv_stride;
}

/* scores[0 .. m) <- scale * (the lane sums of acc[0 .. SCORE_KEYS)) (transpose_sum8, then one multiply). */
static inline void finish_scores(const __m256 *acc, int m, float scale, float *scores) {
    const __m256 s = _mm256_mul_ps(transpose_sum8(acc), _mm256_set1_ps(scale));
    if (m == SCORE_KEYS) {
        _mm256_storeu_ps(scores, s);
    } else {
        float lanes[SCORE_KEYS];
        _mm256_storeu_ps(lanes, s);
        for (int k = 0; k < m; k++) scores[k] = lanes[k];
    }
}

static inline void score_keys(const float *q, const float *key_cache, const int32_t *slots, int m, int64_t kv_stride,
                              int64_t d, float scale, float *scores) {
    const float *rows[SCORE_KEYS];
    __m256 acc[SCORE_KEYS];
    key_rows(key_cache, slots, m, kv_stride, rows);
    for (int k = 0; k < SCORE_KEYS; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int k = 0; k < SCORE_KEYS; k++) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[k] + i), acc[k]);
    }
    finish_scores(acc, m, scale, scores);
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

/* The largest of p[0 .. n) (-inf for n = 0), four 8-lane maxima at a time, then across them: a maximum does not
   depend on the order (a NaN is skipped as the scalar `p > m ? p : m` skips it; the sign a zero maximum keeps
   changes no exp below), so the bits are those of the scalar loop, which had cost as much as the score pass on a
   2-core Xeon (vmaxss's latency, one element at a time, 12 heads x ~3,500 keys a row and layer). */
static float max_of(const float *p, int64_t n) {
    __m256 m[4];
    for (int i = 0; i < 4; i++) m[i] = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        for (int i = 0; i < 4; i++) m[i] = _mm256_max_ps(_mm256_loadu_ps(p + j + 8 * i), m[i]);
    for (; j + 8 <= n; j += 8) m[0] = _mm256_max_ps(_mm256_loadu_ps(p + j), m[0]);
    float lanes[32], best = -INFINITY;
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(lanes + 8 * i, m[i]);
    for (int i = 0; i < 32; i++) best = lanes[i] > best ? lanes[i] : best;
    for (; j < n; j++) best = p[j] > best ? p[j] : best;
    return best;
}

#define HEAD_TILE 6         /* query heads of one KV head whose value chunks are accumulated together */

#define KEY_BLOCK 16        /* keys whose value rows stay in L1 while every 16-dim chunk passes over them */

/* acc[h, 0 : L * width] += sum_{j0 <= j < j1} probs[h, j] * V[slot_j, 0 : L * width] for the nh heads (width 1 or 2,
   L the floats of a register), starting from zero when `first`: each value chunk is loaded once for all heads; one
   FMA chain per (head, lane), keys in order. acc lives in `out` (row h at out + h * d) between key blocks: storing and
   reloading a float changes nothing, so a chain's numbers are those of one pass over all keys. Defined for 256-bit
   (L = 8) and 512-bit (L = 16) registers: a lane's chain is the same whatever the register width. */
#define DEFINE_WEIGHTED_VALUES(NAME, TARGET, VEC, L, SETZERO, LOADU, STOREU, SET1, FMADD)                        \
static inline __attribute__((always_inline)) TARGET void NAME(                                                  \
        const int nh, const int width, const float *value_cache, const int32_t *slots, int64_t j0, int64_t j1,  \
        int64_t kv_stride, const float *probs, int64_t probs_stride, const int first, float *out, int64_t d) {  \
    VEC acc[HEAD_TILE][2];                                                                                      \
    for (int h = 0; h < nh; h++)                                                                                \
        for (int v = 0; v < width; v++) acc[h][v] = first ? SETZERO() : LOADU(out + h * d + L * v);             \
    for (int64_t j = j0; j < j1; j++) {                                                                         \
        const float *v_row = value_cache + (int64_t)slots[j] * kv_stride;                                       \
        VEC vals[2];                                                                                            \
        for (int v = 0; v < width; v++) vals[v] = LOADU(v_row + L * v);                                        \
        for (int h = 0; h < nh; h++) {                                                                          \
            const VEC p = SET1(probs[h * probs_stride + j]);                                                    \
            for (int v = 0; v < width; v++) acc[h][v] = FMADD(p, vals[v], acc[h][v]);                          \
        }                                                                                                       \
    }                                                                                                           \
    for (int h = 0; h < nh; h++)                                                                                \
        for (int v = 0; v < width; v++) STOREU(out + h * d + L * v, acc[h][v]);                                \
}

DEFINE_WEIGHTED_VALUES(weighted_values, , __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps,
                       _mm256_set1_ps, _mm256_fmadd_ps)

/* The value pass of one key block for the nh (<= HEAD_TILE) query heads of one KV head, in 16-dim chunks (2 vectors x
   nh heads of accumulators: 12 of AVX2's 16 registers). */
static inline __attribute__((always_inline)) void values_block(
        const int nh, const float *value_cache, const int32_t *slots, int64_t j0, int64_t j1, int64_t kv_stride,
        const float *probs, int64_t probs_stride, float *out, int64_t d) {
    for (int64_t c = 0; c + 16 <= d; c += 16)
        weighted_values(nh, 2, value_cache + c, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0, out + c, d);
    if (d % 16)
        weighted_values(nh, 1, value_cache + d - 8, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0, out + d - 8,
                        d);
}

/* The same numbers in 512-bit registers (AVX-512F/DQ: Zen 4 and 5, Intel server cores), for CPUs that run them at
   full width. Every lane goes through the instructions of the 256-bit code in the same order, so the outputs are
   bit-identical to it: scores take two query heads of one KV head at once (lanes 0-7 the first head's chain for a key,
   lanes 8-15 the second's, the key's 8 floats broadcast to both halves; each half then reduced by transpose_sum8),
   and the value pass takes 32 dims per chunk (each lane one dim's chain over the keys, in key order). */
#define WIDE_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512dq,avx512vl")))

/* Scores of `num_pairs` (1 or 3) pairs of consecutive query heads of one KV head for the m keys slots[0 .. m) (q the
   first head's row, head h's at q + h * d; its scores at scores + h * probs_stride): per pair, lanes 0-7 the first
   head's FMA chain for a key and lanes 8-15 the second's, each key's 8 floats broadcast once for every pair. Three
   pairs (six query heads, 24 accumulators, 3 query vectors and a key: 28 registers) pay the broadcasts and the call
   once for the six: on a 2-core Zen 4 the score pass, one pair a call, had taken 1.6x the value pass's time for the
   same arithmetic. A pair's chains are the same whichever count it is called with, so are its bits. */
static inline __attribute__((always_inline)) WIDE_TARGET void score_key_pairs(
        const int num_pairs, const float *q, int64_t d, const float *key_cache, const int32_t *slots, int m,
        int64_t kv_stride, float scale, float *scores, int64_t probs_stride) {
    const float *rows[SCORE_KEYS];
    __m512 acc[3][SCORE_KEYS];
    key_rows(key_cache, slots, m, kv_stride, rows);
    for (int p = 0; p < num_pairs; p++)
        for (int k = 0; k < SCORE_KEYS; k++) acc[p][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m512 qv[3];
        for (int p = 0; p < num_pairs; p++)
            qv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q + 2 * p * d + i)),
                                       _mm256_loadu_ps(q + (2 * p + 1) * d + i), 1);
        for (int k = 0; k < SCORE_KEYS; k++) {
            const __m512 key = _mm512_broadcast_f32x8(_mm256_loadu_ps(rows[k] + i));
            for (int p = 0; p < num_pairs; p++) acc[p][k] = _mm512_fmadd_ps(qv[p], key, acc[p][k]);
        }
    }
    for (int p = 0; p < num_pairs; p++) {
        __m256 low[SCORE_KEYS], high[SCORE_KEYS];
        for (int k = 0; k < SCORE_KEYS; k++) {
            low[k] = _mm512_castps512_ps256(acc[p][k]);
            high[k] = _mm512_extractf32x8_ps(acc[p][k], 1);
        }
        finish_scores(low, m, scale, scores + 2 * p * probs_stride);
        finish_scores(high, m, scale, scores + (2 * p + 1) * probs_stride);
    }
}

DEFINE_WEIGHTED_VALUES(weighted_values_wide, WIDE_TARGET, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
                       _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps)

static inline __attribute__((always_inline)) WIDE_TARGET void values_block_wide(
        const int nh, const float *value_cache, const int32_t *slots, int64_t j0, int64_t j1, int64_t kv_stride,
        const float *probs, int64_t probs_stride, float *out, int64_t d) {
    int64_t c = 0;
    for (; c + 32 <= d; c += 32)
        weighted_values_wide(nh, 2, value_cache + c, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0, out + c,
                             d);
    if (c + 16 <= d) {
        weighted_values_wide(nh, 1, value_cache + c, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0, out + c,
                             d);
        c += 16;
    }
    if (c < d)
        weighted_values(nh, 1, value_cache + d - 8, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0, out + d - 8,
                        d);
}

/* Scores of `nh` (1, 2, or 6 where max_score_heads says so) consecutive query heads of one KV head for m keys; their
   rows of probs are probs_stride apart. */
typedef void (*score_fn)(const float *q, int nh, const float *key_cache, const int32_t *slots, int m,
                         int64_t kv_stride, int64_t d, float scale, float *scores, int64_t probs_stride);
/* The value pass of one key block for nh (1 .. HEAD_TILE) query heads of one KV head. */
typedef void (*values_fn)(int nh, const float *value_cache, const int32_t *slots, int64_t j0, int64_t j1,
                          int64_t kv_stride, const float *probs, int64_t probs_stride, float *out, int64_t d);

static void score_narrow(const float *q, int nh, const float *key_cache, const int32_t *slots, int m,
                         int64_t kv_stride, int64_t d, float scale, float *scores, int64_t probs_stride) {
    for (int h = 0; h < nh; h++)
        score_keys(q + h * d, key_cache, slots, m, kv_stride, d, scale, scores + h * probs_stride);
}

static WIDE_TARGET void score_wide(const float *q, int nh, const float *key_cache, const int32_t *slots, int m,
                                   int64_t kv_stride, int64_t d, float scale, float *scores, int64_t probs_stride) {
    if (nh == 6)
        score_key_pairs(3, q, d, key_cache, slots, m, kv_stride, scale, scores, probs_stride);
    else if (nh == 2)
        score_key_pairs(1, q, d, key_cache, slots, m, kv_stride, scale, scores, probs_stride);
    else
        score_keys(q, key_cache, slots, m, kv_stride, d, scale, scores);
}

#define VALUES_SWITCH(BLOCK) switch (nh) {                                                                   \
        case 1: BLOCK(1, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 2: BLOCK(2, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 3: BLOCK(3, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 4: BLOCK(4, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 5: BLOCK(5, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        default: BLOCK(6, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;         \
    }

static void values_narrow(int nh, const float *value_cache, const int32_t *slots, int64_t j0, int64_t j1,
                          int64_t kv_stride, const float *probs, int64_t probs_stride, float *out, int64_t d) {
    VALUES_SWITCH(values_block)
}

static WIDE_TARGET void values_wide(int nh, const float *value_cache, const int32_t *slots, int64_t j0, int64_t j1,
                                    int64_t kv_stride, const float *probs, int64_t probs_stride, float *out,
                                    int64_t d) {
    VALUES_SWITCH(values_block_wide)
}
#undef VALUES_SWITCH

typedef struct { score_fn score; values_fn values; int max_score_heads; } row_kernels_t;   /* heads a score call */
static const row_kernels_t NARROW = {score_narrow, values_narrow, 2}, WIDE = {score_wide, values_wide, 6};

/* Rows that share one key list (a chain's new tokens: row r sees its first row_len[r] keys of `slots`) over their
   keys, for the query heads of KV heads [g0, g1): q [R, H, D] -> out [R, H, D] (those heads' rows); probs
   [R, H, probs_stride] and inv [R, H] are scratch. Key block by key block, every row of the tile takes its scores
   (then, after the softmax numerators per row and head, its weighted values) from the block while it is in L1: a
   long context's keys and values are read from memory once for the tile, not once per row (at ~4k positions each
   row's pass over a layer's 8 MB of KV ran at memory speed). The cache holds a slot's KV heads side by side (one row
   of kvH * D floats), so with every KV head (g0 = 0, g1 = kvH) each pass reads key and value rows whole, in order
   (reading one KV head's half of each row at a time ran at a quarter of the memory bandwidth on one thread; split
   over threads by KV head, the halves are read on different cores at once). Query heads of one KV head go through
   the value pass in tiles of up to HEAD_TILE. Every (row, head)'s numbers go through the same operations in the same
   order whatever else the tile or the call holds: its keys in blocks from key 0, its last block cut at its own length. */
static void attend_rows(const row_kernels_t *kern, const float *q, int64_t num_rows, const int64_t *row_len,
                        int64_t heads, int64_t kv_heads, int64_t g0, int64_t g1, const float *key_cache,
                        const float *value_cache, const int32_t *slots, int64_t d, float scale, float *probs,
                        int64_t probs_stride, float *inv, float *out) {
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * d, row_floats = heads * d;
    const int64_t row_probs = heads * probs_stride;
    const int64_t h_begin = g0 * group, h_end = g1 * group, kv_offset = g0 * d, kv_width = (g1 - g0) * d;
    int64_t n_max = 0;
    for (int64_t r = 0; r < num_rows; r++) n_max = row_len[r] > n_max ? row_len[r] : n_max;
    for (int64_t j = 0; j < n_max; j += SCORE_KEYS) {
        for (int64_t f = j + PREFETCH_KEYS; f < j + PREFETCH_KEYS + SCORE_KEYS && f < n_max; f++)
            prefetch_row(key_cache + (int64_t)slots[f] * kv_stride + kv_offset, kv_width);
        for (int64_t r = 0; r < num_rows; r++) {
            if (j >= row_len[r]) continue;
            const int m = row_len[r] - j < SCORE_KEYS ? (int)(row_len[r] - j) : SCORE_KEYS;
            for (int64_t h = h_begin; h < h_end;) {   /* 6 or 2 heads of one KV head at a time where they are */
                const int nh = kern->max_score_heads >= 6 && h + 5 < h_end && (h + 5) / group == h / group ? 6
                             : h + 1 < h_end && (h + 1) / group == h / group ? 2 : 1;
                kern->score(q + r * row_floats + h * d, nh, key_cache + (h / group) * d, slots + j, m, kv_stride, d,
                            scale, probs + r * row_probs + h * probs_stride + j, probs_stride);
                h += nh;
            }
        }
    }
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t h = h_begin; h < h_end; h++) {
            const float max_score = max_of(probs + r * row_probs + h * probs_stride, row_len[r]);
            inv[r * heads + h] = 1.0f / exp_scores(probs + r * row_probs + h * probs_stride, row_len[r], max_score);
        }
    for (int64_t j0 = 0; j0 < n_max; j0 += KEY_BLOCK) {
        for (int64_t f = j0 + PREFETCH_KEYS; f < j0 + KEY_BLOCK + PREFETCH_KEYS && f < n_max; f++)
            prefetch_row(value_cache + (int64_t)slots[f] * kv_stride + kv_offset, kv_width);
        for (int64_t r = 0; r < num_rows; r++) {
            if (j0 >= row_len[r]) continue;
            const int64_t j1 = j0 + KEY_BLOCK < row_len[r] ? j0 + KEY_BLOCK : row_len[r];
            for (int64_t g = g0; g < g1; g++)
                for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HEAD_TILE) {
                    const int64_t left = (g + 1) * group - h0;
                    kern->values(left < HEAD_TILE ? (int)left : HEAD_TILE, value_cache + g * d, slots, j0, j1,
                                 kv_stride, probs + r * row_probs + h0 * probs_stride, probs_stride,
                                 out + r * row_floats + h0 * d, d);
                }
        }
    }
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t h = h_begin; h < h_end; h++) {
            float *o = out + r * row_floats + h * d;
            const __m256 scale_h = _mm256_set1_ps(inv[r * heads + h]);
            for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), scale_h));
        }
}

/* A forward's attention as pool chunks (cpu_pool.h): tiles of up to ROW_TILE consecutive rows with one key list,
   chunk c being tile c / split, KV heads of part c % split (split = 1: all heads; split = kvH: one KV head and its
   query heads). Each thread has its own scratch. */
#define ROW_TILE 8
typedef struct {
    const float *query, *key_cache, *value_cache; const int32_t *key_slots; const int64_t *row_start, *row_len;
    const int64_t *tile_start; int64_t heads, kv_heads, d, max_len, split; float scale; float *scratch; float *out;
    const row_kernels_t *kern;
} attention_job_t;

static void attention_chunk(void *ctx, int64_t chunk, int thread) {
    const attention_job_t *j = ctx;
    const int64_t tile = chunk / j->split, part = chunk % j->split, parts = j->kv_heads / j->split;
    const int64_t t = j->tile_start[tile], num_rows = j->tile_start[tile + 1] - t;
    float *probs = j->scratch + (int64_t)thread * ROW_TILE * j->heads * (j->max_len + 1);
    attend_rows(j->kern, j->query + t * j->heads * j->d, num_rows, j->row_len + t, j->heads, j->kv_heads, part * parts,
                (part + 1) * parts, j->key_cache, j->value_cache, j->key_slots + j->row_start[t], j->d, j->scale, probs,
                j->max_len, probs + ROW_TILE * j->heads * j->max_len, j->out + t * j->heads * j->d);
}

/* query [T, H, D], caches [slots, kvH, D], out [T, H, D]; D a multiple of 8, H a multiple of kvH; scratch holds
   threads * ROW_TILE * H * (max(row_len) + 1) floats. Query heads h attend over KV head h / (H / kvH); rows with the
   same row_start share one key list (row t sees its first row_len[t] keys). Tiles run on up to `threads` threads
   (the caller's included); with fewer than TILES_PER_THREAD tiles a thread, each tile's KV heads are split among them
   too (a decode's one row on every core). The numbers are the same whatever the tiles and the split. */
#define TILES_PER_THREAD 4
int sm_row_tile(void) { return ROW_TILE; }

/* 1: the 512-bit code (the default where the CPU has AVX-512F/DQ), 0: the 256-bit code; both give the same bits.
   wanted 0 or 1 pins one (1 only where the CPU has it); negative: just report. */
static atomic_int wide = -1;

static int wide_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

int sm_attention_wide(int wanted) {
    if (atomic_load(&wide) < 0) atomic_store(&wide, wide_supported());
    if (wanted == 0 || (wanted == 1 && wide_supported())) atomic_store(&wide, wanted);
    return atomic_load(&wide);
}

void sm_paged_attention(const float *query, const float *key_cache, const float *value_cache,
                        const int32_t *key_slots, const int64_t *row_start, const int64_t *row_len, int64_t rows,
                        int64_t heads, int64_t kv_heads, int64_t d, float scale, float *scratch, float *out,
                        int threads) {
    int64_t max_len = 1, num_tiles = 0;
    for (int64_t t = 0; t < rows; t++) max_len = row_len[t] > max_len ? row_len[t] : max_len;
    int64_t *tile_start = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (!tile_start) abort();
    for (int64_t t = 0; t < rows; t++)
        if (num_tiles == 0 || row_start[t] != row_start[tile_start[num_tiles - 1]]
                || t - tile_start[num_tiles - 1] >= ROW_TILE)
            tile_start[num_tiles++] = t;
    tile_start[num_tiles] = rows;
    const int64_t split = threads > 1 && num_tiles < (int64_t)threads * TILES_PER_THREAD ? kv_heads : 1;
    attention_job_t job = {query, key_cache, value_cache, key_slots, row_start, row_len, tile_start, heads, kv_heads,
                           d, max_len, split, scale, scratch, out, sm_attention_wide(-1) ? &WIDE : &NARROW};
    pool_run(threads, num_tiles * split, attention_chunk, &job);
    free(tile_start);
}

int sm_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
