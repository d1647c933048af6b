/* A decode step's decoder layers in one call: the program of shardwise/kernels/step.py.
 *
 * Python describes the layers once, as int64 words (the header and one record per layer,
 * layouts below, mirrored in step.py), and each step calls sw_step once: every layer's
 * RMSNorm, activation quantization, block-format linears, rotary + KV write + attention,
 * gated activation, residual adds and, at tp > 1, both all-reduces through the group's
 * shared-memory segment (shardwise/comm/shm.py: the same protocol, word for word), with no
 * Python between them. The kernels are the tables' (module.c), so a step computes exactly
 * what the per-op fused path computes, in the same order.
 *
 * An all-reduce whose peers have not arrived within the header's spin budget returns
 * SW_STEP_WAIT with the resume point in `st`: Python then waits through the communicator
 * (its timeout, peer checks and diagnosis) and calls again to finish. A tp group without the
 * segment (across hosts: H_EXTERNAL) returns at every all-reduce, and Python runs it. */
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "sw.h"

/* header words */
enum {
    H_ISA, H_NLAYERS, H_B, H_HIDDEN,
    H_X, H_HN, H_QA, H_QKV, H_ATT, H_OA, H_Y, H_UP, H_G, H_GA,
    H_WORDS, H_MINE, H_NPEERS, H_PEERS, /* H_PEERS .. H_PEERS + 7: the peers' seq word indices */
    H_SLOTS = H_PEERS + 8, H_SLOT_FLOATS, H_RANK, H_SIZE, H_PERIOD, H_SPIN_NS,
    H_PROFILE, /* nonzero: time the step's parts into st[5..8] */
    H_EXTERNAL, /* nonzero: every all-reduce is Python's (a tp group over TCP, shardwise/comm/tcp.py):
                 * the step returns SW_STEP_WAIT at each, and the next call resumes with y reduced */
    SW_STEP_HEADER
};

/* a linear's words: its activation block (0: an fp32 linear of the float rows), parts, output
 * width, bias; then per part (ggml type, weight pointer, row bytes, rows, kblocks; for fp32:
 * type 0, or -1 for a column-major weight (row bytes: its transpose's), and kblocks = the input
 * length) */
enum { L_BLOCK, L_NPARTS, L_OUT, L_BIAS, L_PARTS, SW_STEP_MAX_PARTS = 4, P_WORDS = 5 };
#define SW_STEP_LIN (L_PARTS + SW_STEP_MAX_PARTS * P_WORDS)

/* a layer's words */
enum {
    Y_NORM1, Y_EPS1, /* eps as the bits of a double */
    Y_QKV,
    Y_NQ = Y_QKV + SW_STEP_LIN, Y_NKV, Y_HD, Y_GROUPS, Y_KC, Y_VC, Y_POS_STRIDE, Y_HEAD_STRIDE, Y_SCALE, Y_RROW,
    Y_O,
    Y_NORM2 = Y_O + SW_STEP_LIN, Y_EPS2,
    Y_UP,
    Y_GLU = Y_UP + SW_STEP_LIN, Y_INTER,
    Y_DOWN,
    Y_OBIAS = Y_DOWN + SW_STEP_LIN, Y_DBIAS, /* the row-parallel biases, added after the reduce (0: none) */
    SW_STEP_LAYER
};


/* st (in/out): [0] layer to resume at, [1] phase (0 start, 1 o's reduce, 2 down's reduce),
 * [2] all-reduces completed so far, [3] the seq waited on, [4] ns inside all-reduces; with
 * H_PROFILE, ns added up in [5] the linears, [6] attention, [7] everything else (norms,
 * activation quantization, the gated activation, residual adds), [8] all-reduces spinning
 * for a peer (the rest of [4] is the copy in and the sum) */
enum { SW_STEP_DONE = 0, SW_STEP_WAIT = 1, SW_STEP_NOMEM = -1 };

#define PTR(T, v) ((T)(uintptr_t)(v))

