/* The 32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) against sw_a32 activations.
 *
 * Block layouts (little-endian; d and m are fp16), 32 weights each:
 *   Q8_0  34 bytes: d, q[32] int8                          w_j = d * q_j
 *   Q4_0  18 bytes: d, qs[16]                              w_j = d * (q_j - 8)
 *   Q4_1  20 bytes: d, m, qs[16]                           w_j = d * q_j + m
 *   Q5_0  22 bytes: d, qh[4], qs[16]                       w_j = d * (q_j - 16)
 *   Q5_1  24 bytes: d, m, qh[4], qs[16]                    w_j = d * q_j + m
 * Nibbles: byte j of qs holds q_j (low 4 bits) and q_{j+16} (high 4 bits); Q5_*: bit j of
 * the little-endian word qh is bit 4 of q_j.
 *
 * One block of a weight row against one activation block (x_j = dx * a_j, s = dx * sum(a)):
 *   sum_j w_j x_j = d * dx * sum_j q'_j a_j  +  m * s
 * with q' the signed weights (Q8_0: q; Q4_0: q - 8; Q5_0: q - 16) and m = 0 for those, or
 * q' = q and the block's m for Q4_1 / Q5_1. The integer sum is exact; the float scaling
 * is once per block.
 *
 * Variants (all registered into sw_gemm_table / sw_dequant_table):
 *   portable  plain C, one block at a time.
 *   avx2      a block is one ymm of 32 bytes in weight order; signed weights by the
 *             sign trick (|q'| as u8 times the activation with q's sign), maddubs + madd.
 *   avx512    8 blocks at a time: the activation rows are first repacked (once per call)
 *             so that zmm t holds bytes 8t .. 8t + 7 of 8 blocks, the order 8 blocks of
 *             nibbles unpack to (Q8_0's bytes by a qword transpose); vpdpbusd on unsigned
 *             weights (Q8_0: q + 128) with the offset's correction (-offset * sum(a)) as the
 *             accumulator's start; each 32-bit lane pair holds one block, so a group of 8
 *             blocks costs 4 vpdpbusd and one float scale-and-add per activation row.
 * Batched rows (n > 1): each weight block is decoded into registers once per group of up to
 * 8 (avx512, two weight rows at a time) or 4 (avx2) activation rows and used for all of them.
 */
#include <immintrin.h>
#include <stdlib.h>

#include "sw.h"
#include "tile16.h"

