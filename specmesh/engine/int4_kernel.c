/* Batch-invariant int4 x int8 matrix multiply for CPU inference (AVX2 + FMA + F16C; AVX-512 VNNI and AMX paths where
   the CPU has them), built by int4_kernel.py.

Weights: w[o, 32g + j] = scale[o, g] * q[o, g, j] + min[o, g], q in 0..15, scale and min in fp16: 5 bits per weight.
Activations (per row r): x[r] = row_scale[r] * xq[r], xq int8 in [-127, 127], row_scale = absmax / 127.

    y[r, o] = row_scale[r] * sum_g ( scale[o, g] * isum[r, o, g] + min[o, g] * xsum[r, g] ) + bias[o]
    isum[r, o, g] = sum_j xq[r, 32g + j] q[o, g, j]  (exact integers),   xsum[r, g] = sum_j xq[r, 32g + j]

Layout (fbgemm-like, output channels in SIMD lanes): outputs come in tiles of 8 channels; for each tile and group,
4 blocks of 32 bytes. Block s covers inputs 32g + 8s .. 32g + 8s + 7: byte 4c + i holds q[8t + c, 32g + 8s + i] in
its low nibble and q[8t + c, 32g + 8s + 4 + i] in its high nibble (c = channel in the tile, i = 0..3). A 4-byte
broadcast of activations times one unpacked block (maddubs) gives each channel's pair sums; 8 of them add up in
int16 without overflow (8 * 2 * 15 * 127 = 30480 < 32767), so a group costs per row 8 maddubs + 8 adds, then one
widening, one convert and two FMAs for 8 channels at once.

Every y[r, o] is computed by the same instructions in the same order whatever the number of rows, the tile it falls
in, or the range of output tiles a call covers: a token's result never depends on what shares its forward (so
k-token verification gives bit-identical logits to one-token decoding) nor on how output tiles are split across
threads. Built without -ffast-math: the compiler must not reassociate the float sums.
*/

#ifndef _GNU_SOURCE           /* cpu_build.py defines it for every kernel */
#define _GNU_SOURCE            /* syscall() for arch_prctl */
#endif
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_pool.h"

#define GROUP 32
#define LANES 8             /* output channels per tile */
#define ROW_TILE 4          /* activation rows sharing one unpacked weight block */
#define PREFETCH_BYTES 2048 /* AVX2 and AMX: weights read this far ahead (16 groups) */
#define ROW_BLOCK 32        /* activation rows kept in cache while every output tile passes over them */

/* x [m, k] float -> xq [m, k] int8, row_scale [m], xsum [m, k / 32] (as float: exact, |sum| <= 32 * 127); k a
   multiple of 32. Vectorized, the same numbers as the scalar loop it replaced: the row's absmax is exact in any
   order, each input goes through one float multiply by 127 / absmax, a round to nearest even (the default mode, as
   nearbyintf) and a clamp to +-127, and the group sums are exact integers. (One thread: on many rows this loop
   had been ~15% of an AMX matmul's time.) */
void sm_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *row_scale, float *xsum) {
    const int64_t groups = k / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   /* undoes the packs' lane interleave */
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8)      /* (a > max) ? a : max, lane by lane, as the scalar loop did */
            vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i)), vmax);
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float absmax = 0.0f;
        for (int i = 0; i < 8; i++) absmax = lanes[i] > absmax ? lanes[i] : absmax;
        const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
        row_scale[r] = absmax > 0.0f ? absmax / 127.0f : 1.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t g = 0; g < groups; g++) {
            __m256i q[4];
            for (int j = 0; j < 4; j++) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + g * GROUP + 8 * j), vinv);
                v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
            }
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + r * k + g * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
            const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
            sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
            sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
            xsum[r * groups + g] = (float)_mm_cvtsi128_si32(sum4);
        }
    }
}

/* An empty asm that takes v in a register: the integer adds before it cannot be reassociated past it. Without it GCC
   turns each group's chain of maddubs + add into a tree, computes all 32 products of a 4-row tile first and spills
   them to the stack (the integer sums are exact, so only speed is at stake). */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One output tile (8 channels) for `rows` activation rows from r0; a constant `rows` per call site keeps the
   accumulators in registers. Each row's accumulators see the same instructions whatever `rows` is. */
