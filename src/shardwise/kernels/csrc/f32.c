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

#if defined(__x86_64__)
#include <immintrin.h>

/* AVX2: NR weight rows x NI activation rows of 8-lane sums, k's tail masked */
#define SW_F32_AVX2_TILE(NR, NI)                                                                  \
    {                                                                                             \
        __m256 acc[NI][NR];                                                                       \
        for (int a = 0; a < NI; a++)                                                              \
            for (int c = 0; c < NR; c++) acc[a][c] = _mm256_setzero_ps();                         \
        int64_t j = 0;                                                                            \
        for (; j + 8 <= k; j += 8) {                                                              \
            __m256 wv[NR];                                                                        \
            for (int c = 0; c < NR; c++) wv[c] = _mm256_loadu_ps(w + (r + c) * ldw + j);          \
            for (int a = 0; a < NI; a++) {                                                        \
                const __m256 xv = _mm256_loadu_ps(x + (i + a) * ldx + j);                         \
                for (int c = 0; c < NR; c++) acc[a][c] = _mm256_fmadd_ps(wv[c], xv, acc[a][c]);   \
            }                                                                                     \
        }                                                                                         \
        if (j < k) {                                                                              \
            const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(k - j)),                 \
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));      \
            __m256 wv[NR];                                                                        \
            for (int c = 0; c < NR; c++) wv[c] = _mm256_maskload_ps(w + (r + c) * ldw + j, m);    \
            for (int a = 0; a < NI; a++) {                                                        \
                const __m256 xv = _mm256_maskload_ps(x + (i + a) * ldx + j, m);                   \
                for (int c = 0; c < NR; c++) acc[a][c] = _mm256_fmadd_ps(wv[c], xv, acc[a][c]);   \
            }                                                                                     \
        }                                                                                         \
        for (int a = 0; a < NI; a++)                                                              \
            for (int c = 0; c < NR; c++) {                                                        \
                __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[a][c]), _mm256_extractf128_ps(acc[a][c], 1)); \
                s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           \
                s = _mm_add_ss(s, _mm_movehdup_ps(s));                                            \
                y[(i + a) * ldy + r + c] = _mm_cvtss_f32(s);                                      \
            }                                                                                     \
    }

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

/* AVX-512: NR weight rows x NI activation rows of 16-lane sums, k's tail masked */
#define SW_F32_AVX512_TILE(NR, NI)                                                                \
    {                                                                                             \
        __m512 acc[NI][NR];                                                                       \
        for (int a = 0; a < NI; a++)                                                              \
            for (int c = 0; c < NR; c++) acc[a][c] = _mm512_setzero_ps();                         \
        int64_t j = 0;                                                                            \
        for (; j + 16 <= k; j += 16) {                                                            \
            __m512 wv[NR];                                                                        \
            for (int c = 0; c < NR; c++) wv[c] = _mm512_loadu_ps(w + (r + c) * ldw + j);          \
            for (int a = 0; a < NI; a++) {                                                        \
                const __m512 xv = _mm512_loadu_ps(x + (i + a) * ldx + j);                         \
                for (int c = 0; c < NR; c++) acc[a][c] = _mm512_fmadd_ps(wv[c], xv, acc[a][c]);   \
            }                                                                                     \
        }                                                                                         \
        if (j < k) {                                                                              \
            const __mmask16 m = (__mmask16)((1u << (k - j)) - 1);                                 \
            __m512 wv[NR];                                                                        \
            for (int c = 0; c < NR; c++) wv[c] = _mm512_maskz_loadu_ps(m, w + (r + c) * ldw + j); \
            for (int a = 0; a < NI; a++) {                                                        \
                const __m512 xv = _mm512_maskz_loadu_ps(m, x + (i + a) * ldx + j);                \
                for (int c = 0; c < NR; c++) acc[a][c] = _mm512_fmadd_ps(wv[c], xv, acc[a][c]);   \
            }                                                                                     \
        }                                                                                         \
        for (int a = 0; a < NI; a++)                                                              \
            for (int c = 0; c < NR; c++) y[(i + a) * ldy + r + c] = _mm512_reduce_add_ps(acc[a][c]); \
    }

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
#if defined(__x86_64__)
    sw_f32_table[SW_ISA_AVX2] = f32_avx2;
    sw_f32_table[SW_ISA_AVX512] = f32_avx512;
#endif
}