/* Format ids for the generic kernels below (compile-time constants after inlining). */
enum { F_Q8_0, F_Q4_0, F_Q4_1, F_Q5_0, F_Q5_1 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE int fmt_bytes(int f) { return f == F_Q8_0 ? 34 : f == F_Q4_0 ? 18 : f == F_Q4_1 ? 20 : f == F_Q5_0 ? 22 : 24; }
ALWAYS_INLINE int fmt_has_min(int f) { return f == F_Q4_1 || f == F_Q5_1; }
/* What q' = q - offset subtracts (Q8_0's 128 is the avx512 path's u8 bias, not the format's). */
ALWAYS_INLINE int fmt_offset(int f) { return f == F_Q4_0 ? 8 : f == F_Q5_0 ? 16 : 0; }
/* Where qs (the nibbles) start, and qh (Q5_*). */
ALWAYS_INLINE int fmt_qs(int f) { return f == F_Q4_0 ? 2 : f == F_Q4_1 ? 4 : f == F_Q5_0 ? 6 : 8; }
ALWAYS_INLINE int fmt_qh(int f) { return f == F_Q5_0 ? 2 : 4; }

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ---------------------------------------------------------------- portable */

/* One block -> q'[32] and (d, m) with w_j = d * q'_j + m. */
ALWAYS_INLINE void decode_block(int f, const uint8_t *b, int q[32], float *d, float *m) {
    *d = sw_load_fp16(b);
    *m = fmt_has_min(f) ? sw_load_fp16(b + 2) : 0.0f;
    if (f == F_Q8_0) {
        for (int j = 0; j < 32; j++) q[j] = (int8_t)b[2 + j];
        return;
    }
    const uint8_t *qs = b + fmt_qs(f);
    uint32_t qh = (f == F_Q5_0 || f == F_Q5_1) ? load_u32(b + fmt_qh(f)) : 0;
    int off = fmt_offset(f);
    for (int j = 0; j < 16; j++) {
        q[j] = (int)((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - off;
        q[j + 16] = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off;
    }
}

/* sum_j w_j x_j of one weight block and one activation block. */
ALWAYS_INLINE float block_dot(int f, const uint8_t *b, const sw_a32 *x) {
    int q[32], dot = 0;
    float d, m;
    decode_block(f, b, q, &d, &m);
    for (int j = 0; j < 32; j++) dot += q[j] * x->q[j];
    float r = d * x->d * (float)dot;
    return fmt_has_min(f) ? r + m * x->s : r;
}

/* y[i * ldy + r] = sum_b block_dot(W[r, b], X[i, b]): W rows row_bytes apart, X (n, kblocks). */
ALWAYS_INLINE void gemm_portable(int f, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                 const void *x, int64_t n, float *y, int64_t ldy) {
    const sw_a32 *xa = (const sw_a32 *)x;
    const int bs = fmt_bytes(f);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        for (int64_t i = 0; i < n; i++) {
            const sw_a32 *xb = xa + i * kblocks;
            float acc = 0.0f;
            for (int64_t b = 0; b < kblocks; b++) acc += block_dot(f, wr + bs * b, xb + b);
            y[i * ldy + r] = acc;
        }
    }
}

/* out (rows, 32 * kblocks) fp32, row-major. */
ALWAYS_INLINE void dequant_portable(int f, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                    float *out) {
    const int bs = fmt_bytes(f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kblocks; b++) {
            int q[32];
            float d, m, *o = out + (r * kblocks + b) * 32;
            decode_block(f, w + r * row_bytes + bs * b, q, &d, &m);
            for (int j = 0; j < 32; j++) o[j] = fmt_has_min(f) ? d * (float)q[j] + m : d * (float)q[j];
        }
}

/* ---------------------------------------------------------------- AVX2 */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* One block -> 32 bytes in weight order: signed q' (Q8_0 / Q4_0 / Q5_0) or unsigned q (Q4_1 / Q5_1). */
ALWAYS_INLINE __m256i decode_avx2(int f, const uint8_t *b) {
    if (f == F_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    __m128i qs = _mm_loadu_si128((const __m128i *)(b + fmt_qs(f)));
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
    if (f == F_Q5_0 || f == F_Q5_1) {
        /* bit j of qh -> byte j: byte k of qh spread over bytes 8k .. 8k + 7, then one bit each */
        __m256i h = _mm256_set1_epi32((int)load_u32(b + fmt_qh(f)));
        h = _mm256_shuffle_epi8(h, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                                    2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
        h = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    }
    int off = fmt_offset(f);
    return off ? _mm256_sub_epi8(v, _mm256_set1_epi8((char)off)) : v;
}

static inline float hsum8_avx2(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* ni (<= 4) activation rows from i0 against every weight row. */
ALWAYS_INLINE void rows_avx2(int f, int ni, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                             const sw_a32 *xa, float *y, int64_t ldy) {
    const int bs = fmt_bytes(f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m256 acc[4];
        float ms[4];
        for (int i = 0; i < ni; i++) acc[i] = _mm256_setzero_ps(), ms[i] = 0.0f;
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = wr + bs * b;
            sw_prefetch_ahead(wr, row_bytes, r, rows, bs * b, bs);
            __m256i v = decode_avx2(f, blk), u = fmt_has_min(f) ? v : _mm256_sign_epi8(v, v); /* u = |q'| */
            __m256 dw = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
            float m = fmt_has_min(f) ? _cvtsh_ss(load_u16(blk + 2)) : 0.0f;
            for (int i = 0; i < ni; i++) {
                const sw_a32 *xb = xa + i * kblocks + b;
                __m256i a = _mm256_loadu_si256((const __m256i *)xb->q);
                if (!fmt_has_min(f)) a = _mm256_sign_epi8(a, v); /* a * sign(q') */
                __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_broadcast_ss(&xb->d)), acc[i]);
                if (fmt_has_min(f)) ms[i] += m * xb->s;
            }
        }
        for (int i = 0; i < ni; i++) y[i * ldy + r] = hsum8_avx2(acc[i]) + ms[i];
    }
}

ALWAYS_INLINE void gemm_avx2(int f, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x,
                             int64_t n, float *y, int64_t ldy) {
    const sw_a32 *xa = (const sw_a32 *)x;
    for (int64_t i0 = 0; i0 < n;) {
        int64_t left = n - i0;
        const sw_a32 *xi = xa + i0 * kblocks;
        float *yi = y + i0 * ldy;
        if (left >= 4) rows_avx2(f, 4, w, row_bytes, rows, kblocks, xi, yi, ldy), i0 += 4;
        else if (left == 3) rows_avx2(f, 3, w, row_bytes, rows, kblocks, xi, yi, ldy), i0 += 3;
        else if (left == 2) rows_avx2(f, 2, w, row_bytes, rows, kblocks, xi, yi, ldy), i0 += 2;
        else rows_avx2(f, 1, w, row_bytes, rows, kblocks, xi, yi, ldy), i0 += 1;
    }
}

ALWAYS_INLINE void dequant_avx2(int f, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out) {
    const int bs = fmt_bytes(f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + bs * b;
            float *o = out + (r * kblocks + b) * 32;
            __m256i v = decode_avx2(f, blk);
            __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
            __m256 m = _mm256_set1_ps(fmt_has_min(f) ? _cvtsh_ss(load_u16(blk + 2)) : 0.0f);
            __m128i h[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
            for (int k = 0; k < 4; k++) {
                __m128i part = k & 1 ? _mm_srli_si128(h[k >> 1], 8) : h[k >> 1];
                __m256i q = fmt_has_min(f) ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part);
                __m256 fq = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
                _mm256_storeu_ps(o + 8 * k, fmt_has_min(f) ? _mm256_add_ps(fq, m) : fq);
            }
        }
}

#pragma GCC pop_options

/* ---------------------------------------------------------------- AVX-512 VNNI */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

/* The u8 bias the weights carry into vpdpbusd: Q8_0's q + 128, Q4_0's q, Q5_0's q. */
ALWAYS_INLINE int fmt_bias512(int f) { return f == F_Q8_0 ? 128 : fmt_offset(f); }

/* Every format takes 8 blocks at a time: 4 zmm of weights hold bytes 8t .. 8t + 7 of each of
 * 8 blocks (t = 0..3), so each 32-bit lane holds one of 2 lanes of one block, and 8 blocks
 * cost 4 vpdpbusd and one float scale-and-add per activation row. A last group of fewer
 * than 8 blocks is padded: zero activations (and zero dx, correction, s), against block 0's
 * weights read again. */
typedef struct {
    int8_t q[4][64]; /* q[t][8j .. 8j + 7] = a[8t .. 8t + 7] of block j */
    float dx[16];    /* block j's dx in lanes 2j, 2j + 1 */
    union {
        int32_t corr[16]; /* Q8_0 / Q4_0 / Q5_0: -bias * (the sum of the 16 a's lane l takes) */
        float s[16];      /* Q4_1 / Q5_1: s in lane 2j, 0 in 2j + 1 */
    };
} xg8; /* 384 bytes */

static const xg8 *repack8(int f, const sw_a32 *xa, int64_t n, int64_t kblocks) {
    static __thread xg8 *buf;
    static __thread size_t cap;
    int64_t ng = (kblocks + 7) / 8;
    size_t need = (size_t)(n * ng);
    if (need > cap) {
        free(buf);
        cap = need + need / 2 + 16;
        buf = aligned_alloc(64, cap * sizeof(xg8));
        if (!buf) {
            cap = 0;
            return NULL;
        }
    }
    const int bias = fmt_bias512(f);
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < ng; g++) {
            xg8 *o = buf + i * ng + g;
            memset(o, 0, sizeof *o);
            for (int j = 0; j < 8 && 8 * g + j < kblocks; j++) {
                const sw_a32 *xb = xa + i * kblocks + 8 * g + j;
                for (int t = 0; t < 4; t++) memcpy(o->q[t] + 8 * j, xb->q + 8 * t, 8);
                for (int h = 0; h < 2; h++) {
                    int sum = 0; /* lane 2j + h: a[8t + 4h .. 8t + 4h + 3], t = 0..3 */
                    for (int t = 0; t < 4; t++)
                        for (int u = 0; u < 4; u++) sum += xb->q[8 * t + 4 * h + u];
                    o->dx[2 * j + h] = xb->d;
                    if (!fmt_has_min(f)) o->corr[2 * j + h] = -bias * sum;
                }
                if (fmt_has_min(f)) o->s[2 * j] = xb->s;
            }
        }
    return buf;
}

/* The nibble formats' 8 blocks -> w[t] (bytes 8t .. 8t + 7 of each block, u8). */
ALWAYS_INLINE void decode8_nibbles(int f, const uint8_t *const b[8], __m512i w[4]) {
    const int qs = fmt_qs(f);
    __m512i z1 = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b[0] + qs)));
    __m512i z2 = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b[4] + qs)));
    for (int j = 1; j < 4; j++) {
        z1 = _mm512_inserti32x4(z1, _mm_loadu_si128((const __m128i *)(b[j] + qs)), j);
        z2 = _mm512_inserti32x4(z2, _mm_loadu_si128((const __m128i *)(b[4 + j] + qs)), j);
    }
    /* qword 2j of z: qs[0..7] of block j (weights 0-7 low, 16-23 high); 2j + 1: qs[8..15] */
    __m512i pe = _mm512_permutex2var_epi64(z1, _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), z2);
    __m512i po = _mm512_permutex2var_epi64(z1, _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15), z2);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    w[0] = _mm512_and_si512(pe, nib);
    w[1] = _mm512_and_si512(po, nib);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(pe, 4), nib);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(po, 4), nib);
    if (f == F_Q5_0 || f == F_Q5_1) {
        const int qh = fmt_qh(f);
        __m256i h = _mm256_setr_epi32((int)load_u32(b[0] + qh), (int)load_u32(b[1] + qh), (int)load_u32(b[2] + qh),
                                      (int)load_u32(b[3] + qh), (int)load_u32(b[4] + qh), (int)load_u32(b[5] + qh),
                                      (int)load_u32(b[6] + qh), (int)load_u32(b[7] + qh));
        /* byte transpose: qword t = byte t of each block's qh = the 5th bits of w[t] */
        h = _mm256_shuffle_epi8(h, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1,
                                                     5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
        h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        __m128i h01 = _mm256_castsi256_si128(h), h23 = _mm256_extracti128_si256(h, 1);
        const __m512i b4 = _mm512_set1_epi8(0x10);
        w[0] = _mm512_mask_add_epi8(w[0], _cvtu64_mask64((uint64_t)_mm_cvtsi128_si64(h01)), w[0], b4);
        w[1] = _mm512_mask_add_epi8(w[1], _cvtu64_mask64((uint64_t)_mm_extract_epi64(h01, 1)), w[1], b4);
        w[2] = _mm512_mask_add_epi8(w[2], _cvtu64_mask64((uint64_t)_mm_cvtsi128_si64(h23)), w[2], b4);
        w[3] = _mm512_mask_add_epi8(w[3], _cvtu64_mask64((uint64_t)_mm_extract_epi64(h23, 1)), w[3], b4);
    }
}

