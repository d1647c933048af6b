/* shardwise native kernels: shared declarations.
 *
 * Weights stay in their GGUF block layout. A linear y = x W^T runs as
 *   1. the activation rows quantized once to 8-bit blocks (sw_a32 or sw_a256, by the
 *      weight format's block length), then
 *   2. per-block integer dot products of weight blocks with activation blocks, both
 *      scales applied per block, summed in fp32.
 *
 * Every kernel exists in a portable C variant (no intrinsics, always built and always
 * tested) and in per-ISA variants compiled into the same binary with
 * `#pragma GCC target(...)`, chosen at run time by CPU features (module.c). A table maps
 * (format, ISA) to the function; a missing entry falls back to the next ISA down.
 */
#ifndef SW_H
#define SW_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ISA levels, lowest first. A level is used only when the CPU has all its features. */
enum {
    SW_ISA_PORTABLE = 0, /* plain C */
    SW_ISA_AVX2 = 1,     /* avx2, fma, f16c */
    SW_ISA_AVX512 = 2,   /* avx512f, avx512bw, avx512vl, avx512dq, avx512vnni */
    SW_NUM_ISA = 3,
};

/* Weight formats, by their ggml type ids. */
enum {
    SW_Q4_0 = 2,
    SW_Q4_1 = 3,
    SW_Q5_0 = 6,
    SW_Q5_1 = 7,
    SW_Q8_0 = 8,
    SW_Q4_K = 12,
    SW_Q5_K = 13,
    SW_Q6_K = 14,
    SW_NUM_TYPES = 16,
};

/* Activation blocks (fp32 row -> 8-bit blocks), symmetric: d = amax / 127, q = round(x / d)
 * (round half to even, as torch.round). */
typedef struct {
    float d;     /* scale: x ~= d * q */
    float s;     /* d * sum(q): what a block's weight offset (Q4_1/Q5_1's m, Q4_0's -8) needs */
    int8_t q[32];
} sw_a32;        /* 40 bytes, for the 32-weight formats */

/* The K-quants' activation blocks: 256 values, each 32 of them (sub-block j) with its own
 * scale d * m[j], m[j] = ceil(SW_A256_M amax_j / amax) in 1 .. SW_A256_M, d = amax / (127 SW_A256_M):
 * x ~= d * m[j] * q. One scale per 256 (llama.cpp's Q8_K) leaves every sub-block beside an outlier
 * channel a few levels: on the real SmolLM2 the Q6_K ffn_down's inputs alone cost +0.4% perplexity
 * (docs/benchmarks/native-kernels.md). The sub-scales are small integers so that the kernels fold
 * them into the weights' integer sub-scales (sc[j] m[j]) and still sum a block in integers.
 * Bounds, with SW_A256_M 8: |m bsum| <= 8 * 16 * 127 and a pair of them <= 8 * 32 * 127 fit int16;
 * Q6_K's block total <= 256 * 32 * 127 * 128 * 8 and the sum of its -32 terms fit int32. */
enum { SW_A256_M = 8 };
typedef struct {
    float d;
    int16_t bsum[16]; /* m[g / 2] * the sum of q[16 g .. 16 g + 15]: for the K-quants' mins and Q6_K's -32 */
    uint8_t m[8];     /* sub-block j's scale is d * m[j] */
    uint8_t m16[16];  /* m[g / 2] for each 16-weight group g (Q6_K's sub-blocks) */
    int8_t q[256];
} sw_a256;            /* 316 bytes, for the 256-weight K-quants */

/* y[i * ldy + r] = sum over the row of W[r, :] . X[i, :], r < rows, i < n.
 * w: rows of `kblocks` weight blocks, `row_bytes` apart (the rank's slice, or a view into a
 * wider row). x: n rows of kblocks activation blocks (sw_a32 or sw_a256 by the format). */
typedef void (*sw_gemm_fn)(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x,
                           int64_t n, float *y, int64_t ldy);

/* x: n rows of k floats (k a multiple of the block), `ldx` floats apart -> n * k / block blocks. */
typedef void (*sw_quant_fn)(const float *x, int64_t ldx, int64_t n, int64_t k, void *out);

/* w (rows of kblocks blocks, row_bytes apart) -> out (rows, kblocks * block) fp32, row-major. */
typedef void (*sw_dequant_fn)(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, float *out);

/* out (n rows, ldo apart) = RMSNorm of x (n rows of k, ldx apart) with weight w (k) and eps. */
typedef void (*sw_rmsnorm_fn)(const float *x, int64_t ldx, int64_t n, int64_t k, const float *w, float eps, float *out,
                              int64_t ldo);

/* sum = x + a and out = RMSNorm(sum) * w: n contiguous rows of k (the residual add and the next norm). */
typedef void (*sw_add_rmsnorm_fn)(const float *x, const float *a, int64_t n, int64_t k, const float *w, float eps,
                                  float *sum, float *out);

/* One decode step of attention with rotary embedding and the KV-cache write (attn.c). 0, or -1
 * when out of memory. */
typedef int (*sw_attend_fn)(float *qkv, int64_t ldq, int64_t B, int64_t nq, int64_t nkv, int64_t hd,
                            const int64_t *groups, const float *cos, const float *sin, int64_t ldr, int64_t rot,
                            float *kc, float *vc, int64_t pos_stride, int64_t head_stride, const int64_t *widx,
                            int64_t wbase, const int64_t *ridx, int64_t rrow, int64_t K, const uint8_t *mask,
                            int64_t ldm, float scale, float *out, int64_t ldo);

