/* runtime gemm: the matrix products of backend "ember"'s CUDA programs, called through cuBLASLt from C.
 *
 * A compiled CUDA program calls torch for its GEMMs (extern kernels): torch.mm, torch.addmm,
 * torch.matmul and F.linear. Each such call costs 19-25 us of host time at GPT-2's bf16 shapes on
 * the H200 host, where the Gemm's call costs ~16, 12.6 of them in cublasLtMatmul itself: what it
 * saves is torch's dispatch and the heuristic query torch repeats on every call
 * (bench/results/fullsize_h200_2026-12-01_s50.txt); a full-size transformer's training step and
 * Llama's inference are host-bound there. ember.config.cublaslt_gemm (default True) makes the
 * program call a Gemm object instead (em_gemm_new, from em_runtime_ember.c's program_extern):
 *
 *   - it reads its operands through DLPack (no Python), and takes the call when they are plain
 *     float32 / float16 / bfloat16 CUDA tensors of one dtype on the current device, A (m, k) with
 *     unit stride in one of its two dims (or an n-d input whose rows collapse, as F.linear's and
 *     matmul's x), B (k, n) likewise (F.linear's weight transposed), a bias (addmm's and F.linear's)
 *     of n dense elements broadcast over the rows, no gradient recorded, and no CUDA graph being
 *     captured on the current stream;
 *   - it computes D = A @ B (+ bias) as cuBLASLt's column-major D^T = B^T A^T, the bias added by
 *     the CUBLASLT_EPILOGUE_BIAS epilogue, accumulating in float32 (TF32 for float32 exactly when
 *     torch.backends.cuda.matmul.allow_tf32 says so, read on every call), into a new contiguous
 *     tensor (or addmm/mm/matmul's out=), on torch's current stream, with a 32 MiB workspace of its
 *     own per stream;
 *   - the algorithm is chosen once per (device, dtype, compute type, sizes, transposes, leading
 *     dims, pointer alignments, epilogue) by cublasLtMatmulAlgoGetHeuristic and kept for the
 *     process (a plan; torch asks again on every call);
 *   - anything else calls the torch function itself with the same arguments: other dtypes and
 *     layouts, the CPU, meta and subclass tensors, torch.matmul of batched operands, a call under
 *     torch.autocast (a program runs with autocast off; torch casts at dispatch), reduced-precision
 *     reductions switched off (torch.backends.cuda.matmul.allow_bf16/fp16_reduced_precision_reduction
 *     False), fp16 accumulation on, float32_matmul_precision "medium", no cuBLASLt in the process,
 *     an out= that overlaps an operand, a plan cuBLASLt has no algorithm for, a failed cuBLASLt
 *     call. So the Gemm is never a new error.
 *
 * Values: cuBLAS's GEMMs, as torch's, with float32 accumulation; the algorithm can differ from the
 * one torch's own heuristic query or cublasGemmEx picks, so results agree with eager's within the
 * dtype's matmul tolerance, not bitwise (as Inductor's extern mm agrees with eager).
 *
 *   ember._C._gemm_stats() -> {"cublaslt": calls taken, "torch": calls given to torch, "plans": plans
 *       made, "library": cuBLASLt's soname or None, "last_fallback": why the last call went to torch}
 *
 * The cuBLASLt API (cublasLt.h) is declared here by hand from its reference manual, as em_runtime_cuda.c
 * declares the driver API: building ember never needs CUDA. */
#include "guard/em_guard.h"
#include "runtime/em_runtime.h"

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h> /* T_PYSSIZET, READONLY (kept as aliases of Py_T_* by 3.12) */