/* 8 blocks at b[0..7] -> w[t] (bytes 8t .. 8t + 7 of each block, u8), d (and m) per lane pair. */
ALWAYS_INLINE void decode8(int f, const uint8_t *const b[8], __m512i w[4], __m512 *dv, __m512 *mv) {
    if (f == F_Q8_0) { /* a qword transpose: zmm p holds blocks 2p, 2p + 1; w[t] takes qword t of each */
        __m512i z[4];
        for (int p = 0; p < 4; p++)
            z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b[2 * p] + 2))),
                                      _mm256_loadu_si256((const __m256i *)(b[2 * p + 1] + 2)), 1);
        const __m512i flip = _mm512_set1_epi8((char)0x80); /* q + 128: u8 */
        for (int t = 0; t < 4; t++) {
            const __m512i lo = _mm512_setr_epi64(t, 4 + t, 8 + t, 12 + t, 0, 0, 0, 0);
            const __m512i hi = _mm512_setr_epi64(0, 0, 0, 0, t, 4 + t, 8 + t, 12 + t);
            const __m512i q = _mm512_mask_blend_epi64(0xF0, _mm512_permutex2var_epi64(z[0], lo, z[1]),
                                                      _mm512_permutex2var_epi64(z[2], hi, z[3]));
            w[t] = _mm512_xor_si512(q, flip);
        }
    } else {
        decode8_nibbles(f, b, w);
    }
    const __m512i idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m128i d = _mm_setr_epi16((short)load_u16(b[0]), (short)load_u16(b[1]), (short)load_u16(b[2]),
                               (short)load_u16(b[3]), (short)load_u16(b[4]), (short)load_u16(b[5]),
                               (short)load_u16(b[6]), (short)load_u16(b[7]));
    *dv = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_cvtph_ps(d)));
    if (fmt_has_min(f)) {
        __m128i m = _mm_setr_epi16((short)load_u16(b[0] + 2), (short)load_u16(b[1] + 2), (short)load_u16(b[2] + 2),
                                   (short)load_u16(b[3] + 2), (short)load_u16(b[4] + 2), (short)load_u16(b[5] + 2),
                                   (short)load_u16(b[6] + 2), (short)load_u16(b[7] + 2));
        *mv = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_cvtph_ps(m)));
    } else {
        *mv = _mm512_setzero_ps();
    }
}