static inline __attribute__((always_inline)) void tile_rows(
        int64_t tile, int64_t r0, const int rows, int64_t k, int64_t n, const int8_t *xq, const float *row_scale,
        const float *xsum, const uint8_t *wq, const uint16_t *scales, const uint16_t *mins, const float *bias,
        float *y) {
    const int64_t groups = k / GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE], acc_min[ROW_TILE];       /* two independent FMA chains per row (scales, mins) */
    for (int t = 0; t < ROW_TILE; t++) acc[t] = acc_min[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t tg = tile * groups + g;
        const uint8_t *blocks = wq + tg * 4 * 32;
        _mm_prefetch((const char *)(blocks + PREFETCH_BYTES), _MM_HINT_T0);     /* one stream: 2 KB ahead */
        _mm_prefetch((const char *)(blocks + PREFETCH_BYTES + 64), _MM_HINT_T0);
        __m256i isum[ROW_TILE];
        for (int t = 0; t < ROW_TILE; t++) isum[t] = _mm256_setzero_si256();
        for (int s = 0; s < 4; s++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(blocks + s * 32));
            const __m256i wa = _mm256_and_si256(packed, low);                        /* inputs 8s .. 8s+3 */
            const __m256i wb = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);  /* inputs 8s+4 .. 8s+7 */
            for (int t = 0; t < rows; t++) {
                const int8_t *x = xq + (r0 + t) * k + g * GROUP + 8 * s;
                isum[t] = _mm256_add_epi16(isum[t], _mm256_maddubs_epi16(wa, bcast4(x)));
                isum[t] = _mm256_add_epi16(isum[t], _mm256_maddubs_epi16(wb, bcast4(x + 4)));
                KEEP_IN_REGISTER(isum[t]);
            }
        }
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + tg * LANES)));
        for (int t = 0; t < rows; t++) {
            const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[t], ones));    /* 8 channels */
            acc[t] = _mm256_fmadd_ps(dots, sc, acc[t]);
        }
    }
    for (int64_t g = 0; g < groups; g++) {     /* the min terms, in a pass of their own (fewer live registers) */
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + (tile * groups + g) * LANES)));
        for (int t = 0; t < rows; t++)
            acc_min[t] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[(r0 + t) * groups + g]), mn, acc_min[t]);
    }
    const __m256 b = bias ? _mm256_loadu_ps(bias + tile * LANES) : _mm256_setzero_ps();
    for (int t = 0; t < rows; t++)
        _mm256_storeu_ps(y + (r0 + t) * n + tile * LANES,
                         _mm256_fmadd_ps(_mm256_add_ps(acc[t], acc_min[t]), _mm256_set1_ps(row_scale[r0 + t]), b));
}

/* The same outputs on AVX-512 VNNI, two adjacent output tiles (16 channels: tile, tile + 1) at a time in 512-bit
   registers, lanes 0-7 the first tile's channels, lanes 8-15 the second's. One vpdpbusd per 4-byte broadcast adds
   the 4 products of each channel straight into int32, where AVX2 needs a maddubs, an int16 add and a final madd. The
   integer sums are exact on both paths and the float steps after them are the same instructions in the same order
   per lane (convert, FMA by the group's scale in group order; the min terms' own FMA chain in a second pass; one
   final FMA by the row scale plus bias), so the two paths give bit-identical outputs (tests/test_int4_linear.py
   checks it). Two chains per row (low and high nibbles) hide vpdpbusd's latency; their sum is an exact integer add.
   A lone last tile (`lone`) runs through the same code with its own weights in both halves, the upper half masked
   off at the bias load and the store. Against one 8-channel tile per 256-bit register this halves the unpacking and
   activation broadcasts per channel: on a 2-core Zen 5 (full-width 512-bit units) the 1.5B target's forward of 128
   rows went from 607 to 390 ms, 32 rows 166 -> 111, 8 rows 48 -> 36 (one row stays ~27 ms, memory-bound). */
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define VNNI_ROW_TILE 8     /* 3 registers per row in the main loop (of 32) */

