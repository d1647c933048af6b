/* The 256-weight K-quants (Q4_K, Q5_K, Q6_K) against sw_a256 activations. */
#include <immintrin.h>

#include "sw.h"

void sw_register_qk(void) {}
