/* runtime: ember._C.skinny_linear, F.linear of a few rows on CUDA by a kernel of ember's own.
 *
 *   ember._C.skinny_linear(input, weight, bias=None) -> F.linear(input, weight, bias)
 *
 * The decode step of a language model multiplies each weight by batch x 1 rows, where cuBLAS's GEMM
 * kernels read the weight at a fraction of the memory bandwidth (codegen/em_codegen_cuda.c,
 * em_codegen_cuda_skinny, says how much and what the kernel does instead). The skinny_mm pass
 * (passes/em_pass_skinny_mm.c) writes this call for such linears of static CUDA inference graphs;
 * the call takes the kernel when, on this call's tensors, input holds 1 to EM_SKINNY_MAX_ROWS rows
 * (its elements over weight's K) of a CUDA float32 / float16 / bfloat16 tensor, input and weight
 * are contiguous with 16-byte aligned data, K is a multiple of 16 bytes, bias (when given) is a
 * dense vector of N, all of one dtype on the current CUDA device, and no gradient is being
 * recorded for them. Anything else (meta tensors: the passes infer the call's meta through here;
 * the CPU; more rows; strided operands) is torch's F.linear itself, called with the same
 * arguments. The result is a new contiguous tensor input.shape[:-1] + (N,), computed with float32
 * accumulation and rounded once (as cuBLAS's GEMMs accumulate), launched on torch's current
 * stream (CUDA-graph capture included). One compiled kernel per (device, dtype, rows, N, K, bias)
 * (a model has a handful), compiled through NVRTC and the on-disk cache on first use.
 *
 *   ember._C._skinny_source(dtype, rows, N, K, bias) -> {"source", "block", "blocks"}: the kernel's
 *       CUDA C and launch (tests run it on the CPU emulator, ember.testing.cuda).
 *   ember._C._skinny_launches() -> int: the kernel's launches in this process (tests: which calls
 *       took it). */
#include "codegen/em_codegen.h"
#include "guard/em_guard.h"
#include "runtime/em_runtime.h"

#include <string.h>

static PyObject *f_linear = NULL;        /* torch.nn.functional.linear */
static PyObject *dtypes[3] = {NULL, NULL, NULL}; /* torch.float32, float16, bfloat16 */
static PyObject *tensor_type = NULL, *parameter_type = NULL; /* torch.Tensor, torch.nn.Parameter */

static int init_once(void) {
    if (f_linear) return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *fn = PyImport_ImportModule("torch.nn.functional");
    if (!torch || !fn) goto fail;
    static const char *names[3] = {"float32", "float16", "bfloat16"};
    for (int i = 0; i < 3; i++)
        if (!(dtypes[i] = PyObject_GetAttrString(torch, names[i]))) goto fail;
    if (!(tensor_type = PyObject_GetAttrString(torch, "Tensor"))) goto fail;
    PyObject *nn = PyImport_ImportModule("torch.nn");
    parameter_type = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
    Py_XDECREF(nn);
    if (!parameter_type) goto fail;
    f_linear = PyObject_GetAttrString(fn, "linear");
fail:
    Py_XDECREF(torch);
    Py_XDECREF(fn);
    return f_linear ? 0 : -1;
}

/* The dtype of a DLPack description as an LDtype the kernel takes, or -1. */
static int desc_dtype(const EmTensorDesc *d) {
    if (d->code == 2 && d->bits == 32) return LDT_F32;
    if (d->code == 2 && d->bits == 16) return LDT_F16;
    if (d->code == 4 && d->bits == 16) return LDT_BF16;
    return -1;
}

static bool dense(const EmTensorDesc *d) {
    int64_t e = 1;
    for (int32_t i = d->ndim; i-- > 0;) {
        if (d->sizes[i] != 1 && d->strides[i] != e) return false;
        e *= d->sizes[i];
    }
    return true;
}

/* The compiled kernels, one per shape; never freed (a process meets a handful). */
typedef struct {
    int device, dt, rows, bias;
    int64_t N, K;
    EmCudaFn *fn;
    PyObject *module;
} SkinnyFn;
enum { SKINNY_FNS = 64 };
static SkinnyFn fns[SKINNY_FNS];
static int nfns = 0;
static unsigned long long launches = 0;

/* The kernel for these sizes on device, or NULL (no exception) where there is none: the table is
 * full, or the kernel did not compile or load (no NVRTC, say; remembered, not tried again): the
 * call is then F.linear's, never an error eager would not raise. */
static EmCudaFn *skinny_fn(int device, int dt, int rows, int64_t N, int64_t K, int bias) {
    for (int i = 0; i < nfns; i++) {
        const SkinnyFn *f = &fns[i];
        if (f->device == device && f->dt == dt && f->rows == rows && f->N == N && f->K == K && f->bias == bias) return f->fn;
    }
    if (nfns == SKINNY_FNS) return NULL;
    EmCudaLaunch L;
    PyObject *src = em_codegen_cuda_skinny((LDtype)dt, rows, N, K, bias, &L);
    Py_ssize_t n = 0;
    const char *text = src ? PyUnicode_AsUTF8AndSize(src, &n) : NULL;
    char key[40];
    int cached = 0;
    PyObject *module = text ? em_cuda_module_load(text, (size_t)n, device, key, &cached) : NULL;
    Py_XDECREF(src);
    EmCudaFn *fn = module ? em_cuda_fn_new(module, "ember_skinny", &L) : NULL;
    if (!fn) Py_CLEAR(module);
    PyErr_Clear();
    fns[nfns++] = (SkinnyFn){device, dt, rows, bias, N, K, fn, module};
    return fn;
}