static inline VNNI_TARGET __m512i bcast4_wide(const int8_t *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __attribute__((always_inline)) VNNI_TARGET void tile_pair_rows_vnni(
        int64_t tile, const int lone, int64_t r0, const int rows, int64_t k, int64_t n, const int8_t *xq,
        const float *row_scale, const float *xsum, const uint8_t *wq, const uint16_t *scales, const uint16_t *mins,
        const float *bias, float *y) {
    const int64_t groups = k / GROUP, second = lone ? 0 : groups;     /* the upper half's tile, in groups */
    const __mmask16 keep = lone ? 0x00FF : 0xFFFF;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[VNNI_ROW_TILE];
    for (int t = 0; t < VNNI_ROW_TILE; t++) acc[t] = _mm512_setzero_ps();
    /* Prefetching. A decode-sized call is bound by how fast the weights stream in from memory, and a tile pair's
       weights, scales and minimums are 6 short streams (two tiles' each) that restart at every pair. So while one
       pair is multiplied, group g prefetches its share of the *next* pair's bytes (256 of weights, 32 of scales and
       32 of minimums a group, linearly): the next pair is in cache when it starts, no stream starts cold. Reading
       each stream 2 KB ahead of itself instead (as the AVX2 path does: one stream a tile, which the hardware
       prefetcher follows) left the first 2 KB of every pair's second tile and all its scales and minimums to come
       on demand. On a 2-core Zen 4, one row through 28 layers of the 1.5B target's MLP (0.72 GB of int4 weights in
       huge pages, `python -m bench.int4_prefetch --baseline-rev <before>`, three runs, the kernels alternating):
       1.10-1.34x faster on one thread, 1.10-1.14x on two (25-29 GB/s instead of 22-26), 16 rows 1.05-1.09x, 4 rows
       about the same; the whole 1-row forward of the target took 38.6 ms on two threads against 47.6 ms three hours
       earlier. Bit-identical outputs (prefetches only); past the last pair they touch no memory (a prefetch never
       faults). */
    const char *next = (const char *)(wq + (tile + 2) * groups * 4 * 32);
    const char *next_scales = (const char *)(scales + (tile + 2) * groups * LANES);
    const char *next_mins = (const char *)(mins + (tile + 2) * groups * LANES);
    for (int64_t g = 0; g < groups; g++) {
        const int64_t tg = tile * groups + g, tg2 = tg + second;
        const uint8_t *blocks = wq + tg * 4 * 32, *blocks2 = wq + tg2 * 4 * 32;
        for (int line = 0; line < 256; line += 64) _mm_prefetch(next + g * 256 + line, _MM_HINT_T0);
        if (g % 2 == 0) {                                   /* 32 bytes a group: a new line every other group */
            _mm_prefetch(next_scales + g * 32, _MM_HINT_T0);
            _mm_prefetch(next_mins + g * 32, _MM_HINT_T0);
        }
        __m512i isum_a[VNNI_ROW_TILE], isum_b[VNNI_ROW_TILE];
        __m512i isum_c[2], isum_d[2];
        for (int t = 0; t < VNNI_ROW_TILE; t++) isum_a[t] = isum_b[t] = _mm512_setzero_si512();
        for (int t = 0; t < 2; t++) isum_c[t] = isum_d[t] = _mm512_setzero_si512();
        for (int s = 0; s < 4; s++) {
            const __m512i packed = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blocks + s * 32))),
                _mm256_loadu_si256((const __m256i *)(blocks2 + s * 32)), 1);
            const __m512i wa = _mm512_and_si512(packed, low);
            const __m512i wb = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            for (int t = 0; t < rows; t++) {
                const int8_t *x = xq + (r0 + t) * k + g * GROUP + 8 * s;
                if (rows <= 2 && (s & 1)) {          /* few rows: 4 chains per row, else they wait on latency */
                    isum_c[t] = _mm512_dpbusd_epi32(isum_c[t], wa, bcast4_wide(x));
                    isum_d[t] = _mm512_dpbusd_epi32(isum_d[t], wb, bcast4_wide(x + 4));
                } else {
                    isum_a[t] = _mm512_dpbusd_epi32(isum_a[t], wa, bcast4_wide(x));
                    isum_b[t] = _mm512_dpbusd_epi32(isum_b[t], wb, bcast4_wide(x + 4));
                }
            }
        }
        if (rows <= 2)
            for (int t = 0; t < rows; t++) {
                isum_a[t] = _mm512_add_epi32(isum_a[t], isum_c[t]);
                isum_b[t] = _mm512_add_epi32(isum_b[t], isum_d[t]);
            }
        const __m512 sc = _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(scales + tg2 * LANES)),
                                                           _mm_loadu_si128((const __m128i *)(scales + tg * LANES))));
        for (int t = 0; t < rows; t++) {
            const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(isum_a[t], isum_b[t]));
            acc[t] = _mm512_fmadd_ps(dots, sc, acc[t]);
        }
    }
    __m512 acc_min[VNNI_ROW_TILE];
    for (int t = 0; t < VNNI_ROW_TILE; t++) acc_min[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {     /* the min terms: the same FMA chain per lane, a pass of its own */
        const int64_t tg = tile * groups + g, tg2 = tg + second;
        const __m512 mn = _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(mins + tg2 * LANES)),
                                                           _mm_loadu_si128((const __m128i *)(mins + tg * LANES))));
        for (int t = 0; t < rows; t++)
            acc_min[t] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(r0 + t) * groups + g]), mn, acc_min[t]);
    }
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + tile * LANES) : _mm512_setzero_ps();
    for (int t = 0; t < rows; t++)
        _mm512_mask_storeu_ps(y + (r0 + t) * n + tile * LANES, keep,
                              _mm512_fmadd_ps(_mm512_add_ps(acc[t], acc_min[t]), _mm512_set1_ps(row_scale[r0 + t]), b));
}

