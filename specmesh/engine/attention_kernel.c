/* Batch-invariant paged attention for CPU decoding (AVX2 + FMA), built by cpu_build.py, loaded by attention_kernel.py.

Each query row t (one new token, one head h) attends to its own list of key slots, in order, straight from the
layer's paged cache (no gather copy, no padding):

    s_j = scale * <q[t, h], K[slot_j, h / G]>,   p_j = exp(s_j - max_j s_j),
    out[t, h] = sum_j p_j V[slot_j, h / G] / sum_j p_j          (G = query heads per KV head)

where slot_j = key_slots[row_start[t] + j] for j < row_len[t]. Every sum runs in one fixed order that depends only on
the row's own keys: a token's output is bit-identical whatever else shares the forward, whichever thread computes it,
and whether its keys come from a chain (context, then the new tokens before it) or a tree path (context, then its
ancestors): the same keys in the same order give the same numbers. Built without -ffast-math.

The cache holds floats or IEEE half floats (`EngineConfig.kv_cache_dtype`): the code that reads it is in
attention_rows.h, compiled once per element type; a half float becomes a float as it is loaded, exactly, so the
arithmetic and its order are the same for both.
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

/* The first half of transpose_sum8 for four accumulators (keys 0-3 or 4-7 of a block): pairwise sums of each one's
   lanes, interleaved. */
static inline __m256 half_sum4(const __m256 *v) {
    return _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
}

/* Lane k: the sum of v[k]'s 8 lanes, as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), from half_sum4 of keys 0-3 (u0)
   and of keys 4-7 (u1). */
