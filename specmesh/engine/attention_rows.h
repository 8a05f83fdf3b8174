/* The part of attention_kernel.c that reads the KV cache, once per cache element type (a C template): included with

    KV_T          the cache's element: float, or uint16_t holding IEEE half floats
    KV(name)      name with the type's suffix (name##_f32, name##_f16)
    KV_LOAD8(p)   8 elements at p as an __m256 of floats
    KV_LOAD16(p)  16 elements at p as an __m512 of floats (WIDE_TARGET code)

Every half float is exactly a float, so a key or value enters the arithmetic as the same float either way: the kernel's
order of operations, its batch invariance and its bit-identity across the 256- and 512-bit code do not depend on the
cache type; only what was rounded when the cache was written (to half precision) differs. A half cache reads half the
bytes per key, which is the pass over a long context's KV that a step beside a long prompt repeats every step. */

static inline void KV(prefetch_row)(const KV_T *row, int64_t num_elements) {
    for (int64_t i = 0; i < num_elements; i += 64 / (int64_t)sizeof(KV_T))
        _mm_prefetch((const char *)(row + i), _MM_HINT_T1);
}

/* The key rows of a block of m <= SCORE_KEYS keys; a short block repeats its last key in the unused places. */
static inline void KV(key_rows)(const KV_T *key_cache, const int32_t *slots, int m, int64_t kv_stride,
                                const KV_T **rows) {
    for (int k = 0; k < SCORE_KEYS; k++) rows[k] = key_cache + (int64_t)slots[k < m ? k : m - 1] * kv_stride;
}

/* scores[k] = scale * <q, K[slots[k]]> for the m <= SCORE_KEYS keys slots[0 .. m): one FMA chain per key over its d / 8
   vectors in order, then transpose_sum8 (a short block repeats its last key in the unused lanes). A key's score
   depends on q and its own key row only, not on the keys beside it. */
static inline void KV(score_keys)(const float *q, const KV_T *key_cache, const int32_t *slots, int m,
                                  int64_t kv_stride, int64_t d, float scale, float *scores) {
    const KV_T *rows[SCORE_KEYS];
    __m256 acc[SCORE_KEYS];
    KV(key_rows)(key_cache, slots, m, kv_stride, rows);
    for (int k = 0; k < SCORE_KEYS; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int k = 0; k < SCORE_KEYS; k++) acc[k] = _mm256_fmadd_ps(qv, KV_LOAD8(rows[k] + i), acc[k]);
    }
    finish_scores(acc, m, scale, scores);
}

/* score_keys for nh (2 or 3) consecutive query heads of one KV head (head h's row at q + h * d, its scores at scores +
   h * probs_stride): each key vector is loaded (and, from a half cache, converted) once for the nh heads, where every
   FMA had had its own load and conversion, the score pass's bottleneck on a 256-bit core. Keys go in two halves of
   four (3 x 4 accumulators and a key; the query vectors are read from L1 as the FMAs' memory operands), each half
   folded by half_sum4 as transpose_sum8 folds it: every score's FMA chain and reduction are score_keys', so are its
   bits. A step's attention for 4 and 12 prompt rows over 3,500 keys and a decode row, half cache, 2-core Zen 3
   (`python -m bench.attention_ab --kv-dtypes float16`): 0.77x and 0.73x of one head at a time (pairs: 0.84x, 0.80x). */
static inline __attribute__((always_inline)) void KV(score_key_heads)(
        const int nh, const float *q, int64_t d, const KV_T *key_cache, const int32_t *slots, int m, int64_t kv_stride,
        float scale, float *scores, int64_t probs_stride) {
    const KV_T *rows[SCORE_KEYS];
    __m256 halves[3][2];                                     /* [head][keys 0-3, keys 4-7] */
    KV(key_rows)(key_cache, slots, m, kv_stride, rows);
    for (int f = 0; f < 2; f++) {
        __m256 acc[3][4];
        for (int h = 0; h < nh; h++)
            for (int k = 0; k < 4; k++) acc[h][k] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            for (int k = 0; k < 4; k++) {
                const __m256 key = KV_LOAD8(rows[4 * f + k] + i);
                for (int h = 0; h < nh; h++)
                    acc[h][k] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), key, acc[h][k]);
            }
        }
        for (int h = 0; h < nh; h++) halves[h][f] = half_sum4(acc[h]);
    }
    for (int h = 0; h < nh; h++)
        store_scores(join_halves(halves[h][0], halves[h][1]), m, scale, scores + h * probs_stride);
}

DEFINE_WEIGHTED_VALUES(KV(weighted_values), , KV_T, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, KV_LOAD8,
                       _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps)

/* The value pass of one key block for the nh (<= HEAD_TILE) query heads of one KV head, in 16-dim chunks (2 vectors x
   nh heads of accumulators: 12 of AVX2's 16 registers). */
