/* RMSNorm of activation rows, the decode step's most frequent op outside the matmuls.
 *
 *   out[i, :] = x[i, :] * 1 / sqrt(mean(x[i, :]^2) + eps) * w
 *
 * fp32 throughout, the sum of squares accumulated in 16 fp32 lanes then in double (one row of
 * a few thousand values: the same result to ~1e-7 relative as torch's F.rms_norm). The
 * portable variant is plain C; the AVX2 and AVX-512 ones are the same source compiled for
 * those targets (the loops vectorize), so the three differ only in summation order. */
#include <math.h>

#include "sw.h"

#define SW_RMSNORM_BODY                                                                       \
    for (int64_t i = 0; i < n; i++) {                                                         \
        const float *xi = x + i * ldx;                                                        \
        float *oi = out + i * ldo;                                                            \
        float acc[16] = {0};                                                                  \
        int64_t j = 0;                                                                        \
        for (; j + 16 <= k; j += 16)                                                          \
            for (int l = 0; l < 16; l++) acc[l] += xi[j + l] * xi[j + l];                     \
        double ss = 0.0;                                                                      \
        for (int l = 0; l < 16; l++) ss += acc[l];                                            \
        for (; j < k; j++) ss += (double)xi[j] * xi[j];                                       \
        const float r = (float)(1.0 / sqrt(ss / (double)k + (double)eps));                    \
        for (j = 0; j < k; j++) oi[j] = xi[j] * r * w[j];                                     \
    }

static void rmsnorm_portable(const float *x, int64_t ldx, int64_t n, int64_t k, const float *w, float eps, float *out,
                             int64_t ldo) {
    SW_RMSNORM_BODY
}

__attribute__((target("avx2,fma"))) static void rmsnorm_avx2(const float *x, int64_t ldx, int64_t n, int64_t k,
                                                               const float *w, float eps, float *out, int64_t ldo) {
    SW_RMSNORM_BODY
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void
rmsnorm_avx512(const float *x, int64_t ldx, int64_t n, int64_t k, const float *w, float eps, float *out, int64_t ldo) {
    SW_RMSNORM_BODY
}

/* The residual add and the next norm in one pass: sum = x + a, out = RMSNorm(sum) * w
 * (x, a, sum: n rows of k, contiguous). The same arithmetic as the add then rmsnorm. */
#define SW_ADD_RMSNORM_BODY                                                                   \
    for (int64_t i = 0; i < n; i++) {                                                         \
        const float *xi = x + i * k, *ai = a + i * k;                                         \
        float *si = sum + i * k;                                                              \
        for (int64_t j = 0; j < k; j++) si[j] = xi[j] + ai[j];                                \
    }                                                                                         \
    {                                                                                         \
        const float *x = sum;                                                                 \
        const int64_t ldx = k, ldo = k;                                                       \
        SW_RMSNORM_BODY                                                                       \
    }

#define SW_ADD_RMSNORM_ARGS \
    const float *x, const float *a, int64_t n, int64_t k, const float *w, float eps, float *sum, float *out

static void add_rmsnorm_portable(SW_ADD_RMSNORM_ARGS) { SW_ADD_RMSNORM_BODY }

__attribute__((target("avx2,fma"))) static void add_rmsnorm_avx2(SW_ADD_RMSNORM_ARGS) { SW_ADD_RMSNORM_BODY }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void
add_rmsnorm_avx512(SW_ADD_RMSNORM_ARGS) {
    SW_ADD_RMSNORM_BODY
}

/* Greedy sampling's reduction: out[i] = the first index of row i's largest value, a NaN counting
 * as larger than any number (torch.argmax's answer). One pass, plain C on every ISA: a
 * (16, 128256) fp32 batch of logits in 1.5 ms on one thread, torch.argmax 3.0 (Intel Xeon 207,
 * benchmarks/bench_argmax.py). */
void sw_argmax(const float *x, int64_t ldx, int64_t n, int64_t v, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ldx;
        int64_t at = 0;
        float best = r[0];
        if (best == best)
            for (int64_t j = 1; j < v; j++) {
                const float t = r[j];
                if (t > best) best = t, at = j;
                else if (t != t) { /* the first NaN */
                    at = j;
                    break;
                }
            }
        out[i] = at;
    }
}

void sw_register_norm(void) {
    sw_add_rmsnorm_table[SW_ISA_PORTABLE] = add_rmsnorm_portable;
    sw_add_rmsnorm_table[SW_ISA_AVX2] = add_rmsnorm_avx2;
    sw_add_rmsnorm_table[SW_ISA_AVX512] = add_rmsnorm_avx512;
    sw_rmsnorm_table[SW_ISA_PORTABLE] = rmsnorm_portable;
    sw_rmsnorm_table[SW_ISA_AVX2] = rmsnorm_avx2;
    sw_rmsnorm_table[SW_ISA_AVX512] = rmsnorm_avx512;
}
