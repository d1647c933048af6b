/* The 256-weight K-quants (Q4_K, Q5_K, Q6_K) against sw_a256 activations.
 *
 * Block layouts (little-endian; d, dmin fp16), as src/shardwise/kernels/blocks.py decodes them:
 *
 *   Q4_K, 144 bytes: d [0,2), dmin [2,4), 12 bytes of packed 6-bit sub-scales sc[8] and
 *        sub-mins mn[8] [4,16), 128 bytes of nibbles qs [16,144).
 *        8 sub-blocks of 32: sub-block 2i = low nibbles of qs[32i .. 32i+31], 2i+1 = their
 *        high nibbles.                                     w = d * sc[j] * q - dmin * mn[j]
 *   Q5_K, 176 bytes: as Q4_K, with 32 bytes qh [16,48) before the nibbles qs [48,176):
 *        weight l of sub-block j has 5th bit (qh[l] >> j) & 1.    q = nibble | bit << 4
 *   Q6_K, 210 bytes: ql[128] [0,128), qh[64] [128,192), int8 scales sc[16] [192,208), d
 *        [208,210). Two halves h of 128 weights; in half h, weight p = 32 t + l (t < 4, l < 32)
 *        has low 4 bits from ql[64 h + 32 (t % 2) + l] (low nibble for t < 2, high for t >= 2)
 *        and high 2 bits (qh[32 h + l] >> 2 t) & 3. 16 sub-blocks of 16.
 *                                                          w = d * sc[g] * (q - 32)
 *
 * Against an activation block (da, m[8], bsum[16], qa[256]; sw.h: sub-block j of 32 has the scale
 * da m[j], and bsum holds m times the sums of 16) the dot is, exactly in integers but for the
 * final scaling:
 *   Q4_K/Q5_K: da * (d * sum_j sc[j] m[j] * (q_j . qa_j) - dmin * sum_j mn[j] * (bsum[2j] + bsum[2j+1]))
 *   Q6_K:      da * d * sum_g sc[g] * (m[g / 2] * (q_g . qa_g) - 32 * bsum[g])
 * The weights' sub-scale times the activation's, sc[j] m[j], is one int16 multiplier where the
 * code before multiplied by sc[j] alone (<= 63 * 8 for Q4_K/Q5_K, 128 * 8 for Q6_K).
 * Integer bounds (SW_A256_M 8): |q_j . qa_j| <= 32 * 31 * 127 (Q5_K); a block's sum <= 256 * 31
 * * 127 * 63 * 8, and for Q6_K 256 * 32 * 127 * 128 * 8 (its unsigned dot and -32 term each
 * below 2^31 too): inside int32.
 *
 * Variants (registered into sw_gemm_table / sw_dequant_table):
 *   portable  plain C: each block unpacked to bytes, integer dots per sub-block.
 *   avx2      a sub-block's 32 weights in one ymm as u8 (Q6_K: q, 0..63), times the s8
 *             activations by vpmaddubsw, then vpmaddwd by the sub-scale as int16: the int32
 *             lanes hold exact partial sums of sc * dot. Q4_K/Q5_K: each row's lanes scaled
 *             per block in fp32 (da d isum - da dmin imin, imin by one vpmaddwd of bsum and
 *             the mins); Q6_K: the -32 enters as -32 sc bsum, which cancels against the
 *             unsigned dot, so a block's lanes are summed in integers first (4 rows at once).
 *   avx512    one zmm per 64 weights in weight order; vpdpbusd (4 products a lane, which fit
 *             int16), two zmm of those packed to int16 (vpackssdw) and one vpdpwssd by the
 *             sub-scales: 3 multiplies per 128 weights and row. From a few activation rows
 *             (k45_tile_rows, q6_tile_rows) 16 weight rows a zmm instead, one int32 lane a row
 *             (k45_tile16, q6_tile16): the transposes, scales and float tail shared by 16 rows.
 *             Dequantizing runs the avx2 code.
 * The SIMD gemms take the weight rows a tile of K_TILE at a time and the activation rows in
 * groups of up to 4 (avx2) or 8 (avx512): each weight block is decoded into registers once
 * per group and dotted with the group's rows, and a tile stays in cache while the groups
 * pass over it (the weights are read from memory once). */
#include <immintrin.h>
#include <stdlib.h>

#include "sw.h"
#include "tile16.h"

enum { Q4K_BYTES = 144, Q5K_BYTES = 176, Q6K_BYTES = 210 };
enum { K_TILE = 16 }; /* weight rows per tile in the SIMD gemms */

/* Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 mins. Bytes 0-3: scales 0-3 (low 6 bits)
 * with the top 2 bits of scales 4-7; bytes 4-7: the same for the mins; bytes 8-11: the low
 * 4 bits of scale 4+i (low nibble) and of min 4+i (high nibble). */
static inline void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 63;
        mn[i] = s[4 + i] & 63;
        sc[4 + i] = (uint8_t)((s[8 + i] & 0x0F) | ((s[i] >> 6) << 4));
        mn[4 + i] = (uint8_t)((s[8 + i] >> 4) | ((s[4 + i] >> 6) << 4));
    }
}

/* The same as two 64-bit words of 8 bytes each (byte i = scale/min i), for the SIMD paths. */
static inline void k_scales64(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
    uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *mn = mn_lo | (uint64_t)mn_hi << 32;
}

/* ---------------------------------------------------------------- portable */

/* One Q4_K or Q5_K block -> q[256] (0..31), sc[8], mn[8]. qh is NULL for Q4_K. */
static void k45_unpack(const uint8_t *qs, const uint8_t *qh, uint8_t q[256]) {
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 32; l++) {
            q[64 * i + l] = qs[32 * i + l] & 0x0F;
            q[64 * i + 32 + l] = qs[32 * i + l] >> 4;
        }
    if (qh)
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) q[32 * j + l] |= (uint8_t)(((qh[l] >> j) & 1) << 4);
}

/* One Q6_K block -> q[256] - 32 (-32..31). */
static void q6k_unpack(const uint8_t *blk, int8_t q[256]) {
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++) {
                uint8_t b = ql[64 * h + 32 * (t & 1) + l];
                int lo = t < 2 ? b & 0x0F : b >> 4, hi = (qh[32 * h + l] >> (2 * t)) & 3;
                q[128 * h + 32 * t + l] = (int8_t)((lo | hi << 4) - 32);
            }
}

/* Q4_K (bytes 144, qh_off 0) and Q5_K (176, 16): y[i, r] = sum_b the block dot above. */
static void gemm_k45_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const sw_a256 *x,
                              int64_t n, float *y, int64_t ldy, int bytes, int qh_off) {
    uint8_t q[256], sc[8], mn[8];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) y[i * ldy + r] = 0.0f;
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + bytes * b;
            const float d = sw_load_fp16(blk), dmin = sw_load_fp16(blk + 2);
            k_scales(blk + 4, sc, mn);
            k45_unpack(blk + 16 + (qh_off ? 32 : 0), qh_off ? blk + qh_off : NULL, q);
            for (int64_t i = 0; i < n; i++) {
                const sw_a256 *a = x + i * kblocks + b;
                int32_t isum = 0, imin = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t dot = 0;
                    for (int l = 0; l < 32; l++) dot += q[32 * j + l] * a->q[32 * j + l];
                    isum += sc[j] * a->m[j] * dot;
                    imin += mn[j] * (a->bsum[2 * j] + a->bsum[2 * j + 1]);
                }
                y[i * ldy + r] += a->d * (d * (float)isum - dmin * (float)imin);
            }
        }
    }
}

static void gemm_q4_k_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x,
                               int64_t n, float *y, int64_t ldy) {
    gemm_k45_portable(w, row_bytes, rows, kblocks, (const sw_a256 *)x, n, y, ldy, Q4K_BYTES, 0);
}

static void gemm_q5_k_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x,
                               int64_t n, float *y, int64_t ldy) {
    gemm_k45_portable(w, row_bytes, rows, kblocks, (const sw_a256 *)x, n, y, ldy, Q5K_BYTES, 16);
}

