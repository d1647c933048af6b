/* The 32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) against sw_a32 activations. */
#include <immintrin.h>

#include "sw.h"

/* Q8_0: 34 bytes per block: fp16 d, 32 x int8.  w = d * q. */
static void gemm_q8_0_portable(const uint8_t *w, size_t row_bytes, int64_t rows, int64_t kblocks, const void *x,
                               int64_t n, float *y, int64_t ldy) {
    const sw_a32 *xa = (const sw_a32 *)x;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = w + r * row_bytes;
        for (int64_t i = 0; i < n; i++) {
            const sw_a32 *xb = xa + i * kblocks;
            float acc = 0.0f;
            for (int64_t b = 0; b < kblocks; b++) {
                const uint8_t *blk = wr + 34 * b;
                const int8_t *q = (const int8_t *)(blk + 2);
                int dot = 0;
                for (int j = 0; j < 32; j++) dot += q[j] * xb[b].q[j];
                acc += sw_load_fp16(blk) * xb[b].d * (float)dot;
            }
            y[i * ldy + r] = acc;
        }
    }
}

void sw_register_q32(void) { sw_gemm_table[SW_Q8_0][SW_ISA_PORTABLE] = gemm_q8_0_portable; }