static inline __m256 join_halves(__m256 u0, __m256 u1) {
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Lane k: the sum of v[k]'s 8 lanes (half_sum4 of each half of v, then join_halves). */
static inline __m256 transpose_sum8(const __m256 *v) {
    return join_halves(half_sum4(v), half_sum4(v + 4));
}

/* scores[0 .. m) <- scale * lanes of `sums` (a block's transposed sums). */
static inline void store_scores(__m256 sums, int m, float scale, float *scores) {
    const __m256 s = _mm256_mul_ps(sums, _mm256_set1_ps(scale));
    if (m == SCORE_KEYS) {
        _mm256_storeu_ps(scores, s);
    } else {
        float lanes[SCORE_KEYS];
        _mm256_storeu_ps(lanes, s);
        for (int k = 0; k < m; k++) scores[k] = lanes[k];
    }
}

/* scores[0 .. m) <- scale * (the lane sums of acc[0 .. SCORE_KEYS)) (transpose_sum8, then one multiply). */
static inline void finish_scores(const __m256 *acc, int m, float scale, float *scores) {
    store_scores(transpose_sum8(acc), m, scale, scores);
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
   (L = 8) and 512-bit (L = 16) registers: a lane's chain is the same whatever the register width. Value rows are
   KV_T, read through VLOAD (attention_rows.h). */
#define DEFINE_WEIGHTED_VALUES(NAME, TARGET, KV_T, VEC, L, SETZERO, LOADU, VLOAD, STOREU, SET1, FMADD) \
static inline __attribute__((always_inline)) TARGET void NAME(                                                  \
        const int nh, const int width, const KV_T *value_cache, const int32_t *slots, int64_t j0, int64_t j1,  \
        int64_t kv_stride, const float *probs, int64_t probs_stride, const int first, float *out, int64_t d) {  \
    VEC acc[HEAD_TILE][2];                                                                                      \
    for (int h = 0; h < nh; h++)                                                                                \
        for (int v = 0; v < width; v++) acc[h][v] = first ? SETZERO() : LOADU(out + h * d + L * v);             \
    for (int64_t j = j0; j < j1; j++) {                                                                         \
        const KV_T *v_row = value_cache + (int64_t)slots[j] * kv_stride;                                       \
        VEC vals[2];                                                                                            \
        for (int v = 0; v < width; v++) vals[v] = VLOAD(v_row + L * v);                                         \
        for (int h = 0; h < nh; h++) {                                                                          \
            const VEC p = SET1(probs[h * probs_stride + j]);                                                    \
            for (int v = 0; v < width; v++) acc[h][v] = FMADD(p, vals[v], acc[h][v]);                          \
        }                                                                                                       \
    }                                                                                                           \
    for (int h = 0; h < nh; h++)                                                                                \
        for (int v = 0; v < width; v++) STOREU(out + h * d + L * v, acc[h][v]);                                \
}

#define WIDE_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512dq,avx512vl")))

#define VALUES_SWITCH(BLOCK) switch (nh) {                                                                   \
        case 1: BLOCK(1, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 2: BLOCK(2, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 3: BLOCK(3, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 4: BLOCK(4, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        case 5: BLOCK(5, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;          \
        default: BLOCK(6, value_cache, slots, j0, j1, kv_stride, probs, probs_stride, out, d); break;         \
    }

/* out[r, h] *= inv[r, h] for the heads [h_begin, h_end) of num_rows rows (the softmax's denominators, last). */
static void scale_rows(int64_t num_rows, int64_t heads, int64_t h_begin, int64_t h_end, const float *inv, float *out,
                       int64_t row_floats, int64_t d) {
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t h = h_begin; h < h_end; h++) {
            float *o = out + r * row_floats + h * d;
            const __m256 scale_h = _mm256_set1_ps(inv[r * heads + h]);
            for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), scale_h));
        }
}

/* The cache-reading code, once per cache element type: float (names ending _f32), IEEE half (_f16, converted to float
   on load with F16C / AVX-512F). */
#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV(name) KV_CAT(name, KV_SUFFIX)

#define KV_T float
#define KV_SUFFIX _f32
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#include "attention_rows.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_LOAD8
#undef KV_LOAD16

#define KV_T uint16_t
#define KV_SUFFIX _f16
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#include "attention_rows.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_LOAD8
#undef KV_LOAD16
#undef VALUES_SWITCH

typedef void (*attend_fn)(int wide, const float *q, int64_t num_rows, const int64_t *row_len, int64_t heads,
                          int64_t kv_heads, int64_t g0, int64_t g1, const void *key_cache, const void *value_cache,
                          const int32_t *slots, int64_t d, float scale, float *probs, int64_t probs_stride, float *inv,
                          float *out);

/* A forward's attention as pool chunks (cpu_pool.h): tiles of up to ROW_TILE consecutive rows with one key list,
   chunk c being tile c / split, KV heads of part c % split (split = 1: all heads; split = kvH: one KV head and its
   query heads). Each thread has its own scratch. */
#define ROW_TILE 8
typedef struct {
    const float *query; const void *key_cache, *value_cache; const int32_t *key_slots; const int64_t *row_start,
    *row_len; const int64_t *tile_start; int64_t heads, kv_heads, d, max_len, split; float scale; float *scratch;
    float *out; attend_fn attend; int wide;
} attention_job_t;

static void attention_chunk(void *ctx, int64_t chunk, int thread) {
    const attention_job_t *j = ctx;
    const int64_t tile = chunk / j->split, part = chunk % j->split, parts = j->kv_heads / j->split;
    const int64_t t = j->tile_start[tile], num_rows = j->tile_start[tile + 1] - t;
    float *probs = j->scratch + (int64_t)thread * ROW_TILE * j->heads * (j->max_len + 1);
    j->attend(j->wide, j->query + t * j->heads * j->d, num_rows, j->row_len + t, j->heads, j->kv_heads, part * parts,
                (part + 1) * parts, j->key_cache, j->value_cache, j->key_slots + j->row_start[t], j->d, j->scale, probs,
                j->max_len, probs + ROW_TILE * j->heads * j->max_len, j->out + t * j->heads * j->d);
}

/* query [T, H, D], caches [slots, kvH, D] (float, or IEEE half where kv_half), out [T, H, D]; D a multiple of 8, H a multiple of kvH; scratch holds
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

void sm_paged_attention(const float *query, const void *key_cache, const void *value_cache,
                        const int32_t *key_slots, const int64_t *row_start, const int64_t *row_len, int64_t rows,
                        int64_t heads, int64_t kv_heads, int64_t d, float scale, float *scratch, float *out,
                        int threads, int kv_half) {
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
                           d, max_len, split, scale, scratch, out, kv_half ? attend_rows_f16 : attend_rows_f32,
                           sm_attention_wide(-1)};
    pool_run(threads, num_tiles * split, attention_chunk, &job);
    free(tile_start);
}

int sm_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