static void gemm_q6_k_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x,
                               int64_t n, float *y, int64_t ldy) {
    const sw_a256 *xa = (const sw_a256 *)x;
    int8_t q[256];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) y[i * ldy + r] = 0.0f;
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + Q6K_BYTES * b;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = sw_load_fp16(blk + 208);
            q6k_unpack(blk, q);
            for (int64_t i = 0; i < n; i++) {
                const sw_a256 *a = xa + i * kblocks + b;
                int32_t isum = 0;
                for (int g = 0; g < 16; g++) {
                    int32_t dot = 0;
                    for (int l = 0; l < 16; l++) dot += q[16 * g + l] * a->q[16 * g + l];
                    isum += sc[g] * a->m16[g] * dot;
                }
                y[i * ldy + r] += a->d * d * (float)isum;
            }
        }
    }
}

static void dequant_k45_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out,
                                 int bytes, int qh_off) {
    uint8_t q[256], sc[8], mn[8];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + bytes * b;
            const float d = sw_load_fp16(blk), dmin = sw_load_fp16(blk + 2);
            float *o = out + (r * kblocks + b) * 256;
            k_scales(blk + 4, sc, mn);
            k45_unpack(blk + 16 + (qh_off ? 32 : 0), qh_off ? blk + qh_off : NULL, q);
            for (int j = 0; j < 8; j++) {
                const float s = d * sc[j], m = dmin * mn[j];
                for (int l = 0; l < 32; l++) o[32 * j + l] = s * q[32 * j + l] - m;
            }
        }
}

static void dequant_q4_k_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out) {
    dequant_k45_portable(w, row_bytes, rows, kblocks, out, Q4K_BYTES, 0);
}

static void dequant_q5_k_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out) {
    dequant_k45_portable(w, row_bytes, rows, kblocks, out, Q5K_BYTES, 16);
}

static void dequant_q6_k_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out) {
    int8_t q[256];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + Q6K_BYTES * b;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = sw_load_fp16(blk + 208);
            float *o = out + (r * kblocks + b) * 256;
            q6k_unpack(blk, q);
            for (int g = 0; g < 16; g++) {
                const float s = d * sc[g];
                for (int l = 0; l < 16; l++) o[16 * g + l] = s * q[16 * g + l];
            }
        }
}

/* ---------------------------------------------------------------- AVX2 */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline uint16_t k_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float k_hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* int16 lane 2j, 2j + 1 = byte j of a 64-bit word broadcast to every 64 bits (pshufb, 0x80 = 0). */
static inline __m256i k_pairs16(uint64_t v) {
    const __m256i idx = _mm256_setr_epi8(0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3, -128, 4,
                                         -128, 4, -128, 5, -128, 5, -128, 6, -128, 6, -128, 7, -128, 7, -128);
    return _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)v), idx);
}

/* Sub-block j (32 weights, u8) of a Q4_K / Q5_K block: the nibbles v of qs[32 (j / 2) ..],
 * and for Q5_K bit j of each byte of qh as bit 4, from hk = qh >> 2 (j / 2) (16-bit shifts:
 * the bits used never cross a byte; the shifts stay immediates however the loops unroll). */
ALWAYS_INLINE __m256i k45_sub_avx2(int q5, int j, __m256i v, __m256i hk) {
    const __m256i nib = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, nib);
    if (q5) q = _mm256_or_si256(q, _mm256_and_si256(j & 1 ? _mm256_slli_epi16(hk, 3) : _mm256_slli_epi16(hk, 4), b4));
    return q;
}

/* int16 sc[j] * m[j], j < 8, in both 128-bit lanes: a weight block's sub-scales (8 bytes of
 * a 64-bit word) times an activation block's (sw.h). */
static inline __m256i k_sm16(uint64_t sc, const uint8_t *m) {
    const __m128i p = _mm_mullo_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)),
                                      _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)m)));
    return _mm256_broadcastsi128_si256(p);
}

/* int16 sc[g] * m16[g], g < 16: Q6_K's sub-scales times the activation block's. */
static inline __m256i q6_sm16(__m256i sc16, const sw_a256 *a) {
    return _mm256_mullo_epi16(sc16, _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)a->m16)));
}

/* ni (<= 4) activation rows against every weight row: per block, sub-block j's weights are
 * decoded once and dotted with the ni rows (maddubs: u8 weights x s8 activations, then madd
 * by sc[j] m[j] as int16: the 8 int32 lanes hold exact partial sums of sc[j] m[j] dot_j). */
ALWAYS_INLINE void k45_rows_avx2(int q5, int ni, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                 const sw_a256 *xa, float *y, int64_t ldy) {
    const int bytes = q5 ? Q5K_BYTES : Q4K_BYTES, qs_off = q5 ? 48 : 16;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m256 acc[4];
        for (int i = 0; i < ni; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = wr + bytes * b;
            sw_prefetch_ahead(wr, row_bytes, r, rows, bytes * b, bytes);
            uint64_t sc, mn;
            k_scales64(blk + 4, &sc, &mn);
            __m256i hk = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            __m256i isum[4], sm[4];
            for (int i = 0; i < ni; i++) {
                isum[i] = _mm256_setzero_si256();
                sm[i] = k_sm16(sc, xa[i * kblocks + b].m);
            }
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs_off + 32 * k));
#pragma GCC unroll 2
                for (int j = 2 * k; j < 2 * k + 2; j++) {
                    const __m256i q = k45_sub_avx2(q5, j, v, hk);
                    const __m256i sel = _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j));
#pragma GCC unroll 4
                    for (int i = 0; i < ni; i++) {
                        const __m256i a = _mm256_loadu_si256((const __m256i *)(xa[i * kblocks + b].q + 32 * j));
                        const __m256i s = _mm256_shuffle_epi8(sm[i], sel);
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), s));
                    }
                }
                hk = _mm256_srli_epi16(hk, 2);
            }
            const __m256i mn16 = k_pairs16(mn);
            const __m256 vd = _mm256_set1_ps(_cvtsh_ss(k_u16(blk))), vm = _mm256_set1_ps(_cvtsh_ss(k_u16(blk + 2)));
            for (int i = 0; i < ni; i++) {
                const sw_a256 *a = xa + i * kblocks + b;
                const __m256i imin = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsum), mn16);
                const __m256 fm = _mm256_mul_ps(_mm256_cvtepi32_ps(imin), vm);
                const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum[i]), vd, fm);
                acc[i] = _mm256_fmadd_ps(t, _mm256_set1_ps(a->d), acc[i]); /* da (d isum - dmin imin) */
            }
        }
        for (int i = 0; i < ni; i++) y[i * ldy + r] = k_hsum8(acc[i]);
    }
}

/* Q6_K, 32 weights t of half hf (weights 128 hf + 32 t ..): 4 low bits from ql0 / ql1
 * (qs[64 hf ..], qs[64 hf + 32 ..]), 2 high from qh[32 hf ..] bits 2t, 2t + 1; u8 0..63. */
ALWAYS_INLINE __m256i q6_sub_avx2(int t, __m256i ql0, __m256i ql1, __m256i qh) {
    const __m256i nib = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const __m256i l = t & 1 ? ql1 : ql0;
    const __m256i lo = _mm256_and_si256(t < 2 ? l : _mm256_srli_epi16(l, 4), nib);
    const __m256i hb = t == 0   ? _mm256_slli_epi16(qh, 4)
                       : t == 1 ? _mm256_slli_epi16(qh, 2)
                       : t == 2 ? qh
                                : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hb, hi2));
}

/* The integer sums of up to 4 rows (8 int32 lanes each, unused rows zero) -> their 4 totals,
 * in integers: Q6_K's lanes hold the unsigned dot and the -32 * bsum term, which cancel, so
 * converting each lane to fp32 would round at their size rather than the total's. */