/* ---- cuBLASLt (cublasLt.h, cublas_api.h, library_types.h) ---- */
typedef int cublasStatus_t; /* CUBLAS_STATUS_SUCCESS = 0 */
typedef void *cublasLtHandle_t, *cublasLtMatmulDesc_t, *cublasLtMatrixLayout_t, *cublasLtMatmulPreference_t;
typedef struct {
    uint64_t data[8];
} cublasLtMatmulAlgo_t;
typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;
enum {
    CUDA_R_32F = 0,
    CUDA_R_16F = 2,
    CUDA_R_16BF = 14,
    CUBLAS_COMPUTE_32F = 68,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
    CUBLAS_OP_N = 0,
    CUBLAS_OP_T = 1,
    CUBLASLT_MATMUL_DESC_TRANSA = 3,
    CUBLASLT_MATMUL_DESC_TRANSB = 4,
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
    CUBLASLT_EPILOGUE_DEFAULT = 1,
    CUBLASLT_EPILOGUE_BIAS = 4,
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

#define LT_FUNCS(_)                                                                                                    \
    _(cublasLtCreate, cublasStatus_t, (cublasLtHandle_t *))                                                            \
    _(cublasLtMatmulDescCreate, cublasStatus_t, (cublasLtMatmulDesc_t *, int, int))                                    \
    _(cublasLtMatmulDescDestroy, cublasStatus_t, (cublasLtMatmulDesc_t))                                               \
    _(cublasLtMatmulDescSetAttribute, cublasStatus_t, (cublasLtMatmulDesc_t, int, const void *, size_t))               \
    _(cublasLtMatrixLayoutCreate, cublasStatus_t, (cublasLtMatrixLayout_t *, int, uint64_t, uint64_t, int64_t))        \
    _(cublasLtMatrixLayoutDestroy, cublasStatus_t, (cublasLtMatrixLayout_t))                                           \
    _(cublasLtMatmulPreferenceCreate, cublasStatus_t, (cublasLtMatmulPreference_t *))                                  \
    _(cublasLtMatmulPreferenceDestroy, cublasStatus_t, (cublasLtMatmulPreference_t))                                   \
    _(cublasLtMatmulPreferenceSetAttribute, cublasStatus_t, (cublasLtMatmulPreference_t, int, const void *, size_t))   \
    _(cublasLtMatmulAlgoGetHeuristic, cublasStatus_t,                                                                  \
      (cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, \
       cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int, cublasLtMatmulHeuristicResult_t *, int *))             \
    _(cublasLtMatmul, cublasStatus_t,                                                                                  \
      (cublasLtHandle_t, cublasLtMatmulDesc_t, const void *, const void *, cublasLtMatrixLayout_t, const void *,       \
       cublasLtMatrixLayout_t, const void *, const void *, cublasLtMatrixLayout_t, void *, cublasLtMatrixLayout_t,     \
       const cublasLtMatmulAlgo_t *, void *, size_t, void *))

static struct {
#define DECL(name, ret, args) ret(*name) args;
    LT_FUNCS(DECL)
#undef DECL
    void *lib;
    int tried;
    const char *soname;
    cublasLtHandle_t handle[64]; /* per device, made on first use there */
} Lt;

/* cuBLASLt as torch loaded it (the same library and version; RTLD_NOLOAD), else by its soname.
 * 0 when usable. */
static int lt_load(void) {
    if (Lt.tried) return Lt.lib ? 0 : -1;
    Lt.tried = 1;
    static const char *const sonames[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11"};
    for (int pass = 0; pass < 2 && !Lt.lib; pass++)
        for (size_t i = 0; i < sizeof sonames / sizeof *sonames && !Lt.lib; i++)
            if ((Lt.lib = dlopen(sonames[i], RTLD_LAZY | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0)))) Lt.soname = sonames[i];
    if (!Lt.lib) return -1;
#define LOAD(name, ret, args)                                   \
    if (!(*(void **)&Lt.name = dlsym(Lt.lib, #name))) { \
        Lt.lib = NULL;                                          \
        return -1;                                              \
    }
    LT_FUNCS(LOAD)
#undef LOAD
    return 0;
}

/* ---- torch objects, read once ---- */
static PyObject *tensor_type, *parameter_type, *is_grad_enabled, *empty_cuda, *torch_empty;
static PyObject *any_autocast; /* torch._C._is_any_autocast_enabled, NULL where this torch lacks it */
static PyObject *dtypes[3];                       /* torch.float32, float16, bfloat16 */
static PyObject *f_tf32, *f_bf16_rr, *f_fp16_rr, *f_fp16_acc, *f_precision; /* torch._C._get_cublas_* flags */
static PyObject *s_requires_grad, *s_out, *s_medium, *s_uint8;
static PyObject *t_mm, *t_addmm, *t_matmul, *t_linear, *t_linear_c, *t_op_matmul;

static int init_once(void) {
    if (tensor_type) return 0;
    PyObject *torch = PyImport_ImportModule("torch"), *C = PyImport_ImportModule("torch._C");
    PyObject *nn = PyImport_ImportModule("torch.nn"), *F = PyImport_ImportModule("torch.nn.functional");
    PyObject *nnc = PyImport_ImportModule("torch._C._nn"), *op = PyImport_ImportModule("operator");
    PyObject *guards = PyImport_ImportModule("torch._C._dynamo.guards");
    int ok = torch && C && nn && F && nnc && op;
    static const char *names[3] = {"float32", "float16", "bfloat16"};
    for (int i = 0; ok && i < 3; i++) ok = (dtypes[i] = PyObject_GetAttrString(torch, names[i])) != NULL;
    ok = ok && (is_grad_enabled = PyObject_GetAttrString(torch, "is_grad_enabled")) &&
         (torch_empty = PyObject_GetAttrString(torch, "empty")) && (s_uint8 = PyObject_GetAttrString(torch, "uint8")) &&
         (t_mm = PyObject_GetAttrString(torch, "mm")) && (t_addmm = PyObject_GetAttrString(torch, "addmm")) &&
         (t_matmul = PyObject_GetAttrString(torch, "matmul")) && (t_linear = PyObject_GetAttrString(F, "linear")) &&
         (t_linear_c = PyObject_GetAttrString(nnc, "linear")) && (t_op_matmul = PyObject_GetAttrString(op, "matmul")) &&
         (parameter_type = PyObject_GetAttrString(nn, "Parameter")) &&
         (s_requires_grad = PyUnicode_InternFromString("requires_grad")) && (s_out = PyUnicode_InternFromString("out")) &&
         (s_medium = PyUnicode_InternFromString("medium"));
    if (ok) { /* a CPU-only torch lacks some: then no call is taken */
        f_tf32 = PyObject_GetAttrString(C, "_get_cublas_allow_tf32");
        f_bf16_rr = PyObject_GetAttrString(C, "_get_cublas_allow_bf16_reduced_precision_reduction");
        f_fp16_rr = PyObject_GetAttrString(C, "_get_cublas_allow_fp16_reduced_precision_reduction");
        f_fp16_acc = PyObject_GetAttrString(C, "_get_cublas_allow_fp16_accumulation");
        f_precision = PyObject_GetAttrString(C, "_get_float32_matmul_precision");
        any_autocast = PyObject_GetAttrString(C, "_is_any_autocast_enabled");
        empty_cuda = guards ? PyObject_GetAttrString(guards, "_empty_strided_cuda") : NULL;
        PyErr_Clear();
        ok = (tensor_type = PyObject_GetAttrString(torch, "Tensor")) != NULL;
    }
    Py_XDECREF(torch);
    Py_XDECREF(C);
    Py_XDECREF(nn);
    Py_XDECREF(F);
    Py_XDECREF(nnc);
    Py_XDECREF(op);
    Py_XDECREF(guards);
    PyErr_Clear();
    return ok ? 0 : -1;
}

/* ---- plans: one per distinct problem, process-wide, never freed (a model has tens) ---- */
typedef struct {
    int device, dtype, compute, transa, transb, epilogue;
    int64_t m, n, k, lda, ldb, ldd; /* cuBLASLt's terms: D (m x n) = op(A) (m x k) op(B) (k x n) */
    uint32_t align_a, align_b, align_d;
} PlanKey;

typedef struct {
    PlanKey key;
    int used, ok;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    size_t ws;
} Plan;

enum { NPLANS = 1024, WS_BYTES = 32 << 20, NWS = 16 };
static Plan plans[NPLANS];
static unsigned nplans;

/* The workspace of (device, stream): a uint8 tensor of torch's, kept for the process. */
typedef struct {
    int device;
    void *stream;
    PyObject *t;
    char *p;
} Workspace;
static Workspace ws[NWS];
static unsigned nws;

static struct {
    unsigned long long lt, torch;
    const char *last_fallback;
} stats;

static int dl_dtype(const EmTensorDesc *d) { /* index into dtypes, or -1 */
    if (d->code == 2 && d->bits == 32) return 0; /* kDLFloat */
    if (d->code == 2 && d->bits == 16) return 1;
    if (d->code == 4 && d->bits == 16) return 2; /* kDLBfloat */
    return -1;
}
static const int cuda_type[3] = {CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF};

static uint32_t alignment(const void *p) {
    uint32_t a = 256;
    while (a > 1 && (uintptr_t)p % a) a >>= 1;
    return a;
}

static uint64_t key_hash(const PlanKey *k) {
    const unsigned char *b = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* The plan of key, made (the heuristic asked) on first use; NULL when the table is full or cuBLASLt
 * failed to describe it (no exception either way). A plan without an algorithm has ok = 0. */
static Plan *plan_for(const PlanKey *key) {
    uint64_t h = key_hash(key);
    for (unsigned i = 0; i < NPLANS; i++) {
        Plan *p = &plans[(h + i) % NPLANS];
        if (p->used && !memcmp(&p->key, key, sizeof *key)) return p;
        if (p->used) continue;
        if (nplans * 4 >= NPLANS * 3) return NULL; /* keep probes short */
        if (!Lt.handle[key->device] && Lt.cublasLtCreate(&Lt.handle[key->device]) != 0) return NULL;
        memset(p, 0, sizeof *p);
        p->key = *key;
        p->used = 1;
        nplans++;
        int t = cuda_type[key->dtype];
        int ta = key->transa, tb = key->transb, epi = key->epilogue;
        cublasLtMatmulPreference_t pref = NULL;
        uint64_t wsb = WS_BYTES;
        cublasLtMatmulHeuristicResult_t res;
        int got = 0;
        if (Lt.cublasLtMatmulDescCreate(&p->desc, key->compute, CUDA_R_32F) != 0 ||
            Lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) != 0 ||
            Lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) != 0 ||
            Lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) != 0 ||
            Lt.cublasLtMatrixLayoutCreate(&p->la, t, ta == CUBLAS_OP_N ? key->m : key->k, ta == CUBLAS_OP_N ? key->k : key->m,
                                          key->lda) != 0 ||
            Lt.cublasLtMatrixLayoutCreate(&p->lb, t, tb == CUBLAS_OP_N ? key->k : key->n, tb == CUBLAS_OP_N ? key->n : key->k,
                                          key->ldb) != 0 ||
            Lt.cublasLtMatrixLayoutCreate(&p->ld, t, key->m, key->n, key->ldd) != 0 || Lt.cublasLtMatmulPreferenceCreate(&pref) != 0 ||
            Lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb) != 0 ||
            Lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key->align_a, 4) != 0 ||
            Lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key->align_b, 4) != 0 ||
            Lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key->align_d, 4) != 0 ||
            Lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key->align_d, 4) != 0 ||
            Lt.cublasLtMatmulAlgoGetHeuristic(Lt.handle[key->device], p->desc, p->la, p->lb, p->ld, p->ld, pref, 1, &res, &got) != 0 ||
            got < 1 || res.workspaceSize > WS_BYTES) {
            p->ok = 0;
        } else {
            p->ok = 1;
            p->algo = res.algo;
            p->ws = res.workspaceSize;
        }
        if (pref) Lt.cublasLtMatmulPreferenceDestroy(pref);
        return p;
    }
    return NULL;
}

