/* One decode step of attention, fused: rotary embedding, the write into the KV cache, and
 * one query per row attending over the cached keys (GQA), in one call per layer.
 *
 * For each row b of the step (one new token each):
 *   qkv[b] = [q heads | k heads | v heads], hd floats per head (the fused projection's output)
 *   1. rotate the first `rot` dims of every q and k head (rotate-half convention: cos, sin
 *      hold [f | f] by halves), in place;
 *   2. write row b's k and v heads at its cache position;
 *   3. for each KV head and each query head it serves: scores over the row's K cached keys
 *      (those the mask allows), softmax, the weighted sum of the values -> out[b].
 *
 * The cache is addressed through strides, so that one kernel serves the generate cache
 * (B, nkv, max_len, hd), the slot cache and the paged pool (positions, nkv, hd):
 *   key j of row b, head h:   k + idx(b, j) * pos_stride + h * head_stride
 *   idx(b, j) = ridx ? ridx[b * K + j] : b * rrow + j
 *   row b's new key/value:    position widx ? widx[b] : wbase + b * rrow
 *
 * fp32 throughout. exp is a polynomial on a Cody-Waite reduction (relative error ~1e-7,
 * below fp32 softmax's own rounding), written so the loops vectorize; the portable, AVX2
 * and AVX-512 variants are this source compiled for each target. */
#include <math.h>
#include <stdlib.h>

#include "sw.h"

/* s[j] = exp(s[j] - sub), the argument clamped to [-87, 88] (exp(-87) = 1.6e-38: nothing beside
 * a softmax's largest term, 1; exp(88) = 1.7e38, finite). Cody-Waite reduction x = n ln2 + r,
 * |r| <= ln2 / 2, and a degree-7 Taylor polynomial: relative error about 1e-7. Its own function
 * per ISA, compiled without trapping or non-finite math so that the loop vectorizes. */
#define SW_EXP_BODY                                                                     \
    for (int64_t j = 0; j < n; j++) {                                                   \
        const float x = fminf(fmaxf(s[j] - sub, -87.0f), 88.0f);                        \
        const int32_t ni = (int32_t)(x * 1.44269504088896341f + 128.5f) - 128; /* round */ \
        const float nf = (float)ni;                                                     \
        const float r = x - nf * 0.693145751953125f - nf * 1.428606765330187045e-06f;    \
        float p = 1.0f / 5040.0f;                                                       \
        p = p * r + 1.0f / 720.0f;                                                      \
        p = p * r + 1.0f / 120.0f;                                                      \
        p = p * r + 1.0f / 24.0f;                                                       \
        p = p * r + 1.0f / 6.0f;                                                        \
        p = p * r + 0.5f;                                                               \
        p = p * r + 1.0f;                                                               \
        p = p * r + 1.0f;                                                               \
        const int32_t bits = (ni + 127) << 23;                                          \
        float sc;                                                                       \
        __builtin_memcpy(&sc, &bits, 4);                                                \
        s[j] = p * sc;                                                                  \
    }

#define SW_FINITE optimize("no-trapping-math,finite-math-only")
__attribute__((SW_FINITE)) static void exp_portable(float *s, int64_t n, float sub) { SW_EXP_BODY }
__attribute__((target("avx2,fma"), SW_FINITE)) static void exp_avx2(float *s, int64_t n, float sub) { SW_EXP_BODY }
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), SW_FINITE)) static void exp_avx512(float *s, int64_t n,
                                                                                               float sub) {
    SW_EXP_BODY
}