static inline __m128i k_total4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* Q6_K: the same shape; weights as u8 0..63 and the -32 through bsum: each row's integer sum
 * starts at -32 * sum_g sc[g] * bsum[g] (madd of bsum, m times the sums already, and the int16
 * scales); the dots go in times sc[g] m16[g]. The lanes hold
 * the unsigned dot and the offset apart, which cancel, so a block's lanes are summed in
 * integers (4 rows at once) and its total scaled as the portable path does:
 * y += da * d * (float)isum. */
ALWAYS_INLINE void q6_rows_avx2(int ni, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                const sw_a256 *xa, float *y, int64_t ldy) {
    /* per 128-bit lane: int16 sc[2t] (lane 0) or sc[2t + 1] (lane 1) of a half's 8 scales */
    __m256i sidx[4];
    for (int t = 0; t < 4; t++)
        sidx[t] = _mm256_setr_m128i(_mm_set1_epi16((short)((4 * t + 1) << 8 | 4 * t)),
                                    _mm_set1_epi16((short)((4 * t + 3) << 8 | (4 * t + 2))));
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m128 acc = _mm_setzero_ps(); /* lane i: row i */
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = wr + Q6K_BYTES * b;
            sw_prefetch_ahead(wr, row_bytes, r, rows, Q6K_BYTES * b, Q6K_BYTES);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))); /* int16 sc[0 .. 15] */
            __m256i isum[4], sm[4];
            float da[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int i = 0; i < 4; i++) isum[i] = _mm256_setzero_si256();
            for (int i = 0; i < ni; i++) {
                const sw_a256 *a = xa + i * kblocks + b;
                const __m256i c = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsum), sc16);
                isum[i] = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(c, 5));
                sm[i] = q6_sm16(sc16, a); /* int16 sc[g] m16[g] */
                da[i] = a->d;
            }
#pragma GCC unroll 2
            for (int hf = 0; hf < 2; hf++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hf));
                __m256i sh[4];
#pragma GCC unroll 4
                for (int i = 0; i < ni; i++)
                    sh[i] = _mm256_broadcastsi128_si256(hf ? _mm256_extracti128_si256(sm[i], 1) : _mm256_castsi256_si128(sm[i]));
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    const __m256i q = q6_sub_avx2(t, ql0, ql1, qh);
#pragma GCC unroll 4
                    for (int i = 0; i < ni; i++) {
                        const int8_t *a = xa[i * kblocks + b].q + 128 * hf + 32 * t;
                        const __m256i av = _mm256_loadu_si256((const __m256i *)a);
                        const __m256i s = _mm256_shuffle_epi8(sh[i], sidx[t]);
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), s));
                    }
                }
            }
            /* da from registers: a 16-byte load of 4 just-stored floats would stall the store forwarding */
            const __m128 da4 = _mm_setr_ps(da[0], da[1], da[2], da[3]);
            const __m128 f = _mm_mul_ps(da4, _mm_set1_ps(_cvtsh_ss(k_u16(blk + 208))));
            acc = _mm_add_ps(acc, _mm_mul_ps(f, _mm_cvtepi32_ps(k_total4(isum[0], isum[1], isum[2], isum[3]))));
        }
        float out[4];
        _mm_storeu_ps(out, acc);
        for (int i = 0; i < ni; i++) y[i * ldy + r] = out[i];
    }
}

/* Weight rows a tile at a time (K_TILE rows stay in cache while every group of activation
 * rows passes over them: the weights are read from memory once), activation rows in groups
 * of 4 (then 3, 2, 1). fmt 4, 5 (Q4_K, Q5_K) or 6 (Q6_K). */
ALWAYS_INLINE void gemm_k_avx2(int fmt, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                               const void *x, int64_t n, float *y, int64_t ldy) {
    const sw_a256 *xa = (const sw_a256 *)x;
    for (int64_t r0 = 0; r0 < rows; r0 += K_TILE) {
        const int64_t nr = rows - r0 < K_TILE ? rows - r0 : K_TILE;
        const uint8_t *wt = w + r0 * row_bytes;
        for (int64_t i0 = 0; i0 < n;) {
            const int64_t left = n - i0;
            const int ni = left >= 4 ? 4 : (int)left;
            const sw_a256 *xi = xa + i0 * kblocks;
            float *yi = y + i0 * ldy + r0;
#define K_RUN(k)                                                                                \
    (fmt == 6 ? q6_rows_avx2(k, wt, row_bytes, nr, kblocks, xi, yi, ldy)                          \
              : k45_rows_avx2(fmt == 5, k, wt, row_bytes, nr, kblocks, xi, yi, ldy))
            if (ni == 4) K_RUN(4);
            else if (ni == 3) K_RUN(3);
            else if (ni == 2) K_RUN(2);
            else K_RUN(1);
#undef K_RUN
            i0 += ni;
        }
    }
}

/* 16 u8 (or, signed, s8) weights q times s, minus m -> o[0 .. 15], rounded as the portable
 * path rounds s * q - m (a product, then a difference: no fused multiply-add). */
ALWAYS_INLINE void k_store16_avx2(int is_signed, __m128i q, float s, float m, float *o) {
    const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
    for (int k = 0; k < 2; k++) {
        const __m128i part = k ? _mm_srli_si128(q, 8) : q;
        const __m256i v = is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
        _mm256_storeu_ps(o + 8 * k, _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), vs), vm));
    }
}

ALWAYS_INLINE void dequant_k45_avx2(int q5, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                    float *out) {
    const int bytes = q5 ? Q5K_BYTES : Q4K_BYTES, qs_off = q5 ? 48 : 16;
    uint8_t sc[8], mn[8];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + bytes * b;
            const float d = _cvtsh_ss(k_u16(blk)), dmin = _cvtsh_ss(k_u16(blk + 2));
            float *o = out + (r * kblocks + b) * 256;
            k_scales(blk + 4, sc, mn);
            __m256i hk = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs_off + 32 * k));
                for (int j = 2 * k; j < 2 * k + 2; j++) {
                    const __m256i q = k45_sub_avx2(q5, j, v, hk);
                    const float s = d * sc[j], m = dmin * mn[j];
                    k_store16_avx2(0, _mm256_castsi256_si128(q), s, m, o + 32 * j);
                    k_store16_avx2(0, _mm256_extracti128_si256(q, 1), s, m, o + 32 * j + 16);
                }
                hk = _mm256_srli_epi16(hk, 2);
            }
        }
}

ALWAYS_INLINE void dequant_q6_avx2(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out) {
    const __m256i off = _mm256_set1_epi8(32);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + Q6K_BYTES * b;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = _cvtsh_ss(k_u16(blk + 208));
            float *o = out + (r * kblocks + b) * 256;
            for (int hf = 0; hf < 2; hf++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hf));
                for (int t = 0; t < 4; t++) {
                    const __m256i q = _mm256_sub_epi8(q6_sub_avx2(t, ql0, ql1, qh), off);
                    const int g = 8 * hf + 2 * t; /* sub-blocks g, g + 1: 16 weights each */
                    k_store16_avx2(1, _mm256_castsi256_si128(q), d * sc[g], 0.0f, o + 128 * hf + 32 * t);
                    k_store16_avx2(1, _mm256_extracti128_si256(q, 1), d * sc[g + 1], 0.0f, o + 128 * hf + 32 * t + 16);
                }
            }
        }
}

#pragma GCC pop_options

/* ---------------------------------------------------------------- AVX-512 VNNI */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

/* One zmm holds 64 weights (two 32-weight sub-blocks for Q4_K / Q5_K, four 16-weight ones
 * for Q6_K) in weight order, so the activations are read as stored. Per pair of zmm and
 * activation row: two vpdpbusd from zero (u8 weights x s8 activations, 4 products a lane:
 * |.| <= 4 * 63 * 127 < 2^15), vpackssdw of the two (exact: nothing saturates), and one
 * vpdpwssd by the int16 sub-scales in the packed order into the row's int32 lanes. */

