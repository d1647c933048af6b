/* fp32 linears at decode sizes: y[i, r] = sum_j x[i, j] W[r, j], for 1 to a few dozen rows x.
 *
 * The native decode step (step.c) runs an fp32 model's projections with these, so that a step
 * needs no call back into PyTorch. Weights are read once per group of 4 activation rows, 4
 * weight rows at a time: at batch 1 the loop streams W from memory once, which is all a
 * bandwidth-bound product can do. Each (row, output) sum is kept in 16 (AVX-512), 8 (AVX2) or
 * 1 (portable) lanes and added up at the end, so the variants differ from each other and from
 * MKL only in summation order. */
#include "sw.h"

#define SW_F32_ARGS                                                                                  \
    const float *w, int64_t ldw, int64_t rows, int64_t k, const float *x, int64_t ldx, int64_t n, float *y, \
        int64_t ldy

static void f32_portable(SW_F32_ARGS) {
    for (int64_t r = 0; r < rows; r++) {
        const float *wr = w + r * ldw;
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * ldx;
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) acc += wr[j] * xi[j];
            y[i * ldy + r] = acc;
        }
    }
}

/* The same product with the weight stored column-major (its transpose contiguous: wt[j * ldw + r]
 * is W[r, j]; quant/layout.py's decode order for MKL): each output row accumulated over j in
 * chunks of the outputs, so wt streams once per activation row. */
#define SW_F32T_ARGS                                                                                 \
    const float *wt, int64_t ldw, int64_t rows, int64_t k, const float *x, int64_t ldx, int64_t n, float *y, \
        int64_t ldy