static double bits_double(int64_t w) {
    double d;
    memcpy(&d, &w, sizeof d);
    return d;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void add_bias(float *y, int64_t bias, int64_t n, int64_t out) {
    if (!bias) return;
    const float *b = PTR(const float *, bias);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < out; j++) y[i * out + j] += b[j];
}

/* part type 0: fp32 rows (row bytes apart); -1: fp32 column-major (the transpose's rows, row bytes apart) */
/* y (n rows of L_OUT) = the input times every part (+ bias): the activation blocks qa of a
 * block-format linear, or the float rows x (n rows of k) of an fp32 one */
static void lin_run(const int64_t *L, int64_t isa, const void *qa, const float *x, int64_t n, float *y) {
    const int64_t out = L[L_OUT];
    int64_t col = 0;
    for (int64_t p = 0; p < L[L_NPARTS]; p++) {
        const int64_t *P = L + L_PARTS + p * P_WORDS;
        if (L[L_BLOCK])
            sw_gemm_for(P[0], isa)(PTR(const uint8_t *, P[1]), (size_t)P[2], P[3], P[4], qa, n, y + col, out);
        else
            sw_f32_for(P[0] != 0, isa)(PTR(const float *, P[1]), P[2] / 4, P[3], P[4], x, P[4], n, y + col, out);
        col += P[3];
    }
    add_bias(y, L[L_BIAS], n, out);
}

/* the activation blocks of n rows of k for L, when it reads blocks */
static void quant_in(const int64_t *L, int64_t isa, const float *x, int64_t n, int64_t k, void *qa) {
    if (L[L_BLOCK]) sw_quant_for(L[L_BLOCK], isa)(x, k, n, k, qa);
}


/* ---- the shared-memory all-reduce (comm/shm.py's protocol) ------------------------------------ */
static int64_t seq_of(const int64_t *H, int64_t call) { return call % H[H_PERIOD]; }

static float *slot(const int64_t *H, int64_t seq, int64_t rank) {
    return PTR(float *, H[H_SLOTS]) + ((seq & 1) * H[H_SIZE] + rank) * H[H_SLOT_FLOATS];
}

static void ar_post(const int64_t *H, const float *y, int64_t n, int64_t seq) {
    memcpy(slot(H, seq, H[H_RANK]), y, (size_t)n * sizeof(float));
    int64_t *words = PTR(int64_t *, H[H_WORDS]);
    __atomic_store_n(&words[H[H_MINE]], seq, __ATOMIC_RELEASE); /* after the data */
}

static int ar_arrived(const int64_t *H, int64_t seq) {
    const int64_t *words = PTR(const int64_t *, H[H_WORDS]), period = H[H_PERIOD];
    for (int64_t p = 0; p < H[H_NPEERS]; p++) {
        int64_t d = (__atomic_load_n(&words[H[H_PEERS + p]], __ATOMIC_ACQUIRE) - seq) % period;
        if (d < 0) d += period;
        if (d > 1) return 0;
    }
    return 1;
}

