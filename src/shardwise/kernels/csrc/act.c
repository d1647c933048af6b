/* Activation quantization: fp32 rows -> sw_a32 / sw_a256 blocks (see sw.h).
 * Each variant computes exactly what the portable one does (same scale, same rounding:
 * x * (1 / d) rounded half to even), so every gemm sees the same activations on every ISA. */
#include <immintrin.h>
#include <math.h>

#include "sw.h"

static inline void block_scale(float amax, float *d, float *id) {
    *d = amax / 127.0f;
    *id = amax > 0.0f ? 1.0f / *d : 0.0f;
}

static void quant32_portable(const float *x, int64_t ldx, int64_t n, int64_t k, void *out) {
    sw_a32 *o = (sw_a32 *)out;
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ldx;
        for (int64_t b = 0; b < k / 32; b++, o++) {
            const float *v = r + 32 * b;
            float amax = 0.0f, d, id;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
            block_scale(amax, &d, &id);
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                int q = (int)nearbyintf(v[j] * id);
                o->q[j] = (int8_t)q;
                sum += q;
            }
            o->d = d;
            o->s = d * (float)sum;
        }
    }
}

/* sw_a256's scales from its sub-blocks' amax (sw.h): d, m, m16; each sub-block's 1 / (d m[j]) in
 * id. Scalar in every variant, so that every ISA quantizes alike. */
static inline void a256_scales(const float amax8[8], sw_a256 *o, float id[8]) {
    float amax = 0.0f;
    for (int j = 0; j < 8; j++) amax = fmaxf(amax, amax8[j]);
    const float d = amax / (127.0f * SW_A256_M);
    for (int j = 0; j < 8; j++) {
        int m = amax > 0.0f ? (int)ceilf((float)SW_A256_M * amax8[j] / amax) : 1;
        m = m < 1 ? 1 : m > SW_A256_M ? SW_A256_M : m;
        const float s = d * (float)m;
        o->m[j] = o->m16[2 * j] = o->m16[2 * j + 1] = (uint8_t)m;
        id[j] = s > 0.0f ? 1.0f / s : 0.0f;
    }
    o->d = d;
}

static void quant256_portable(const float *x, int64_t ldx, int64_t n, int64_t k, void *out) {
    sw_a256 *o = (sw_a256 *)out;
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ldx;
        for (int64_t b = 0; b < k / 256; b++, o++) {
            const float *v = r + 256 * b;
            float amax8[8], id[8];
            for (int j = 0; j < 8; j++) {
                amax8[j] = 0.0f;
                for (int l = 0; l < 32; l++) amax8[j] = fmaxf(amax8[j], fabsf(v[32 * j + l]));
            }
            a256_scales(amax8, o, id);
            for (int g = 0; g < 16; g++) {
                int sum = 0;
                for (int j = 16 * g; j < 16 * g + 16; j++) {
                    int q = (int)nearbyintf(v[j] * id[g / 2]);
                    o->q[j] = (int8_t)q;
                    sum += q;
                }
                o->bsum[g] = (int16_t)(o->m[g / 2] * sum);
            }
        }
    }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline __m256i q8x8_avx2(__m256 v, __m256 id) {
    return _mm256_cvtps_epi32(_mm256_mul_ps(v, id)); /* rounds half to even (MXCSR default) */
}

static inline float hmax8_avx2(__m256 m) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline int hsum8i_avx2(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* 32 floats at v -> 32 int8 at q (given id); returns the sum of the q. */
static inline int quant_run32_avx2(const float *v, __m256 id, int8_t *q) {
    __m256i a = q8x8_avx2(_mm256_loadu_ps(v), id), b = q8x8_avx2(_mm256_loadu_ps(v + 8), id);
    __m256i c = q8x8_avx2(_mm256_loadu_ps(v + 16), id), e = q8x8_avx2(_mm256_loadu_ps(v + 24), id);
    int sum = hsum8i_avx2(_mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, e)));
    __m256i ab = _mm256_packs_epi32(a, b), ce = _mm256_packs_epi32(c, e); /* lanes interleaved */
    __m256i p = _mm256_packs_epi16(ab, ce);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    return sum;
}