/* Q4_K / Q5_K: zmm k = sub-blocks 2k (bytes 0-31: the low nibbles of qs[32k ..]) and 2k + 1
 * (bytes 32-63: the high nibbles); Q5_K's bit 2k / 2k + 1 of qh as bit 4. */
ALWAYS_INLINE __m512i k45_sub512(int q5, int k, const uint8_t *qs, __m512i h) {
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1); /* 0 | 4 */
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
    __m512i q = _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(0x0F));
    if (q5) {
        const __m512i bit =
            _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << 2 * k)), _mm256_set1_epi8((char)(1 << (2 * k + 1))), 1);
        q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(h, bit), q, _mm512_set1_epi8(0x10));
    }
    return q;
}

/* ni (<= 8) activation rows against every weight row, as k45_rows_avx2. */
ALWAYS_INLINE void k45_rows512(int q5, int ni, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                               const sw_a256 *xa, float *y, int64_t ldy) {
    const __m512i zero = _mm512_setzero_si512();
    const int bytes = q5 ? Q5K_BYTES : Q4K_BYTES, qs_off = q5 ? 48 : 16;
    /* vpackssdw of the dots of zmm 2p and 2p + 1 holds, per 128-bit lane c, 4 int16 of
     * sub-block 4p + c / 2 then 4 of 4p + 2 + c / 2: their scales, from a broadcast 64-bit word */
    __m512i sidx[2]; /* byte indices of int16 element e of sc[j] m[j]: 2e, 2e + 1 */
#define K_E16(e) ((short)((2 * (e) + 1) << 8 | 2 * (e)))
    for (int p = 0; p < 2; p++) {
        const short e0 = K_E16(4 * p), e2 = K_E16(4 * p + 2), e1 = K_E16(4 * p + 1), e3 = K_E16(4 * p + 3);
        const __m128i lo = _mm_setr_epi16(e0, e0, e0, e0, e2, e2, e2, e2);
        const __m128i hi = _mm_setr_epi16(e1, e1, e1, e1, e3, e3, e3, e3);
        sidx[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_m128i(lo, lo)), _mm256_setr_m128i(hi, hi), 1);
    }
#undef K_E16
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m256 acc[8];
        for (int i = 0; i < ni; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = wr + bytes * b;
            sw_prefetch_ahead(wr, row_bytes, r, rows, bytes * b, bytes);
            uint64_t sc, mn;
            k_scales64(blk + 4, &sc, &mn);
            const __m512i h =
                q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16))) : _mm512_setzero_si512();
            __m512i isum[8], sm[8];
            for (int i = 0; i < ni; i++) {
                isum[i] = _mm512_setzero_si512();
                sm[i] = _mm512_broadcast_i64x4(k_sm16(sc, xa[i * kblocks + b].m)); /* int16 sc[j] m[j] */
            }
            for (int p = 0; p < 2; p++) {
                const __m512i q0 = k45_sub512(q5, 2 * p, blk + qs_off, h);
                const __m512i q1 = k45_sub512(q5, 2 * p + 1, blk + qs_off, h);
                for (int i = 0; i < ni; i++) {
                    const int8_t *a = xa[i * kblocks + b].q + 128 * p;
                    const __m512i d0 = _mm512_dpbusd_epi32(zero, q0, _mm512_loadu_si512((const void *)a));
                    const __m512i d1 = _mm512_dpbusd_epi32(zero, q1, _mm512_loadu_si512((const void *)(a + 64)));
                    isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_packs_epi32(d0, d1), _mm512_shuffle_epi8(sm[i], sidx[p]));
                }
            }
            const __m256i mn16 = k_pairs16(mn);
            const __m256 vd = _mm256_set1_ps(_cvtsh_ss(k_u16(blk))), vm = _mm256_set1_ps(_cvtsh_ss(k_u16(blk + 2)));
            for (int i = 0; i < ni; i++) { /* 16 lanes to 8 in integers, then as the avx2 path */
                const sw_a256 *a = xa + i * kblocks + b;
                const __m256i is8 = _mm256_add_epi32(_mm512_castsi512_si256(isum[i]), _mm512_extracti64x4_epi64(isum[i], 1));
                const __m256i imin = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsum), mn16);
                const __m256 fm = _mm256_mul_ps(_mm256_cvtepi32_ps(imin), vm);
                const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(is8), vd, fm);
                acc[i] = _mm256_fmadd_ps(t, _mm256_set1_ps(a->d), acc[i]); /* da (d isum - dmin imin) */
            }
        }
        for (int i = 0; i < ni; i++) y[i * ldy + r] = k_hsum8(acc[i]);
    }
}

/* Q6_K half hf: zmm lo = weights 128 hf + 0 .. 63 (t = 0, 1), hi = 64 .. 127 (t = 2, 3). */
ALWAYS_INLINE void q6_half512(const uint8_t *blk, int hf, __m512i *lo, __m512i *hi) {
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1); /* 0 | 2 */
    const __m512i nib = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * hf));
    /* qh, and qh >> 2 in the upper half: bits 0-1 (t = 0) | 2-3 (t = 1) at 0-1, 4-5 | 6-7 at 4-5 */
    const __m256i qh8 = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hf));
    const __m512i qh = _mm512_srlv_epi16(_mm512_broadcast_i64x4(qh8), shift);
    *lo = _mm512_or_si512(_mm512_and_si512(ql, nib), _mm512_and_si512(_mm512_slli_epi16(qh, 4), hi2));
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nib), _mm512_and_si512(qh, hi2));
}

/* ni (<= 8) activation rows, as q6_rows_avx2: a block's lanes summed in integers, 4 rows at once. */
ALWAYS_INLINE void q6_rows512(int ni, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                              const sw_a256 *xa, float *y, int64_t ldy) {
    /* vpackssdw of half hf's two dots holds, per 128-bit lane c, 4 int16 of sub-block 8 hf + c
     * (zmm lo) then 4 of 8 hf + 4 + c (zmm hi): int16 lane l <- sc[8 hf + l / 8 + 4 (l / 4 % 2)] */
    const __m512i zero = _mm512_setzero_si512();
    __m512i sidx[2];
    for (int hf = 0; hf < 2; hf++) {
        __m128i lane[4];
        for (int c = 0; c < 4; c++) {
            const short g = (short)(8 * hf + c), g4 = (short)(8 * hf + 4 + c);
            lane[c] = _mm_setr_epi16(g, g, g, g, g4, g4, g4, g4);
        }
        sidx[hf] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_m128i(lane[0], lane[1])),
                                      _mm256_setr_m128i(lane[2], lane[3]), 1);
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()}; /* lane i % 4 of acc[i / 4]: row i */
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = wr + Q6K_BYTES * b;
            sw_prefetch_ahead(wr, row_bytes, r, rows, Q6K_BYTES * b, Q6K_BYTES);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            __m512i isum[8], sm[8];
            float da[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int i = 0; i < ni; i++) { /* -32 * sum_g sc[g] * bsum[g] */
                const sw_a256 *a = xa + i * kblocks + b;
                const __m256i c = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsum), sc16);
                isum[i] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(c, 5)));
                sm[i] = _mm512_castsi256_si512(q6_sm16(sc16, a)); /* int16 sc[g] m16[g]; the upper half never indexed */
                da[i] = a->d;
            }
            for (int hf = 0; hf < 2; hf++) {
                __m512i lo, hi;
                q6_half512(blk, hf, &lo, &hi);
                for (int i = 0; i < ni; i++) {
                    const int8_t *a = xa[i * kblocks + b].q + 128 * hf;
                    const __m512i d0 = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512((const void *)a));
                    const __m512i d1 = _mm512_dpbusd_epi32(zero, hi, _mm512_loadu_si512((const void *)(a + 64)));
                    isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_packs_epi32(d0, d1), _mm512_permutexvar_epi16(sidx[hf], sm[i]));
                }
            }
            __m256i h[8];
            for (int i = 0; i < 8; i++)
                h[i] = i < ni ? _mm256_add_epi32(_mm512_castsi512_si256(isum[i]), _mm512_extracti64x4_epi64(isum[i], 1))
                              : _mm256_setzero_si256();
            const __m128 vd = _mm_set1_ps(_cvtsh_ss(k_u16(blk + 208)));
            for (int u = 0; u < (ni + 3) / 4; u++) {
                const __m128 f = _mm_mul_ps(_mm_setr_ps(da[4 * u], da[4 * u + 1], da[4 * u + 2], da[4 * u + 3]), vd);
                const __m128i tot = k_total4(h[4 * u], h[4 * u + 1], h[4 * u + 2], h[4 * u + 3]);
                acc[u] = _mm_add_ps(acc[u], _mm_mul_ps(f, _mm_cvtepi32_ps(tot)));
            }
        }
        float out[8];
        _mm_storeu_ps(out, acc[0]);
        _mm_storeu_ps(out + 4, acc[1]);
        for (int i = 0; i < ni; i++) y[i * ldy + r] = out[i];
    }
}