/* Group g of row wr: its 8 block pointers (a last partial group repeats block 0). */
ALWAYS_INLINE void group8(int f, const uint8_t *wr, int64_t g, int64_t kblocks, const uint8_t *b[8]) {
    const int bs = fmt_bytes(f);
    for (int j = 0; j < 8; j++) b[j] = wr + bs * (8 * g + j < kblocks ? 8 * g + j : 0);
}

/* nr (1 or 2) weight rows at a time, against ni (<= 8) activation rows (their groups xg):
 * each activation group is loaded once for the nr rows, each weight group decoded once for
 * the ni rows. rows: a multiple of nr. */
ALWAYS_INLINE void rows8(int f, int nr, int ni, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                         const xg8 *xg, float *y, int64_t ldy) {
    const int bs = fmt_bytes(f);
    const int64_t ng = (kblocks + 7) / 8, full = kblocks / 8;
    for (int64_t r = 0; r < rows; r += nr) {
        const uint8_t *wr = w + r * row_bytes;
        __m512 acc[2][8];
        for (int k = 0; k < nr; k++)
            for (int i = 0; i < ni; i++) acc[k][i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            __m512i wq[2][4];
            __m512 dv[2], mv[2];
            if (r + nr < rows) /* the next rows' same group, a row-pair ahead: DRAM keeps up */
                for (int k = 0; k < nr; k++) {
                    const char *ahead = (const char *)(wr + (nr + k) * row_bytes + bs * 8 * g);
                    for (int l = 0; l < 8 * bs; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
                }
            for (int k = 0; k < nr; k++) {
                const uint8_t *b[8];
                if (g < full)
                    for (int j = 0; j < 8; j++) b[j] = wr + k * row_bytes + bs * (8 * g + j);
                else group8(f, wr + k * row_bytes, g, kblocks, b);
                decode8(f, b, wq[k], &dv[k], &mv[k]);
            }
            for (int i = 0; i < ni; i++) {
                const xg8 *p = xg + i * ng + g;
                const __m512 dx = _mm512_load_ps(p->dx);
                const __m512i c = fmt_has_min(f) ? _mm512_setzero_si512() : _mm512_load_si512(p->corr);
                for (int k = 0; k < nr; k++) {
                    __m512i t = _mm512_dpbusd_epi32(c, wq[k][0], _mm512_load_si512(p->q[0]));
                    t = _mm512_dpbusd_epi32(t, wq[k][1], _mm512_load_si512(p->q[1]));
                    t = _mm512_dpbusd_epi32(t, wq[k][2], _mm512_load_si512(p->q[2]));
                    t = _mm512_dpbusd_epi32(t, wq[k][3], _mm512_load_si512(p->q[3]));
                    acc[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv[k], dx), acc[k][i]);
                    if (fmt_has_min(f)) acc[k][i] = _mm512_fmadd_ps(mv[k], _mm512_load_ps(p->s), acc[k][i]);
                }
            }
        }
        for (int k = 0; k < nr; k++)
            for (int i = 0; i < ni; i++) y[i * ldy + r + k] = _mm512_reduce_add_ps(acc[k][i]);
    }
}