/* out (n, inter) = act(h[:, :inter]) * h[:, inter:]; kind 0 silu, 1 gelu (tanh) (attn.c). */
typedef void (*sw_glu_fn)(const float *h, int64_t ldh, int64_t n, int64_t inter, int kind, float *out, int64_t ldo);

/* y[i * ldy + r] = sum_j x[i * ldx + j] w[r * ldw + j]: an fp32 linear, r < rows, i < n (f32.c). */
typedef void (*sw_f32_fn)(const float *w, int64_t ldw, int64_t rows, int64_t k, const float *x, int64_t ldx,
                          int64_t n, float *y, int64_t ldy);

extern sw_f32_fn sw_f32_table[SW_NUM_ISA];
/* The same with the weight column-major: w[j * ldw + r] is W[r, j] (f32.c). */
extern sw_f32_fn sw_f32t_table[SW_NUM_ISA];
extern sw_add_rmsnorm_fn sw_add_rmsnorm_table[SW_NUM_ISA];
extern sw_attend_fn sw_attend_table[SW_NUM_ISA];
extern sw_glu_fn sw_glu_table[SW_NUM_ISA];
extern sw_gemm_fn sw_gemm_table[SW_NUM_TYPES][SW_NUM_ISA];
extern sw_rmsnorm_fn sw_rmsnorm_table[SW_NUM_ISA];
extern sw_dequant_fn sw_dequant_table[SW_NUM_TYPES][SW_NUM_ISA];
extern sw_quant_fn sw_quant32_table[SW_NUM_ISA];
extern sw_quant_fn sw_quant256_table[SW_NUM_ISA];

/* A decode step's layers in one call (step.c): the program's header and layer words, the
 * step's own arguments and the resume state; SW_STEP_DONE, SW_STEP_WAIT or SW_STEP_NOMEM. */
typedef struct sw_step_args sw_step_args;
struct sw_step_args {
    const float *cos, *sin;
    int64_t ldr, rot;
    const uint8_t *mask;
    int64_t ldm, K, wbase;
    const int64_t *widx, *ridx;
    int64_t calls; /* the communicator's all-reduces before this step */
};
int sw_step(const int64_t *header, const int64_t *layers, const sw_step_args *a, int64_t *st);
const char *sw_step_check(const int64_t *header, const int64_t *layers);
int sw_step_header_words(void);
int sw_step_layer_words(void);
int sw_step_lin_words(void);

/* The kernel of each table for an ISA, or the next ISA down that has one (NULL: none). */
static inline sw_gemm_fn sw_gemm_for(int64_t type, int64_t isa) {
    sw_gemm_fn f = NULL;
    for (int64_t i = isa; i >= 0 && !f; i--) f = sw_gemm_table[type][i];
    return f;
}

/* fp32 linears: transposed 0 for row-major weights, nonzero for column-major ones. */
static inline sw_f32_fn sw_f32_for(int transposed, int64_t isa) {
    sw_f32_fn f = NULL;
    for (int64_t i = isa; i >= 0 && !f; i--) f = transposed ? sw_f32t_table[i] : sw_f32_table[i];
    return f;
}

/* The activation quantizer for blocks of 32 or 256 (NULL for another length). */
static inline sw_quant_fn sw_quant_for(int64_t block, int64_t isa) {
    return block == 32 ? sw_quant32_table[isa] : block == 256 ? sw_quant256_table[isa] : NULL;
}

/* out[i]: the first index of the largest value of row i (n rows of v > 0 values, ldx apart; a
 * NaN is the largest), as torch.argmax (norm.c). */
void sw_argmax(const float *x, int64_t ldx, int64_t n, int64_t v, int64_t *out);

/* A thread's scratch of at least n int32 (grown, never shrunk; one buffer a thread, for what a
 * gemm call computes once from its activations for every tile: q32.c's Q8_0 corrections,
 * qk.c's sums of 32), or NULL where it cannot be had (module.c). */
int32_t *sw_scratch_i32(size_t n);

/* Each source file fills its entries of the tables (called once at import). */
void sw_register_act(void);
void sw_register_q32(void);
void sw_register_qk(void);
void sw_register_norm(void);
void sw_register_attn(void);
void sw_register_f32(void);

/* IEEE half -> float without F16C (portable paths). */
/* Row-at-a-time kernels read a weight row whole, then the next: one stream, which one core's
 * hardware prefetchers do not keep far enough ahead of. While a kernel works on block b of row
 * r it asks for the same bytes of row r + SW_AHEAD_ROWS (2 rows: 4-35 KB ahead at the models'
 * widths). On an Intel Xeon (family 6 model 207) one Q8_0 row through a 17.8 MB weight from
 * DRAM went from 8.6 to 13.2-13.5 GB/s, as fast as a plain sum of the same bytes
 * (benchmarks/bench_kernel_ab.py; docs/benchmarks/native-kernels.md, "Prefetching the next rows"). A
 * hint: no fault, no effect on results. */
enum { SW_AHEAD_ROWS = 2 };
static inline void sw_prefetch_ahead(const uint8_t *row, size_t row_bytes, int64_t r, int64_t rows, size_t off,
                                     size_t bytes) {
    if (r + SW_AHEAD_ROWS >= rows) return;
    const uint8_t *p = row + SW_AHEAD_ROWS * row_bytes + off;
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
    __builtin_prefetch(p + bytes - 1, 0, 3);
}

static inline float sw_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float sw_load_fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return sw_fp16_to_fp32(h);
}

#endif
