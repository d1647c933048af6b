/* 16-row tiles (q32.c's Q8_0 tiles, qk.c's K-quant tiles): 16 weight rows' bytes transposed in
 * registers so that each int32 lane of a zmm holds one row. */
#ifndef SW_TILE16_H
#define SW_TILE16_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define SW_TILE16_INLINE                                                                                     \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2," \
                                                       "fma,f16c")))

/* The order of the rows in the lanes the transposes leave: lane l holds row sw_lane_row[l]. */
static const int sw_lane_row[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

/* A tile reads 16 rows a block at a time: 16 streams, more than the hardware prefetchers follow
 * well. While it works on block b it asks for block b + SW_TILE_AHEAD of its 16 rows (past the
 * row's end: the next tile's first blocks). With the K-quant tiles' other changes of the same
 * commit, 16 activation rows from DRAM against the code before, in one process
 * (benchmarks/bench_kernel_ab.py, Intel Xeon model 207): Q4_K 118 -> 150 GMAC/s at 8192 x 2048,
 * 147 -> 164 at 2048 x 8192; Q6_K 78 -> 113 and 100 -> 137 (docs/benchmarks/native-kernels.md). */
enum { SW_TILE_AHEAD = 2 };
static inline void sw_prefetch16(const uint8_t *p, size_t stride, size_t bytes) { /* 16 rows' bytes at p */
    for (int j = 0; j < 16; j++, p += stride) {
        for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
        __builtin_prefetch(p + bytes - 1, 0, 3);
    }
}

/* At block b (p: its bytes in the tile's first row) of a tile of blocks `bytes` long: block
 * b + SW_TILE_AHEAD of the same 16 rows, or, past the row's end, of the next tile (`next`: one follows). */
static inline void sw_tile_ahead(const uint8_t *p, size_t stride, size_t bytes, int64_t b, int64_t kblocks, int next) {
    if (b + SW_TILE_AHEAD < kblocks) sw_prefetch16(p + SW_TILE_AHEAD * bytes, stride, bytes);
    else if (next) sw_prefetch16(p + 16 * stride + (SW_TILE_AHEAD - kblocks) * (int64_t)bytes, stride, bytes);
}

/* 16 rows' 32 bytes at p, p + stride, ... -> wk[k]: bytes 4k .. 4k + 3 of each row, the rows in
 * lanes as sw_lane_row (rows j and j + 8 share a zmm, whose unpacks leave them so). */
SW_TILE16_INLINE void sw_tr16x32(const uint8_t *p, size_t stride, __m512i wk[8]) {
    __m512i z[8], t[8], u[8];
    for (int j = 0; j < 8; j++) /* rows j (low half) and j + 8 (high half) */
        z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + j * stride))),
                                  _mm256_loadu_si256((const __m256i *)(p + (j + 8) * stride)), 1);
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm512_unpacklo_epi32(z[j], z[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(z[j], z[j + 1]);
    }
    for (int h = 0; h < 8; h += 4) { /* u[h + c]: dword c (lane 0 of 4), 4 + c (lane 1) of rows h .. h + 3 */
        u[h + 0] = _mm512_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int c = 0; c < 4; c++) {
        wk[c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        wk[c + 4] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    }
}

/* 16 rows' 16 bytes at p, p + stride, ... -> x[k]: dword k of each row, the rows in lanes as
 * sw_lane_row (a 4 x 4 dword transpose in each 128-bit lane). */
SW_TILE16_INLINE void sw_tr16x16(const uint8_t *p, size_t stride, __m512i x[4]) {
    __m512i h[4], t[4];
    for (int c = 0; c < 4; c++) { /* h[c] lane q: row sw_lane_row[4q + c] */
#define SW_ROW16(q) _mm_loadu_si128((const __m128i *)(p + sw_lane_row[4 * (q) + c] * stride))
        __m512i v = _mm512_castsi128_si512(SW_ROW16(0));
        v = _mm512_inserti32x4(v, SW_ROW16(1), 1);
        v = _mm512_inserti32x4(v, SW_ROW16(2), 2);
        h[c] = _mm512_inserti32x4(v, SW_ROW16(3), 3);
#undef SW_ROW16
    }
    t[0] = _mm512_unpacklo_epi32(h[0], h[1]);
    t[1] = _mm512_unpackhi_epi32(h[0], h[1]);
    t[2] = _mm512_unpacklo_epi32(h[2], h[3]);
    t[3] = _mm512_unpackhi_epi32(h[2], h[3]);
    x[0] = _mm512_unpacklo_epi64(t[0], t[2]);
    x[1] = _mm512_unpackhi_epi64(t[0], t[2]);
    x[2] = _mm512_unpacklo_epi64(t[1], t[3]);
    x[3] = _mm512_unpackhi_epi64(t[1], t[3]);
}

#endif