static int ar_spin(const int64_t *H, int64_t seq) {
    const int64_t budget = H[H_SPIN_NS];
    int64_t t0 = -1;
    for (unsigned polls = 0;; polls++) {
        if (ar_arrived(H, seq)) return 1;
        if (budget < 0) return 0; /* no spin at all: every late peer's wait goes to Python (tests) */
        if ((polls & 63) == 63) {
            const int64_t t = now_ns();
            if (t0 < 0) t0 = t;
            else if (t - t0 > budget) return 0;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}

/* y = every rank's slot summed in rank order (as _reduce: r0 + r1, then + r2, ...) */
static void ar_sum(const int64_t *H, float *y, int64_t n, int64_t seq) {
    const float *r0 = slot(H, seq, 0), *r1 = slot(H, seq, 1);
    for (int64_t i = 0; i < n; i++) y[i] = r0[i] + r1[i];
    for (int64_t r = 2; r < H[H_SIZE]; r++) {
        const float *rr = slot(H, seq, r);
        for (int64_t i = 0; i < n; i++) y[i] += rr[i];
    }
}

/* ---- the step -------------------------------------------------------------------------------- */
/* A reduce of y (n floats): post, spin, sum. 1 = done, 0 = wait (posted; st says where). */
static int reduce_or_wait(const int64_t *H, const sw_step_args *a, int64_t *st, float *y, int64_t n, int64_t phase,
                          int64_t layer) {
    if (H[H_EXTERNAL]) { /* Python reduces y in place (st[3] = -1: no seq), then calls again: done */
        if (st[1] != phase) {
            st[0] = layer, st[1] = phase, st[3] = -1;
            return 0;
        }
        st[2] += 1, st[1] = 0;
        return 1;
    }
    const int64_t seq = seq_of(H, a->calls + st[2] + 1);
    const int64_t t0 = now_ns();
    if (st[1] != phase) ar_post(H, y, n, seq); /* not yet posted: a resume has posted already */
    const int64_t t1 = now_ns();
    const int arrived = ar_spin(H, seq);
    const int64_t t2 = now_ns();
    st[8] += t2 - t1;
    if (!arrived) {
        st[0] = layer, st[1] = phase, st[3] = seq;
        st[4] += t2 - t0;
        return 0;
    }
    ar_sum(H, y, n, seq);
    st[2] += 1, st[1] = 0;
    st[4] += now_ns() - t0;
    return 1;
}

/* with H_PROFILE: ns since *t added to st[slot], *t moved on */
#define LAP(slot)                            \
    if (prof) {                              \
        const int64_t t1 = now_ns();         \
        st[slot] += t1 - tl;                 \
        tl = t1;                             \
    }

int sw_step(const int64_t *H, const int64_t *layers, const sw_step_args *a, int64_t *st) {
    const int64_t isa = H[H_ISA], B = H[H_B], hid = H[H_HIDDEN];
    float *x = PTR(float *, H[H_X]), *hn = PTR(float *, H[H_HN]), *qkv = PTR(float *, H[H_QKV]);
    float *att = PTR(float *, H[H_ATT]), *y = PTR(float *, H[H_Y]), *up = PTR(float *, H[H_UP]);
    float *g = PTR(float *, H[H_G]);
    void *qa = PTR(void *, H[H_QA]), *oa = PTR(void *, H[H_OA]), *ga = PTR(void *, H[H_GA]);
    const int tp = H[H_SIZE] > 1, prof = H[H_PROFILE] != 0;
    int64_t tl = prof ? now_ns() : 0;
    for (int64_t l = st[0]; l < H[H_NLAYERS]; l++) {
        const int64_t *Y = layers + l * SW_STEP_LAYER;
        const int64_t *Lq = Y + Y_QKV, *Lo = Y + Y_O, *Lu = Y + Y_UP, *Ld = Y + Y_DOWN;
        const int64_t phase = (l == st[0]) ? st[1] : 0;
        if (phase == 0) {
            sw_rmsnorm_table[isa](x, hid, B, hid, PTR(const float *, Y[Y_NORM1]), (float)bits_double(Y[Y_EPS1]), hn,
                                  hid);
            quant_in(Lq, isa, hn, B, hid, qa);
            LAP(7) lin_run(Lq, isa, qa, hn, B, qkv);
            LAP(5) const int64_t nq = Y[Y_NQ], hd = Y[Y_HD], ldq = Lq[L_OUT];
            if (sw_attend_table[isa](qkv, ldq, B, nq, Y[Y_NKV], hd, PTR(const int64_t *, Y[Y_GROUPS]), a->cos, a->sin,
                                     a->ldr, a->rot, PTR(float *, Y[Y_KC]), PTR(float *, Y[Y_VC]), Y[Y_POS_STRIDE],
                                     Y[Y_HEAD_STRIDE], a->widx, a->wbase, a->ridx, Y[Y_RROW], a->K, a->mask, a->ldm,
                                     (float)bits_double(Y[Y_SCALE]), att, nq * hd))
                return SW_STEP_NOMEM;
            LAP(6) quant_in(Lo, isa, att, B, nq * hd, oa);
            LAP(7) lin_run(Lo, isa, oa, att, B, y); /* its bias is Y_OBIAS, after the reduce */
            LAP(5)
        }
        if (phase <= 1) {
            if (tp && !reduce_or_wait(H, a, st, y, B * hid, 1, l)) return SW_STEP_WAIT;
            if (prof) tl = now_ns(); /* the reduce timed itself */
            add_bias(y, Y[Y_OBIAS], B, hid);
            sw_add_rmsnorm_table[isa](x, y, B, hid, PTR(const float *, Y[Y_NORM2]), (float)bits_double(Y[Y_EPS2]), x,
                                      hn);
            quant_in(Lu, isa, hn, B, hid, qa);
            LAP(7) lin_run(Lu, isa, qa, hn, B, up);
            LAP(5) const int64_t inter = Y[Y_INTER];
            sw_glu_table[isa](up, 2 * inter, B, inter, (int)Y[Y_GLU], g, inter);
            quant_in(Ld, isa, g, B, inter, ga);
            LAP(7) lin_run(Ld, isa, ga, g, B, y);
            LAP(5)
        }
        if (tp && !reduce_or_wait(H, a, st, y, B * hid, 2, l)) return SW_STEP_WAIT;
        if (prof) tl = now_ns();
        add_bias(y, Y[Y_DBIAS], B, hid);
        for (int64_t i = 0; i < B * hid; i++) x[i] += y[i];
        LAP(7)
    }
    st[0] = H[H_NLAYERS], st[1] = 0;
    return SW_STEP_DONE;
}

/* NULL, or why the program cannot run here (a type without a gemm, a block without a quantizer) */
const char *sw_step_check(const int64_t *H, const int64_t *layers) {
    const int64_t isa = H[H_ISA];
    if (isa < 0 || isa >= SW_NUM_ISA) return "unknown ISA";
    if (H[H_B] < 1 || H[H_HIDDEN] < 1 || H[H_NLAYERS] < 0) return "bad sizes";
    if (!sw_rmsnorm_table[isa] || !sw_add_rmsnorm_table[isa] || !sw_attend_table[isa] || !sw_glu_table[isa])
        return "no norm, attention or gated-activation kernel for this ISA";
    if (H[H_SIZE] > 1 && !H[H_EXTERNAL] && (H[H_NPEERS] != H[H_SIZE] - 1 || H[H_NPEERS] > 8 || H[H_PERIOD] < 4 || !H[H_WORDS] ||
                          !H[H_SLOTS] || H[H_SLOT_FLOATS] < H[H_B] * H[H_HIDDEN]))
        return "bad all-reduce segment";
    for (int64_t l = 0; l < H[H_NLAYERS]; l++) {
        const int64_t *Y = layers + l * SW_STEP_LAYER;
        const int64_t lins[4] = {Y_QKV, Y_O, Y_UP, Y_DOWN};
        for (int i = 0; i < 4; i++) {
            const int64_t *L = Y + lins[i];
            if (L[L_BLOCK] != 0 && L[L_BLOCK] != 32 && L[L_BLOCK] != 256) return "an activation block that is not 32 or 256";
            if (L[L_BLOCK] && !sw_quant_for(L[L_BLOCK], isa)) return "no activation quantizer";
            if (L[L_NPARTS] < 1 || L[L_NPARTS] > SW_STEP_MAX_PARTS) return "bad parts";
            int64_t rows = 0;
            for (int64_t p = 0; p < L[L_NPARTS]; p++) {
                const int64_t *P = L + L_PARTS + p * P_WORDS;
                if (!L[L_BLOCK] ? ((P[0] != 0 && P[0] != -1) || !sw_f32_for(P[0] != 0, isa))
                                : (P[0] < 1 || P[0] >= SW_NUM_TYPES || !sw_gemm_for(P[0], isa)))
                    return "a weight type without a kernel";
                rows += P[3];
            }
            if (rows != L[L_OUT]) return "parts that do not add up to the output";
        }
        if (Y[Y_GLU] != 0 && Y[Y_GLU] != 1) return "unknown gated activation";
    }
    return NULL;
}

int sw_step_header_words(void) { return SW_STEP_HEADER; }
int sw_step_layer_words(void) { return SW_STEP_LAYER; }
int sw_step_lin_words(void) { return SW_STEP_LIN; }