/* The workspace for (device, stream), allocated on first use (on that stream, so torch's caching
 * allocator orders its reuse there). NULL with an exception, or NULL without one when the table is
 * full. */
static char *workspace(int device, void *stream) {
    for (unsigned i = 0; i < nws; i++)
        if (ws[i].device == device && ws[i].stream == stream) return ws[i].p;
    if (nws == NWS) return NULL;
    PyObject *dev = PyUnicode_FromFormat("cuda:%d", device);
    PyObject *kw = dev ? Py_BuildValue("{s:O,s:O}", "dtype", s_uint8, "device", dev) : NULL;
    PyObject *args = kw ? Py_BuildValue("(i)", (int)WS_BYTES) : NULL;
    PyObject *t = args ? PyObject_Call(torch_empty, args, kw) : NULL;
    Py_XDECREF(dev);
    Py_XDECREF(kw);
    Py_XDECREF(args);
    char *p = NULL;
    if (!t || em_guard_tensor_data_ptr(t, &p) < 0) {
        Py_XDECREF(t);
        return NULL;
    }
    ws[nws++] = (Workspace){device, stream, t, p};
    return p;
}

/* ---- the call ---- */
typedef enum { G_MM, G_ADDMM, G_MATMUL, G_LINEAR } GemmKind;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *target; /* the torch function, called where the Gemm does not take the call */
    GemmKind kind;
} Gemm;