/* One activation row in ymm with VNNI (decode at batch 1). On Zen 4, whose 512-bit
 * operations take two passes, a block's 64 weights a ymm cost fewer passes than the zmm
 * kernels' broadcasts and variable shifts: per 64 weights two vpdpbusd from zero (exact, as
 * above), vpackssdw of the two and one vpdpwssd by the sub-scales; the block's float tail
 * into one of two sums by the block's parity. Same arithmetic as k45_rows512. */
/* One block of k45_row1_vnni256: da (d isum - dmin imin) added to acc. */
ALWAYS_INLINE __m256 k45_block1_vnni256(int q5, const uint8_t *blk, const sw_a256 *a, const __m256i sidx[4], __m256 acc) {
    const __m256i zero = _mm256_setzero_si256();
    const int qs_off = q5 ? 48 : 16;
    uint64_t sc, mn;
    k_scales64(blk + 4, &sc, &mn);
    const __m256i sm = k_sm16(sc, a->m); /* int16 sc[j] m[j] */
    __m256i hk = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : zero;
    __m256i isum = zero;
    for (int k = 0; k < 4; k++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs_off + 32 * k));
        const __m256i q0 = k45_sub_avx2(q5, 2 * k, v, hk), q1 = k45_sub_avx2(q5, 2 * k + 1, v, hk);
        const __m256i d0 = _mm256_dpbusd_epi32(zero, q0, _mm256_loadu_si256((const __m256i *)(a->q + 64 * k)));
        const __m256i d1 = _mm256_dpbusd_epi32(zero, q1, _mm256_loadu_si256((const __m256i *)(a->q + 64 * k + 32)));
        isum = _mm256_dpwssd_epi32(isum, _mm256_packs_epi32(d0, d1), _mm256_shuffle_epi8(sm, sidx[k]));
        if (q5) hk = _mm256_srli_epi16(hk, 2);
    }
    const __m256i imin = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsum), k_pairs16(mn));
    const __m256 vd = _mm256_set1_ps(_cvtsh_ss(k_u16(blk))), vm = _mm256_set1_ps(_cvtsh_ss(k_u16(blk + 2)));
    const __m256 fm = _mm256_mul_ps(_mm256_cvtepi32_ps(imin), vm);
    const __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum), vd, fm);
    return _mm256_fmadd_ps(t, _mm256_set1_ps(a->d), acc);
}

/* One activation row in ymm with VNNI (decode at batch 1). On Zen 4, whose 512-bit
 * operations take two passes, a block's 64 weights a ymm cost fewer passes than the zmm
 * kernels' broadcasts and variable shifts: per 64 weights two vpdpbusd from zero (exact, as
 * above), vpackssdw of the two and one vpdpwssd by the sub-scales; two blocks a step into two
 * sums held in registers. Same arithmetic as k45_rows512. */
ALWAYS_INLINE void k45_row1_vnni256(int q5, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                    const sw_a256 *xa, float *y) {
    const int bytes = q5 ? Q5K_BYTES : Q4K_BYTES;
    __m256i sidx[4]; /* vpackssdw of sub-blocks 2k, 2k + 1 holds per 128-bit lane 4 int16 of each: sc m [2k] x4, [2k+1] x4 */
    for (int k = 0; k < 4; k++) { /* byte indices of int16 elements 2k, 2k + 1 */
        const short lo = (short)((4 * k + 1) << 8 | 4 * k), hi = (short)((4 * k + 3) << 8 | (4 * k + 2));
        const __m128i l = _mm_setr_epi16(lo, lo, lo, lo, hi, hi, hi, hi);
        sidx[k] = _mm256_setr_m128i(l, l);
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= kblocks; b += 2) {
            sw_prefetch_ahead(wr, row_bytes, r, rows, bytes * b, 2 * bytes);
            acc0 = k45_block1_vnni256(q5, wr + bytes * b, xa + b, sidx, acc0);
            acc1 = k45_block1_vnni256(q5, wr + bytes * (b + 1), xa + b + 1, sidx, acc1);
        }
        if (b < kblocks) acc0 = k45_block1_vnni256(q5, wr + bytes * b, xa + b, sidx, acc0);
        y[r] = k_hsum8(_mm256_add_ps(acc0, acc1));
    }
}

/* Q6_K, one activation row in ymm with VNNI: as q6_rows512 a ymm at a time; sub-blocks 2u and
 * 2u + 1 of half hf packed together hold per 128-bit lane c 4 int16 of 16-weight group
 * 8 hf + 4u + c, then 4 of 8 hf + 4u + 2 + c. A block's integer total, then da d total. */
ALWAYS_INLINE void q6_row1_vnni256(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                   const sw_a256 *xa, float *y) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i pidx[4];
    for (int hf = 0; hf < 2; hf++)
        for (int u = 0; u < 2; u++) {
            const short g = (short)(8 * hf + 4 * u);
            pidx[2 * hf + u] = _mm256_setr_m128i(_mm_setr_epi16(g, g, g, g, g + 2, g + 2, g + 2, g + 2),
                                                 _mm_setr_epi16(g + 1, g + 1, g + 1, g + 1, g + 3, g + 3, g + 3, g + 3));
        }
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m128 acc = _mm_setzero_ps();
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = wr + Q6K_BYTES * b;
            sw_prefetch_ahead(wr, row_bytes, r, rows, Q6K_BYTES * b, Q6K_BYTES);
            const sw_a256 *a = xa + b;
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            const __m256i c = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsum), sc16);
            const __m256i sm = q6_sm16(sc16, a); /* int16 sc[g] m16[g] */
            __m256i isum = _mm256_sub_epi32(zero, _mm256_slli_epi32(c, 5)); /* -32 sum_g sc[g] bsum[g] */
            for (int hf = 0; hf < 2; hf++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hf + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hf));
                for (int u = 0; u < 2; u++) {
                    const int8_t *x = a->q + 128 * hf + 64 * u;
                    const __m256i d0 = _mm256_dpbusd_epi32(zero, q6_sub_avx2(2 * u, ql0, ql1, qh),
                                                           _mm256_loadu_si256((const __m256i *)x));
                    const __m256i d1 = _mm256_dpbusd_epi32(zero, q6_sub_avx2(2 * u + 1, ql0, ql1, qh),
                                                           _mm256_loadu_si256((const __m256i *)(x + 32)));
                    isum = _mm256_dpwssd_epi32(isum, _mm256_packs_epi32(d0, d1),
                                               _mm256_permutexvar_epi16(pidx[2 * hf + u], sm));
                }
            }
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            const __m128 f = _mm_mul_ss(_mm_set_ss(a->d), _mm_set_ss(_cvtsh_ss(k_u16(blk + 208))));
            acc = _mm_add_ss(acc, _mm_mul_ss(f, _mm_cvtepi32_ps(t)));
        }
        y[r] = _mm_cvtss_f32(acc);
    }
}

