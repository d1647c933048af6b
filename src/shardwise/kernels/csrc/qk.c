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
 * Against an activation block (da, bsum[16], qa[256]) the dot is, exactly in integers
 * but for the final scaling:
 *   Q4_K/Q5_K: da * (d * sum_j sc[j] * (q_j . qa_j) - dmin * sum_j mn[j] * (bsum[2j] + bsum[2j+1]))
 *   Q6_K:      da * d * sum_g sc[g] * (q_g . qa_g - 32 * bsum[g])
 * Integer bounds: |q_j . qa_j| <= 32 * 31 * 127 (Q5_K); a block's sum <= 8 * 63 * 126k, and
 * for Q6_K 16 * 128 * 16 * 63 * 127: both well inside int32.
 *
 * Each gemm: for each weight row, for each group of up to 4 activation rows, for each block,
 * the weight block is decoded once into registers and dotted with the group's rows. */
#include <immintrin.h>

#include "sw.h"

enum { Q4K_BYTES = 144, Q5K_BYTES = 176, Q6K_BYTES = 210 };

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
                    isum += sc[j] * dot;
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
                    isum += sc[g] * dot;
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

void sw_register_qk(void) {
    sw_gemm_table[SW_Q4_K][SW_ISA_PORTABLE] = gemm_q4_k_portable;
    sw_gemm_table[SW_Q5_K][SW_ISA_PORTABLE] = gemm_q5_k_portable;
    sw_gemm_table[SW_Q6_K][SW_ISA_PORTABLE] = gemm_q6_k_portable;
    sw_dequant_table[SW_Q4_K][SW_ISA_PORTABLE] = dequant_q4_k_portable;
    sw_dequant_table[SW_Q5_K][SW_ISA_PORTABLE] = dequant_q5_k_portable;
    sw_dequant_table[SW_Q6_K][SW_ISA_PORTABLE] = dequant_q6_k_portable;
}