/* A plain tensor or parameter: no subclass (fake tensors, DTensor) whose __torch_function__ or
 * storage is not what the kernel reads. */
static bool plain(PyObject *t) {
    return !t || (PyObject *)Py_TYPE(t) == tensor_type || (PyObject *)Py_TYPE(t) == parameter_type;
}

/* The kernel's call on these arguments, or 0 where F.linear must run (-1 with an exception). */
static int skinny_call(PyObject *x, PyObject *w, PyObject *b, PyObject **out) {
    EmTensorDesc xd, wd, bd;
    if (!plain(x) || !plain(w) || !plain(b)) return 0;
    if (em_guard_tensor_desc(x, &xd) < 0 || em_guard_tensor_desc(w, &wd) < 0 || (b && em_guard_tensor_desc(b, &bd) < 0)) return 0;
    int dt = desc_dtype(&xd);
    if (dt < 0 || desc_dtype(&wd) != dt || (b && desc_dtype(&bd) != dt)) return 0;
    if (xd.device_type != 2 || wd.device_type != 2 || wd.device_id != xd.device_id || (b && (bd.device_type != 2 || bd.device_id != xd.device_id)))
        return 0; /* kDLCUDA, one device */
    if (wd.ndim != 2 || xd.ndim < 1 || !dense(&wd) || !dense(&xd)) return 0;
    int64_t N = wd.sizes[0], K = wd.sizes[1], numel = 1;
    for (int32_t i = 0; i < xd.ndim; i++) numel *= xd.sizes[i];
    int64_t es = dt == LDT_F32 ? 4 : 2;
    if (N < 1 || K < 1 || xd.sizes[xd.ndim - 1] != K || numel % K || (K * es) % 16) return 0;
    int64_t rows = numel / K;
    if (rows < 1 || rows > EM_SKINNY_MAX_ROWS || !xd.data || !wd.data || (uintptr_t)xd.data % 16 || (uintptr_t)wd.data % 16)
        return 0;
    if (b && (bd.ndim != 1 || bd.sizes[0] != N || (N > 1 && bd.strides[0] != 1) || !bd.data)) return 0;
    int grad = em_grad_recorded((PyObject *const[]){x, w, b}, 3);
    if (grad) return grad < 0 ? -1 : 0; /* a recorded gradient is F.linear's */
    EmCudaFn *fn = skinny_fn(xd.device_id, dt, (int)rows, N, K, b != NULL);
    if (!fn) return 0;
    if (!em_cuda_device_is_current(xd.device_id)) return 0; /* the allocation and the stream are the current device's */
    PyObject *y = em_cuda_rows_result(x, &xd, N, dtypes[dt == LDT_F32 ? 0 : dt == LDT_F16 ? 1 : 2]);
    char *yp = NULL;
    if (!y || em_guard_tensor_data_ptr(y, &yp) < 0) {
        Py_XDECREF(y);
        return -1;
    }
    char *ptrs[4] = {xd.data, wd.data, b ? bd.data : wd.data, yp};
    if (em_cuda_launch(fn, ptrs, 4) < 0) {
        Py_DECREF(y);
        return -1;
    }
    launches++;
    *out = y;
    return 1;
}

static PyObject *skinny_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    EM_UNUSED(self);
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "skinny_linear(input, weight, bias=None) takes 2 or 3 arguments");
        return NULL;
    }
    if (init_once() < 0) return NULL;
    PyObject *b = nargs == 3 && args[2] != Py_None ? args[2] : NULL, *y = NULL;
    int r = skinny_call(args[0], args[1], b, &y);
    if (r < 0) return NULL;
    return r ? y : PyObject_Vectorcall(f_linear, args, (size_t)nargs, NULL);
}

static PyObject *skinny_source(PyObject *self, PyObject *args) {
    EM_UNUSED(self);
    PyObject *dtype;
    int rows, bias;
    long long N, K;
    if (!PyArg_ParseTuple(args, "OiLLp:_skinny_source", &dtype, &rows, &N, &K, &bias) || init_once() < 0) return NULL;
    int dt = dtype == dtypes[0] ? LDT_F32 : dtype == dtypes[1] ? LDT_F16 : dtype == dtypes[2] ? LDT_BF16 : -1;
    if (dt < 0) {
        PyErr_SetString(PyExc_ValueError, "_skinny_source: dtype must be torch.float32, float16 or bfloat16");
        return NULL;
    }
    EmCudaLaunch L;
    PyObject *src = em_codegen_cuda_skinny((LDtype)dt, rows, N, K, bias, &L);
    return src ? Py_BuildValue("{s:N,s:i,s:L}", "source", src, "block", L.block, "blocks", (long long)L.blocks) : NULL;
}

static PyObject *skinny_launches(PyObject *self, PyObject *unused) {
    EM_UNUSED(self);
    EM_UNUSED(unused);
    return PyLong_FromUnsignedLongLong(launches);
}

int em_runtime_skinny_init(PyObject *module) {
    static PyMethodDef defs[] = {
        {"skinny_linear", (PyCFunction)(void (*)(void))skinny_linear, METH_FASTCALL,
         "skinny_linear(input, weight, bias=None): F.linear, by ember's GEMV kernel for 1-8 rows on CUDA."},
        {"_skinny_source", (PyCFunction)skinny_source, METH_VARARGS,
         "_skinny_source(dtype, rows, N, K, bias) -> dict: the skinny GEMM kernel's CUDA C and launch."},
        {"_skinny_launches", skinny_launches, METH_NOARGS, "_skinny_launches() -> int: skinny GEMM launches so far."},
        {NULL, NULL, 0, NULL},
    };
    return em_runtime_add_functions(module, defs);
}