/* Q4_K / Q5_K from k45_tile_rows activation rows: 16 weight rows a zmm, one int32 lane each, as
 * q32.c's Q8_0 tiles. Per block, each pair of sub-blocks (32 bytes of nibbles a row) is
 * transposed in registers into 8 zmm, zmm k holding bytes 4k .. 4k + 3 of every row, and split
 * into the two sub-blocks' weights (low and high nibbles; Q5_K's fifth bits from qh, transposed
 * the same way once a block). Per activation row and sub-block, 8 vpdpbusd with its 4 bytes
 * broadcast give the 16 rows' dots, exact, in two chains of 4 (the latency an activation row
 * waits on halved); times the rows' sub-scales (times the activation's m, vpmullw) into one integer sum a row: Q4_K's chains each
 * fit int16 (16 * 15 * 127), whole in the lane's low half, so one vpdpwssd by (sc, 0) a chain
 * (against packing two chains into a pair for (sc, sc): 3-4% faster at 16 activation rows,
 * docs/benchmarks/kernel_ab_q4k_chains_xeon207.txt); Q5_K's do not,
 * so vpmulld (|dot| <= 32 * 31 * 127, the block's sum inside int32, as the header says). The
 * mins through vpdpwssd of each row's (mn[2j], mn[2j + 1]) with the activation's sums of 32
 * (k_tile_act, once a call for every tile). Then one fp32
 * tail a block for the 16 rows: da (d isum - dmin imin), the portable path's arithmetic. The
 * transposes, the scales and the float work are shared by 16 rows where k45_rows512 pays them
 * per row: about 2.5x fewer instructions at 16 activation rows. The lanes hold the rows in the
 * order 0-3, 8-11, 4-7, 12-15 (the transpose's), the headers are read in that order, and the
 * results put back in order as they are stored. */
/* The fewest activation rows that take the tiles; SHARDWISE_K_TILES=0 in the environment at
 * import turns them off (benchmarks/bench_k_tiles.py compares both in one run). */
static int64_t k45_tile_rows = 3, q6_tile_rows = 6;
enum { K_TILE_ACT = 12 }; /* int32 a block in k_tile_act's table */

/* Byte j of each int32 lane of v (j < 4). */
ALWAYS_INLINE __m512i k_byte32(__m512i v, int j) {
    return j == 3 ? _mm512_srli_epi32(v, 24) : _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xFF));
}

ALWAYS_INLINE void k45_tile16(int q5, int ni, const uint8_t *w, size_t row_bytes, int64_t kblocks, const sw_a256 *xa,
                              const int32_t *sums, int64_t ldx, float *y, int64_t ldy, int ahead) {
    const int bytes = q5 ? Q5K_BYTES : Q4K_BYTES, qs_off = q5 ? 48 : 16;
    const __m512i nib = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    __m512 acc[16];
    for (int i = 0; i < ni; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kblocks; b++) {
        const uint8_t *p = w + bytes * b;
        sw_tile_ahead(p, row_bytes, bytes, b, kblocks, ahead);
        /* headers (d, dmin, 12 bytes of scales: 16 bytes a row): x[k] lane l = dword k of lane l's row */
        __m512i x[4]; /* d | dmin << 16, scale bytes 0-3, 4-7, 8-11 */
        sw_tr16x16(p, row_bytes, x);
        const __m512i m3f = _mm512_set1_epi32(0x3F3F3F3F), m0f = _mm512_set1_epi32(0x0F0F0F0F),
                      m30 = _mm512_set1_epi32(0x30303030);
        const __m512i sc_lo = _mm512_and_si512(x[1], m3f), mn_lo = _mm512_and_si512(x[2], m3f);
        const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(x[3], m0f),
                                              _mm512_and_si512(_mm512_srli_epi32(x[1], 2), m30));
        const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(x[3], 4), m0f),
                                              _mm512_and_si512(_mm512_srli_epi32(x[2], 2), m30));
        const __m512 vd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x[0]));
        const __m512 vdmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x[0], 16)));
        __m512i hk[8];
        if (q5) sw_tr16x32(p + 16, row_bytes, hk);
        __m512i isum[16];
        for (int i = 0; i < ni; i++) isum[i] = _mm512_setzero_si512();
        for (int pr = 0; pr < 4; pr++) { /* sub-blocks 2 pr (low nibbles), 2 pr + 1 (high) */
            __m512i wk[8], lo[8], hi[8];
            sw_tr16x32(p + qs_off + 32 * pr, row_bytes, wk);
            for (int k = 0; k < 8; k++) {
                lo[k] = _mm512_and_si512(wk[k], nib);
                hi[k] = _mm512_and_si512(_mm512_srli_epi16(wk[k], 4), nib);
                if (q5) { /* bit j of qh byte l: weight l of sub-block j's fifth bit */
                    lo[k] = _mm512_mask_add_epi8(lo[k], _mm512_test_epi8_mask(hk[k], _mm512_set1_epi8((char)(1 << 2 * pr))),
                                                 lo[k], b4);
                    hi[k] = _mm512_mask_add_epi8(
                        hi[k], _mm512_test_epi8_mask(hk[k], _mm512_set1_epi8((char)(1 << (2 * pr + 1)))), hi[k], b4);
                }
            }
            /* each row's sc in its lane: as an int16 pair (sc, 0) for vpdpwssd */
            const __m512i s0 = k_byte32(pr < 2 ? sc_lo : sc_hi, (2 * pr) & 3);
            const __m512i s1 = k_byte32(pr < 2 ? sc_lo : sc_hi, (2 * pr + 1) & 3);
            for (int i = 0; i < ni; i++) {
                const int8_t *a = xa[i * ldx + b].q + 64 * pr;
                /* (sc m, 0): times the activation's sub-scales, (m, m) from k_tile_act (sc m <= 63 * 8) */
                const int32_t *mm = sums + K_TILE_ACT * (i * ldx + b) + 4;
                const __m512i s0m = _mm512_mullo_epi16(s0, _mm512_set1_epi32(mm[2 * pr]));
                const __m512i s1m = _mm512_mullo_epi16(s1, _mm512_set1_epi32(mm[2 * pr + 1]));
                /* four chains of 4 (not two of 8): half the latency an activation row waits on */
                __m512i d0[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, d1[2] = {d0[0], d0[0]};
                for (int k = 0; k < 8; k++) {
                    int32_t x0, x1;
                    memcpy(&x0, a + 4 * k, 4);
                    memcpy(&x1, a + 32 + 4 * k, 4);
                    d0[k >> 2] = _mm512_dpbusd_epi32(d0[k >> 2], lo[k], _mm512_set1_epi32(x0));
                    d1[k >> 2] = _mm512_dpbusd_epi32(d1[k >> 2], hi[k], _mm512_set1_epi32(x1));
                }
                if (!q5) { /* Q4_K: each chain's |dot| <= 16 * 15 * 127 < 2^15 sits whole in its lane's low
                            * int16, and vpdpwssd by (sc, 0) scales and adds it: exact, one instruction a chain
                            * (no vpmulld, no packing of two chains into a pair) */
                    isum[i] = _mm512_dpwssd_epi32(isum[i], d0[0], s0m);
                    isum[i] = _mm512_dpwssd_epi32(isum[i], d0[1], s0m);
                    isum[i] = _mm512_dpwssd_epi32(isum[i], d1[0], s1m);
                    isum[i] = _mm512_dpwssd_epi32(isum[i], d1[1], s1m);
                } else { /* Q5_K's dots reach 16 * 31 * 127: int32 */
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(d0[0], d0[1]), s0m),
                                                                         _mm512_mullo_epi32(_mm512_add_epi32(d1[0], d1[1]), s1m)));
                }
            }
        }
        __m512i mw[4]; /* (mn[2j], mn[2j + 1]) as an int16 pair in each row's lane */
        const __m512i lo8 = _mm512_set1_epi32(0xFF), hi8 = _mm512_set1_epi32(0xFF0000);
        for (int j = 0; j < 4; j++) {
            const __m512i m = _mm512_srli_epi32(j < 2 ? mn_lo : mn_hi, 16 * (j & 1));
            mw[j] = _mm512_or_si512(_mm512_and_si512(m, lo8), _mm512_and_si512(_mm512_slli_epi32(m, 8), hi8));
        }
        for (int i = 0; i < ni; i++) {
            const sw_a256 *a = xa + i * ldx + b;
            const int32_t *s32 = sums + K_TILE_ACT * (i * ldx + b); /* (sum of sub-block 2j, of 2j + 1) pairs */
            __m512i imin = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) /* mn[2j] s32[2j] + mn[2j + 1] s32[2j + 1] */
                imin = _mm512_dpwssd_epi32(imin, mw[j], _mm512_set1_epi32(s32[j]));
            const __m512 tt = _mm512_fmsub_ps(_mm512_cvtepi32_ps(isum[i]), vd,
                                              _mm512_mul_ps(_mm512_cvtepi32_ps(imin), vdmin));
            acc[i] = _mm512_fmadd_ps(tt, _mm512_set1_ps(a->d), acc[i]); /* da (d isum - dmin imin) */
        }
    }
    for (int i = 0; i < ni; i++) _mm512_storeu_ps(y + i * ldy, _mm512_shuffle_f32x4(acc[i], acc[i], 0xD8));
}