static void f32t_portable(SW_F32T_ARGS) {
    for (int64_t i = 0; i < n; i++) {
        float *yi = y + i * ldy;
        for (int64_t r = 0; r < rows; r++) yi[r] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float xj = x[i * ldx + j], *wj = wt + j * ldw;
            for (int64_t r = 0; r < rows; r++) yi[r] += xj * wj[r];
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

/* Column-major: 8 input positions j at a time over all the outputs, the output rows (2 at a
 * time) accumulated in y itself (L1/L2-resident), so the weight streams row after row. */
#define SW_F32T_BODY(VEC, W, LOADM, STOREM, FMA, SET1, MASK_T, MASK)                        \
    for (int64_t i0 = 0; i0 < n; i0 += 2) {                                               \
        const int two = i0 + 1 < n;                                                       \
        float *y0 = y + i0 * ldy, *y1 = y + (i0 + two) * ldy;                             \
        for (int64_t r = 0; r < rows; r++) y0[r] = y1[r] = 0.0f;                          \
        for (int64_t j0 = 0; j0 < k; j0 += 8) {                                           \
            const int jb = k - j0 < 8 ? (int)(k - j0) : 8;                                \
            VEC x0[8], x1[8];                                                             \
            for (int jj = 0; jj < jb; jj++) {                                             \
                x0[jj] = SET1(x[i0 * ldx + j0 + jj]);                                     \
                x1[jj] = SET1(two ? x[(i0 + 1) * ldx + j0 + jj] : 0.0f);                  \
            }                                                                             \
            for (int64_t c = 0; c < rows; c += W) {                                       \
                const MASK_T m = MASK(rows - c);                                          \
                VEC a0 = LOADM(m, y0 + c), a1 = LOADM(m, y1 + c);                         \
                for (int jj = 0; jj < jb; jj++) {                                         \
                    const VEC wv = LOADM(m, wt + (j0 + jj) * ldw + c);                    \
                    a0 = FMA(wv, x0[jj], a0);                                             \
                    a1 = FMA(wv, x1[jj], a1);                                             \
                }                                                                         \
                STOREM(y0 + c, m, a0);                                                    \
                if (two) STOREM(y1 + c, m, a1);                                           \
            }                                                                             \
        }                                                                                 \
    }

__attribute__((target("avx2,fma"))) static inline __m256i mask8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define SW_AVX2_LOADM(m, p) _mm256_maskload_ps((p), (m))
#define SW_AVX2_STOREM(p, m, v) _mm256_maskstore_ps((p), (m), (v))

__attribute__((target("avx2,fma"))) static void f32t_avx2(SW_F32T_ARGS) {
    SW_F32T_BODY(__m256, 8, SW_AVX2_LOADM, SW_AVX2_STOREM, _mm256_fmadd_ps, _mm256_set1_ps, __m256i, mask8)
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static inline __mmask16 mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}
#define SW_AVX512_LOADM(m, p) _mm512_maskz_loadu_ps((m), (p))
#define SW_AVX512_STOREM(p, m, v) _mm512_mask_storeu_ps((p), (m), (v))

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void f32t_avx512(SW_F32T_ARGS) {
    SW_F32T_BODY(__m512, 16, SW_AVX512_LOADM, SW_AVX512_STOREM, _mm512_fmadd_ps, _mm512_set1_ps, __mmask16, mask16)
}

/* Row-major: NR weight rows x NI activation rows of W-lane sums (VEC), k's tail masked;
 * LOADM / MASK as for the column-major body, HSUM a vector's lanes added up. */
#define SW_F32_TILE(NR, NI, VEC, W, ZERO, LOADU, LOADM, FMA, HSUM, MASK_T, MASK)                  \
    {                                                                                             \
        VEC acc[NI][NR];                                                                          \
        for (int a = 0; a < NI; a++)                                                              \
            for (int c = 0; c < NR; c++) acc[a][c] = ZERO();                                      \
        for (int64_t j = 0; j < k; j += W) {                                                      \
            const MASK_T m = MASK(k - j);                                                         \
            VEC wv[NR];                                                                           \
            for (int c = 0; c < NR; c++)                                                          \
                wv[c] = j + W <= k ? LOADU(w + (r + c) * ldw + j) : LOADM(m, w + (r + c) * ldw + j); \
            for (int a = 0; a < NI; a++) {                                                        \
                const VEC xv = j + W <= k ? LOADU(x + (i + a) * ldx + j) : LOADM(m, x + (i + a) * ldx + j); \
                for (int c = 0; c < NR; c++) acc[a][c] = FMA(wv[c], xv, acc[a][c]);              \
            }                                                                                     \
        }                                                                                         \
        for (int a = 0; a < NI; a++)                                                              \
            for (int c = 0; c < NR; c++) y[(i + a) * ldy + r + c] = HSUM(acc[a][c]);              \
    }

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define SW_F32_AVX2_TILE(NR, NI)                                                                   \
    SW_F32_TILE(NR, NI, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, SW_AVX2_LOADM, _mm256_fmadd_ps, hsum8, \
                __m256i, mask8)

__attribute__((target("avx2,fma"))) static void f32_avx2(SW_F32_ARGS) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        int64_t i = 0;
        for (; i + 2 <= n; i += 2) SW_F32_AVX2_TILE(4, 2)
        for (; i < n; i++) SW_F32_AVX2_TILE(4, 1)
    }
    for (; r < rows; r++) {
        int64_t i = 0;
        for (; i < n; i++) SW_F32_AVX2_TILE(1, 1)
    }
}

#define SW_F32_AVX512_TILE(NR, NI)                                                                 \
    SW_F32_TILE(NR, NI, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, SW_AVX512_LOADM, _mm512_fmadd_ps,  \
                _mm512_reduce_add_ps, __mmask16, mask16)

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void f32_avx512(SW_F32_ARGS) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) SW_F32_AVX512_TILE(4, 4)
        for (; i < n; i++) SW_F32_AVX512_TILE(4, 1)
    }
    for (; r < rows; r++) {
        int64_t i = 0;
        for (; i < n; i++) SW_F32_AVX512_TILE(1, 1)
    }
}
#endif

void sw_register_f32(void) {
    sw_f32_table[SW_ISA_PORTABLE] = f32_portable;
    sw_f32t_table[SW_ISA_PORTABLE] = f32t_portable;
#if defined(__x86_64__)
    sw_f32_table[SW_ISA_AVX2] = f32_avx2;
    sw_f32_table[SW_ISA_AVX512] = f32_avx512;
    sw_f32t_table[SW_ISA_AVX2] = f32t_avx2;
    sw_f32t_table[SW_ISA_AVX512] = f32t_avx512;
#endif
}