static float amax_avx2(const float *v, int len) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < len; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
    return hmax8_avx2(m);
}

static void quant32_avx2(const float *x, int64_t ldx, int64_t n, int64_t k, void *out) {
    sw_a32 *o = (sw_a32 *)out;
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ldx;
        for (int64_t b = 0; b < k / 32; b++, o++) {
            float d, id;
            block_scale(amax_avx2(r + 32 * b, 32), &d, &id);
            int sum = quant_run32_avx2(r + 32 * b, _mm256_set1_ps(id), o->q);
            o->d = d;
            o->s = d * (float)sum;
        }
    }
}

static void quant256_avx2(const float *x, int64_t ldx, int64_t n, int64_t k, void *out) {
    sw_a256 *o = (sw_a256 *)out;
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ldx;
        for (int64_t b = 0; b < k / 256; b++, o++) {
            float amax8[8], id[8];
            for (int j = 0; j < 8; j++) amax8[j] = amax_avx2(r + 256 * b + 32 * j, 32);
            a256_scales(amax8, o, id);
            for (int g = 0; g < 8; g++) {
                (void)quant_run32_avx2(r + 256 * b + 32 * g, _mm256_set1_ps(id[g]), o->q + 32 * g);
                int s0 = 0, s1 = 0;
                for (int j = 0; j < 16; j++) s0 += o->q[32 * g + j], s1 += o->q[32 * g + 16 + j];
                o->bsum[2 * g] = (int16_t)(o->m[g] * s0);
                o->bsum[2 * g + 1] = (int16_t)(o->m[g] * s1);
            }
        }
    }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

static inline int quant_run16_avx512(const float *v, __m512 id, int8_t *q) {
    __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), id));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(a));
    return _mm512_reduce_add_epi32(a);
}

static float amax_avx512(const float *v, int len) {
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < len; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
    return _mm512_reduce_max_ps(m);
}

static void quant32_avx512(const float *x, int64_t ldx, int64_t n, int64_t k, void *out) {
    sw_a32 *o = (sw_a32 *)out;
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ldx;
        for (int64_t b = 0; b < k / 32; b++, o++) {
            float d, id;
            block_scale(amax_avx512(r + 32 * b, 32), &d, &id);
            __m512 vid = _mm512_set1_ps(id);
            int sum = quant_run16_avx512(r + 32 * b, vid, o->q) + quant_run16_avx512(r + 32 * b + 16, vid, o->q + 16);
            o->d = d;
            o->s = d * (float)sum;
        }
    }
}

static void quant256_avx512(const float *x, int64_t ldx, int64_t n, int64_t k, void *out) {
    sw_a256 *o = (sw_a256 *)out;
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * ldx;
        for (int64_t b = 0; b < k / 256; b++, o++) {
            float amax8[8], id[8];
            for (int j = 0; j < 8; j++) amax8[j] = amax_avx512(r + 256 * b + 32 * j, 32);
            a256_scales(amax8, o, id);
            for (int g = 0; g < 16; g++)
                o->bsum[g] = (int16_t)(o->m[g / 2] * quant_run16_avx512(r + 256 * b + 16 * g, _mm512_set1_ps(id[g / 2]),
                                                                        o->q + 16 * g));
        }
    }
}

#pragma GCC pop_options

void sw_register_act(void) {
    sw_quant32_table[SW_ISA_PORTABLE] = quant32_portable;
    sw_quant256_table[SW_ISA_PORTABLE] = quant256_portable;
    sw_quant32_table[SW_ISA_AVX2] = quant32_avx2;
    sw_quant256_table[SW_ISA_AVX2] = quant256_avx2;
    sw_quant32_table[SW_ISA_AVX512] = quant32_avx512;
    sw_quant256_table[SW_ISA_AVX512] = quant256_avx512;
}