static inline __attribute__((always_inline)) void KV(values_block)(
        const int nh, const KV_T *value_cache, const int32_t *slots, int64_t j0, int64_t j1, int64_t kv_stride,
        const float *probs, int64_t probs_stride, float *out, int64_t d) {
    for (int64_t c = 0; c + 16 <= d; c += 16)
        KV(weighted_values)(nh, 2, value_cache + c, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0, out + c,
                            d);
    if (d % 16)
        KV(weighted_values)(nh, 1, value_cache + d - 8, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0,
                            out + d - 8, d);
}

/* The same numbers in 512-bit registers (AVX-512F/DQ: Zen 4 and 5, Intel server cores), for CPUs that run them at
   full width. Every lane goes through the instructions of the 256-bit code in the same order, so the outputs are
   bit-identical to it: scores take two query heads of one KV head at once (lanes 0-7 the first head's chain for a key,
   lanes 8-15 the second's, the key's 8 floats broadcast to both halves; each half then reduced by transpose_sum8),
   and the value pass takes 32 dims per chunk (each lane one dim's chain over the keys, in key order). */

/* Scores of `num_pairs` (1 or 3) pairs of consecutive query heads of one KV head for the m keys slots[0 .. m) (q the
   first head's row, head h's at q + h * d; its scores at scores + h * probs_stride): per pair, lanes 0-7 the first
   head's FMA chain for a key and lanes 8-15 the second's, each key's 8 floats broadcast once for every pair. Three
   pairs (six query heads, 24 accumulators, 3 query vectors and a key: 28 registers) pay the broadcasts and the call
   once for the six: on a 2-core Zen 4 the score pass, one pair a call, had taken 1.6x the value pass's time for the
   same arithmetic. A pair's chains are the same whichever count it is called with, so are its bits. */