static inline __attribute__((always_inline)) float sw_dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void sw_rope(float *x, const float *c, const float *s, int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

#define SW_ATTEND_BODY(EXP)                                                                                   \
    const int64_t width = (nq + 2 * nkv) * hd;                                                             \
    int64_t gmax = 0;                                                                                      \
    for (int64_t h = 0; h < nkv; h++) {                                                                    \
        const int64_t g = groups ? groups[h] : nq / nkv;                                                   \
        gmax = g > gmax ? g : gmax;                                                                        \
    }                                                                                                      \
    float *scores = (float *)malloc(sizeof(float) * (size_t)(gmax * (K > 0 ? K : 1)));                     \
    if (!scores) return -1;                                                                                \
    for (int64_t b = 0; b < B; b++) {                                                                      \
        float *row = qkv + b * ldq;                                                                        \
        if (rot > 0)                                                                                       \
            for (int64_t h = 0; h < nq + nkv; h++) sw_rope(row + h * hd, cos + b * ldr, sin + b * ldr, rot); \
        const int64_t wpos = widx ? widx[b] : wbase + b * rrow;                                            \
        for (int64_t h = 0; h < nkv; h++) {                                                                \
            memcpy(kc + wpos * pos_stride + h * head_stride, row + (nq + h) * hd, sizeof(float) * hd);     \
            memcpy(vc + wpos * pos_stride + h * head_stride, row + (nq + nkv + h) * hd, sizeof(float) * hd); \
        }                                                                                                  \
        const uint8_t *m = mask ? mask + b * ldm : NULL;                                                   \
        const int64_t *ri = ridx ? ridx + b * K : NULL;                                                    \
        int64_t q0 = 0;                                                                                    \
        for (int64_t h = 0; h < nkv; h++) {                                                                \
            const int64_t G = groups ? groups[h] : nq / nkv;                                               \
            const float *kh = kc + h * head_stride, *vh = vc + h * head_stride;                            \
            float mx[G > 0 ? G : 1], sum[G > 0 ? G : 1];                                                   \
            for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY, sum[g] = 0.0f;                              \
            for (int64_t j = 0; j < K; j++) {                                                              \
                if (m && !m[j]) continue;                                                                  \
                const float *kj = kh + (ri ? ri[j] : b * rrow + j) * pos_stride;                           \
                for (int64_t g = 0; g < G; g++) {                                                          \
                    const float sc = sw_dot(row + (q0 + g) * hd, kj, hd) * scale;                          \
                    scores[g * K + j] = sc;                                                                \
                    mx[g] = sc > mx[g] ? sc : mx[g];                                                       \
                }                                                                                          \
            }                                                                                              \
            for (int64_t g = 0; g < G; g++) {                                                              \
                float *sg = scores + g * K;                                                                \
                const float mg = mx[g];                                                                    \
                float acc[16] = {0};                                                                       \
                if (m)                                                                                     \
                    for (int64_t j = 0; j < K; j++) sg[j] = m[j] ? sg[j] : mg; /* masked: finite */        \
                EXP(sg, K, mg);                                                                            \
                if (m)                                                                                     \
                    for (int64_t j = 0; j < K; j++) sg[j] *= (float)m[j];                                  \
                int64_t j = 0;                                                                             \
                for (; j + 16 <= K; j += 16)                                                               \
                    for (int l = 0; l < 16; l++) acc[l] += sg[j + l];                                      \
                float s = 0.0f;                                                                            \
                for (int l = 0; l < 16; l++) s += acc[l];                                                  \
                for (; j < K; j++) s += sg[j];                                                             \
                sum[g] = s;                                                                                \
                float *og = out + b * ldo + (q0 + g) * hd;                                                 \
                for (int64_t d = 0; d < hd; d++) og[d] = 0.0f;                                             \
            }                                                                                              \
            for (int64_t j = 0; j < K; j++) {                                                              \
                if (m && !m[j]) continue;                                                                  \
                const float *vj = vh + (ri ? ri[j] : b * rrow + j) * pos_stride;                           \
                for (int64_t g = 0; g < G; g++) {                                                          \
                    const float p = scores[g * K + j];                                                     \
                    float *og = out + b * ldo + (q0 + g) * hd;                                             \
                    for (int64_t d = 0; d < hd; d++) og[d] += p * vj[d];                                   \
                }                                                                                          \
            }                                                                                              \
            for (int64_t g = 0; g < G; g++) {                                                              \
                float *og = out + b * ldo + (q0 + g) * hd;                                                 \
                const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;                                    \
                for (int64_t d = 0; d < hd; d++) og[d] *= inv;                                             \
            }                                                                                              \
            q0 += G;                                                                                       \
        }                                                                                                  \
    }                                                                                                      \
    free(scores);                                                                                          \
    (void)width;                                                                                           \
    return 0;

#define SW_ATTEND_ARGS                                                                                        \
    float *qkv, int64_t ldq, int64_t B, int64_t nq, int64_t nkv, int64_t hd, const int64_t *groups,            \
        const float *cos, const float *sin, int64_t ldr, int64_t rot, float *kc, float *vc, int64_t pos_stride, \
        int64_t head_stride, const int64_t *widx, int64_t wbase, const int64_t *ridx, int64_t rrow, int64_t K,  \
        const uint8_t *mask, int64_t ldm, float scale, float *out, int64_t ldo

static int attend_portable(SW_ATTEND_ARGS) { SW_ATTEND_BODY(exp_portable) }

__attribute__((target("avx2,fma"))) static int attend_avx2(SW_ATTEND_ARGS) { SW_ATTEND_BODY(exp_avx2) }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static int attend_avx512(SW_ATTEND_ARGS) {
    SW_ATTEND_BODY(exp_avx512)
}

/* The gated activation of an MLP: out[i, :] = act(h[i, :inter]) * h[i, inter:] (h = [gate | up]).
 * kind 0: silu(g) = g / (1 + exp(-g)); kind 1: gelu, tanh approximation
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), 1 + tanh(t) from exp(-2 |t|) (no cancellation). */
#define SW_GLU_BODY(EXP)                                                                \
    for (int64_t i = 0; i < n; i++) {                                                   \
        const float *g = h + i * ldh, *u = g + inter;                                   \
        float *o = out + i * ldo;                                                       \
        if (kind == 0) {                                                                \
            for (int64_t j = 0; j < inter; j++) o[j] = -g[j];                           \
            EXP(o, inter, 0.0f);                                                        \
            for (int64_t j = 0; j < inter; j++) o[j] = g[j] / (1.0f + o[j]) * u[j];     \
        } else { /* e = exp(-2 |t|): 1 + tanh(t) = 2 / (1 + e) for t >= 0, 2 e / (1 + e) below */ \
            for (int64_t j = 0; j < inter; j++) {                                       \
                const float t = 0.7978845608028654f * (g[j] + 0.044715f * g[j] * g[j] * g[j]); \
                o[j] = -2.0f * (t < 0.0f ? -t : t);                                     \
            }                                                                           \
            EXP(o, inter, 0.0f);                                                        \
            for (int64_t j = 0; j < inter; j++) {                                       \
                const float t = g[j] + 0.044715f * g[j] * g[j] * g[j];                  \
                const float one_plus = (t < 0.0f ? 2.0f * o[j] : 2.0f) / (1.0f + o[j]);  \
                o[j] = 0.5f * g[j] * one_plus * u[j];                                   \
            }                                                                           \
        }                                                                               \
    }

#define SW_GLU_ARGS const float *h, int64_t ldh, int64_t n, int64_t inter, int kind, float *out, int64_t ldo

__attribute__((SW_FINITE)) static void glu_portable(SW_GLU_ARGS) { SW_GLU_BODY(exp_portable) }

__attribute__((target("avx2,fma"), SW_FINITE)) static void glu_avx2(SW_GLU_ARGS) { SW_GLU_BODY(exp_avx2) }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), SW_FINITE)) static void glu_avx512(SW_GLU_ARGS) {
    SW_GLU_BODY(exp_avx512)
}

void sw_register_attn(void) {
    sw_attend_table[SW_ISA_PORTABLE] = attend_portable;
    sw_attend_table[SW_ISA_AVX2] = attend_avx2;
    sw_attend_table[SW_ISA_AVX512] = attend_avx512;
    sw_glu_table[SW_ISA_PORTABLE] = glu_portable;
    sw_glu_table[SW_ISA_AVX2] = glu_avx2;
    sw_glu_table[SW_ISA_AVX512] = glu_avx512;
}