/* Q6_K from q6_tile_rows activation rows: as k45_tile16. Per half, the 32 bytes of ql at 0 and at
 * 32 and the 32 of qh are transposed (sw_tr16x32); weights t = 0 .. 3 of the half take the low
 * or high nibbles and their two high bits, u8 0..63. Per activation row and 32 weights, 8
 * vpdpbusd: lanes 0-3 of the chain are one 16-weight sub-block, 4-7 the next, each dot times its
 * int8 sub-scale in fp32 (vcvtdq2ps and an fma: each product exact, below 2^24); the -32
 * through vpdpwssd of each row's (sc[g], sc[g + 1]) with bsum's pairs; then da d sum. */
ALWAYS_INLINE void q6_tile16(int ni, const uint8_t *w, size_t row_bytes, int64_t kblocks, const sw_a256 *xa,
                             const int32_t *act, int64_t ldx, float *y, int64_t ldy, int ahead) {
    const __m512i nib = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    __m512 acc[16];
    for (int i = 0; i < ni; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kblocks; b++) {
        const uint8_t *p = w + Q6K_BYTES * b;
        sw_tile_ahead(p, row_bytes, Q6K_BYTES, b, kblocks, ahead);
        __m512i x[4]; /* x[k] lane l: sc[4k .. 4k + 3] of lane l's row */
        sw_tr16x16(p + 192, row_bytes, x);
#define SC(g) _mm512_srai_epi32(_mm512_slli_epi32(x[(g) / 4], 24 - 8 * ((g) % 4)), 24) /* int8 sc[g], sign-extended */
#define D16(r) ((short)k_u16(p + (r) * row_bytes + 208))
        const __m512 vd = _mm512_cvtph_ps(_mm256_setr_epi16(D16(0), D16(1), D16(2), D16(3), D16(8), D16(9), D16(10),
                                                            D16(11), D16(4), D16(5), D16(6), D16(7), D16(12), D16(13),
                                                            D16(14), D16(15)));
#undef D16
        __m512i sp[8];
        __m512 fsum[16]; /* each row's block sum, fp32 (products below exact) */
        for (int g = 0; g < 16; g += 2) /* (sc[g], sc[g + 1]) as an int16 pair in each row's lane */
            sp[g / 2] = _mm512_or_si512(_mm512_and_si512(SC(g), _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(SC(g + 1), 16));
        for (int i = 0; i < ni; i++) { /* -32 sum_g sc[g] bsum[g], by pairs of sub-blocks */
            const sw_a256 *a = xa + i * ldx + b;
            __m512i c = _mm512_setzero_si512();
            for (int g = 0; g < 16; g += 2) {
                int32_t pair;
                memcpy(&pair, a->bsum + g, 4);
                c = _mm512_dpwssd_epi32(c, sp[g / 2], _mm512_set1_epi32(pair));
            }
            fsum[i] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(c, 5)));
        }
        for (int hf = 0; hf < 2; hf++) {
            __m512i l0[8], l1[8], qh[8];
            sw_tr16x32(p + 64 * hf, row_bytes, l0);
            sw_tr16x32(p + 64 * hf + 32, row_bytes, l1);
            sw_tr16x32(p + 128 + 32 * hf, row_bytes, qh);
            for (int tq = 0; tq < 4; tq++) { /* weights 128 hf + 32 tq + l: sub-blocks g, g + 1 */
                const int g = 8 * hf + 2 * tq;
                __m512i wq[8];
                for (int k = 0; k < 8; k++) {
                    const __m512i l = tq & 1 ? l1[k] : l0[k];
                    const __m512i lo = _mm512_and_si512(tq < 2 ? l : _mm512_srli_epi16(l, 4), nib);
                    const __m512i hb = tq == 0   ? _mm512_slli_epi16(qh[k], 4)
                                       : tq == 1 ? _mm512_slli_epi16(qh[k], 2)
                                       : tq == 2 ? qh[k]
                                                 : _mm512_srli_epi16(qh[k], 2);
                    wq[k] = _mm512_or_si512(lo, _mm512_and_si512(hb, hi2));
                }
                const __m512 s0 = _mm512_cvtepi32_ps(SC(g)), s1 = _mm512_cvtepi32_ps(SC(g + 1));
                for (int i = 0; i < ni; i++) {
                    const int8_t *a = xa[i * ldx + b].q + 32 * (g / 2);
                    float m; /* the activation's sub-scale of these 32 weights, as a float (k_tile_act) */
                    memcpy(&m, act + K_TILE_ACT * (i * ldx + b) + 4 + g / 2, 4);
                    __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                    for (int k = 0; k < 4; k++) {
                        int32_t x0, x1;
                        memcpy(&x0, a + 4 * k, 4);
                        memcpy(&x1, a + 16 + 4 * k, 4);
                        d0 = _mm512_dpbusd_epi32(d0, wq[k], _mm512_set1_epi32(x0));
                        d1 = _mm512_dpbusd_epi32(d1, wq[k + 4], _mm512_set1_epi32(x1));
                    }
                    /* sc times the dot in fp32 (vcvtdq2ps and an fma, not vpmulld's two uops and an add):
                     * each product exact (|dot sc| <= 16 * 63 * 127 * 128 < 2^24), then their sum times m */
                    const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), s0, _mm512_mul_ps(_mm512_cvtepi32_ps(d1), s1));
                    fsum[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(m), fsum[i]);
                }
            }
        }
#undef SC
        for (int i = 0; i < ni; i++)
            acc[i] = _mm512_fmadd_ps(fsum[i], _mm512_mul_ps(vd, _mm512_set1_ps(xa[i * ldx + b].d)), acc[i]);
    }
    for (int i = 0; i < ni; i++) _mm512_storeu_ps(y + i * ldy, _mm512_shuffle_f32x4(acc[i], acc[i], 0xD8));
}

/* Per activation block, once a call for every tile, K_TILE_ACT int32: [0, 4) its 8 sums of 32
 * as 4 int16 pairs (Q4_K/Q5_K's mins are per 32 weights: 4 vpdpwssd a block and row, not 8;
 * |m sum| <= 8 * 32 * 127), [4, 12) its sub-scales m[j]: as int16 pairs (m, m) for Q4_K/Q5_K
 * (a broadcast load, then vpmullw), as floats for Q6_K. NULL where the buffer cannot be had. */
static const int32_t *k_tile_act(int fmt, const sw_a256 *xa, int64_t n, int64_t kblocks) {
    int32_t *buf = sw_scratch_i32((size_t)(K_TILE_ACT * n * kblocks));
    if (!buf) return NULL;
    for (int64_t j = 0; j < n * kblocks; j++) {
        int32_t *o = buf + K_TILE_ACT * j;
        for (int p = 0; p < 4; p++) {
            const int16_t *bs = xa[j].bsum + 4 * p;
            const uint32_t lo = (uint16_t)(bs[0] + bs[1]), hi = (uint16_t)(bs[2] + bs[3]);
            o[p] = (int32_t)(lo | hi << 16);
        }
        for (int k = 0; k < 8; k++) {
            const int32_t m = xa[j].m[k];
            const float f = (float)m;
            if (fmt == 6) memcpy(o + 4 + k, &f, 4);
            else o[4 + k] = m | m << 16;
        }
    }
    return buf;
}