static PyTypeObject *Gemm_Type;

/* One operand as a matrix (rows x cols) with element strides s0, s1. */
typedef struct {
    int64_t rows, cols, s0, s1;
} Mat;

/* How cuBLASLt reads matrix x (column-major BLAS): as its transpose op and leading dim, with x
 * row-major (unit column stride) read as x^T column-major. 0 when neither dim has unit stride. */
static int blas_view(const Mat *x, int *op, int64_t *ld) {
    if ((x->cols == 1 || x->s1 == 1) && (x->rows == 1 || x->s0 >= x->cols)) { /* row-major */
        *op = CUBLAS_OP_N;
        *ld = x->rows == 1 ? x->cols : x->s0;
        return *ld >= 1;
    }
    if ((x->rows == 1 || x->s0 == 1) && (x->cols == 1 || x->s1 >= x->rows)) { /* column-major */
        *op = CUBLAS_OP_T;
        *ld = x->cols == 1 ? x->rows : x->s1;
        return *ld >= 1;
    }
    return 0;
}

/* Do the bytes tensors x and y span (element size es; non-negative strides) share an address? */
static bool overlaps(const EmTensorDesc *x, const EmTensorDesc *y, int64_t es) {
    const EmTensorDesc *d[2] = {x, y};
    uintptr_t lo[2], hi[2];
    for (int j = 0; j < 2; j++) {
        int64_t last = 0;
        for (int32_t i = 0; i < d[j]->ndim; i++) last += (d[j]->sizes[i] - 1) * d[j]->strides[i];
        lo[j] = (uintptr_t)d[j]->data;
        hi[j] = lo[j] + (uintptr_t)((last + 1) * es);
    }
    return lo[0] < hi[1] && lo[1] < hi[0];
}