/* One Q8_0 block against one activation block: acc += float(|q| . sign(q) qa) dw dx. */
ALWAYS_INLINE __m256 q8_block256(const uint8_t *blk, const sw_a32 *xb, __m256 acc) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2)), u = _mm256_abs_epi8(q);
    const __m256i a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->q), q);
    const __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(_cvtsh_ss(load_u16(blk)) * xb->d), acc);
}

/* Q8_0, ni (<= 2) activation rows against every weight row, one block at a time in ymm, as
 * rows_avx2 with one vpdpbusd of |q| by sign(q) qa for its vpmaddubsw and vpmaddwd: exact in
 * int32 (no int16 pair saturates), then acc += dot * (dw dx) in the row's 8 fp32 lanes. A row
 * streams through once, in order. On Zen 4, whose 512-bit operations take two passes, rows8's
 * 8-block transposes cost more than a block read from memory: this streams Q8_0 beyond the
 * cache at twice rows8's speed for one row, 1.4x for two (the nibble formats gain nothing:
 * docs/benchmarks/native-kernels.md, "Q8_0 one row at a time"). */
ALWAYS_INLINE void rows_q8_vnni256(int ni, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                   const sw_a32 *xa, float *y, int64_t ldy) {
    const int bs = fmt_bytes(F_Q8_0);
    if (ni == 1) { /* four blocks a step into four sums: the adds' latency off the path */
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *wr = w + r * row_bytes;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            int64_t b = 0;
            for (; b + 4 <= kblocks; b += 4) {
                sw_prefetch_ahead(wr, row_bytes, r, rows, bs * b, 4 * bs);
                for (int k = 0; k < 4; k++) acc[k] = q8_block256(wr + bs * (b + k), xa + b + k, acc[k]);
            }
            for (; b < kblocks; b++) acc[0] = q8_block256(wr + bs * b, xa + b, acc[0]);
            y[r] = hsum8_avx2(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = wr + bs * b;
            sw_prefetch_ahead(wr, row_bytes, r, rows, bs * b, bs);
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2)), u = _mm256_abs_epi8(q); /* u8 |q| */
            const float dw = _cvtsh_ss(load_u16(blk));
            for (int i = 0; i < ni; i++) {
                const sw_a32 *xb = xa + i * kblocks + b;
                const __m256i a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->q), q);
                const __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(dw * xb->d), acc[i]);
            }
        }
        for (int i = 0; i < ni; i++) y[i * ldy + r] = hsum8_avx2(acc[i]);
    }
}