static inline __attribute__((always_inline)) WIDE_TARGET void KV(score_key_pairs)(
        const int num_pairs, const float *q, int64_t d, const KV_T *key_cache, const int32_t *slots, int m,
        int64_t kv_stride, float scale, float *scores, int64_t probs_stride) {
    const KV_T *rows[SCORE_KEYS];
    __m512 acc[3][SCORE_KEYS];
    KV(key_rows)(key_cache, slots, m, kv_stride, rows);
    for (int p = 0; p < num_pairs; p++)
        for (int k = 0; k < SCORE_KEYS; k++) acc[p][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m512 qv[3];
        for (int p = 0; p < num_pairs; p++)
            qv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q + 2 * p * d + i)),
                                       _mm256_loadu_ps(q + (2 * p + 1) * d + i), 1);
        for (int k = 0; k < SCORE_KEYS; k++) {
            const __m512 key = _mm512_broadcast_f32x8(KV_LOAD8(rows[k] + i));
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

DEFINE_WEIGHTED_VALUES(KV(weighted_values_wide), WIDE_TARGET, KV_T, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
                       KV_LOAD16, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps)

static inline __attribute__((always_inline)) WIDE_TARGET void KV(values_block_wide)(
        const int nh, const KV_T *value_cache, const int32_t *slots, int64_t j0, int64_t j1, int64_t kv_stride,
        const float *probs, int64_t probs_stride, float *out, int64_t d) {
    int64_t c = 0;
    for (; c + 32 <= d; c += 32)
        KV(weighted_values_wide)(nh, 2, value_cache + c, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0,
                                 out + c, d);
    if (c + 16 <= d) {
        KV(weighted_values_wide)(nh, 1, value_cache + c, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0,
                                 out + c, d);
        c += 16;
    }
    if (c < d)
        KV(weighted_values)(nh, 1, value_cache + d - 8, slots, j0, j1, kv_stride, probs, probs_stride, j0 == 0,
                            out + d - 8, d);
}

/* Scores of `nh` (1, 2, or 6: the 256-bit code takes 6 as two triples) consecutive query heads of one KV head for m
   keys; their rows of probs are probs_stride apart. */
typedef void (*KV(score_fn))(const float *q, int nh, const KV_T *key_cache, const int32_t *slots, int m,
                             int64_t kv_stride, int64_t d, float scale, float *scores, int64_t probs_stride);
/* The value pass of one key block for nh (1 .. HEAD_TILE) query heads of one KV head. */
typedef void (*KV(values_fn))(int nh, const KV_T *value_cache, const int32_t *slots, int64_t j0, int64_t j1,
                              int64_t kv_stride, const float *probs, int64_t probs_stride, float *out, int64_t d);

static void KV(score_narrow)(const float *q, int nh, const KV_T *key_cache, const int32_t *slots, int m,
                             int64_t kv_stride, int64_t d, float scale, float *scores, int64_t probs_stride) {
    int h = 0;
    for (; h + 2 < nh; h += 3)
        KV(score_key_heads)(3, q + h * d, d, key_cache, slots, m, kv_stride, scale, scores + h * probs_stride,
                            probs_stride);
    for (; h + 1 < nh; h += 2)
        KV(score_key_heads)(2, q + h * d, d, key_cache, slots, m, kv_stride, scale, scores + h * probs_stride,
                            probs_stride);
    if (h < nh) KV(score_keys)(q + h * d, key_cache, slots, m, kv_stride, d, scale, scores + h * probs_stride);
}

static WIDE_TARGET void KV(score_wide)(const float *q, int nh, const KV_T *key_cache, const int32_t *slots, int m,
                                       int64_t kv_stride, int64_t d, float scale, float *scores,
                                       int64_t probs_stride) {
    if (nh == 6)
        KV(score_key_pairs)(3, q, d, key_cache, slots, m, kv_stride, scale, scores, probs_stride);
    else if (nh == 2)
        KV(score_key_pairs)(1, q, d, key_cache, slots, m, kv_stride, scale, scores, probs_stride);
    else
        KV(score_keys)(q, key_cache, slots, m, kv_stride, d, scale, scores);
}

static void KV(values_narrow)(int nh, const KV_T *value_cache, const int32_t *slots, int64_t j0, int64_t j1,
                              int64_t kv_stride, const float *probs, int64_t probs_stride, float *out, int64_t d) {
    VALUES_SWITCH(KV(values_block))
}

static WIDE_TARGET void KV(values_wide)(int nh, const KV_T *value_cache, const int32_t *slots, int64_t j0, int64_t j1,
                                        int64_t kv_stride, const float *probs, int64_t probs_stride, float *out,
                                        int64_t d) {
    VALUES_SWITCH(KV(values_block_wide))
}

typedef struct { KV(score_fn) score; KV(values_fn) values; int max_score_heads; } KV(row_kernels_t);  /* heads a call */
static const KV(row_kernels_t) KV(NARROW) = {KV(score_narrow), KV(values_narrow), 6},
                               KV(WIDE) = {KV(score_wide), KV(values_wide), 6};

/* Rows that share one key list (a chain's new tokens: row r sees its first row_len[r] keys of `slots`) over their
   keys, for the query heads of KV heads [g0, g1): q [R, H, D] -> out [R, H, D] (those heads' rows); probs
   [R, H, probs_stride] and inv [R, H] are scratch. Key block by key block, every row of the tile takes its scores
   (then, after the softmax numerators per row and head, its weighted values) from the block while it is in L1: a
   long context's keys and values are read from memory once for the tile, not once per row (at ~4k positions each
   row's pass over a layer's 8 MB of KV ran at memory speed). The cache holds a slot's KV heads side by side (one row
   of kvH * D elements), so with every KV head (g0 = 0, g1 = kvH) each pass reads key and value rows whole, in order
   (reading one KV head's half of each row at a time ran at a quarter of the memory bandwidth on one thread; split
   over threads by KV head, the halves are read on different cores at once). Query heads of one KV head go through
   the value pass in tiles of up to HEAD_TILE. Every (row, head)'s numbers go through the same operations in the same
   order whatever else the tile or the call holds: its keys in blocks from key 0, its last block cut at its own length.
   `wide`: the 512-bit kernels (else the 256-bit ones); the caches are KV_T. */
static void KV(attend_rows)(int wide, const float *q, int64_t num_rows, const int64_t *row_len, int64_t heads,
                            int64_t kv_heads, int64_t g0, int64_t g1, const void *key_cache_v,
                            const void *value_cache_v, const int32_t *slots, int64_t d, float scale, float *probs,
                            int64_t probs_stride, float *inv, float *out) {
    const KV(row_kernels_t) *kern = wide ? &KV(WIDE) : &KV(NARROW);
    const KV_T *key_cache = key_cache_v, *value_cache = value_cache_v;
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * d, row_floats = heads * d;
    const int64_t row_probs = heads * probs_stride;
    const int64_t h_begin = g0 * group, h_end = g1 * group, kv_offset = g0 * d, kv_width = (g1 - g0) * d;
    int64_t n_max = 0;
    for (int64_t r = 0; r < num_rows; r++) n_max = row_len[r] > n_max ? row_len[r] : n_max;
    for (int64_t j = 0; j < n_max; j += SCORE_KEYS) {
        for (int64_t f = j + PREFETCH_KEYS; f < j + PREFETCH_KEYS + SCORE_KEYS && f < n_max; f++)
            KV(prefetch_row)(key_cache + (int64_t)slots[f] * kv_stride + kv_offset, kv_width);
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
            KV(prefetch_row)(value_cache + (int64_t)slots[f] * kv_stride + kv_offset, kv_width);
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
    scale_rows(num_rows, heads, h_begin, h_end, inv, out, row_floats, d);
}