static bool plain(PyObject *t) { return (PyObject *)Py_TYPE(t) == tensor_type || (PyObject *)Py_TYPE(t) == parameter_type; }

/* A flag of torch's: 1 / 0, -1 with an exception; `absent` where this torch lacks it. A tuple (the
 * reduced-precision getters' (allow_reduced_precision, allow_splitk) since torch 2.10) is 1 when
 * every item is true: the Gemm then does what torch's defaults do. */
static int flag(PyObject *f, int absent) {
    if (!f) return absent;
    PyObject *v = PyObject_CallNoArgs(f);
    int r = v ? 1 : -1;
    if (v && PyTuple_Check(v)) {
        for (Py_ssize_t i = 0; r == 1 && i < PyTuple_GET_SIZE(v); i++) r = PyObject_IsTrue(PyTuple_GET_ITEM(v, i));
    } else if (v) {
        r = PyObject_IsTrue(v);
    }
    Py_XDECREF(v);
    return r;
}

/* The compute type torch's math-mode flags ask for a GEMM of dtype (index into dtypes), 0 where
 * torch would compute in a way the Gemm does not (the call is torch's), -1 with an exception. */
static int compute_type(int dt) {
    if (dt == 0) {
        PyObject *p = f_precision ? PyObject_CallNoArgs(f_precision) : NULL;
        if (!p) return f_precision ? -1 : 0;
        int medium = PyUnicode_Check(p) && !PyUnicode_Compare(p, s_medium);
        Py_DECREF(p);
        if (medium) return 0; /* bfloat16 internal precision: cuBLAS's COMPUTE_32F_FAST_16BF */
        int tf32 = flag(f_tf32, -2);
        return tf32 < 0 ? (tf32 == -2 ? 0 : -1) : tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    }
    int rr = flag(dt == 1 ? f_fp16_rr : f_bf16_rr, -2);
    if (rr < 0) return rr == -2 ? 0 : -1;
    if (!rr) return 0; /* torch then masks cuBLASLt's reduction schemes */
    if (dt == 1) {
        int acc = flag(f_fp16_acc, 0);
        if (acc) return acc < 0 ? -1 : 0; /* float16 accumulation */
    }
    return CUBLAS_COMPUTE_32F;
}

int em_grad_recorded(PyObject *const *ts, int n) {
    if (init_once() < 0) {
        PyErr_SetString(PyExc_RuntimeError, "ember: torch is not importable");
        return -1;
    }
    PyObject *ge = PyObject_CallNoArgs(is_grad_enabled);
    int on = ge ? PyObject_IsTrue(ge) : -1;
    Py_XDECREF(ge);
    for (int i = 0; on == 1 && i < n; i++) {
        if (!ts[i]) continue;
        PyObject *v = PyObject_GetAttr(ts[i], s_requires_grad);
        int r = v ? PyObject_IsTrue(v) : -1;
        Py_XDECREF(v);
        if (r) return r;
    }
    return on < 0 ? -1 : 0;
}