/* Q8_0 at 8 or more activation rows: 16 weight rows a zmm, one int32 lane each. Per block the
 * 16 rows' 32 bytes are transposed in registers into 8 zmm, zmm k holding bytes 4k .. 4k + 3
 * of every row, made unsigned (w + 128); then per activation row one vpdpbusd per k with its
 * 4 bytes broadcast from memory: 16 rows x 4 products an instruction, the transpose's cost
 * shared by up to 16 activation rows. The +128 is taken back through the activation block's
 * sum (the lanes start at -128 sum(x), exact in int32); then acc += float(lane) * dw dx, one
 * rounding a block as the other paths. The lanes hold the rows in the order 0-3, 8-11, 4-7,
 * 12-15 (what the last shuffle of the transpose leaves), put back in order as they are stored. */
/* From 8 activation rows: at 4 the tiles gained 5-10% over rows8 (streaming, Zen 4), and on
 * the real SmolLM2-135M the batched greedy check (4 prompts, 8 tokens against fp32) came out
 * 2 of 4 with them at 4 rows, 4 of 4 from 8 (3 of 4 on the avx2 path): correct kernels that
 * sum in another order move that model's logits by about 0.17 rms through the activations'
 * 8-bit rounding, which decides its near ties (docs/benchmarks/native-kernels.md). */
enum { Q8_TILE_ROWS = 8 };

static const int32_t *q8_corr(const sw_a32 *xa, int64_t n, int64_t kblocks) {
    int32_t *buf = sw_scratch_i32((size_t)(n * kblocks));
    if (!buf) return NULL;
    for (int64_t j = 0; j < n * kblocks; j++) {
        int sum = 0;
        for (int t = 0; t < 32; t++) sum += xa[j].q[t];
        buf[j] = -128 * sum;
    }
    return buf;
}

