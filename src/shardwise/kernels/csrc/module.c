/* The Python module shardwise.kernels._native: a thin binding over the kernel tables.
 *
 * Arguments are plain integers (data pointers from tensor.data_ptr(), sizes), so the module
 * needs neither torch nor numpy headers to build. Every call checks its ISA and format are
 * present and returns None; shapes and pointers are the caller's contract
 * (shardwise/kernels/native.py checks them once per weight, at load). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#include "sw.h"

sw_gemm_fn sw_gemm_table[SW_NUM_TYPES][SW_NUM_ISA];
sw_dequant_fn sw_dequant_table[SW_NUM_TYPES][SW_NUM_ISA];
sw_quant_fn sw_quant32_table[SW_NUM_ISA];
sw_quant_fn sw_quant256_table[SW_NUM_ISA];
sw_rmsnorm_fn sw_rmsnorm_table[SW_NUM_ISA];
sw_add_rmsnorm_fn sw_add_rmsnorm_table[SW_NUM_ISA];
sw_attend_fn sw_attend_table[SW_NUM_ISA];
sw_glu_fn sw_glu_table[SW_NUM_ISA];
sw_f32_fn sw_f32_table[SW_NUM_ISA];
sw_f32_fn sw_f32t_table[SW_NUM_ISA];

static const char *isa_names[SW_NUM_ISA] = {"portable", "avx2", "avx512"};

static int cpu_has(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case SW_ISA_PORTABLE:
        return 1;
    case SW_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case SW_ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni") && cpu_has(SW_ISA_AVX2);
    }
    return 0;
}

static int args_i64(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd integer arguments, got %zd", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int check_isa(long long isa) {
    if (isa < 0 || isa >= SW_NUM_ISA || !cpu_has((int)isa)) {
        PyErr_Format(PyExc_ValueError, "ISA %lld is not available on this CPU", isa);
        return -1;
    }
    return 0;
}

/* gemm(type, isa, w, row_bytes, rows, kblocks, x, n, y, ldy) */
static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[10];
    if (args_i64(args, nargs, 10, a, "gemm") < 0) return NULL;
    if (a[0] < 0 || a[0] >= SW_NUM_TYPES) return PyErr_Format(PyExc_ValueError, "unknown weight type %lld", a[0]);
    if (check_isa(a[1]) < 0) return NULL;
    sw_gemm_fn f = sw_gemm_for(a[0], a[1]); /* or the next ISA down */
    if (!f) return PyErr_Format(PyExc_ValueError, "no %s kernel for weight type %lld", isa_names[a[1]], a[0]);
    Py_BEGIN_ALLOW_THREADS f((const uint8_t *)(uintptr_t)a[2], (size_t)a[3], a[4], a[5], (const void *)(uintptr_t)a[6],
                             a[7], (float *)(uintptr_t)a[8], a[9]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* quantize(block, isa, x, ldx, n, k, out): block 32 -> sw_a32, 256 -> sw_a256 */
static PyObject *py_quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[7];
    if (args_i64(args, nargs, 7, a, "quantize") < 0) return NULL;
    if (check_isa(a[1]) < 0) return NULL;
    sw_quant_fn f = sw_quant_for(a[0], a[1]);
    if (!f) return PyErr_Format(PyExc_ValueError, "no %s activation quantizer for blocks of %lld", isa_names[a[1]], a[0]);
    if (a[5] % a[0]) return PyErr_Format(PyExc_ValueError, "row length %lld is not a multiple of %lld", a[5], a[0]);
    Py_BEGIN_ALLOW_THREADS f((const float *)(uintptr_t)a[2], a[3], a[4], a[5], (void *)(uintptr_t)a[6]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* dequantize(type, isa, w, row_bytes, rows, kblocks, out) */
static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[7];
    if (args_i64(args, nargs, 7, a, "dequantize") < 0) return NULL;
    if (a[0] < 0 || a[0] >= SW_NUM_TYPES) return PyErr_Format(PyExc_ValueError, "unknown weight type %lld", a[0]);
    if (check_isa(a[1]) < 0) return NULL;
    sw_dequant_fn f = NULL;
    for (long long i = a[1]; i >= 0 && !f; i--) f = sw_dequant_table[a[0]][i];
    if (!f) return PyErr_Format(PyExc_ValueError, "no %s dequantizer for weight type %lld", isa_names[a[1]], a[0]);
    Py_BEGIN_ALLOW_THREADS f((const uint8_t *)(uintptr_t)a[2], (size_t)a[3], a[4], a[5], (float *)(uintptr_t)a[6]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static int args_i64_f(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_ssize_t fpos, long long *out,
                      double *f, const char *name);

/* The optional trailing (block, q) of a kernel that can also quantize its output rows of
 * `row` floats into activation blocks: *qf = the quantizer, or NULL without them. -1 (an
 * exception set) when there is no quantizer for that block or the rows do not split into it. */
static int tail_quantizer(Py_ssize_t nargs, Py_ssize_t base, const long long *a, long long row, sw_quant_fn *qf,
                          const char *name) {
    *qf = NULL;
    if (nargs == base) return 0;
    const long long block = a[base], isa = a[0];
    *qf = sw_quant_for(block, isa);
    if (!*qf || row % block) {
        PyErr_Format(PyExc_ValueError, "%s: no quantizer for rows of %lld in blocks of %lld", name, row, block);
        return -1;
    }
    return 0;
}

/* rmsnorm(isa, x, ldx, n, k, w, eps, out, ldo[, block, q]): eps a float, the rest integers.
 * With block (32 or 256) and q: the normed rows also quantized into activation blocks at q
 * (what the next block-format linear reads), in the same call. */
static PyObject *py_rmsnorm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[11] = {0};
    double eps;
    if (nargs != 9 && nargs != 11) return PyErr_Format(PyExc_TypeError, "rmsnorm takes 9 or 11 arguments, got %zd", nargs);
    if (args_i64_f(args, nargs, nargs, 6, a, &eps, "rmsnorm") < 0) return NULL;
    if (check_isa(a[0]) < 0) return NULL;
    sw_rmsnorm_fn f = NULL;
    for (long long i = a[0]; i >= 0 && !f; i--) f = sw_rmsnorm_table[i];
    if (!f) return PyErr_Format(PyExc_ValueError, "no %s rmsnorm", isa_names[a[0]]);
    sw_quant_fn qf;
    if (tail_quantizer(nargs, 9, a, a[4], &qf, "rmsnorm") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS f((const float *)(uintptr_t)a[1], a[2], a[3], a[4], (const float *)(uintptr_t)a[5], (float)eps,
                             (float *)(uintptr_t)a[7], a[8]);
    if (qf) qf((const float *)(uintptr_t)a[7], a[8], a[3], a[4], (void *)(uintptr_t)a[10]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* Integer arguments, except one float at position `fpos` (into *f). */
static int args_i64_f(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_ssize_t fpos, long long *out,
                      double *f, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (i == fpos) {
            *f = PyFloat_AsDouble(args[i]);
            if (*f == -1.0 && PyErr_Occurred()) return -1;
            out[i] = 0;
            continue;
        }
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* add_rmsnorm(isa, x, a, n, k, w, eps, sum, out[, block, q]): as rmsnorm, q the normed rows' blocks */
static PyObject *py_add_rmsnorm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[11] = {0};
    double eps;
    if (nargs != 9 && nargs != 11) return PyErr_Format(PyExc_TypeError, "add_rmsnorm takes 9 or 11 arguments, got %zd", nargs);
    if (args_i64_f(args, nargs, nargs, 6, a, &eps, "add_rmsnorm") < 0) return NULL;
    if (check_isa(a[0]) < 0) return NULL;
    sw_add_rmsnorm_fn f = sw_add_rmsnorm_table[a[0]];
    sw_quant_fn qf;
    if (tail_quantizer(nargs, 9, a, a[4], &qf, "add_rmsnorm") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS f((const float *)(uintptr_t)a[1], (const float *)(uintptr_t)a[2], a[3], a[4],
                             (const float *)(uintptr_t)a[5], (float)eps, (float *)(uintptr_t)a[7], (float *)(uintptr_t)a[8]);
    if (qf) qf((const float *)(uintptr_t)a[8], a[4], a[3], a[4], (void *)(uintptr_t)a[10]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* attend(isa, qkv, ldq, B, nq, nkv, hd, groups, cos, sin, ldr, rot, k, v, pos_stride, head_stride,
 *        widx, wbase, ridx, rrow, K, mask, ldm, scale, out, ldo): pointers as integers (0 = none),
 * scale a float (csrc/attn.c) */
static PyObject *py_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[28] = {0};
    double scale;
    if (nargs != 26 && nargs != 28) return PyErr_Format(PyExc_TypeError, "attend takes 26 or 28 arguments, got %zd", nargs);
    if (args_i64_f(args, nargs, nargs, 23, a, &scale, "attend") < 0) return NULL;
    if (check_isa(a[0]) < 0) return NULL;
    if (a[4] < 1 || a[5] < 1 || a[6] < 1 || a[11] < 0 || a[11] > a[6] || a[11] % 2)
        return PyErr_Format(PyExc_ValueError, "attend: bad heads (%lld q, %lld kv, dim %lld, rotary %lld)", a[4], a[5],
                            a[6], a[11]);
    if (!a[7] && a[4] % a[5])
        return PyErr_Format(PyExc_ValueError, "attend: %lld query heads do not divide over %lld KV heads", a[4], a[5]);
    sw_attend_fn f = sw_attend_table[a[0]];
    sw_quant_fn qf; /* the output also quantized, for the block-format linear that reads it */
    if (tail_quantizer(nargs, 26, a, a[4] * a[6], &qf, "attend") < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = f((float *)(uintptr_t)a[1], a[2], a[3], a[4], a[5], a[6], (const int64_t *)(uintptr_t)a[7],
                                  (const float *)(uintptr_t)a[8], (const float *)(uintptr_t)a[9], a[10], a[11],
                                  (float *)(uintptr_t)a[12], (float *)(uintptr_t)a[13], a[14], a[15],
                                  (const int64_t *)(uintptr_t)a[16], a[17], (const int64_t *)(uintptr_t)a[18], a[19],
                                  a[20], (const uint8_t *)(uintptr_t)a[21], a[22], (float)scale,
                                  (float *)(uintptr_t)a[24], a[25]);
    if (!rc && qf) qf((const float *)(uintptr_t)a[24], a[25], a[3], a[4] * a[6], (void *)(uintptr_t)a[27]);
    Py_END_ALLOW_THREADS if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* glu(isa, h, ldh, n, inter, kind, out, ldo[, block, q]): q the output's activation blocks */
static PyObject *py_glu(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[10] = {0};
    if (nargs != 8 && nargs != 10) return PyErr_Format(PyExc_TypeError, "glu takes 8 or 10 arguments, got %zd", nargs);
    if (args_i64(args, nargs, nargs, a, "glu") < 0) return NULL;
    if (check_isa(a[0]) < 0) return NULL;
    if (a[5] != 0 && a[5] != 1) return PyErr_Format(PyExc_ValueError, "glu: unknown activation kind %lld", a[5]);
    sw_glu_fn f = sw_glu_table[a[0]];
    sw_quant_fn qf;
    if (tail_quantizer(nargs, 8, a, a[4], &qf, "glu") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS f((const float *)(uintptr_t)a[1], a[2], a[3], a[4], (int)a[5], (float *)(uintptr_t)a[6], a[7]);
    if (qf) qf((const float *)(uintptr_t)a[6], a[7], a[3], a[4], (void *)(uintptr_t)a[9]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

int32_t *sw_scratch_i32(size_t n) {
    static __thread int32_t *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        cap = n + n / 2 + 64;
        buf = malloc(cap * sizeof(int32_t));
        if (!buf) cap = 0;
    }
    return buf;
}

/* argmax(x, ldx, n, v, out): out (int64) the first index of each row's largest value (norm.c) */
static PyObject *py_argmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[5] = {0};
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "argmax takes 5 arguments, got %zd", nargs);
    if (args_i64(args, nargs, nargs, a, "argmax") < 0) return NULL;
    if (a[2] < 0 || a[3] < 1 || a[1] < a[3])
        return PyErr_Format(PyExc_ValueError, "argmax: %lld rows of %lld values, %lld apart", a[2], a[3], a[1]);
    Py_BEGIN_ALLOW_THREADS sw_argmax((const float *)(uintptr_t)a[0], a[1], a[2], a[3], (int64_t *)(uintptr_t)a[4]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* f32_gemm(isa, w, ldw, rows, k, x, ldx, n, y, ldy[, transposed]): an fp32 linear (f32.c);
 * transposed: w column-major (w[j * ldw + r] is W[r, j]) */
static PyObject *py_f32_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[11] = {0};
    if (nargs != 10 && nargs != 11) return PyErr_Format(PyExc_TypeError, "f32_gemm takes 10 or 11 arguments, got %zd", nargs);
    if (args_i64(args, nargs, nargs, a, "f32_gemm") < 0) return NULL;
    if (check_isa(a[0]) < 0) return NULL;
    sw_f32_fn f = sw_f32_for(a[10] != 0, a[0]);
    Py_BEGIN_ALLOW_THREADS f((const float *)(uintptr_t)a[1], a[2], a[3], a[4], (const float *)(uintptr_t)a[5], a[6], a[7],
                             (float *)(uintptr_t)a[8], a[9]);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* step(header, layers, cos, sin, ldr, rot, mask, ldm, K, wbase, widx, ridx, calls, st) -> 0 done,
 * 1 waiting for a peer (st: where to resume), -1 out of memory: a decode step's layers (step.c) */
static PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[14];
    if (args_i64(args, nargs, 14, a, "step") < 0) return NULL;
    const int64_t *H = (const int64_t *)(uintptr_t)a[0], *layers = (const int64_t *)(uintptr_t)a[1];
    if (!H || !layers || !a[13]) return PyErr_Format(PyExc_ValueError, "step: null program");
    const char *why = sw_step_check(H, layers);
    if (why) return PyErr_Format(PyExc_ValueError, "step: %s", why);
    if (check_isa(H[0]) < 0) return NULL;
    sw_step_args sa = {(const float *)(uintptr_t)a[2], (const float *)(uintptr_t)a[3], a[4], a[5],
                       (const uint8_t *)(uintptr_t)a[6], a[7], a[8], a[9], (const int64_t *)(uintptr_t)a[10],
                       (const int64_t *)(uintptr_t)a[11], a[12]};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = sw_step(H, layers, &sa, (int64_t *)(uintptr_t)a[13]);
    Py_END_ALLOW_THREADS if (rc < 0) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

/* isas() -> names of the ISA levels this CPU runs, lowest first */
static PyObject *py_isas(PyObject *self, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (int i = 0; i < SW_NUM_ISA; i++)
        if (cpu_has(i)) {
            PyObject *s = PyUnicode_FromString(isa_names[i]);
            PyList_Append(out, s);
            Py_DECREF(s);
        }
    return out;
}

/* kernels() -> {type id: [ISA names with a gemm for it]} */
static PyObject *py_kernels(PyObject *self, PyObject *unused) {
    PyObject *out = PyDict_New();
    for (int t = 0; t < SW_NUM_TYPES; t++) {
        PyObject *names = PyList_New(0);
        for (int i = 0; i < SW_NUM_ISA; i++)
            if (sw_gemm_table[t][i]) {
                PyObject *s = PyUnicode_FromString(isa_names[i]);
                PyList_Append(names, s);
                Py_DECREF(s);
            }
        if (PyList_GET_SIZE(names)) {
            PyObject *k = PyLong_FromLong(t);
            PyDict_SetItem(out, k, names);
            Py_DECREF(k);
        }
        Py_DECREF(names);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL, "gemm(type, isa, w, row_bytes, rows, kblocks, x, n, y, ldy)"},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL, "quantize(block, isa, x, ldx, n, k, out)"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL, "dequantize(type, isa, w, row_bytes, rows, kblocks, out)"},
    {"rmsnorm", (PyCFunction)(void (*)(void))py_rmsnorm, METH_FASTCALL, "rmsnorm(isa, x, ldx, n, k, w, eps, out, ldo[, block, q])"},
    {"add_rmsnorm", (PyCFunction)(void (*)(void))py_add_rmsnorm, METH_FASTCALL, "add_rmsnorm(isa, x, a, n, k, w, eps, sum, out[, block, q])"},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL, "attend(isa, qkv, ldq, B, nq, nkv, hd, groups, cos, sin, ldr, rot, k, v, pos_stride, head_stride, widx, wbase, ridx, rrow, K, mask, ldm, scale, out, ldo[, block, q])"},
    {"glu", (PyCFunction)(void (*)(void))py_glu, METH_FASTCALL, "glu(isa, h, ldh, n, inter, kind, out, ldo[, block, q])"},
    {"argmax", (PyCFunction)(void (*)(void))py_argmax, METH_FASTCALL, "argmax(x, ldx, n, v, out)"},
    {"f32_gemm", (PyCFunction)(void (*)(void))py_f32_gemm, METH_FASTCALL, "f32_gemm(isa, w, ldw, rows, k, x, ldx, n, y, ldy[, transposed])"},
    {"step", (PyCFunction)(void (*)(void))py_step, METH_FASTCALL, "step(header, layers, cos, sin, ldr, rot, mask, ldm, K, wbase, widx, ridx, calls, st) -> 0 done, 1 waiting"},
    {"isas", py_isas, METH_NOARGS, "ISA levels this CPU runs, lowest first"},
    {"kernels", py_kernels, METH_NOARGS, "{type id: [ISA names with a gemm]}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "shardwise's native block-format kernels", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    sw_register_act();
    sw_register_q32();
    sw_register_qk();
    sw_register_norm();
    sw_register_attn();
    sw_register_f32();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *names = PyTuple_New(SW_NUM_ISA);
    for (int i = 0; i < SW_NUM_ISA; i++) PyTuple_SET_ITEM(names, i, PyUnicode_FromString(isa_names[i]));
    PyModule_AddObject(m, "ISA_NAMES", names);
    PyModule_AddIntConstant(m, "A32_BYTES", (long)sizeof(sw_a32));
    PyModule_AddIntConstant(m, "A256_BYTES", (long)sizeof(sw_a256));
    PyModule_AddIntConstant(m, "A256_M", SW_A256_M);
    PyModule_AddIntConstant(m, "STEP_HEADER_WORDS", sw_step_header_words());
    PyModule_AddIntConstant(m, "STEP_LAYER_WORDS", sw_step_layer_words());
    PyModule_AddIntConstant(m, "STEP_LIN_WORDS", sw_step_lin_words());
    return m;
}