PyObject *em_cuda_rows_result(PyObject *x, const EmTensorDesc *xd, int64_t n, PyObject *dtype) {
    if (init_once() < 0) {
        PyErr_SetString(PyExc_RuntimeError, "ember: torch is not importable");
        return NULL;
    }
    int32_t nd = xd->ndim;
    PyObject *size = PyTuple_New(nd), *stride = PyTuple_New(nd), *y = NULL;
    int64_t st = 1;
    for (int32_t i = nd; size && stride && i-- > 0;) {
        int64_t s = i == nd - 1 ? n : xd->sizes[i];
        PyTuple_SET_ITEM(size, i, PyLong_FromLongLong(s));
        PyTuple_SET_ITEM(stride, i, PyLong_FromLongLong(st));
        st *= s;
    }
    if (size && stride && !PyErr_Occurred()) {
        if (empty_cuda) {
            PyObject *ea[4] = {NULL, size, stride, dtype};
            y = PyObject_Vectorcall(empty_cuda, ea + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        } else {
            y = PyObject_CallMethod(x, "new_empty_strided", "OO", size, stride);
        }
    }
    Py_XDECREF(size);
    Py_XDECREF(stride);
    return y;
}

#define FALLBACK(why)                \
    do {                             \
        stats.last_fallback = (why); \
        return 0;                    \
    } while (0)

/* The Gemm's own call: 1 with *result, 0 where torch's function must run (stats.last_fallback says
 * why), -1 with an exception. */
static int gemm_call(Gemm *g, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **result) {
    PyObject *a = NULL, *b = NULL, *bias = NULL, *out = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nkw > 1 || (nkw == 1 && PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), s_out)))
        FALLBACK("keyword arguments other than out=");
    if (nkw) out = args[nargs];
    switch (g->kind) {
    case G_ADDMM:
        if (nargs != 3) FALLBACK("arguments");
        bias = args[0], a = args[1], b = args[2];
        break;
    case G_LINEAR:
        if (nargs != 2 && nargs != 3) FALLBACK("arguments");
        a = args[0], b = args[1], bias = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
        break;
    default:
        if (nargs != 2) FALLBACK("arguments");
        a = args[0], b = args[1];
    }
    if (!plain(a) || !plain(b) || (bias && !plain(bias)) || (out && !plain(out))) FALLBACK("not a plain tensor");
    EmTensorDesc ad, bd, cd, od;
    if (em_guard_tensor_desc(a, &ad) < 0 || em_guard_tensor_desc(b, &bd) < 0 || (bias && em_guard_tensor_desc(bias, &cd) < 0) ||
        (out && em_guard_tensor_desc(out, &od) < 0))
        FALLBACK("no DLPack view (meta tensor?)");
    int dt = dl_dtype(&ad);
    if (dt < 0 || dl_dtype(&bd) != dt || (bias && dl_dtype(&cd) != dt) || (out && dl_dtype(&od) != dt))
        FALLBACK("dtypes");
    /* A (m x k): its last dim against the rows above it, which must collapse (F.linear's and
     * matmul's n-d input); B (k x n): F.linear's weight (n x k) read transposed */
    if (ad.ndim < 2 || bd.ndim != 2 || (g->kind != G_LINEAR && g->kind != G_MATMUL && ad.ndim != 2)) FALLBACK("operand dims");
    Mat A = {1, ad.sizes[ad.ndim - 1], 0, ad.strides[ad.ndim - 1]};
    for (int32_t i = ad.ndim - 1; i-- > 0;) {
        if (ad.sizes[i] == 1) continue;
        if (A.rows > 1 && ad.strides[i] != A.s0 * A.rows) FALLBACK("input rows do not collapse");
        if (A.rows == 1) A.s0 = ad.strides[i];
        A.rows *= ad.sizes[i];
    }
    if (A.rows == 1) A.s0 = A.cols;
    /* rows that collapsed over several dims are row-major only */
    if (ad.ndim > 2 && !(A.cols == 1 || A.s1 == 1)) FALLBACK("n-d input not row-major");
    Mat B = g->kind == G_LINEAR ? (Mat){bd.sizes[1], bd.sizes[0], bd.strides[1], bd.strides[0]}
                                : (Mat){bd.sizes[0], bd.sizes[1], bd.strides[0], bd.strides[1]};
    int64_t m = A.rows, k = A.cols, n = B.cols;
    if (B.rows != k) FALLBACK("sizes");
    if (m < 1 || n < 1 || k < 1 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) FALLBACK("empty or huge");
    int opa, opb;
    int64_t lda, ldb;
    if (!blas_view(&A, &opa, &lda) || !blas_view(&B, &opb, &ldb)) FALLBACK("operand strides");
    if (bias) { /* n dense elements, broadcast over the rows: (n,), (1, n), or (m, n) expanded */
        int64_t bs = cd.ndim ? cd.strides[cd.ndim - 1] : 0;
        bool ok = cd.ndim >= 1 && cd.ndim <= 2 && cd.sizes[cd.ndim - 1] == n && (n == 1 || bs == 1) &&
                  (cd.ndim == 1 || cd.sizes[0] == 1 || (cd.sizes[0] == m && cd.strides[0] == 0)) && alignment(cd.data) >= 16;
        if (!ok) FALLBACK("bias not a dense row");
    }
    if (out) { /* out=: exactly the result's shape, contiguous */
        bool ok = od.ndim == ad.ndim; /* mm / addmm: A is 2-d */
        int64_t e = 1;
        for (int32_t i = od.ndim; ok && i-- > 0;) {
            int64_t s = i == od.ndim - 1 ? n : ad.sizes[i];
            ok = od.sizes[i] == s && (s == 1 || od.strides[i] == e);
            e *= s;
        }
        if (!ok) FALLBACK("out= not the contiguous result");
        int64_t es = dt == 0 ? 4 : 2;
        if (overlaps(&od, &ad, es) || overlaps(&od, &bd, es) || (bias && overlaps(&od, &cd, es))) FALLBACK("out= overlaps an operand");
    }
    /* the layout is one the Gemm takes (the tests read this order on the CPU); now the device */
    int dev = ad.device_id;
    if (ad.device_type != 2 || bd.device_type != 2 || bd.device_id != dev || (bias && (cd.device_type != 2 || cd.device_id != dev)) ||
        (out && (od.device_type != 2 || od.device_id != dev)) || dev < 0 || dev >= 64)
        FALLBACK("not one CUDA device");
    /* a program runs with autocast off (hook/em_hook_cache.c); a call under autocast is torch's,
     * which casts its operands at dispatch */
    PyObject *ac = any_autocast ? PyObject_CallNoArgs(any_autocast) : NULL;
    int autocast = ac ? PyObject_IsTrue(ac) : any_autocast ? -1 : 0;
    Py_XDECREF(ac);
    if (autocast) return autocast < 0 ? -1 : (stats.last_fallback = "autocast is on", 0);
    int grad = em_grad_recorded((PyObject *const[]){a, b, bias}, 3);
    if (grad) return grad < 0 ? -1 : (stats.last_fallback = "gradient recorded", 0);
    int compute = compute_type(dt);
    if (compute <= 0) return compute < 0 ? -1 : (stats.last_fallback = "torch's math-mode flags", 0);
    if (lt_load() < 0) FALLBACK("no cuBLASLt in this process");
    void *stream = NULL;
    int capturing = 0;
    if (em_cuda_current_stream(dev, &stream, &capturing) < 0) {
        PyErr_Clear(); /* torch's function says what is wrong, if anything */
        FALLBACK("the CUDA driver or torch's current stream is not usable");
    }
    if (!em_cuda_device_is_current(dev)) FALLBACK("not the current device");
    if (capturing) FALLBACK("a CUDA graph is being captured");
    /* cuBLASLt's D (n x m, column-major) = op(B^T) (n x k) op(A^T) (k x m): row-major A and B read
     * as their transposes, so that D is row-major (m x n), ld n */
    PlanKey key;
    memset(&key, 0, sizeof key); /* the padding is hashed and compared */
    key.device = dev;
    key.dtype = dt;
    key.compute = compute;
    key.transa = opb == CUBLAS_OP_N ? CUBLAS_OP_N : CUBLAS_OP_T;
    key.transb = opa == CUBLAS_OP_N ? CUBLAS_OP_N : CUBLAS_OP_T;
    key.epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    key.m = n, key.n = m, key.k = k, key.lda = ldb, key.ldb = lda, key.ldd = n;
    key.align_a = alignment(bd.data), key.align_b = alignment(ad.data);
    char *dp = NULL;
    PyObject *d = out ? Py_NewRef(out) : NULL;
    if (d) {
        dp = od.data;
    } else { /* the result: A's leading dims then n, contiguous (mm / addmm: A is 2-d) */
        d = em_cuda_rows_result(a, &ad, n, dtypes[dt]);
        if (!d || em_guard_tensor_data_ptr(d, &dp) < 0) {
            Py_XDECREF(d);
            return -1;
        }
    }
    key.align_d = alignment(dp);
    Plan *p = plan_for(&key);
    char *wsp = p && p->ok ? workspace(dev, stream) : NULL;
    if (!wsp) {
        Py_DECREF(d);
        if (PyErr_Occurred()) return -1;
        FALLBACK(p ? "no cuBLASLt algorithm for this problem" : "no plan (the table is full, or no cuBLASLt handle)");
    }
    const void *bp = bias ? (const void *)cd.data : NULL;
    float alpha = 1.0f, beta = 0.0f;
    if ((bias && Lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp) != 0) ||
        Lt.cublasLtMatmul(Lt.handle[dev], p->desc, &alpha, bd.data, p->la, ad.data, p->lb, &beta, dp, p->ld, dp, p->ld, &p->algo, wsp,
                          p->ws, stream) != 0) {
        p->ok = 0; /* torch's function from now on, for this problem */
        Py_DECREF(d);
        FALLBACK("cuBLASLt refused the call");
    }
    *result = d;
    return 1;
}