/* rows: a multiple of 16; activation rows in runs of up to 16, each run over every tile. */
ALWAYS_INLINE void k_tiles16(int fmt, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                               const sw_a256 *xa, int64_t n, float *y, int64_t ldy) {
    const int32_t *sums = k_tile_act(fmt, xa, n, kblocks);
    if (!sums) { /* out of memory for the table: the row kernels need none */
        for (int64_t i = 0; i < n; i++) {
            if (fmt == 6) q6_rows512(1, w, row_bytes, rows, kblocks, xa + i * kblocks, y + i * ldy, ldy);
            else k45_rows512(fmt == 5, 1, w, row_bytes, rows, kblocks, xa + i * kblocks, y + i * ldy, ldy);
        }
        return;
    }
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int ni = n - i0 < 16 ? (int)(n - i0) : 16;
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const uint8_t *wt = w + r0 * row_bytes;
            const int ahead = r0 + 16 < rows;
            const sw_a256 *xi = xa + i0 * kblocks;
            const int32_t *si = sums + K_TILE_ACT * i0 * kblocks;
            float *yi = y + i0 * ldy + r0;
            switch (ni) {
#define T16(k) \
    case k:                                                                          \
        if (fmt == 6) q6_tile16(k, wt, row_bytes, kblocks, xi, si, kblocks, yi, ldy, ahead); \
        else k45_tile16(fmt == 5, k, wt, row_bytes, kblocks, xi, si, kblocks, yi, ldy, ahead); \
        break;
                T16(1) T16(2) T16(3) T16(4) T16(5) T16(6) T16(7) T16(8)
                T16(9) T16(10) T16(11) T16(12) T16(13) T16(14) T16(15) T16(16)
#undef T16
            }
        }
    }
}

ALWAYS_INLINE void gemm_k_avx512(int fmt, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                 const void *x, int64_t n, float *y, int64_t ldy) {
    const sw_a256 *xa = (const sw_a256 *)x;
    if (n == 1) { /* one row: a ymm at a time (k45_row1_vnni256) */
        if (fmt == 6) q6_row1_vnni256(w, row_bytes, rows, kblocks, xa, y);
        else k45_row1_vnni256(fmt == 5, w, row_bytes, rows, kblocks, xa, y);
        return;
    }
    if (n >= (fmt == 6 ? q6_tile_rows : k45_tile_rows) && rows >= 16) { /* 16 weight rows a zmm; the last rows % 16 below */
        const int64_t body = rows & ~(int64_t)15;
        k_tiles16(fmt, w, row_bytes, body, kblocks, xa, n, y, ldy);
        w += body * row_bytes;
        y += body;
        rows -= body;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += K_TILE) {
        const int64_t nr = rows - r0 < K_TILE ? rows - r0 : K_TILE;
        const uint8_t *wt = w + r0 * row_bytes;
        for (int64_t i0 = 0; i0 < n;) {
            const int64_t left = n - i0;
            const int ni = left >= 8 ? 8 : left >= 4 ? 4 : (int)left;
            const sw_a256 *xi = xa + i0 * kblocks;
            float *yi = y + i0 * ldy + r0;
#define K_RUN(k)                                                                                \
    (fmt == 6 ? q6_rows512(k, wt, row_bytes, nr, kblocks, xi, yi, ldy)                          \
              : k45_rows512(fmt == 5, k, wt, row_bytes, nr, kblocks, xi, yi, ldy))
            if (ni == 8) K_RUN(8);
            else if (ni == 4) K_RUN(4);
            else if (ni == 3) K_RUN(3);
            else if (ni == 2) K_RUN(2);
            else K_RUN(1);
#undef K_RUN
            i0 += ni;
        }
    }
}

#pragma GCC pop_options

/* ---------------------------------------------------------------- the tables */

#define K_GEMM_ARGS \
    const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x, int64_t n, float *y, int64_t ldy
#define K_DEQ_ARGS const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out
#define K_AVX2 __attribute__((target("avx2,fma,f16c")))
#define K_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

K_AVX2 static void gemm_q4_k_avx2(K_GEMM_ARGS) { gemm_k_avx2(4, w, row_bytes, rows, kblocks, x, n, y, ldy); }
K_AVX2 static void gemm_q5_k_avx2(K_GEMM_ARGS) { gemm_k_avx2(5, w, row_bytes, rows, kblocks, x, n, y, ldy); }
K_AVX2 static void gemm_q6_k_avx2(K_GEMM_ARGS) { gemm_k_avx2(6, w, row_bytes, rows, kblocks, x, n, y, ldy); }
K_AVX512 static void gemm_q4_k_avx512(K_GEMM_ARGS) { gemm_k_avx512(4, w, row_bytes, rows, kblocks, x, n, y, ldy); }
K_AVX512 static void gemm_q5_k_avx512(K_GEMM_ARGS) { gemm_k_avx512(5, w, row_bytes, rows, kblocks, x, n, y, ldy); }
K_AVX512 static void gemm_q6_k_avx512(K_GEMM_ARGS) { gemm_k_avx512(6, w, row_bytes, rows, kblocks, x, n, y, ldy); }
/* AVX-512 dequantizes with the AVX2 code: the table's fallback to the next ISA down. */
K_AVX2 static void dequant_q4_k_avx2(K_DEQ_ARGS) { dequant_k45_avx2(0, w, row_bytes, rows, kblocks, out); }
K_AVX2 static void dequant_q5_k_avx2(K_DEQ_ARGS) { dequant_k45_avx2(1, w, row_bytes, rows, kblocks, out); }
K_AVX2 static void dequant_q6_k_avx2(K_DEQ_ARGS) { dequant_q6_avx2(w, row_bytes, rows, kblocks, out); }

void sw_register_qk(void) {
    const char *tiles = getenv("SHARDWISE_K_TILES");
    if (tiles && tiles[0] == '0') k45_tile_rows = q6_tile_rows = INT64_MAX;
    sw_gemm_table[SW_Q4_K][SW_ISA_PORTABLE] = gemm_q4_k_portable;
    sw_gemm_table[SW_Q5_K][SW_ISA_PORTABLE] = gemm_q5_k_portable;
    sw_gemm_table[SW_Q6_K][SW_ISA_PORTABLE] = gemm_q6_k_portable;
    sw_gemm_table[SW_Q4_K][SW_ISA_AVX2] = gemm_q4_k_avx2;
    sw_gemm_table[SW_Q5_K][SW_ISA_AVX2] = gemm_q5_k_avx2;
    sw_gemm_table[SW_Q6_K][SW_ISA_AVX2] = gemm_q6_k_avx2;
    sw_gemm_table[SW_Q4_K][SW_ISA_AVX512] = gemm_q4_k_avx512;
    sw_gemm_table[SW_Q5_K][SW_ISA_AVX512] = gemm_q5_k_avx512;
    sw_gemm_table[SW_Q6_K][SW_ISA_AVX512] = gemm_q6_k_avx512;
    sw_dequant_table[SW_Q4_K][SW_ISA_PORTABLE] = dequant_q4_k_portable;
    sw_dequant_table[SW_Q5_K][SW_ISA_PORTABLE] = dequant_q5_k_portable;
    sw_dequant_table[SW_Q6_K][SW_ISA_PORTABLE] = dequant_q6_k_portable;
    sw_dequant_table[SW_Q4_K][SW_ISA_AVX2] = dequant_q4_k_avx2;
    sw_dequant_table[SW_Q5_K][SW_ISA_AVX2] = dequant_q5_k_avx2;
    sw_dequant_table[SW_Q6_K][SW_ISA_AVX2] = dequant_q6_k_avx2;
}
