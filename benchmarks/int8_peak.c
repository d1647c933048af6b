/* The int8 multiply-accumulate ceiling of one core, for benchmarks/bench_native.py: how many
 * 8-bit products a second the instruction the block-format kernels are built on can do when it
 * does nothing else (12 independent accumulators in registers, no loads). Thread CPU time.
 *
 *   avx512: vpdpbusd on zmm (64 products an instruction), the kernels' avx512 path;
 *   avx2:   vpmaddubsw + vpmaddwd + vpaddd on ymm (32 products per three), their avx2 path; the
 *           accumulator is the signed operand, so no product can be hoisted out of the loop.
 *
 * Prints one line: "avx512 <MAC/s>" and/or "avx2 <MAC/s>", the best of 5 runs each, for the
 * ISAs this CPU has. Built by bench_native.py with the machine's gcc; not part of the package. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

/* Twelve accumulators, each its own register (an array would live in memory, and the loop
 * would time store-to-load forwarding instead). */
#define EACH(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
#define N 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni512(long iters) {
    const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i);
#define STEP(i) a##i = _mm512_dpbusd_epi32(a##i, x, y);
#define SUM(i) sink += _mm512_reduce_add_epi32(a##i);
    EACH(DECL)
    const double t = now();
    for (long k = 0; k < iters; k++) {
        EACH(STEP)
    }
    const double s = now() - t;
    int sink = 0;
    EACH(SUM)
    return sink == 42 ? 0.0 : (double)iters * N * 64 / s;
#undef DECL
#undef STEP
#undef SUM
}

__attribute__((target("avx2"))) static double madd256(long iters) {
    const __m256i x = _mm256_set1_epi8(3), one = _mm256_set1_epi16(1);
#define DECL(i) __m256i a##i = _mm256_set1_epi32(i);
#define STEP(i) a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(_mm256_maddubs_epi16(x, a##i), one));
#define SUM(i) sink += _mm256_extract_epi32(a##i, 0);
    EACH(DECL)
    const double t = now();
    for (long k = 0; k < iters; k++) {
        EACH(STEP)
    }
    const double s = now() - t;
    int sink = 0;
    EACH(SUM)
    return sink == 42 ? 0.0 : (double)iters * N * 32 / s;
#undef DECL
#undef STEP
#undef SUM
}

static double best(double (*f)(long), long iters) {
    double b = 0.0;
    for (int r = 0; r < 5; r++) {
        const double v = f(iters);
        b = v > b ? v : b;
    }
    return b;
}

int main(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
        printf("avx512 %.4g ", best(vnni512, 4000000));
    if (__builtin_cpu_supports("avx2")) printf("avx2 %.4g", best(madd256, 4000000));
    printf("\n");
    return 0;
}
