/* How fast a core issues 512-bit instructions, and whether vpdpbusd shares that rate with the
 * other vector work of the K-quant tiles (shifts, adds, shuffles, int->float conversions, FMAs):
 * the instruction budget behind the tiles' GMAC/s (docs/benchmarks/native-kernels.md).
 * Not part of the package.
 *
 *   gcc -O2 -o /tmp/zmm_ports benchmarks/zmm_ports.c && /tmp/zmm_ports
 *
 * Twelve independent vpdpbusd chains a loop iteration, alone and then with twelve independent
 * instructions of one other kind beside them (their own chains: nothing waits on a vpdpbusd).
 * If vpdpbusd had ports of its own, the others would be free; if every zmm instruction shares
 * the same ones, each one added costs about as much as a vpdpbusd. Prints ns per vpdpbusd, the best of
 * 5 runs of thread CPU time each. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define EACH(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
enum { ITERS = 20000000, MODES = 6 };
static const char *NAMES[MODES] = {"vpdpbusd alone", "+ vpslld", "+ vpaddd", "+ vpunpckldq", "+ vcvtdq2ps", "+ vfmadd"};

__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static double run(long iters, int mode) {
    const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i), b##i = _mm512_set1_epi32(i + 1);
    EACH(DECL)
    const double t0 = now();
    for (long n = 0; n < iters; n++) {
#define DOT(i) a##i = _mm512_dpbusd_epi32(a##i, x, y);
#define SHL(i) b##i = _mm512_slli_epi32(b##i, 1);
#define ADD(i) b##i = _mm512_add_epi32(b##i, x);
#define UNP(i) b##i = _mm512_unpacklo_epi32(b##i, y);
#define CVT(i) b##i = _mm512_castps_si512(_mm512_cvtepi32_ps(b##i));
#define FMA(i)                                                                                            \
    b##i = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(b##i), _mm512_castsi512_ps(x), \
                                               _mm512_castsi512_ps(y)));
        EACH(DOT)
        switch (mode) {
        case 1: EACH(SHL) break;
        case 2: EACH(ADD) break;
        case 3: EACH(UNP) break;
        case 4: EACH(CVT) break;
        case 5: EACH(FMA) break;
        }
        __asm__ volatile("" ::"v"(a0), "v"(b0));
    }
    const double t = now() - t0;
    volatile int sink = 0;
#define SUM(i) sink += _mm512_reduce_add_epi32(a##i) + _mm512_reduce_add_epi32(b##i);
    EACH(SUM)
    return t;
}

int main(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512vnni")) {
        printf("no avx512vnni on this CPU\n");
        return 0;
    }
    for (int m = 0; m < MODES; m++) {
        double best = 1e9;
        for (int r = 0; r < 5; r++) {
            const double t = run(ITERS, m);
            best = t < best ? t : best;
        }
        printf("%-16s %.3f ns per vpdpbusd\n", NAMES[m], best / (ITERS * 12.0) * 1e9);
    }
    return 0;
}