static PyObject *gemm_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Gemm *g = (Gemm *)self;
    PyObject *r = NULL;
    int taken = gemm_call(g, args, PyVectorcall_NARGS(nargsf), kwnames, &r);
    if (taken < 0) return NULL;
    if (taken) {
        stats.lt++;
        return r;
    }
    stats.torch++;
    return PyObject_Vectorcall(g->target, args, nargsf, kwnames);
}

static void gemm_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(((Gemm *)self)->target);
    PyObject_GC_Del(self);
}
static int gemm_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((Gemm *)self)->target);
    return 0;
}
static int gemm_clear(PyObject *self) {
    Py_CLEAR(((Gemm *)self)->target);
    return 0;
}
static PyObject *gemm_repr(PyObject *self) { return PyUnicode_FromFormat("<ember gemm via cuBLASLt, else %R>", ((Gemm *)self)->target); }
/* __name__ / __qualname__: the torch function's, so that the program's node reads as that op */
static PyObject *gemm_name(PyObject *self, void *attr) { return PyObject_GetAttrString(((Gemm *)self)->target, (const char *)attr); }
static PyObject *gemm_target(PyObject *self, void *unused) {
    EM_UNUSED(unused);
    return Py_NewRef(((Gemm *)self)->target);
}

PyObject *em_gemm_new(PyObject *target, uint32_t nargs, uint32_t nkwargs, const int *ndim) {
    if (!Gemm_Type || nkwargs || nargs < 2 || nargs > 3) return NULL;
    if (init_once() < 0) return NULL;
    GemmKind kind;
    int a = ndim[0], b = ndim[1];
    if (target == t_mm && nargs == 2) kind = G_MM;
    else if (target == t_addmm && nargs == 3) kind = G_ADDMM, a = ndim[1], b = ndim[2];
    else if ((target == t_matmul || target == t_op_matmul) && nargs == 2) kind = G_MATMUL;
    else if ((target == t_linear || target == t_linear_c) && (nargs == 2 || nargs == 3)) kind = G_LINEAR;
    else return NULL;
    if (b != 2 || a < 2 || (a != 2 && (kind == G_MM || kind == G_ADDMM))) return NULL;
    Gemm *g = PyObject_GC_New(Gemm, Gemm_Type);
    if (!g) return NULL;
    g->vectorcall = gemm_vectorcall;
    g->target = Py_NewRef(target);
    g->kind = kind;
    PyObject_GC_Track(g);
    return (PyObject *)g;
}