static void matmul_avx2(const int8_t *xq, const float *row_scale, const float *xsum, int64_t m, int64_t k,
                        const uint8_t *wq, const uint16_t *scales, const uint16_t *mins, const float *bias,
                        int64_t n, int64_t tile_begin, int64_t tile_end, float *y) {
    for (int64_t rb = 0; rb < m; rb += ROW_BLOCK) {
        const int64_t re = rb + ROW_BLOCK < m ? rb + ROW_BLOCK : m;
        for (int64_t tile = tile_begin; tile < tile_end; tile++) {
            for (int64_t r0 = rb; r0 < re; r0 += ROW_TILE) {
#define ROWS(R) tile_rows(tile, r0, R, k, n, xq, row_scale, xsum, wq, scales, mins, bias, y)
                switch (re - r0 < ROW_TILE ? re - r0 : ROW_TILE) {
                    case 1: ROWS(1); break;
                    case 2: ROWS(2); break;
                    case 3: ROWS(3); break;
                    default: ROWS(4); break;
                }
#undef ROWS
            }
        }
    }
}

static VNNI_TARGET void matmul_vnni(const int8_t *xq, const float *row_scale, const float *xsum, int64_t m,
                                    int64_t k, const uint8_t *wq, const uint16_t *scales, const uint16_t *mins,
                                    const float *bias, int64_t n, int64_t tile_begin, int64_t tile_end, float *y) {
    for (int64_t rb = 0; rb < m; rb += ROW_BLOCK) {
        const int64_t re = rb + ROW_BLOCK < m ? rb + ROW_BLOCK : m;
        for (int64_t tile = tile_begin; tile < tile_end; tile += 2) {
            const int lone = tile + 1 == tile_end;
            for (int64_t r0 = rb; r0 < re; r0 += VNNI_ROW_TILE) {
#define ROWS(R) tile_pair_rows_vnni(tile, lone, r0, R, k, n, xq, row_scale, xsum, wq, scales, mins, bias, y)
                switch (re - r0 < VNNI_ROW_TILE ? re - r0 : VNNI_ROW_TILE) {
                    case 1: ROWS(1); break;
                    case 2: ROWS(2); break;
                    case 3: ROWS(3); break;
                    case 4: ROWS(4); break;
                    case 5: ROWS(5); break;
                    case 6: ROWS(6); break;
                    case 7: ROWS(7); break;
                    default: ROWS(8); break;
                }
#undef ROWS
            }
        }
    }
}