ALWAYS_INLINE void q8_tile16(int ni, const uint8_t *w, size_t row_bytes, int64_t kblocks, const sw_a32 *xa,
                             const int32_t *corr, int64_t ldx, float *y, int64_t ldy) {
    const int bs = fmt_bytes(F_Q8_0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[16];
    for (int i = 0; i < ni; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kblocks; b++) {
        const uint8_t *p = w + bs * b;
        __m512i wk[8];
        sw_tr16x32(p + 2, row_bytes, wk);
        for (int k = 0; k < 8; k++) wk[k] = _mm512_xor_si512(wk[k], flip); /* +128: u8 */
#define D16(r) ((short)load_u16(p + (r) * row_bytes))
        const __m512 dw = _mm512_cvtph_ps(_mm256_setr_epi16(D16(0), D16(1), D16(2), D16(3), D16(8), D16(9), D16(10),
                                                            D16(11), D16(4), D16(5), D16(6), D16(7), D16(12), D16(13),
                                                            D16(14), D16(15)));
#undef D16
        for (int i = 0; i < ni; i++) {
            const sw_a32 *xb = xa + i * ldx + b;
            __m512i s[2] = {_mm512_set1_epi32(corr[i * ldx + b]), _mm512_setzero_si512()}; /* two chains: half the latency */
            for (int k = 0; k < 8; k++) {
                int32_t x4;
                memcpy(&x4, xb->q + 4 * k, 4);
                s[k & 1] = _mm512_dpbusd_epi32(s[k & 1], wk[k], _mm512_set1_epi32(x4));
            }
            const __m512i st = _mm512_add_epi32(s[0], s[1]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(st), _mm512_mul_ps(dw, _mm512_set1_ps(xb->d)), acc[i]);
        }
    }
    for (int i = 0; i < ni; i++) _mm512_storeu_ps(y + i * ldy, _mm512_shuffle_f32x4(acc[i], acc[i], 0xD8));
}

/* rows: a multiple of 16; activation rows in runs of up to 16, each run over every tile. */
ALWAYS_INLINE void q8_tiles16(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const sw_a32 *xa,
                              const int32_t *corr, int64_t n, float *y, int64_t ldy) {
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int ni = n - i0 < 16 ? (int)(n - i0) : 16;
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const uint8_t *wt = w + r0 * row_bytes;
            const sw_a32 *xi = xa + i0 * kblocks;
            const int32_t *ci = corr + i0 * kblocks;
            float *yi = y + i0 * ldy + r0;
            switch (ni) {
#define T16(k) \
    case k: q8_tile16(k, wt, row_bytes, kblocks, xi, ci, kblocks, yi, ldy); break;
                T16(1) T16(2) T16(3) T16(4) T16(5) T16(6) T16(7) T16(8)
                T16(9) T16(10) T16(11) T16(12) T16(13) T16(14) T16(15) T16(16)
#undef T16
            }
        }
    }
}

ALWAYS_INLINE void gemm8_avx512(int f, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                const void *x, int64_t n, float *y, int64_t ldy) {
    const sw_a32 *xa = (const sw_a32 *)x;
    if (n <= 0 || rows <= 0) return;
    if (f == F_Q8_0 && n <= 2) { /* one or two rows: a block at a time (rows_q8_vnni256) */
        if (n == 2) rows_q8_vnni256(2, w, row_bytes, rows, kblocks, xa, y, ldy);
        else rows_q8_vnni256(1, w, row_bytes, rows, kblocks, xa, y, ldy);
        return;
    }
    const int32_t *corr = f == F_Q8_0 && n >= Q8_TILE_ROWS && rows >= 16 ? q8_corr(xa, n, kblocks) : NULL;
    if (corr) { /* 16 weight rows a zmm (q8_tiles16); the last rows % 16 a block at a time */
        const int64_t body = rows & ~(int64_t)15;
        q8_tiles16(w, row_bytes, body, kblocks, xa, corr, n, y, ldy);
        for (int64_t i = 0; i + 1 < n; i += 2) /* rows_q8_vnni256 takes one or two activation rows */
            rows_q8_vnni256(2, w + body * row_bytes, row_bytes, rows - body, kblocks, xa + i * kblocks, y + i * ldy + body, ldy);
        if (n & 1)
            rows_q8_vnni256(1, w + body * row_bytes, row_bytes, rows - body, kblocks, xa + (n - 1) * kblocks,
                            y + (n - 1) * ldy + body, ldy);
        return;
    }
    const int64_t ng = (kblocks + 7) / 8;
    const xg8 *xg = ng ? repack8(f, xa, n, kblocks) : NULL;
    if (ng && !xg) { /* out of memory for the repacked activations: the AVX2 path needs none */
        gemm_avx2(f, w, row_bytes, rows, kblocks, x, n, y, ldy);
        return;
    }
    const int64_t even = rows & ~(int64_t)1;
    const uint8_t *wlast = w + even * row_bytes;
    for (int64_t i0 = 0; i0 < n;) {
        int64_t left = n - i0;
        const xg8 *g = xg + i0 * ng;
        float *yi = y + i0 * ldy;
#define RUN(k)                                                                                \
    do {                                                                                      \
        rows8(f, 2, k, w, row_bytes, even, kblocks, g, yi, ldy);                              \
        if (rows & 1) rows8(f, 1, k, wlast, row_bytes, 1, kblocks, g, yi + even, ldy);        \
        i0 += k;                                                                              \
    } while (0)
        if (left >= 8) RUN(8);
        else if (left >= 4) RUN(4);
        else if (left == 3) RUN(3);
        else if (left == 2) RUN(2);
        else RUN(1);
#undef RUN
    }
}