/* ember._C._gemm(target): the Gemm of target, for tests (any operand dims; the call decides). */
static PyObject *gemm_for_tests(PyObject *self, PyObject *target) {
    EM_UNUSED(self);
    static const int ndim[3] = {2, 2, 2};
    PyObject *g = NULL;
    for (uint32_t nargs = 2; !g && !PyErr_Occurred() && nargs <= 3; nargs++) g = em_gemm_new(target, nargs, 0, ndim);
    if (!g && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_gemm: not torch.mm, addmm, matmul or F.linear");
    return g;
}

int em_gemm_bias_arg(PyObject *gemm, uint32_t nargs) {
    GemmKind k = ((Gemm *)gemm)->kind;
    return k == G_ADDMM ? 0 : k == G_LINEAR && nargs == 3 ? 2 : -1;
}

static PyObject *gemm_stats(PyObject *self, PyObject *unused) {
    EM_UNUSED(self);
    EM_UNUSED(unused);
    return Py_BuildValue("{s:K,s:K,s:I,s:z,s:z}", "cublaslt", stats.lt, "torch", stats.torch, "plans", nplans, "library",
                         Lt.lib ? Lt.soname : NULL, "last_fallback", stats.last_fallback);
}

static PyGetSetDef gemm_getset[] = {
    {"__name__", gemm_name, NULL, NULL, "__name__"},
    {"__qualname__", gemm_name, NULL, NULL, "__qualname__"},
    {"__module__", gemm_name, NULL, NULL, "__module__"},
    {"target", gemm_target, NULL, "the torch function called where cuBLASLt is not", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef gemm_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Gemm, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot gemm_slots[] = {
    {Py_tp_dealloc, gemm_dealloc},
    {Py_tp_traverse, gemm_traverse},
    {Py_tp_clear, gemm_clear},
    {Py_tp_repr, gemm_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_getset, gemm_getset},
    {Py_tp_members, gemm_members},
    {Py_tp_doc, (void *)"A matrix product of a compiled CUDA program: cuBLASLt from C, else the torch function."},
    {0, NULL},
};

int em_runtime_gemm_init(PyObject *module) {
    static PyType_Spec spec = {"ember._C.Gemm", sizeof(Gemm), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
                               gemm_slots};
    if (!Gemm_Type && !(Gemm_Type = (PyTypeObject *)PyType_FromSpec(&spec))) return -1;
    if (PyModule_AddObjectRef(module, "Gemm", (PyObject *)Gemm_Type) < 0) return -1;
    static PyMethodDef defs[] = {
        {"_gemm", gemm_for_tests, METH_O, "_gemm(target) -> Gemm: target's Gemm (torch.mm, addmm, matmul, F.linear), for tests"},
        {"_gemm_stats", gemm_stats, METH_NOARGS,
         "_gemm_stats() -> dict: calls of compiled programs' GEMMs taken by cuBLASLt or given to torch, plans made, "
         "why the last call went to torch"},
        {NULL, NULL, 0, NULL},
    };
    return em_runtime_add_functions(module, defs);
}