/* The same outputs on AMX (Sapphire Rapids and later), for calls with at least AMX_MIN_ROWS rows. One TDPBSUD
   multiplies 16 activation rows (tile A: 16 rows x the 32 int8 inputs of one group, straight from xq) by 16 output
   channels (tile B: the group's weights of two adjacent 8-channel tiles, unpacked to one byte each) into 16 x 16
   exact int32 group sums (tile C), the same integers the VNNI path adds up. B's 8 rows are the group's 8 quads of
   inputs; quad 2s is block s's low nibbles (inputs 8s..8s+3), quad 2s+1 its high nibbles, each row channel-major:
   exactly the unpacked 256-bit vectors of the VNNI loop, the two tiles side by side. From C on, a row's 16
   channels see the VNNI path's float steps (convert, FMA by the group's scale in group order; the min terms' own FMA
   chain; one final FMA by the row scale plus bias), in 512-bit registers, so the outputs are bit-identical. A call's
   last, partial row block reads its rows from a zero-padded copy; a lone output tile at the end of a range runs on
   the VNNI path. Each group has its own scale, so every 16 x 16 block of sums makes a trip through memory (the tile
   store, then vector loads): on a 2-core Emerald Rapids VM that trip costs about twice the tile multiply, so AMX
   pays from 16 rows on (the 1.5B target's forward of k rows after 100, 2 threads, VNNI / AMX: k = 8 78 / 113 ms,
   16 140 / 121, 32 267 / 176, 256 2083 / 1350; `python -m bench.quantized_forward --int4-isas avx512vnni,amx`
   with AMX_MIN_ROWS set to 1). */
#define AMX_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")))
#define AMX_ROWS 16          /* activation rows per tile */
#define AMX_MIN_ROWS 16      /* fewer rows in a call: the VNNI path, faster there (see the measurements above) */
#define AMX_ROW_BLOCK 128    /* activation rows kept in cache while every output tile pair passes over them */
#define AMX_B_BYTES 512      /* one group of a tile pair: 8 quads x 16 channels x 4 bytes */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* Tiles 0, 1: C (16 rows x 16 int32); 2, 3: A (16 rows x 32 bytes); 4, 5: B (8 rows x 64 bytes). Two of each let
   the next group's multiply start while this group's sums are converted. Per thread: tile state is thread-local. */
static AMX_TARGET void amx_configure(void) {
    amx_config_t c;
    __builtin_memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) {
        c.colsb[t] = 64; c.rows[t] = AMX_ROWS;
        c.colsb[2 + t] = GROUP; c.rows[2 + t] = AMX_ROWS;
        c.colsb[4 + t] = 64; c.rows[4 + t] = GROUP / 4;
    }
    _tile_loadconfig(&c);
}

/* Two tiles' 8 fp16 values (a group's scales or minimums) as the 16 floats of the pair, first tile first. */
static inline AMX_TARGET __m512 amx_pair_floats(const uint16_t *first, const uint16_t *second) {
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)second),
                                            _mm_loadu_si128((const __m128i *)first)));
}

/* The weights of output tiles (tile, tile + 1), every group, as B tiles: b [groups][8 quads][16 channels x 4]; their
   scales and minimums as floats: scale_f, min_f [groups][16 channels]. */
static inline AMX_TARGET void amx_unpack_pair(int64_t tile, int64_t groups, const uint8_t *wq, const uint16_t *scales,
                                              const uint16_t *mins, uint8_t *b, float *scale_f, float *min_f) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *lo = wq + (tile * groups + g) * 4 * 32, *hi = wq + ((tile + 1) * groups + g) * 4 * 32;
        uint8_t *out = b + g * AMX_B_BYTES;
        for (int line = 0; line < 2; line++) {  /* streamed from memory: ask for the next lines early */
            _mm_prefetch((const char *)(lo + PREFETCH_BYTES + 64 * line), _MM_HINT_T0);
            _mm_prefetch((const char *)(hi + PREFETCH_BYTES + 64 * line), _MM_HINT_T0);
        }
        for (int s = 0; s < 4; s++) {
            const __m256i p0 = _mm256_loadu_si256((const __m256i *)(lo + s * 32));
            const __m256i p1 = _mm256_loadu_si256((const __m256i *)(hi + s * 32));
            _mm256_store_si256((__m256i *)(out + 2 * s * 64), _mm256_and_si256(p0, low));
            _mm256_store_si256((__m256i *)(out + 2 * s * 64 + 32), _mm256_and_si256(p1, low));
            _mm256_store_si256((__m256i *)(out + (2 * s + 1) * 64), _mm256_and_si256(_mm256_srli_epi16(p0, 4), low));
            _mm256_store_si256((__m256i *)(out + (2 * s + 1) * 64 + 32),
                               _mm256_and_si256(_mm256_srli_epi16(p1, 4), low));
        }
        const int64_t i0 = (tile * groups + g) * LANES, i1 = ((tile + 1) * groups + g) * LANES;
        _mm512_store_ps(scale_f + g * 16, amx_pair_floats(scales + i0, scales + i1));
        _mm512_store_ps(min_f + g * 16, amx_pair_floats(mins + i0, mins + i1));
    }
}