ALWAYS_INLINE void dequant_avx512(int f, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks,
                                  float *out) {
    const int bs = fmt_bytes(f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kblocks; b++) {
            const uint8_t *blk = w + r * row_bytes + bs * b;
            float *o = out + (r * kblocks + b) * 32;
            __m256i v = decode_avx2(f, blk);
            __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(blk)));
            __m512 m = _mm512_set1_ps(fmt_has_min(f) ? _cvtsh_ss(load_u16(blk + 2)) : 0.0f);
            for (int k = 0; k < 2; k++) {
                __m128i part = k ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
                __m512i q = fmt_has_min(f) ? _mm512_cvtepu8_epi32(part) : _mm512_cvtepi8_epi32(part);
                __m512 fq = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
                _mm512_storeu_ps(o + 16 * k, fmt_has_min(f) ? _mm512_add_ps(fq, m) : fq);
            }
        }
}

#pragma GCC pop_options

/* ---------------------------------------------------------------- the tables */

#define SW_GEMM_ARGS const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x, int64_t n, float *y, int64_t ldy
#define SW_DEQ_ARGS const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out

#define DEFINE_FORMAT(name, F)                                                                                   \
    static void gemm_##name##_portable(SW_GEMM_ARGS) { gemm_portable(F, w, row_bytes, rows, kblocks, x, n, y, ldy); } \
    static void dequant_##name##_portable(SW_DEQ_ARGS) { dequant_portable(F, w, row_bytes, rows, kblocks, out); }     \
    __attribute__((target("avx2,fma,f16c"))) static void gemm_##name##_avx2(SW_GEMM_ARGS) {                          \
        gemm_avx2(F, w, row_bytes, rows, kblocks, x, n, y, ldy);                                                     \
    }                                                                                                                \
    __attribute__((target("avx2,fma,f16c"))) static void dequant_##name##_avx2(SW_DEQ_ARGS) {                        \
        dequant_avx2(F, w, row_bytes, rows, kblocks, out);                                                           \
    }                                                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))) static void               \
        gemm_##name##_avx512(SW_GEMM_ARGS) {                                                                         \
        gemm8_avx512(F, w, row_bytes, rows, kblocks, x, n, y, ldy);                                                  \
    }                                                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))) static void               \
        dequant_##name##_avx512(SW_DEQ_ARGS) {                                                                       \
        dequant_avx512(F, w, row_bytes, rows, kblocks, out);                                                         \
    }

DEFINE_FORMAT(q8_0, F_Q8_0)
DEFINE_FORMAT(q4_0, F_Q4_0)
DEFINE_FORMAT(q4_1, F_Q4_1)
DEFINE_FORMAT(q5_0, F_Q5_0)
DEFINE_FORMAT(q5_1, F_Q5_1)

#define REGISTER(T, name)                                               \
    sw_gemm_table[T][SW_ISA_PORTABLE] = gemm_##name##_portable;         \
    sw_gemm_table[T][SW_ISA_AVX2] = gemm_##name##_avx2;                 \
    sw_gemm_table[T][SW_ISA_AVX512] = gemm_##name##_avx512;             \
    sw_dequant_table[T][SW_ISA_PORTABLE] = dequant_##name##_portable;   \
    sw_dequant_table[T][SW_ISA_AVX2] = dequant_##name##_avx2;           \
    sw_dequant_table[T][SW_ISA_AVX512] = dequant_##name##_avx512;

void sw_register_q32(void) {
    REGISTER(SW_Q8_0, q8_0)
    REGISTER(SW_Q4_0, q4_0)
    REGISTER(SW_Q4_1, q4_1)
    REGISTER(SW_Q5_0, q5_0)
    REGISTER(SW_Q5_1, q5_1)
}