/* Group g's sums (C tile `c`, 16 rows x 16 channels) stored to `sums`: issued one group ahead of their fold, so the
   tile store has reached the cache when the vector loads read it. */
#define AMX_SUMS(c, a, bt, g, sums) do {      /* tile numbers must be literals (they are pasted into asm) */  \
        _tile_zero(c);                                                                                       \
        _tile_loadd(a, xa + (g) * GROUP, lda);                                                               \
        _tile_loadd(bt, b + (g) * AMX_B_BYTES, 64);                                                          \
        _tile_dpbsud(c, a, bt);                                                                              \
        _tile_stored(c, sums, 64);                                                                           \
    } while (0)

/* The VNNI path's FMA by the group's scale, for the block's first `cap` rows. */
#define AMX_FOLD(g, sums) do {                                                                               \
        const __m512 sc = _mm512_load_ps(scale_f + (g) * 16);                                               \
        for (int r = 0; r < cap; r++)                                                                        \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((sums) + r * 16)), sc, acc[r]);   \
    } while (0)

/* Output tiles (tile, tile + 1) for 16 activation rows at xa (row stride lda); rows [0, valid) are written to y's
   rows r0.. (the rest are padding). Only the first `cap` >= valid rows (a constant per call site, so that the
   accumulators stay in registers) are converted: a small verify pays for its own rows. */
static inline __attribute__((always_inline)) AMX_TARGET void amx_block(
        int64_t tile, const int8_t *xa, int64_t lda, int64_t r0, int valid, const int cap, int64_t k, int64_t n,
        const float *row_scale, const float *xsum, const uint8_t *b, const float *scale_f, const float *min_f,
        const float *bias, float *y) {
    const int64_t groups = k / GROUP;
    __attribute__((aligned(64))) int32_t sums[2][AMX_ROWS * 16];
    const float *xs[AMX_ROWS];                  /* padding rows repeat the last valid row's sums (never written) */
    for (int r = 0; r < cap; r++) xs[r] = xsum + (r0 + (r < valid ? r : valid - 1)) * groups;
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < cap; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++)        /* the min terms first: each row's chain in group order */
        for (int r = 0; r < cap; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r][g]), _mm512_load_ps(min_f + g * 16), acc[r]);
    __attribute__((aligned(64))) float min_terms[AMX_ROWS * 16];
    for (int r = 0; r < cap; r++) {
        _mm512_store_ps(min_terms + r * 16, acc[r]);
        acc[r] = _mm512_setzero_ps();
    }
    AMX_SUMS(0, 2, 4, 0, sums[0]);
    for (int64_t g = 1; g < groups; g++) {
        if (g & 1) AMX_SUMS(1, 3, 5, g, sums[1]);
        else AMX_SUMS(0, 2, 4, g, sums[0]);
        AMX_FOLD(g - 1, sums[(g - 1) & 1]);
    }
    AMX_FOLD(groups - 1, sums[(groups - 1) & 1]);
    const __m512 bv = bias ? _mm512_loadu_ps(bias + tile * LANES) : _mm512_setzero_ps();
    for (int r = 0; r < valid; r++)
        _mm512_storeu_ps(y + (r0 + r) * n + tile * LANES,
                         _mm512_fmadd_ps(_mm512_add_ps(acc[r], _mm512_load_ps(min_terms + r * 16)),
                                         _mm512_set1_ps(row_scale[r0 + r]), bv));
}

static AMX_TARGET void matmul_amx(const int8_t *xq, const float *row_scale, const float *xsum, int64_t m, int64_t k,
                                  const uint8_t *wq, const uint16_t *scales, const uint16_t *mins, const float *bias,
                                  int64_t n, int64_t tile_begin, int64_t tile_end, float *y) {
    static __thread uint8_t *scratch;           /* B tiles of one pair, then 16 zero-padded activation rows */
    static __thread size_t capacity;
    const int64_t groups = k / GROUP, pair_end = tile_begin + (tile_end - tile_begin) / 2 * 2;
    const int64_t full = m / AMX_ROWS * AMX_ROWS, b_bytes = groups * AMX_B_BYTES;
    const size_t need = (size_t)(b_bytes + 2 * groups * 16 * (int64_t)sizeof(float) + AMX_ROWS * k);
    if (need > capacity) {
        free(scratch);
        scratch = aligned_alloc(64, (need + 63) & ~(size_t)63);
        if (!scratch) abort();
        capacity = need;
    }
    uint8_t *b = scratch;
    float *scale_f = (float *)(scratch + b_bytes), *min_f = scale_f + groups * 16;
    int8_t *padded = (int8_t *)(min_f + groups * 16);
    if (full < m) {
        __builtin_memset(padded, 0, (size_t)(AMX_ROWS * k));
        __builtin_memcpy(padded, xq + full * k, (size_t)((m - full) * k));
    }
    amx_configure();
    for (int64_t rb = 0; rb < m; rb += AMX_ROW_BLOCK) {
        const int64_t re = rb + AMX_ROW_BLOCK < m ? rb + AMX_ROW_BLOCK : m;
        for (int64_t tile = tile_begin; tile < pair_end; tile += 2) {
            amx_unpack_pair(tile, groups, wq, scales, mins, b, scale_f, min_f);
            for (int64_t r0 = rb; r0 < re; r0 += AMX_ROWS) {
                const int valid = m - r0 < AMX_ROWS ? (int)(m - r0) : AMX_ROWS;
                const int8_t *xa = r0 < full ? xq + r0 * k : padded;
#define BLOCK(CAP) amx_block(tile, xa, k, r0, valid, CAP, k, n, row_scale, xsum, b, scale_f, min_f, bias, y)
                if (valid <= 4) BLOCK(4);
                else if (valid <= 8) BLOCK(8);
                else BLOCK(AMX_ROWS);
#undef BLOCK
            }
        }
    }
    _tile_release();
    if (pair_end < tile_end)
        matmul_vnni(xq, row_scale, xsum, m, k, wq, scales, mins, bias, n, pair_end, tile_end, y);
}

/* Instruction sets: 0 = AVX2, 1 = AVX-512 VNNI, 2 = AMX (VNNI below AMX_MIN_ROWS rows). The best the CPU has is
   chosen on first use; tests pin one. */
enum { ISA_AVX2 = 0, ISA_VNNI = 1, ISA_AMX = 2 };
static atomic_int isa = -1;

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* AMX needs the CPU's flags and the kernel's leave to use the tile data state (once per process). */
static int amx_usable(void) {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static int best_isa(void) {
    static int best = -1;
    if (best >= 0) return best;
    __builtin_cpu_init();
    const int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    best = !vnni ? ISA_AVX2 : (amx_usable() ? ISA_AMX : ISA_VNNI);
    return best;
}

/* Pins the instruction set (one the CPU lacks is refused); returns the one in use. Negative: just report it. */
int sm_set_isa(int wanted) {
    if (atomic_load(&isa) < 0) atomic_store(&isa, best_isa());
    if (wanted >= ISA_AVX2 && wanted <= best_isa()) atomic_store(&isa, wanted);
    return atomic_load(&isa);
}

/* Calls of at most `small_rows` rows run on the `small_isa` path (-1: none): int4_small_calls.calibrate_small_calls
   sets it where that path measured faster for decode-sized calls (a 2-core Zen 4: the AVX2 path's one stream a tile
   beat the VNNI path's tile pairs up to 4 rows). Every path gives the same bits, so this changes only the time. */
static atomic_int small_isa = -1;
static atomic_int small_rows = 0;

int sm_set_small_calls(int wanted, int max_rows) {
    if (wanted > sm_set_isa(-1) || max_rows <= 0) wanted = -1;    /* never a path the chosen one does not cover */
    atomic_store(&small_rows, wanted < 0 ? 0 : max_rows);
    atomic_store(&small_isa, wanted);
    return wanted;
}

/* y [m, n] for output tiles [tile_begin, tile_end) (n a multiple of 8, k of 32). */
void sm_int4_matmul(const int8_t *xq, const float *row_scale, const float *xsum, int64_t m, int64_t k,
                    const uint8_t *wq, const uint16_t *scales, const uint16_t *mins, const float *bias, int64_t n,
                    int64_t tile_begin, int64_t tile_end, float *y) {
    const int small = atomic_load(&small_isa);
    const int use = small >= 0 && m <= atomic_load(&small_rows) ? small : sm_set_isa(-1);
    if (use == ISA_AMX && m >= AMX_MIN_ROWS)
        matmul_amx(xq, row_scale, xsum, m, k, wq, scales, mins, bias, n, tile_begin, tile_end, y);
    else if (use >= ISA_VNNI)
        matmul_vnni(xq, row_scale, xsum, m, k, wq, scales, mins, bias, n, tile_begin, tile_end, y);
    else
        matmul_avx2(xq, row_scale, xsum, m, k, wq, scales, mins, bias, n, tile_begin, tile_end, y);
}

/* sm_int4_matmul over output tiles [tile_begin, tile_end) on up to `threads` threads (the caller included), through
   cpu_pool.h: the tiles are cut into CHUNKS_PER_THREAD chunks a thread, claimed one at a time. */

#define CHUNKS_PER_THREAD 6      /* chunks a job is cut into per thread: small enough to balance, few claims */

typedef struct {
    const int8_t *xq; const float *row_scale; const float *xsum; int64_t m, k;
    const uint8_t *wq; const uint16_t *scales; const uint16_t *mins; const float *bias; int64_t n;
    int64_t tile_begin, chunk_tiles, tile_end; float *y;
} matmul_job_t;

static void matmul_chunk(void *ctx, int64_t chunk, int thread) {
    (void)thread;
    const matmul_job_t *j = ctx;
    const int64_t b = j->tile_begin + chunk * j->chunk_tiles;
    const int64_t e = b + j->chunk_tiles < j->tile_end ? b + j->chunk_tiles : j->tile_end;
    sm_int4_matmul(j->xq, j->row_scale, j->xsum, j->m, j->k, j->wq, j->scales, j->mins, j->bias, j->n, b, e, j->y);
}

void sm_int4_matmul_mt(const int8_t *xq, const float *row_scale, const float *xsum, int64_t m, int64_t k,
                       const uint8_t *wq, const uint16_t *scales, const uint16_t *mins, const float *bias, int64_t n,
                       int64_t tile_begin, int64_t tile_end, float *y, int threads) {
    const int64_t tiles = tile_end - tile_begin;
    if (threads <= 1 || tiles <= 1) {
        sm_int4_matmul(xq, row_scale, xsum, m, k, wq, scales, mins, bias, n, tile_begin, tile_end, y);
        return;
    }
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    int64_t num_chunks = (int64_t)threads * CHUNKS_PER_THREAD;
    if (num_chunks > tiles) num_chunks = tiles;
    int64_t chunk_tiles = (tiles + num_chunks - 1) / num_chunks;
    if (sm_set_isa(-1) >= ISA_VNNI && chunk_tiles % 2) chunk_tiles++;   /* whole tile pairs (AMX and VNNI) */
    num_chunks = (tiles + chunk_tiles - 1) / chunk_tiles;
    matmul_job_t job = {xq, row_scale, xsum, m, k, wq, scales, mins, bias, n, tile_begin, chunk_tiles, tile_end, y};
    pool_run(threads, num_chunks, matmul_chunk, &job);
}

/* One linear layer: x [m, k] float32 rows quantized (sm_quantize_rows) into this thread's scratch, then
   sm_int4_matmul_mt over every output tile into y [m, n]. The same numbers as the two calls made separately. */
void sm_int4_linear(const float *x, int64_t m, int64_t k, const uint8_t *wq, const uint16_t *scales,
                    const uint16_t *mins, const float *bias, int64_t n, float *y, int threads) {
    static __thread unsigned char *scratch;
    static __thread size_t capacity;
    const size_t xq_bytes = ((size_t)(m * k) + 63) & ~(size_t)63;
    const size_t need = xq_bytes + sizeof(float) * (size_t)(m + m * (k / GROUP));
    if (need > capacity) {
        free(scratch);
        scratch = aligned_alloc(64, (need + 63) & ~(size_t)63);
        if (!scratch) abort();
        capacity = need;
    }
    int8_t *xq = (int8_t *)scratch;
    float *row_scale = (float *)(scratch + xq_bytes), *xsum = row_scale + m;
    sm_quantize_rows(x, m, k, xq, row_scale, xsum);
    sm_int4_matmul_mt(xq, row_scale, xsum, m, k, wq, scales, mins, bias, n, 0, n / LANES, y, threads);
}

int sm_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
