/* runtime ember: the "ember" backend on CPU. lower -> schedule -> codegen (C) -> compile/load,
 * then a program: a new IR graph whose call nodes are the generated kernels (ember._C.Kernel
 * objects) and the extern calls, replayed by an EagerGraph (slots, last-use frees, vectorcall).
 * Memory planning: a kernel's output takes over the tensor of an intermediate that is dead by
 * then (same dtype and layout, never returned, never seen by an extern), or, for a pointwise
 * kernel, the tensor of an input it reads at the very element it writes (in place).
 * Invariant: outputs are allocated with eager's sizes, strides and dtype (the IR meta); a tensor
 * the user can see (input, output, extern result that may alias) is never written. */
#include "runtime/em_runtime.h"

#include "codegen/em_codegen.h"
#include "guard/em_guard.h"
#include "lower/em_lower.h"
#include "schedule/em_schedule.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <structmember.h> /* T_PYSSIZET, READONLY (kept as aliases of Py_T_* by 3.12) */

#define NONE UINT32_MAX

typedef void (*KernelFn)(char *const *, const int64_t *);
typedef void (*MetaFn)(const int64_t *, int64_t *);
typedef void (*SetThreadsFn)(int);

/* A bounds check of a gather load (em_codegen.h, em_codegen_gather_check): the error eager raises
 * when the kernel reports it. */
typedef struct {
    int64_t check;
    int64_t size;         /* the dim's size */
    uint8_t err;          /* LGatherErr */
    int8_t dim;           /* the dim eager's message names */
} GatherCheck;

/* Where a call of a symbolic graph's kernel or view finds this call's symbol values: in the
 * sizes of the source tensors passed after its own arguments (SymSources), symbol src_sym[i] =
 * size src_dim[i] of source argument src_arg[i] (-1: the argument, an int: a size the forward half
 * of a training region saved). nsym: the env's symbol count (the values array). */
typedef struct {
    uint32_t nsym, nsrc, nsrcargs;
    uint32_t *src_sym, *src_arg;
    int32_t *src_dim;
} SymIn;

static void symin_free(SymIn *si) {
    free(si->src_sym);
    free(si->src_arg);
    free(si->src_dim);
    si->src_sym = si->src_arg = NULL;
    si->src_dim = NULL;
}

/* sv[symbol] for this call from the source arguments src[0 .. nsrcargs). -1 with an exception
 * (name: the kernel or view, for the message). */
static int symin_read(const SymIn *si, PyObject *name, PyObject *const *src, int64_t *sv) {
    for (uint32_t i = 0; i < si->nsrc; i++) {
        if (si->src_dim[i] < 0) {
            sv[si->src_sym[i]] = PyLong_AsLongLong(src[si->src_arg[i]]);
            if (PyErr_Occurred()) return -1;
            continue;
        }
        PyObject *sh = PyObject_GetAttr(src[si->src_arg[i]], em_str("shape"));
        if (!sh) return -1;
        if (!PyTuple_Check(sh) || si->src_dim[i] >= PyTuple_GET_SIZE(sh)) {
            Py_DECREF(sh);
            PyErr_Format(PyExc_SystemError, "ember %U: a size source is not a tensor of the expected rank", name);
            return -1;
        }
        sv[si->src_sym[i]] = PyLong_AsLongLong(PyTuple_GET_ITEM(sh, si->src_dim[i]));
        Py_DECREF(sh);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    KernelFn fn;
    SetThreadsFn set_threads; /* the library's ember_set_threads, NULL for kernels run on one thread */
    PyObject *lib;        /* capsule owning the dlopen handle */
    PyObject *name;       /* "ember_k3" */
    uint32_t nin;         /* tensors read */
    int32_t donor;        /* argument whose tensor becomes the output (index into args), -1 */
    bool donor_relayout;  /* static layouts: the output is donor.as_strided(out_size, out_stride), a
                             dead buffer of the same dtype and element count in another dense layout */
    uint32_t nextra;      /* outputs after the first (horizontal fusion, shared values: em_schedule.c):
                             static layouts: tensors passed after the inputs and the donor, written
                             in place; symbolic: allocated per call from m[] (extra_ndim, extra_dtype)
                             and returned with the first as a tuple */
    int32_t *extra_ndim;  /* symbolic, per output after the first: its rank */
    PyObject **extra_dtype; /* symbolic, per output after the first: its dtype (owned) */
    int64_t numel;        /* 0: nothing to compute */
    PyObject *out_size, *out_stride, *out_dtype;
    PyObject **in_size, **in_stride; /* per input: expected layout, NULL when guaranteed */
    EmCudaFn *cuda;       /* a CUDA kernel (em_runtime_cuda.c): launched instead of fn */
    PyObject *out_device; /* CUDA: the torch.device outputs are allocated on */
    /* symbolic sizes (sizes as kernel arguments): meta computes this call's layout from the
     * symbols' values (si: read from the source tensors passed after the inputs and the donor) */
    MetaFn meta;
    SymProg *mprog;       /* CUDA: the same layout as a program over sv (em_sym_exprs_compile), then
                             the row length and the farthest element (EmCudaCall) */
    SymIn si;
    uint32_t nmeta;
    int32_t out_ndim;
    int32_t *in_ndim;     /* per input: ndim of an extern result checked against m[], else -1 */
    int64_t threshold;    /* work from which the kernel runs in parallel (ember_set_threads) */
    GatherCheck *checks;  /* CPU kernels with gather loads: their bounds checks (the kernel's last
                             argument is then the error word, int64_t[2]) */
    uint32_t nchecks;
    int32_t out_elsize;   /* CPU, ember.config.huge_pages: bytes per output element (else 0) */
    int64_t out_bytes;    /* static layouts: the output's elements x out_elsize */
} Kernel;

static PyTypeObject *Kernel_Type = NULL;

/* ---- huge pages for large CPU outputs (ember.config.huge_pages) ----
 * A CPU buffer of tens of MiB comes from glibc's mmap (above its 32 MiB mmap threshold, or after a
 * trim) as fresh 4 KiB pages: the kernel that first writes it takes one page fault per 4 KiB, which
 * cost more than the computation itself for a 16M-element pointwise chain (dev VM: 30 ms of a 30 ms
 * call; 10 ms with huge pages). Before the kernel runs, the 2 MiB-aligned part of an output of at
 * least EM_HUGE_MIN bytes is advised MADV_HUGEPAGE (Linux, transparent huge pages in "madvise" or
 * "always" mode; a no-op otherwise): what torch's own THP_MEM_ALLOC_ENABLE=1 does for every
 * allocation (c10/core/alloc_cpu.cpp), here only for ember's kernel outputs. */
#define EM_HUGE_MIN ((int64_t)4 << 20)
static void advise_huge_pages(char *p, int64_t nbytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t H = (uintptr_t)2 << 20;
    if (nbytes < EM_HUGE_MIN) return;
    uintptr_t a = ((uintptr_t)p + H - 1) & ~(H - 1), b = ((uintptr_t)p + (uintptr_t)nbytes) & ~(H - 1);
    if (b > a) (void)madvise((void *)a, b - a, MADV_HUGEPAGE); /* advice: a failure changes nothing */
#else
    (void)p;
    (void)nbytes;
#endif
}
static PyObject *empty_strided = NULL; /* torch.empty_strided */
static PyObject *as_strided_at(PyObject *t, PyObject *size, PyObject *stride, int64_t offset);
static PyObject *get_num_threads = NULL; /* torch.get_num_threads */
static PyObject *kw_dtype_device = NULL; /* ("dtype", "device") */
/* torch.device("cpu"): CPU buffers name their device, so that torch.set_default_device("cuda")
 * (a TorchFunctionMode that factory calls made through Python see) never puts memory a C kernel
 * writes on the GPU */
static PyObject *cpu_device = NULL;

/* torch._C._dynamo.guards._empty_strided_cpu / _empty_strided_cuda(size, stride, dtype): the
 * allocation entry points Inductor's generated code calls, torch.empty_strided without the argument
 * parser and the dispatcher (NULL where this torch lacks them). _cuda allocates on the current
 * device. On the H200 a Llama training step spent 2.7 ms of host time per step in
 * torch.empty_strided for ember's buffers (bench/results/fullsize_h200_llama_autocast_profile_*). */
static PyObject *fast_empty_cpu = NULL, *fast_empty_cuda = NULL;

/* A new tensor of size/stride/dtype on device (a torch.device; cuda_device: its index when it is a
 * CUDA device, -1 when it is the CPU, -2 otherwise): the fast entry point where it allocates
 * the same tensor (the CPU; a CUDA device that is current), else torch.empty_strided. */
static PyObject *new_empty(PyObject *size, PyObject *stride, PyObject *dtype, PyObject *device, int cuda_device) {
    PyObject *fast = cuda_device == -1                                                  ? fast_empty_cpu
                     : cuda_device >= 0 && em_cuda_device_is_current(cuda_device) ? fast_empty_cuda
                                                                                        : NULL;
    if (fast) {
        PyObject *a[4] = {NULL, size, stride, dtype};
        return PyObject_Vectorcall(fast, a + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    PyObject *eargs[5] = {NULL, size, stride, dtype, device};
    return PyObject_Vectorcall(empty_strided, eargs + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, kw_dtype_device);
}

/* ember._C._empty_strided(size, stride, dtype, device, cuda_device): new_empty for the programs'
 * planned buffers (alloc_node). */
static PyObject *empty_strided_py(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 5 || !PyLong_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "_empty_strided(size, stride, dtype, device, cuda_device)");
        return NULL;
    }
    return new_empty(args[0], args[1], args[2], args[3], (int)PyLong_AsLong(args[4]));
}
static PyMethodDef empty_strided_def = {"_empty_strided", (PyCFunction)(void (*)(void))empty_strided_py, METH_FASTCALL,
                                        "torch.empty_strided(size, stride, dtype=, device=) by the fastest entry point"};
static PyObject *empty_strided_fn = NULL; /* the function object of empty_strided_def */

/* The cuda_device argument of new_empty for a torch.device. -3 with an exception. */
static int device_code(PyObject *device) {
    PyObject *type = PyObject_GetAttrString(device, "type");
    PyObject *index = type ? PyObject_GetAttrString(device, "index") : NULL;
    int code = -3;
    if (index) {
        if (PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cpu") == 0) code = -1;
        else if (PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cuda") == 0 && PyLong_Check(index))
            code = (int)PyLong_AsLong(index);
        else code = -2;
    }
    Py_XDECREF(type);
    Py_XDECREF(index);
    return code;
}

static PyObject *tensor_as(PyObject *t, PyObject *size, PyObject *stride) {
    /* an extern's result with another layout than its meta said: copy into the expected one (same
     * dtype and device) */
    PyObject *e = PyObject_CallMethod(t, "new_empty_strided", "OO", size, stride);
    if (!e) return NULL;
    PyObject *r = PyObject_CallMethod(e, "copy_", "O", t);
    if (!r) {
        Py_DECREF(e);
        return NULL;
    }
    Py_DECREF(r);
    return e;
}

/* Does tensor t's layout differ from size / stride (tuples; strides of size-1 dims do not
 * matter)? 1 / 0, -1 with an exception. Read through DLPack (em_guard_tensor_layout) where it
 * can, else through t.shape and t.stride(): every kernel input that an extern call made, and every
 * view of one, is checked on every call. */
static int layout_differs(PyObject *t, PyObject *size, PyObject *stride) {
    int64_t dsz[EM_LMAXDIM], dst[EM_LMAXDIM];
    int32_t nd = 0;
    if (em_guard_tensor_layout(t, EM_LMAXDIM, &nd, dsz, dst) == 0) {
        if (nd != PyTuple_GET_SIZE(size)) return 1;
        for (int32_t d = 0; d < nd; d++) {
            long long want = PyLong_AsLongLong(PyTuple_GET_ITEM(size, d));
            if (want != dsz[d]) return PyErr_Occurred() ? -1 : 1;
            if (want > 1 && PyLong_AsLongLong(PyTuple_GET_ITEM(stride, d)) != dst[d]) return PyErr_Occurred() ? -1 : 1;
        }
        return 0;
    }
    PyObject *s = PyObject_GetAttrString(t, "shape");
    if (!s) return -1;
    int eq = PyObject_RichCompareBool(s, size, Py_EQ);
    Py_DECREF(s);
    if (eq <= 0) return eq < 0 ? -1 : 1;
    PyObject *st = PyObject_CallMethodNoArgs(t, em_str("stride"));
    if (!st) return -1;
    /* strides of size-1 dims do not matter */
    Py_ssize_t n = PyTuple_Check(st) ? PyTuple_GET_SIZE(st) : -1;
    int differs = n != PyTuple_GET_SIZE(stride);
    for (Py_ssize_t d = 0; !differs && d < n; d++) {
        long long sz = PyLong_AsLongLong(PyTuple_GET_ITEM(size, d));
        if (sz > 1 && PyObject_RichCompareBool(PyTuple_GET_ITEM(st, d), PyTuple_GET_ITEM(stride, d), Py_EQ) != 1) differs = 1;
    }
    Py_DECREF(st);
    if (PyErr_Occurred()) return -1;
    return differs;
}

static int data_ptr(PyObject *t, char **out) { return em_guard_tensor_data_ptr(t, out); }

enum { KSTACK = 16 };

/* Does tensor t have sizes m[0..nd) and (dims of size > 1) strides m[nd..2nd)? 1 / 0, -1 error. */
static int layout_is_m(PyObject *t, int32_t nd, const int64_t *m) {
    PyObject *sh = PyObject_GetAttr(t, em_str("shape"));
    if (!sh) return -1;
    int same = PyTuple_Check(sh) && PyTuple_GET_SIZE(sh) == nd;
    for (int32_t d = 0; same && d < nd; d++) same = PyLong_AsLongLong(PyTuple_GET_ITEM(sh, d)) == m[d];
    Py_DECREF(sh);
    if (PyErr_Occurred()) return -1;
    if (!same) return 0;
    PyObject *st = PyObject_CallMethodNoArgs(t, em_str("stride"));
    if (!st) return -1;
    same = PyTuple_Check(st) && PyTuple_GET_SIZE(st) == nd;
    for (int32_t d = 0; same && d < nd; d++) same = m[d] <= 1 || PyLong_AsLongLong(PyTuple_GET_ITEM(st, d)) == m[nd + d];
    Py_DECREF(st);
    if (PyErr_Occurred()) return -1;
    return same;
}

static int data_ptr(PyObject *t, char **out);

/* OpenMP threads follow torch.set_num_threads (the kernels' omp_set_num_threads is per calling
 * thread, and a torch build may bring its own OpenMP runtime: docs/backend_cpu.md). -1 with an
 * exception. */
static int follow_torch_threads(Kernel *k) {
    PyObject *nt = PyObject_CallNoArgs(get_num_threads);
    long n = nt ? PyLong_AsLong(nt) : -1;
    Py_XDECREF(nt);
    if (n < 0 && PyErr_Occurred()) return -1;
    k->set_threads((int)n);
    return 0;
}

static int gather_error(const Kernel *k, const int64_t *err);

/* A kernel of a symbolic graph: this call's symbol values from the source tensors' sizes, its
 * layout from ember_k<i>_meta, then the kernel with the values as arguments. */
static PyObject *kernel_call_symbolic(Kernel *k, PyObject *const *args) {
    int64_t svbuf[KSTACK], mbuf[4 * KSTACK], *sv = svbuf, *m = mbuf;
    char *pbuf[KSTACK], **ptrs = pbuf;
    PyObject *fixbuf[KSTACK], **fixed = fixbuf, *out = NULL, *size = NULL, *stride = NULL, *outs = NULL;
    int64_t err[2] = {0, 0}; /* CPU kernels with gather loads: the error word, after the outputs */
    uint32_t nptr = k->nin + 1 + k->nextra + (k->nchecks > 0);
    memset(fixbuf, 0, sizeof fixbuf);
    if (k->si.nsym > KSTACK) sv = PyMem_Calloc(k->si.nsym, sizeof(int64_t));
    else memset(svbuf, 0, sizeof svbuf);
    if (k->nmeta > 4 * KSTACK) m = PyMem_Calloc(k->nmeta, sizeof(int64_t));
    if (nptr > KSTACK) {
        ptrs = PyMem_Malloc(nptr * sizeof(char *));
        fixed = PyMem_Calloc(nptr, sizeof(PyObject *));
    }
    if (!sv || !m || !ptrs || !fixed) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t first_src = (Py_ssize_t)k->nin + (k->donor >= 0 && (uint32_t)k->donor >= k->nin);
    if (symin_read(&k->si, k->name, args + first_src, sv) < 0) goto done;
    if (!k->mprog) {
        k->meta(sv, m);
    } else if (em_sym_exprs_eval(k->mprog, sv, m) < 0) {
        PyErr_Format(PyExc_RuntimeError, "ember kernel %U: a size expression overflows for these sizes", k->name);
        goto done;
    }
    int32_t mi = EM_KMETA_OUT + 2 * k->out_ndim;
    for (uint32_t i = 0; i < k->nin; i++) {
        PyObject *t = args[i];
        if (k->in_ndim[i] >= 0) {
            /* an extern result: the layout its meta promised for these sizes, else a copy into it */
            int nd = k->in_ndim[i];
            int same = layout_is_m(t, nd, m + mi);
            if (same < 0) goto done;
            if (!same) {
                PyObject *sz = em_int64_tuple(nd, m + mi), *st = sz ? em_int64_tuple(nd, m + mi + nd) : NULL;
                fixed[i] = st ? tensor_as(t, sz, st) : NULL;
                Py_XDECREF(sz);
                Py_XDECREF(st);
                if (!fixed[i]) goto done;
                t = fixed[i];
            }
            mi += 2 * nd;
        }
        if (data_ptr(t, &ptrs[i]) < 0) goto done;
    }
    if (k->donor >= 0) {
        out = Py_NewRef(args[k->donor]);
    } else {
        size = em_int64_tuple(k->out_ndim, m + EM_KMETA_OUT);
        stride = size ? em_int64_tuple(k->out_ndim, m + EM_KMETA_OUT + k->out_ndim) : NULL;
        if (!stride) goto done;
        out = new_empty(size, stride, k->out_dtype, k->out_device, k->cuda ? em_cuda_fn_device(k->cuda) : -1);
        if (!out) goto done;
    }
    if (data_ptr(out, &ptrs[k->nin]) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    if (k->nextra) { /* the other outputs, in the layouts m[] gives after the extern results' */
        if (!(outs = PyTuple_New(1 + k->nextra))) {
            Py_CLEAR(out);
            goto done;
        }
        PyTuple_SET_ITEM(outs, 0, out);
        for (uint32_t e = 0; e < k->nextra; e++) {
            int32_t nd = k->extra_ndim[e];
            PyObject *sz = em_int64_tuple(nd, m + mi), *st = sz ? em_int64_tuple(nd, m + mi + nd) : NULL;
            PyObject *t = st ? new_empty(sz, st, k->extra_dtype[e], k->out_device, k->cuda ? em_cuda_fn_device(k->cuda) : -1)
                             : NULL;
            Py_XDECREF(sz);
            Py_XDECREF(st);
            mi += 2 * nd;
            if (!t) goto fail_outs;
            PyTuple_SET_ITEM(outs, 1 + e, t);
            if (data_ptr(t, &ptrs[k->nin + 1 + e]) < 0) goto fail_outs;
        }
        out = outs; /* the kernel's result: (first output, other outputs...) */
    }
    if (k->out_elsize && k->donor < 0) {
        int64_t nbytes = k->out_elsize;
        for (int32_t d = 0; d < k->out_ndim; d++) nbytes *= m[EM_KMETA_OUT + d];
        advise_huge_pages(ptrs[k->nin], nbytes);
    }
    if (m[EM_KMETA_NUMEL] > 0 && k->set_threads && m[EM_KMETA_WORK] >= k->threshold && follow_torch_threads(k) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    if (k->cuda) {
        /* the launch shape of this call's sizes; the last two values of m are the row length
         * and the farthest element (cuda_meta_exprs) */
        EmCudaCall cc = {sv, m[EM_KMETA_NUMEL], m[k->nmeta - 2], m[k->nmeta - 1]};
        if (em_cuda_launch_sym(k->cuda, ptrs, nptr, &cc) < 0) Py_CLEAR(out);
    } else if (m[EM_KMETA_NUMEL] > 0) {
        if (k->nchecks) ptrs[k->nin + 1 + k->nextra] = (char *)err;
        Py_BEGIN_ALLOW_THREADS
        k->fn(ptrs, sv);
        Py_END_ALLOW_THREADS
        if (gather_error(k, err) < 0) Py_CLEAR(out);
    }
    goto done;
fail_outs:
    Py_CLEAR(outs); /* owns out */
    out = NULL;
done:
    for (uint32_t i = 0; i < k->nin && fixed; i++) Py_XDECREF(fixed[i]);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    if (sv && sv != svbuf) PyMem_Free(sv);
    if (m && m != mbuf) PyMem_Free(m);
    if (ptrs && ptrs != pbuf) PyMem_Free(ptrs);
    if (fixed && fixed != fixbuf) PyMem_Free(fixed);
    return out;
}

/* Raises the error eager raises for the index a gather load's check reported (err: the kernel's
 * error word), and returns -1; 0 when no check failed. */
static int gather_error(const Kernel *k, const int64_t *err) {
    if (!err[0]) return 0;
    for (uint32_t i = 0; i < k->nchecks; i++) {
        const GatherCheck *c = &k->checks[i];
        if (c->check != err[0] - 1) continue;
        if (c->err == LGERR_RANGE_IN_SELF) PyErr_SetString(PyExc_IndexError, "index out of range in self");
        else if (c->err == LGERR_INDEX_COPY)
            PyErr_Format(PyExc_IndexError, "index_copy_(): index %lld is out of bounds for dimension %d with size %lld",
                         (long long)err[1], c->dim, (long long)c->size);
        else if (c->err == LGERR_DATA_BOUNDS)
            PyErr_Format(PyExc_RuntimeError, "INDICES element is out of DATA bounds, id=%lld axis_dim=%lld",
                         (long long)err[1], (long long)c->size);
        else
            PyErr_Format(c->err == LGERR_GATHER ? PyExc_RuntimeError : PyExc_IndexError,
                         "index %lld is out of bounds for dimension %d with size %lld", (long long)err[1], c->dim,
                         (long long)c->size);
        return -1;
    }
    PyErr_Format(PyExc_SystemError, "ember kernel %U: an unknown bounds check failed", k->name);
    return -1;
}

static PyObject *kernel_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Kernel *k = (Kernel *)self;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if ((kwnames && PyTuple_GET_SIZE(kwnames)) ||
        n != (Py_ssize_t)k->nin + (k->donor >= 0 && (uint32_t)k->donor >= k->nin) +
                 (k->meta || k->mprog ? 0 : (Py_ssize_t)k->nextra) + (Py_ssize_t)k->si.nsrcargs) {
        PyErr_Format(PyExc_TypeError, "ember kernel %U: wrong arguments", k->name);
        return NULL;
    }
    if (k->meta || k->mprog) return kernel_call_symbolic(k, args);
    char *pbuf[KSTACK], **ptrs = pbuf;
    PyObject *fixbuf[KSTACK], **fixed = fixbuf, *out = NULL;
    int64_t err[2] = {0, 0}; /* the gather loads' error word (em_codegen.h) */
    uint32_t nptr = k->nin + 1 + k->nextra + (k->nchecks > 0);
    if (nptr > KSTACK) {
        ptrs = PyMem_Malloc(nptr * sizeof(char *));
        fixed = PyMem_Calloc(nptr, sizeof(PyObject *));
        if (!ptrs || !fixed) {
            PyErr_NoMemory();
            goto done;
        }
    } else {
        memset(fixbuf, 0, sizeof fixbuf);
    }
    for (uint32_t i = 0; i < k->nin; i++) {
        PyObject *t = args[i];
        if (k->in_size && k->in_size[i]) {
            int d = layout_differs(t, k->in_size[i], k->in_stride[i]);
            if (d < 0) goto done;
            if (d) {
                fixed[i] = tensor_as(t, k->in_size[i], k->in_stride[i]);
                if (!fixed[i]) goto done;
                t = fixed[i];
            }
        }
        if (data_ptr(t, &ptrs[i]) < 0) goto done;
    }
    if (k->donor >= 0) {
        out = k->donor_relayout ? as_strided_at(args[k->donor], k->out_size, k->out_stride, 0)
                                : Py_NewRef(args[k->donor]);
        if (!out) goto done;
    } else {
        /* CUDA: torch's caching allocator on the graph's device, ordered on its current stream */
        out = new_empty(k->out_size, k->out_stride, k->out_dtype, k->out_device, k->cuda ? em_cuda_fn_device(k->cuda) : -1);
        if (!out) goto done;
    }
    if (data_ptr(out, &ptrs[k->nin]) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    for (uint32_t e = 0; e < k->nextra; e++) {
        PyObject *t = args[k->nin + (k->donor >= 0 && (uint32_t)k->donor >= k->nin) + e];
        if (data_ptr(t, &ptrs[k->nin + 1 + e]) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    if (k->out_elsize && k->donor < 0) advise_huge_pages(ptrs[k->nin], k->out_bytes);
    if (k->numel > 0 && !k->cuda && k->set_threads && follow_torch_threads(k) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    if (k->numel > 0 && k->cuda) {
        if (em_cuda_launch(k->cuda, ptrs, k->nin + 1 + k->nextra) < 0) Py_CLEAR(out);
    } else if (k->numel > 0) {
        if (k->nchecks) ptrs[k->nin + 1 + k->nextra] = (char *)err;
        Py_BEGIN_ALLOW_THREADS
        k->fn(ptrs, NULL);
        Py_END_ALLOW_THREADS
        if (gather_error(k, err) < 0) Py_CLEAR(out);
    }
done:
    for (uint32_t i = 0; i < k->nin && fixed; i++) Py_XDECREF(fixed[i]);
    if (ptrs != pbuf) PyMem_Free(ptrs);
    if (fixed != fixbuf) PyMem_Free(fixed);
    return out;
}

static void kernel_dealloc(PyObject *self) {
    Kernel *k = (Kernel *)self;
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(k->lib);
    Py_XDECREF(k->name);
    Py_XDECREF(k->out_size);
    Py_XDECREF(k->out_stride);
    Py_XDECREF(k->out_dtype);
    Py_XDECREF(k->out_device);
    em_cuda_fn_free(k->cuda);
    em_sym_prog_free(k->mprog);
    symin_free(&k->si);
    free(k->in_ndim);
    for (uint32_t e = 0; k->extra_dtype && e < k->nextra; e++) Py_XDECREF(k->extra_dtype[e]);
    free(k->extra_dtype);
    free(k->extra_ndim);
    free(k->checks);
    if (k->in_size) {
        for (uint32_t i = 0; i < k->nin; i++) {
            Py_XDECREF(k->in_size[i]);
            Py_XDECREF(k->in_stride[i]);
        }
        free(k->in_size);
        free(k->in_stride);
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *kernel_get_name(PyObject *self, void *c) { return Py_NewRef(((Kernel *)self)->name); }
static PyObject *kernel_repr(PyObject *self) { return PyUnicode_FromFormat("<ember kernel %U>", ((Kernel *)self)->name); }

static PyGetSetDef kernel_getset[] = {
    {"__name__", kernel_get_name, NULL, "the kernel's C function name", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef kernel_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Kernel, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot kernel_slots[] = {
    {Py_tp_dealloc, kernel_dealloc},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_repr, kernel_repr},
    {Py_tp_getset, kernel_getset},
    {Py_tp_members, kernel_members},
    {Py_tp_doc, (void *)"A generated C kernel: kernel(*input_tensors[, donor]) -> output tensor."},
    {0, NULL},
};

static PyType_Spec kernel_spec = {
    .name = "ember._C.Kernel",
    .basicsize = sizeof(Kernel),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = kernel_slots,
};

/* ------------------------------------------------------------------------------------------ */
/* View: the tensor an extern call reads as a view of a buffer (LBUF_VIEW)                      */
/* ------------------------------------------------------------------------------------------ */

/* view(base) -> base.as_strided(size, stride, base.storage_offset() + offset): eager's sizes,
 * strides and storage offset on the base's storage, in one torch call however many view ops
 * eager ran (x.view(2, 16, 2, 32).transpose(1, 2) is one). as_strided keeps the base's storage
 * offset when none is given (torch/_torch_docs.py), so offset 0 costs no storage_offset() read.
 * A base that is an extern's result is first checked against the layout its meta promised (the
 * strides were computed from it) and copied into that layout when torch chose another, as the
 * kernels do with what they read. In a symbolic graph whose view depends on the sizes, prog
 * computes them per call (view_call_symbolic). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *size, *stride; /* tuples */
    int64_t offset;          /* elements from the base's first element */
    PyObject *base_size, *base_stride; /* an extern's result: its meta layout; else NULL */
    PyObject *name;          /* the IR node it stands for */
    /* a view of a parameter is made once: the last base when it was an nn.Parameter, its data
     * pointer then, and the view made from it (reused while nothing else holds it) */
    bool input_base;         /* the base is a graph input */
    PyObject *cache_base, *cache_view;
    void *cache_ptr;
    /* symbolic: prog evaluates (sizes, strides, offset, then an extern base's sizes and strides)
     * from this call's symbols, read from the source tensors passed after the base (si); size,
     * stride, offset and base_* are unused, and no view is cached */
    SymProg *prog;
    SymIn si;
    int32_t ndim, base_ndim; /* base_ndim: an extern base's rank, else -1 */
} View;

static PyTypeObject *View_Type = NULL;
static PyObject *parameter_type = NULL; /* torch.nn.Parameter */

/* The cached view of v for base t, or NULL (no exception) when it cannot be used: t is the same
 * nn.Parameter object as last time with the same data pointer (its sizes, strides and dtype are
 * the guarded ones, so the view's metadata is the same, and the storage the same since the cached
 * view keeps the old one alive: an address cannot be reused while it lives), and nothing but the
 * cache holds the view (no caller, no earlier output can see the object handed out again). */
static PyObject *view_cached(View *v, PyObject *t) {
    if (!v->cache_view || v->cache_base != t || Py_REFCNT(v->cache_view) != 1) return NULL;
    char *p;
    if (data_ptr(t, &p) < 0) {
        PyErr_Clear();
        return NULL;
    }
    return p == v->cache_ptr ? Py_NewRef(v->cache_view) : NULL;
}

/* t.as_strided(size, stride, t.storage_offset() + offset) */
static PyObject *as_strided_at(PyObject *t, PyObject *size, PyObject *stride, int64_t offset) {
    if (offset == 0) {
        PyObject *a[3] = {t, size, stride};
        return PyObject_VectorcallMethod(em_str("as_strided"), a, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    PyObject *so = PyObject_CallMethodNoArgs(t, em_str("storage_offset")), *r = NULL;
    long long o = so ? PyLong_AsLongLong(so) : -1;
    Py_XDECREF(so);
    PyObject *off = (o == -1 && PyErr_Occurred()) ? NULL : PyLong_FromLongLong(o + offset);
    if (off) {
        PyObject *a[4] = {t, size, stride, off};
        r = PyObject_VectorcallMethod(em_str("as_strided"), a, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(off);
    }
    return r;
}

/* A view of a symbolic graph: args are the base, then the symbols' source tensors. */
static PyObject *view_call_symbolic(View *v, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 + (Py_ssize_t)v->si.nsrcargs) {
        PyErr_Format(PyExc_TypeError, "ember view %U: wrong arguments", v->name);
        return NULL;
    }
    int64_t svbuf[KSTACK], mbuf[4 * EM_LMAXDIM + 1], *sv = svbuf;
    if (v->si.nsym > KSTACK && !(sv = PyMem_Calloc(v->si.nsym, sizeof(int64_t)))) return PyErr_NoMemory();
    if (sv == svbuf) memset(svbuf, 0, sizeof svbuf);
    PyObject *t = args[0], *fixed = NULL, *size = NULL, *stride = NULL, *r = NULL;
    if (symin_read(&v->si, v->name, args + 1, sv) < 0) goto done;
    if (em_sym_exprs_eval(v->prog, sv, mbuf) < 0) {
        PyErr_Format(PyExc_RuntimeError, "ember view %U: a size expression overflows for these sizes", v->name);
        goto done;
    }
    int32_t nd = v->ndim, bm = 2 * nd + 1;
    if (v->base_ndim >= 0) { /* an extern's result: the layout its meta promised, else a copy into it */
        int same = layout_is_m(t, v->base_ndim, mbuf + bm);
        if (same < 0) goto done;
        if (!same) {
            PyObject *bs = em_int64_tuple(v->base_ndim, mbuf + bm);
            PyObject *bst = bs ? em_int64_tuple(v->base_ndim, mbuf + bm + v->base_ndim) : NULL;
            fixed = bst ? tensor_as(t, bs, bst) : NULL;
            Py_XDECREF(bs);
            Py_XDECREF(bst);
            if (!fixed) goto done;
            t = fixed;
        }
    }
    size = em_int64_tuple(nd, mbuf);
    stride = size ? em_int64_tuple(nd, mbuf + nd) : NULL;
    if (stride) r = as_strided_at(t, size, stride, mbuf[2 * nd]);
done:
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(fixed);
    if (sv != svbuf) PyMem_Free(sv);
    return r;
}

static PyObject *view_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    View *v = (View *)self;
    if (v->prog && !(kwnames && PyTuple_GET_SIZE(kwnames))) return view_call_symbolic(v, args, PyVectorcall_NARGS(nargsf));
    if ((kwnames && PyTuple_GET_SIZE(kwnames)) || PyVectorcall_NARGS(nargsf) != 1) {
        PyErr_Format(PyExc_TypeError, "ember view %U: wrong arguments", v->name);
        return NULL;
    }
    PyObject *t = args[0], *fixed = NULL, *r = NULL;
    int param = v->input_base && parameter_type && PyObject_TypeCheck(t, (PyTypeObject *)parameter_type);
    if (param && (r = view_cached(v, t))) return r;
    if (v->base_size) {
        int d = layout_differs(t, v->base_size, v->base_stride);
        if (d < 0) return NULL;
        if (d && !(t = fixed = tensor_as(t, v->base_size, v->base_stride))) return NULL;
    }
    r = as_strided_at(t, v->size, v->stride, v->offset);
    Py_XDECREF(fixed);
    if (r && param) {
        char *p;
        if (data_ptr(t, &p) < 0) {
            Py_DECREF(r);
            return NULL;
        }
        Py_XSETREF(v->cache_base, Py_NewRef(t));
        Py_XSETREF(v->cache_view, Py_NewRef(r));
        v->cache_ptr = p;
    }
    return r;
}

static void view_dealloc(PyObject *self) {
    View *v = (View *)self;
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(v->cache_base);
    Py_XDECREF(v->cache_view);
    Py_XDECREF(v->size);
    Py_XDECREF(v->stride);
    Py_XDECREF(v->base_size);
    Py_XDECREF(v->base_stride);
    Py_XDECREF(v->name);
    em_sym_prog_free(v->prog);
    symin_free(&v->si);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *view_repr(PyObject *self) {
    View *v = (View *)self;
    if (v->prog) return PyUnicode_FromFormat("<ember view %U: as_strided of this call's sizes>", v->name);
    return PyUnicode_FromFormat("<ember view %U: as_strided(%R, %R, +%lld)>", v->name, v->size, v->stride,
                                (long long)v->offset);
}

static PyMemberDef view_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(View, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot view_slots[] = {
    {Py_tp_dealloc, view_dealloc},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_repr, view_repr},
    {Py_tp_members, view_members},
    {Py_tp_doc, (void *)"A view an extern call reads: view(base) -> base.as_strided(size, stride, offset)."},
    {0, NULL},
};

static PyType_Spec view_spec = {
    .name = "ember._C.View",
    .basicsize = sizeof(View),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = view_slots,
};

static void lib_close(PyObject *cap) {
    void *h = PyCapsule_GetPointer(cap, "ember.lib");
    if (h) dlclose(h);
}

/* ------------------------------------------------------------------------------------------ */
/* Building the program                                                                       */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    const Schedule *s;
    IRGraph *ng;
    uint32_t *ir_new;   /* old IR ref -> new ref */
    uint32_t *buf_new;  /* buffer -> new ref of the tensor that holds it */
} Prog;

static int copy_arg(Prog *p, const IRArg *a, IRArg *out) {
    *out = *a;
    if (a->kind == IRARG_NODE) {
        uint32_t b = p->s->ir_buf[a->u.ref];
        out->u.ref = b != NONE && p->buf_new[b] ? p->buf_new[b] : p->ir_new[a->u.ref];
        if (!out->u.ref) {
            PyErr_SetString(PyExc_SystemError, "ember: extern argument without a value");
            return -1;
        }
        return 0;
    }
    if (a->kind == IRARG_CONST) return em_arena_hold(p->ng->arena, a->u.obj) || !a->u.obj ? 0 : -1;
    out->u.items = a->n ? em_arena_alloc(p->ng->arena, a->n * sizeof(IRArg)) : NULL;
    if (a->n && !out->u.items) return -1;
    for (uint32_t i = 0; i < a->n; i++)
        if (copy_arg(p, &a->u.items[i], &out->u.items[i]) < 0) return -1;
    return 0;
}

/* Does buffer b's layout map its elements one to one onto the element offsets [0, numel)? (dims
 * of size > 1 ordered by stride: the smallest 1, each the product of the ones below) */
static int dense_layout(const LBuf *b) {
    int64_t want = 1;
    uint32_t used = 0;
    for (;;) {
        int pick = -1;
        for (int d = 0; d < b->ndim; d++)
            if (b->sizes[d] > 1 && !((used >> d) & 1) && (pick < 0 || b->strides[d] < b->strides[pick])) pick = d;
        if (pick < 0) return 1;
        if (b->strides[pick] != want) return 0;
        want *= b->sizes[pick];
        used |= 1u << pick;
    }
}

static int64_t numel_of_buf(const LBuf *b) {
    int64_t n = 1;
    for (int d = 0; d < b->ndim; d++) n *= b->sizes[d];
    return n;
}

/* Same dtype and layout (symbolic graph: the same expressions, so for every size). */
static int same_layout(const LBuf *a, const LBuf *b) {
    return a->dtype == b->dtype && a->ndim == b->ndim && memcmp(a->sizes, b->sizes, a->ndim * sizeof(int64_t)) == 0 &&
           memcmp(a->strides, b->strides, a->ndim * sizeof(int64_t)) == 0 &&
           memcmp(a->ssizes, b->ssizes, a->ndim * sizeof(SymRef)) == 0 &&
           memcmp(a->sstrides, b->sstrides, a->ndim * sizeof(SymRef)) == 0;
}

/* Static graph: may buffer b's memory hold buffer ob in ob's own layout (the kernel's output made
 * as b.as_strided(ob's sizes and strides): Kernel.donor_relayout)? Both dense, of one dtype and
 * element count, as Inductor's buffer reuse keys on dtype and storage size, not layout. */
static int same_extent(const LGraph *lg, uint32_t b, uint32_t ob) {
    const LBuf *x = &lg->bufs[b], *y = &lg->bufs[ob];
    return !lg->env && x->dtype == y->dtype && numel_of_buf(x) == numel_of_buf(y) && dense_layout(x) && dense_layout(y);
}

/* Can dead buffer b hold buffer ob: the same layout, or (relayout) the same extent? */
static int can_hold(const LGraph *lg, uint32_t b, uint32_t ob, int relayout) {
    return same_layout(&lg->bufs[b], &lg->bufs[ob]) || (relayout && same_extent(lg, b, ob));
}

/* The buffer of the pool that can hold buffer ob at step st (same layout, or with relayout the same
 * extent) and died last before st, at or after step since - 1; NONE when none. A donated buffer is
 * held from its last read to the step that takes it, where torch's allocator would have handed its
 * memory to an allocation in between: so only a buffer that died after the last allocation
 * (since: that step + 1) is taken, the memory the allocator would hand out next, and the peak
 * stays that of allocating every buffer. */
static uint32_t latest_dead(const LGraph *lg, const uint32_t *pool, uint32_t npool, const uint8_t *consumed,
                            const uint32_t *last, uint32_t since, uint32_t st, uint32_t ob, int relayout) {
    uint32_t pick = NONE;
    for (uint32_t q = 0; q < npool; q++) {
        uint32_t b = pool[q];
        if (consumed[b] || last[b] >= st + 1 || last[b] < since || (pick != NONE && last[b] <= last[pick])) continue;
        if (can_hold(lg, b, ob, relayout)) pick = b;
    }
    return pick;
}

/* ext_seen[b]: SEEN_ANY when an extern call or a VIEW made for one can see buffer b's memory,
 * SEEN_DIRECT when a call reads b's own tensor (not through a VIEW), SEEN_KEPT when b's memory
 * may outlive the call that sees it: a call that may return an alias of its argument (a view op,
 * an op ember knows nothing of) or the graph's output. A buffer that only kernels and fresh
 * calls (matmul, convolution, attention: new tensors, nothing kept) read is dead after its last
 * reader, like one only kernels read. */
enum { SEEN_ANY = 1, SEEN_DIRECT = 2, SEEN_KEPT = 4 };

/* Notes what extern step st (or the output, st NONE) reads: ext_seen as above, and the reads
 * in last[] (step index + 1; a VIEW's reads count as its base's). */
static void mark_ext_uses(const Schedule *s, const IRArg *a, uint8_t kept, uint32_t st, uint8_t *ext_seen,
                          uint32_t *last) {
    if (a->kind == IRARG_NODE) {
        uint32_t b = s->ir_buf[a->u.ref];
        if (b != NONE) {
            ext_seen[b] |= SEEN_ANY | SEEN_DIRECT | kept;
            if (st != NONE) last[b] = st + 1;
            if (s->lg->bufs[b].kind == LBUF_VIEW) {
                ext_seen[s->lg->bufs[b].index] |= SEEN_ANY | kept;
                if (st != NONE) last[s->lg->bufs[b].index] = st + 1;
            }
        }
    } else if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        for (uint32_t i = 0; i < a->n; i++) mark_ext_uses(s, &a->u.items[i], kept, st, ext_seen, last);
    }
}

/* Does extern step index r (an IR node) return new tensors and keep nothing it reads? The
 * lowering's list of such ops (LBuf.fresh), or a linear called without its bias (ext_call). */
static int fresh_call(const LGraph *lg, uint32_t r) {
    const LVal *v = &lg->vals[r];
    if (v->kind == LV_NODE) return v->ext_call;
    return v->kind == LV_EXTERN && v->has_load && lg->bufs[lg->nodes[v->lnode].buf].fresh;
}

/* A program node allocating buffer b (in the layout of its view form_of[b] when it has one, as a
 * kernel's own output is): torch.empty_strided(size, stride, dtype=, device=) through
 * ember._C._empty_strided (new_empty). 0 with an exception. */
static IRRef alloc_node(Prog *p, const LBuf *b, const uint32_t *form_of, PyObject *device) {
    const LBuf *lb = form_of[b - p->s->lg->bufs] != NONE ? &p->s->lg->bufs[form_of[b - p->s->lg->bufs]] : b;
    PyObject *size = em_arena_hold_steal(p->ng->arena, em_int64_tuple(lb->ndim, lb->sizes));
    PyObject *stride = size ? em_arena_hold_steal(p->ng->arena, em_int64_tuple(lb->ndim, lb->strides)) : NULL;
    int code = device_code(device);
    PyObject *codeo = code > -3 ? em_arena_hold_steal(p->ng->arena, PyLong_FromLong(code)) : NULL;
    if (!stride || !codeo || !em_arena_hold(p->ng->arena, empty_strided_fn) || !em_arena_hold(p->ng->arena, device) ||
        !em_arena_hold(p->ng->arena, em_lower_dtype_obj(lb->dtype)))
        return 0;
    IRArg args[5] = {{.kind = IRARG_CONST, .u.obj = size},
                     {.kind = IRARG_CONST, .u.obj = stride},
                     {.kind = IRARG_CONST, .u.obj = em_lower_dtype_obj(lb->dtype)},
                     {.kind = IRARG_CONST, .u.obj = device},
                     {.kind = IRARG_CONST, .u.obj = codeo}};
    IRRef r = em_ir_call(p->ng, IR_CALL_FUNCTION, empty_strided_fn, args, 5, NULL, NULL, 0, NULL);
    if (!r && !PyErr_Occurred()) PyErr_NoMemory();
    return r;
}

/* A program node viewing tensor r in buffer b's layout: r.as_strided(size, stride), r dense with
 * b's dtype and element count (same_extent). 0 with an exception. */
static IRRef relayout_node(Prog *p, IRRef r, const LBuf *b) {
    PyObject *size = em_arena_hold_steal(p->ng->arena, em_int64_tuple(b->ndim, b->sizes));
    PyObject *stride = size ? em_arena_hold_steal(p->ng->arena, em_int64_tuple(b->ndim, b->strides)) : NULL;
    PyObject *name = stride ? em_arena_hold(p->ng->arena, em_str("as_strided")) : NULL;
    if (!name) return 0;
    IRArg args[3] = {{.kind = IRARG_NODE, .u.ref = r}, {.kind = IRARG_CONST, .u.obj = size},
                     {.kind = IRARG_CONST, .u.obj = stride}};
    IRRef v = em_ir_call(p->ng, IR_CALL_METHOD, name, args, 3, NULL, NULL, 0, NULL);
    if (!v && !PyErr_Occurred()) PyErr_NoMemory();
    return v;
}

/* A program node taking item i of the tuple value r (operator.getitem). 0 with an exception. */
static IRRef item_node(Prog *p, IRRef r, uint32_t i) {
    static PyObject *getitem = NULL; /* operator.getitem; one interpreter */
    if (!getitem && !em_lazy_attr(&getitem, "operator", "getitem")) return 0;
    PyObject *idx = em_arena_hold_steal(p->ng->arena, PyLong_FromUnsignedLong(i));
    if (!idx || !em_arena_hold(p->ng->arena, getitem)) return 0;
    IRArg args[2] = {{.kind = IRARG_NODE, .u.ref = r}, {.kind = IRARG_CONST, .u.obj = idx}};
    IRRef g = em_ir_call(p->ng, IR_CALL_FUNCTION, getitem, args, 2, NULL, NULL, 0, NULL);
    if (!g && !PyErr_Occurred()) PyErr_NoMemory();
    return g;
}

/* The launch table of the CUDA code generator, for cache_info and the tests. */
static PyObject *launch_list(const EmCudaLaunch *L, uint32_t n) {
    PyObject *l = PyList_New(0);
    for (uint32_t i = 0; l && i < n; i++) {
        PyObject *e = Py_BuildValue("{s:i,s:L,s:i,s:i,s:i,s:i,s:i,s:i,s:O,s:O,s:i,s:i,s:i}", "block", L[i].block, "blocks",
                                    (long long)L[i].blocks, "per_sm", L[i].per_sm, "vec", L[i].vec, "idx64", L[i].idx64,
                                    "rows_per_block", L[i].rows_per_block, "threads_per_row", L[i].threads_per_row,
                                    "cached", L[i].cached, "symbolic", L[i].sym ? Py_True : Py_False, "block_dyn",
                                    L[i].block_dyn ? Py_True : Py_False, "split", L[i].split, "unroll", L[i].unroll, "cols",
                                    L[i].cols);
        if (!e || PyList_Append(l, e) < 0) Py_CLEAR(l);
        Py_XDECREF(e);
    }
    return l;
}

/* The graph on the eager backend, with the reason in info["fallback"]. New reference or NULL. */
static PyObject *eager_fallback(PyObject *info, const IRGraph *g, const char *why) {
    PyObject *w = PyUnicode_FromString(why);
    int bad = !w || PyDict_SetItemString(info, "fallback", w) < 0;
    Py_XDECREF(w);
    return bad ? NULL : em_eager_graph_new(g);
}

/* The graph on the eager backend after em_cc_load failed with a RuntimeError (set on entry). */
static PyObject *cc_fallback(PyObject *info, const IRGraph *g) {
    static int warned_missing = 0;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *msg = ev ? PyObject_Str(ev) : NULL;
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    if (!msg) return NULL;
    PyObject *result = NULL, *w = PyUnicode_FromFormat("%U: ran by the eager backend", msg);
    const char *m = PyUnicode_AsUTF8(msg);
    int missing = m && strstr(m, "needs a C compiler") != NULL;
    if (w && PyDict_SetItemString(info, "fallback", w) == 0 &&
        ((missing && warned_missing++) || PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "%U", w) == 0))
        result = em_eager_graph_new(g);
    Py_DECREF(msg);
    Py_XDECREF(w);
    return result;
}

/* Where each symbol the kernels read comes from: a graph input (placeholder) whose size at some
 * dim is that symbol, else an int input that is the symbol (dim -1: a size the forward half of a
 * training region saved for its backward). input[]: the distinct inputs (passed to every kernel
 * after its tensors); per used symbol, which of them and which dim. */
typedef struct {
    uint32_t n, nsym;      /* distinct inputs; symbols sourced */
    uint32_t *input;       /* graph input index, per distinct input */
    uint32_t *sym, *which; /* per sourced symbol: symbol index, position in input[] */
    int32_t *dim;
} SymSources;

/* -1 without an exception when a used symbol has no source (the graph runs eagerly). Arrays are
 * malloc'd (freed by sym_sources_free). */
static int sym_sources(const IRGraph *g, ShapeEnv *env, const uint8_t *used, SymSources *out) {
    uint32_t ns = em_sym_nsymbols(env);
    out->input = calloc(g->ninputs + 1, sizeof(uint32_t));
    out->sym = calloc(ns + 1, sizeof(uint32_t));
    out->which = calloc(ns + 1, sizeof(uint32_t));
    out->dim = calloc(ns + 1, sizeof(int32_t));
    if (!out->input || !out->sym || !out->which || !out->dim) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < ns; i++) {
        if (!used[i]) continue;
        int found = 0;
        for (uint32_t pass = 0; pass < 2 && !found; pass++) /* tensors' dims first, then int inputs (dim -1) */
        for (uint32_t p = 0; p < g->ninputs && !found; p++) {
            const IRMeta *m = &g->nodes[g->inputs[p]].meta;
            bool is_int = pass == 1 && m->kind == IRMETA_OTHER && m->sym && m->example && PyLong_Check(m->example) &&
                          em_sym_symbol_index(env, em_sym_simplify(env, m->sym)) == (int64_t)i;
            if (!is_int && (pass == 1 || m->kind != IRMETA_TENSOR || !m->sym_sizes)) continue;
            for (int32_t d = is_int ? -1 : 0; d < (is_int ? 0 : m->ndim) && !found; d++) {
                if (!is_int && em_sym_symbol_index(env, em_sym_simplify(env, m->sym_sizes[d])) != (int64_t)i) continue;
                uint32_t w = NONE;
                for (uint32_t q = 0; q < out->n; q++)
                    if (out->input[q] == p) w = q;
                if (w == NONE) {
                    w = out->n;
                    out->input[out->n++] = p;
                }
                out->sym[out->nsym] = i;
                out->which[out->nsym] = w;
                out->dim[out->nsym++] = d;
                found = 1;
            }
        }
        if (!found) return -1;
    }
    return 0;
}

static void sym_sources_free(SymSources *s) {
    free(s->input);
    free(s->sym);
    free(s->which);
    free(s->dim);
}

/* si for a kernel or view of a graph whose symbols come from srcs; want: the symbols it reads
 * (NULL: all sourced ones), so that a call reads no other source's shape. -1 with an exception. */
static int symin_set(SymIn *si, ShapeEnv *env, const SymSources *srcs, const uint8_t *want) {
    si->nsym = em_sym_nsymbols(env);
    si->nsrc = srcs->nsym;
    si->nsrcargs = srcs->n;
    si->src_sym = malloc((srcs->nsym + 1) * sizeof(uint32_t));
    si->src_arg = malloc((srcs->nsym + 1) * sizeof(uint32_t));
    si->src_dim = malloc((srcs->nsym + 1) * sizeof(int32_t));
    if (!si->src_sym || !si->src_arg || !si->src_dim) {
        PyErr_NoMemory();
        return -1;
    }
    si->nsrc = 0;
    for (uint32_t i = 0; i < srcs->nsym; i++) {
        if (want && !want[srcs->sym[i]]) continue;
        si->src_sym[si->nsrc] = srcs->sym[i];
        si->src_arg[si->nsrc] = srcs->which[i];
        si->src_dim[si->nsrc++] = srcs->dim[i];
    }
    return 0;
}

/* The layout of a CUDA kernel's m[] as size expressions (EM_KMETA_*: work, elements, the output's
 * sizes and strides, each extern result's, the other outputs'; then the row length and the farthest element reached,
 * em_codegen_cuda_sym_exprs). out has room for cuda_meta_cap(s, k) entries; returns the count. */
static uint32_t cuda_meta_cap(const SKernel *k) { return 4 + 2 * EM_LMAXDIM * (k->nargs + 1); }

static uint32_t cuda_meta_exprs(const Schedule *s, const SKernel *k, SymRef *out) {
    const LGraph *lg = s->lg;
    ShapeEnv *env = lg->env;
    uint32_t n = 0;
    SymRef work = em_sym_const(env, 1), numel = work;
    for (int j = 0; j < k->ndim; j++) work = em_sym_mul(env, work, k->ssizes[j]);
    for (int j = 0; j < (k->reduction ? k->nouter : k->ndim); j++) numel = em_sym_mul(env, numel, k->ssizes[j]);
    out[n++] = work;
    out[n++] = numel;
    const LBuf *ob = &lg->bufs[k->args[k->nin]];
    for (int t = 0; t < 2 * ob->ndim; t++) out[n++] = t < ob->ndim ? ob->ssizes[t] : ob->sstrides[t - ob->ndim];
    for (uint32_t a = 0; a < k->nin; a++) {
        const LBuf *ib = &lg->bufs[k->args[a]];
        if (ib->kind != LBUF_EXTERN) continue;
        for (int t = 0; t < 2 * ib->ndim; t++) out[n++] = t < ib->ndim ? ib->ssizes[t] : ib->sstrides[t - ib->ndim];
    }
    for (uint32_t a = k->nin + 1; a < k->nargs; a++) { /* the other outputs (horizontal fusion, shared values) */
        const LBuf *xb = &lg->bufs[k->args[a]];
        for (int t = 0; t < 2 * xb->ndim; t++) out[n++] = t < xb->ndim ? xb->ssizes[t] : xb->sstrides[t - xb->ndim];
    }
    em_codegen_cuda_sym_exprs(s, k, &out[n + 1], &out[n]);
    return n + 2;
}

/* Fills a kernel's symbolic part: its meta function (C) or program (CUDA), the symbol sources, the
 * layout of m[]. */
static int kernel_set_symbolic(Kernel *ko, void *handle, const char *fname, const Schedule *s, const SKernel *k,
                               const SymSources *srcs) {
    const LGraph *lg = s->lg;
    char mname[48];
    snprintf(mname, sizeof mname, "%s_meta", fname);
    uint32_t ncuda = 0;
    if (ko->cuda) {
        SymRef *e = malloc(cuda_meta_cap(k) * sizeof(SymRef));
        if (!e) {
            PyErr_NoMemory();
            return -1;
        }
        ncuda = cuda_meta_exprs(s, k, e);
        ko->mprog = em_sym_exprs_compile(lg->env, e, ncuda);
        free(e);
        if (!ko->mprog) {
            PyErr_Format(PyExc_RuntimeError, "ember: the size expressions of %s: %s", fname,
                         em_sym_error_text(em_sym_env_error(lg->env)));
            return -1;
        }
    } else {
        ko->meta = (MetaFn)dlsym(handle, mname);
    }
    ko->in_ndim = malloc((k->nin + 1) * sizeof(int32_t));
    ko->extra_ndim = malloc((ko->nextra + 1) * sizeof(int32_t));
    ko->extra_dtype = calloc(ko->nextra + 1, sizeof(PyObject *));
    if (!ko->meta && !ko->mprog) {
        PyErr_Format(PyExc_RuntimeError, "ember: %s missing from the library", mname);
        return -1;
    }
    if (symin_set(&ko->si, lg->env, srcs, NULL) < 0 || !ko->in_ndim || !ko->extra_ndim || !ko->extra_dtype) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    ko->out_ndim = lg->bufs[k->args[k->nin]].ndim;
    uint32_t nm = EM_KMETA_OUT + 2 * (uint32_t)ko->out_ndim;
    for (uint32_t q = 0; q < k->nin; q++) {
        const LBuf *ib = &lg->bufs[k->args[q]];
        ko->in_ndim[q] = ib->kind == LBUF_EXTERN ? ib->ndim : -1;
        if (ib->kind == LBUF_EXTERN) nm += 2 * (uint32_t)ib->ndim;
    }
    for (uint32_t e = 0; e < ko->nextra; e++) {
        const LBuf *xb = &lg->bufs[k->args[k->nin + 1 + e]];
        ko->extra_ndim[e] = xb->ndim;
        ko->extra_dtype[e] = Py_XNewRef(em_lower_dtype_obj(xb->dtype));
        if (!ko->extra_dtype[e]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "ember: a fused output without a dtype");
            return -1;
        }
        nm += 2 * (uint32_t)xb->ndim;
    }
    ko->nmeta = ko->cuda ? ncuda : nm;
    EM_ASSERT(!ko->cuda || ncuda == nm + 2);
    return 0;
}

/* A VIEW buffer's layout as expressions: its sizes, strides and offset, then, over an extern's
 * result, the base's sizes and strides (checked per call). Returns the count (at most
 * 4 * EM_LMAXDIM + 1), 0 when every one is a constant (the view is made with fixed arguments). */
static uint32_t view_exprs(const LGraph *lg, const LBuf *vb, SymRef *out) {
    ShapeEnv *env = lg->env;
    const LBuf *base = &lg->bufs[vb->index];
    uint32_t n = 0;
    for (int d = 0; d < vb->ndim; d++) out[n++] = vb->ssizes[d];
    for (int d = 0; d < vb->ndim; d++) out[n++] = vb->sstrides[d];
    out[n++] = vb->soffset ? vb->soffset : em_sym_const(env, vb->offset);
    if (base->kind == LBUF_EXTERN) {
        for (int d = 0; d < base->ndim; d++) out[n++] = base->ssizes[d];
        for (int d = 0; d < base->ndim; d++) out[n++] = base->sstrides[d];
    }
    int sym = 0;
    for (uint32_t i = 0; i < n && !sym; i++) sym = out[i] == SYM_NONE || em_sym_has_symbols(env, out[i]);
    return sym ? n : 0;
}

/* Marks used[i] for every symbol i the expressions e[0 .. n) read. -1 on OOM. */
static int exprs_mark_symbols(ShapeEnv *env, const SymRef *e, uint32_t n, uint8_t *used) {
    uint32_t ns = em_sym_nsymbols(env), *syms = malloc((ns + 1) * sizeof(uint32_t));
    if (!syms) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t m = e[i] == SYM_NONE ? 0 : em_sym_free_symbols(env, e[i], syms, ns);
        for (uint32_t j = 0; j < m; j++) used[syms[j]] = 1;
    }
    free(syms);
    return 0;
}

/* Marks the symbols the symbolic views read (their per-call arguments). -1 on OOM. */
static int mark_view_symbols(const Schedule *s, uint8_t *used) {
    SymRef e[4 * EM_LMAXDIM + 1];
    for (uint32_t st = 0; st < s->nsteps; st++) {
        if (s->steps[st].kind != SSTEP_VIEW) continue;
        uint32_t n = view_exprs(s->lg, &s->lg->bufs[s->steps[st].index], e);
        if (exprs_mark_symbols(s->lg->env, e, n, used) < 0) return -1;
    }
    return 0;
}

/* Marks the symbols the runtime's per-call expressions of every CUDA kernel read. -1 with an
 * exception (memory). */
static int cuda_mark_meta_symbols(const Schedule *s, uint8_t *used) {
    ShapeEnv *env = s->lg->env;
    for (uint32_t ki = 0; ki < s->nkernels; ki++) {
        const SKernel *k = &s->kernels[ki];
        SymRef *e = malloc(cuda_meta_cap(k) * sizeof(SymRef));
        if (!e) {
            PyErr_NoMemory();
            return -1;
        }
        int rc = exprs_mark_symbols(env, e, cuda_meta_exprs(s, k, e), used);
        free(e);
        if (rc < 0) return -1;
    }
    return 0;
}

/* Size expressions rendered with SYM_STYLE_SYMBOLS (`s0*s1`, `(s0//2)`: Python syntax), a list. */
static PyObject *rendered(ShapeEnv *env, const SymRef *e, uint32_t n) {
    PyObject *l = PyList_New(0);
    for (uint32_t i = 0; l && i < n; i++) {
        char t[256];
        em_sym_render(env, e[i], SYM_STYLE_SYMBOLS, t, sizeof t);
        PyObject *v = PyUnicode_FromString(t);
        if (!v || PyList_Append(l, v) < 0) Py_CLEAR(l);
        Py_XDECREF(v);
    }
    return l;
}

/* Symbolic graphs, for the emulator of the tests: each launch entry gets its per-call expressions
 * ("units", "row", "reach"), rendered. */
static int sym_launch_info(const Schedule *s, PyObject *ll) {
    for (uint32_t ki = 0; ki < s->nkernels; ki++) {
        const SKernel *k = &s->kernels[ki];
        SymRef *e = malloc(cuda_meta_cap(k) * sizeof(SymRef));
        if (!e) {
            PyErr_NoMemory();
            return -1;
        }
        uint32_t n = cuda_meta_exprs(s, k, e);
        SymRef three[3] = {e[EM_KMETA_NUMEL], e[n - 2], e[n - 1]};
        free(e);
        PyObject *r = rendered(s->lg->env, three, 3), *ent = PyList_GET_ITEM(ll, ki);
        int bad = !r || PyDict_SetItemString(ent, "units", PyList_GET_ITEM(r, 0)) < 0 ||
                  PyDict_SetItemString(ent, "row", PyList_GET_ITEM(r, 1)) < 0 ||
                  PyDict_SetItemString(ent, "reach", PyList_GET_ITEM(r, 2)) < 0;
        Py_XDECREF(r);
        if (bad) return -1;
    }
    return 0;
}

/* Is IR node r a counter update `p.add_(c)` of a graph input p, c an int constant, that nothing else
 * reads (BatchNorm's num_batches_tracked.add_(1): a lone input update, csrc/lower)? */
static int counter_update(const IRGraph *g, IRRef r) {
    const IRNode *n = &g->nodes[r];
    if (n->kind != IR_CALL_METHOD || !PyUnicode_Check(n->target) || PyUnicode_CompareWithASCIIString(n->target, "add_") ||
        n->nargs != 2 || n->nkwargs || n->args[0].kind != IRARG_NODE || n->args[1].kind != IRARG_CONST ||
        !PyLong_CheckExact(n->args[1].u.obj) || g->nodes[n->args[0].u.ref].kind != IR_PLACEHOLDER)
        return 0;
    IRRef p = n->args[0].u.ref;
    for (IRRef u = 1; u < g->nnodes; u++)
        if (u != r && (em_ir_node_reads(&g->nodes[u], p) || em_ir_node_reads(&g->nodes[u], r))) return 0;
    return 1;
}

/* The extern steps that are counter updates by the same constant, in step order, made one
 * torch._foreach_add_ call (one multi-tensor kernel instead of one launch each: ResNet-18's twenty
 * BatchNorm counters). The call takes the first update's place; so that no extern between the
 * first and the last sees a counter early, none may read a graph input of the counters' dtype
 * (inputs are not guarded against aliasing each other). Marks the group in grouped[] (steps) and
 * returns its size (0 or >= 2). */
static uint32_t counter_group(const Schedule *s, const IRGraph *g, uint8_t *grouped) {
    uint32_t first = NONE, last = NONE, n = 0;
    PyObject *c = NULL, *dtype = NULL;
    for (uint32_t st = 0; st < s->nsteps; st++) {
        const SStep *sp = &s->steps[st];
        if (sp->kind != SSTEP_EXTERN || !counter_update(g, sp->index)) continue;
        const IRNode *nd = &g->nodes[sp->index];
        const IRMeta *m = &g->nodes[nd->args[0].u.ref].meta;
        if (m->kind != IRMETA_TENSOR) continue;
        if (first == NONE) {
            first = st;
            c = nd->args[1].u.obj;
            dtype = m->dtype;
        } else if (m->dtype != dtype || PyObject_RichCompareBool(nd->args[1].u.obj, c, Py_EQ) != 1) {
            PyErr_Clear();
            continue;
        }
        grouped[st] = 1;
        last = st;
        n++;
    }
    for (uint32_t st = first; n >= 2 && st < last; st++) {
        const SStep *sp = &s->steps[st];
        if (sp->kind != SSTEP_EXTERN || grouped[st]) continue;
        const IRNode *nd = &g->nodes[sp->index];
        for (uint32_t i = 0; i < g->ninputs && n; i++) {
            const IRNode *pn = &g->nodes[g->inputs[i]];
            if (pn->meta.kind != IRMETA_TENSOR || pn->meta.dtype != dtype) continue;
            if (em_ir_node_reads(nd, g->inputs[i])) n = 0;
        }
    }
    if (n < 2) {
        memset(grouped, 0, s->nsteps);
        return 0;
    }
    return n;
}

/* The program's call torch._foreach_add_([counters], c) of a counter group (counter_group). */
static int counter_foreach(Prog *p, const Schedule *s, const IRGraph *g, const uint8_t *grouped, uint32_t n,
                           PyObject *ext_list) {
    static PyObject *foreach_add = NULL; /* torch._foreach_add_; one interpreter */
    if (!foreach_add && !em_lazy_attr(&foreach_add, "torch", "_foreach_add_")) return -1;
    IRArg *items = em_arena_alloc(p->ng->arena, n * sizeof(IRArg)), args[2];
    if (!items) return PyErr_NoMemory(), -1;
    uint32_t k = 0;
    for (uint32_t st = 0; st < s->nsteps && k < n; st++) {
        if (!grouped[st]) continue;
        const IRNode *nd = &g->nodes[s->steps[st].index];
        if (k == 0 && copy_arg(p, &nd->args[1], &args[1]) < 0) return -1;
        if (copy_arg(p, &nd->args[0], &items[k++]) < 0) return -1;
    }
    args[0] = (IRArg){.kind = IRARG_LIST, .n = n, .u.items = items};
    if (!em_arena_hold(p->ng->arena, foreach_add)) return -1;
    IRRef r = em_ir_call(p->ng, IR_CALL_FUNCTION, foreach_add, args, 2, NULL, NULL, 0, NULL);
    if (!r) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    PyObject *nm = PyUnicode_FromFormat("_foreach_add_ (%u counters)", n);
    int rc = nm ? PyList_Append(ext_list, nm) : -1;
    Py_XDECREF(nm);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* The compile driver                                                                         */
/* ------------------------------------------------------------------------------------------ */

/* One compilation by backend "ember": what its steps (ember_compile) hand on to each other. Owned
 * references start at NULL and build_clear releases them, all but result (the caller's). */
typedef struct {
    const IRGraph *g;
    int mode;                     /* ember_compile's */
    EmArena *a, *na;              /* the compilation's (lowered graph, schedule, plan); the program's */
    PyObject *result;             /* the program, the graph on the eager backend, mode 1's info, None */
    PyObject *d;                  /* the info dict (cache_info) */
    LGraph *lg;
    Schedule *s;
    int cuda;                     /* the CUDA C generator, NVRTC and the driver API (else C and cc) */
    EmCodegenOptions opt;         /* C kernels */
    int huge_pages;
    /* the code: its source, the compiled library, what the CUDA launches and symbols need */
    PyObject *src, *lib, *device; /* device: the graph's CUDA device */
    EmCudaLaunch *launch;
    uint8_t *sym_used;
    SymSources srcs;
    void *handle;                 /* the C library (dlopen), owned by lib */
    char key[40];
    int cached;
    int cc_failed;
    double t_start, t_lower, t_schedule, t_codegen, t_cc; /* perf log, explain */
    /* the memory plan, per buffer (nb of them), kernel or step */
    uint32_t nb;
    uint32_t *last;
    uint8_t *ext_seen, *consumed;
    int32_t *donor_of;
    uint32_t *extra_donor;        /* per extra output buffer */
    uint32_t *out_donor;          /* per extern step: its out= */
    uint32_t *form_of;
    int ndonated;
    /* the program */
    Prog p;
    PyObject *kernels, *ext_list, *index_table;
    PyObject *gemm_list; /* cache_info's "gemm": the externs made ember._C.Gemm calls (cuBLASLt) */
    uint32_t nviews, ninput_views; /* VIEW steps that call as_strided; of those, views of graph inputs */
} EmberBuild;

/* The arenas, the torch functions the kernels call (made once) and the info dict. */
static int build_begin(EmberBuild *bd) {
    bd->a = em_arena_new();
    bd->na = em_arena_new();
    if (!bd->a || !bd->na) {
        PyErr_NoMemory();
        return -1;
    }
    if (!empty_strided) {
        PyObject *torch = PyImport_ImportModule("torch");
        if (!torch) return -1;
        empty_strided = PyObject_GetAttrString(torch, "empty_strided");
        get_num_threads = PyObject_GetAttrString(torch, "get_num_threads");
        cpu_device = PyObject_CallMethod(torch, "device", "s", "cpu");
        Py_DECREF(torch);
        kw_dtype_device = Py_BuildValue("(ss)", "dtype", "device");
        empty_strided_fn = PyCFunction_New(&empty_strided_def, NULL);
        if (!empty_strided || !get_num_threads || !kw_dtype_device || !cpu_device || !empty_strided_fn) return -1;
        PyObject *guards = PyImport_ImportModule("torch._C._dynamo.guards");
        if (guards) {
            fast_empty_cpu = PyObject_GetAttrString(guards, "_empty_strided_cpu");
            fast_empty_cuda = fast_empty_cpu ? PyObject_GetAttrString(guards, "_empty_strided_cuda") : NULL;
            Py_DECREF(guards);
        }
        PyErr_Clear(); /* a torch without them: torch.empty_strided */
    }
    bd->d = PyDict_New();
    if (!bd->d) return -1;
    bd->t_start = em_now();
    return 0;
}

/* A graph still under torch.autocast here is one whose casts could not be written as nodes
 * (passes/em_pass_autocast.c compiles the others with autocast off): each op's dtypes
 * are decided at dispatch, and ember's lowering types ops by promotion rules alone, so the
 * eager backend runs the graph, where autocast casts each op as in eager. */
static int build_check_autocast(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    PyObject *d = bd->d;
    static PyObject *any_autocast = NULL;
    if (!any_autocast && !em_lazy_attr(&any_autocast, "torch._C", "_is_any_autocast_enabled")) PyErr_Clear();
    PyObject *ac = any_autocast ? PyObject_CallNoArgs(any_autocast) : Py_NewRef(Py_False);
    if (!ac) return -1;
    int on = ac == Py_True;
    Py_DECREF(ac);
    if (on) {
        bd->result = eager_fallback(d, g, "torch.autocast is enabled: the eager backend runs the graph (autocast casts "
                                          "each op at dispatch, and some op has no explicit rewrite)");
        return 1;
    }
    if (em_ir_has_autocast(g)) { /* the same, for a graph whose with-blocks could not be rewritten */
        bd->result = eager_fallback(d, g, "the graph enters a torch.autocast block: the eager backend runs the graph "
                                          "(autocast casts each op at dispatch, and some op has no explicit rewrite)");
        return 1;
    }
    return 0;
}

/* Lowering: torch ops -> primitive ops. A graph this backend does not take runs on the eager
 * backend (mode 1: its info says why). */
static int build_lower(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    PyObject *d = bd->d;
    const char *why = NULL;
    bd->lg = em_lower_graph_device(bd->a, g, bd->mode == 1, &why);
    LGraph *lg = bd->lg;
    bd->t_lower = em_now();
    if (bd->mode == 2 && (!lg || lg->device >= 0)) { /* prefetch: CPU graphs only (NVRTC runs in threads) */
        bd->result = Py_NewRef(Py_None);
        return 1;
    }
    if (!lg) {
        if (!why) return -1;
        if (bd->mode == 1) {
            PyObject *w = PyUnicode_FromString(why);
            if (w && PyDict_SetItemString(d, "fallback", w) == 0) bd->result = Py_NewRef(d);
            Py_XDECREF(w);
            return 1;
        }
        /* not for this backend: the eager backend runs it, and cache_info says why */
        bd->result = eager_fallback(d, g, why);
        return 1;
    }
    return 0;
}

static int build_schedule(EmberBuild *bd) {
    bd->s = em_schedule_graph(bd->lg);
    if (!bd->s) return -1;
    bd->t_schedule = em_now();
    return 0;
}

/* CUDA: the same schedule through the CUDA C generator, NVRTC and the driver API (cuda_load) */
static int cuda_generate(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    PyObject *d = bd->d;
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    const char *cwhy = NULL;
    if (bd->mode == 0 && !em_cuda_available(lg->device, &cwhy)) {
        static int warned = 0;
        PyObject *w = PyUnicode_FromFormat("CUDA tensors ran by the eager backend: %s", cwhy);
        if (!w || PyDict_SetItemString(d, "fallback", w) < 0) {
            Py_XDECREF(w);
            return -1;
        }
        if (!warned++ && PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "ember: backend \"ember\": %U", w) < 0) {
            Py_DECREF(w);
            return -1;
        }
        Py_DECREF(w);
        bd->result = em_eager_graph_new(g);
        return 1;
    }
    bd->launch = em_arena_alloc(bd->a, (s->nkernels + 1) * sizeof(EmCudaLaunch));
    if (lg->env) bd->sym_used = em_arena_alloc(bd->a, em_sym_nsymbols(lg->env) + 1);
    if (!bd->launch || (lg->env && !bd->sym_used)) {
        PyErr_NoMemory();
        return -1;
    }
    if (lg->env) memset(bd->sym_used, 0, em_sym_nsymbols(lg->env) + 1);
    bd->src = em_codegen_cuda(s, bd->launch, bd->sym_used);
    bd->t_codegen = em_now();
    if (!bd->src && PyErr_ExceptionMatches(PyExc_NotImplementedError)) { /* the eager backend runs it */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *w = PyUnicode_FromFormat("CUDA tensors ran by the eager backend: the CUDA code generator "
                                           "does not emit %S yet", ev ? ev : Py_None);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        if (!w || PyDict_SetItemString(d, "fallback", w) < 0) {
            Py_XDECREF(w);
            return -1;
        }
        Py_DECREF(w);
        bd->result = bd->mode == 1 ? Py_NewRef(d) : em_eager_graph_new(g);
        return 1;
    }
    if (!bd->src) return -1;
    if (lg->env) {
        /* the runtime's per-call expressions read symbols too: every one needs a source */
        int srcs_ok = cuda_mark_meta_symbols(s, bd->sym_used) == 0 && mark_view_symbols(s, bd->sym_used) == 0;
        if (srcs_ok && sym_sources(g, lg->env, bd->sym_used, &bd->srcs) < 0) {
            if (PyErr_Occurred()) return -1;
            srcs_ok = 0;
        }
        if (!srcs_ok) {
            if (PyErr_Occurred()) return -1;
            const char *w = "CUDA tensors ran by the eager backend: symbolic sizes: a symbol the kernels read is "
                            "not the size of a graph input";
            if (bd->mode == 1) {
                PyObject *wo = PyUnicode_FromString(w);
                if (wo && PyDict_SetItemString(d, "fallback", wo) == 0) bd->result = Py_NewRef(d);
                Py_XDECREF(wo);
            } else {
                bd->result = eager_fallback(d, g, w);
            }
            return 1;
        }
    }
    return 0;
}

/* C: C11 + OpenMP source for the scheduled kernels */
static int c_generate(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    if (lg->env) {
        bd->sym_used = em_arena_alloc(bd->a, em_sym_nsymbols(lg->env) + 1);
        if (!bd->sym_used) {
            PyErr_NoMemory();
            return -1;
        }
        memset(bd->sym_used, 0, em_sym_nsymbols(lg->env) + 1);
    }
    bd->src = em_codegen_c(s, &bd->opt, bd->sym_used);
    const char *swhy = NULL;
    if (!bd->src && PyErr_ExceptionMatches(PyExc_NotImplementedError)) {
        PyErr_Clear();
        swhy = "the C code generator cannot write an expression of this graph (a size expression or an "
               "operation): ran by the eager backend";
    } else if (!bd->src) {
        return -1;
    } else if (lg->env && (mark_view_symbols(s, bd->sym_used) < 0 || sym_sources(g, lg->env, bd->sym_used, &bd->srcs) < 0)) {
        if (PyErr_Occurred()) return -1;
        swhy = "symbolic sizes: a symbol the kernels read is not the size of a graph input: ran by the eager backend";
    }
    if (swhy) {
        bd->result = eager_fallback(bd->d, g, swhy);
        return 1;
    }
    bd->t_codegen = em_now();
    return 0;
}

/* Code generation for the graph's device (mode 1: CUDA, for tests without a GPU). */
static int build_generate(EmberBuild *bd) {
    bd->cuda = bd->mode == 1 || bd->lg->device >= 0;
    bd->opt = (EmCodegenOptions){.parallel_threshold = 32768, .chunk = 65536}; /* C kernels */
    bd->huge_pages = em_config_bool("huge_pages", 1);
    return bd->cuda ? cuda_generate(bd) : c_generate(bd);
}

/* Mode 1 (tests without a GPU): the info dict is the answer: the CUDA source, the launch table,
 * the kernels, the buffers and the graph's outputs, and for a symbolic graph its symbols. */
static int cuda_source_info(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    PyObject *d = bd->d;
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    PyObject *ll = launch_list(bd->launch, s->nkernels);
    if (ll && lg->env && sym_launch_info(s, ll) < 0) Py_CLEAR(ll);
    if (!ll || PyDict_SetItemString(d, "launch", ll) < 0 || PyDict_SetItemString(d, "source", bd->src) < 0) {
        Py_XDECREF(ll);
        return -1;
    }
    Py_DECREF(ll);
    bd->kernels = PyList_New(0);
    for (uint32_t ki = 0; bd->kernels && ki < s->nkernels; ki++) {
        const SKernel *k = &s->kernels[ki];
        PyObject *names = PyList_New(0);
        for (uint32_t q = 0; names && q < k->nirs; q++) {
            PyObject *nm = PyUnicode_FromString(g->nodes[k->irs[q]].name);
            if (!nm || PyList_Append(names, nm) < 0) Py_CLEAR(names);
            Py_XDECREF(nm);
        }
        PyObject *kargs = PyList_New(0);
        for (uint32_t q = 0; kargs && q < k->nargs; q++) {
            PyObject *v = PyLong_FromUnsignedLong(k->args[q]);
            if (!v || PyList_Append(kargs, v) < 0) Py_CLEAR(kargs);
            Py_XDECREF(v);
        }
        PyObject *kd = names && kargs ? Py_BuildValue("{s:s,s:N,s:N}", "kind", k->reduction ? "reduction" : "pointwise", "nodes",
                                                     names, "args", kargs)
                                      : NULL;
        if (!kargs) Py_XDECREF(names);
        else if (!names) Py_DECREF(kargs);
        if (!kd || PyList_Append(bd->kernels, kd) < 0) Py_CLEAR(bd->kernels);
        Py_XDECREF(kd);
    }
    if (!bd->kernels || PyDict_SetItemString(d, "kernel_list", bd->kernels) < 0) return -1;
    /* buffers (for the CPU emulator of the tests): kind, input index, dtype, layout; the
     * buffer of each graph output; whether every step is a kernel */
    PyObject *bufs = PyList_New(0);
    for (uint32_t bi = 0; bufs && bi < lg->nbufs; bi++) {
        const LBuf *lb = &lg->bufs[bi];
        static const char *const kinds[] = {"input", "extern", "node", "index", "view"};
        PyObject *e = Py_BuildValue("{s:s,s:I,s:s,s:N,s:N}", "kind", kinds[lb->kind], "index", lb->index, "dtype",
                                    em_ldt_name(lb->dtype), "sizes", em_int64_tuple(lb->ndim, lb->sizes), "strides",
                                    em_int64_tuple(lb->ndim, lb->strides));
        if (e && lg->env) { /* symbolic: the layout as expressions over s<j> (Python syntax) */
            PyObject *ss = rendered(lg->env, lb->ssizes, (uint32_t)lb->ndim);
            PyObject *st = rendered(lg->env, lb->sstrides, (uint32_t)lb->ndim);
            if (!ss || !st || PyDict_SetItemString(e, "ssizes", ss) < 0 || PyDict_SetItemString(e, "sstrides", st) < 0)
                Py_CLEAR(e);
            Py_XDECREF(ss);
            Py_XDECREF(st);
        }
        if (!e || PyList_Append(bufs, e) < 0) Py_CLEAR(bufs);
        Py_XDECREF(e);
    }
    if (!bufs || PyDict_SetItemString(d, "buffers", bufs) < 0) {
        Py_XDECREF(bufs);
        return -1;
    }
    Py_DECREF(bufs);
    const IRNode *on = &g->nodes[g->output];
    PyObject *outs = PyList_New(0);
    for (uint32_t q = 0; outs && on->nargs == 1 && q < on->args[0].n; q++) {
        const IRArg *it = &on->args[0].u.items[q];
        uint32_t b = it->kind == IRARG_NODE ? s->ir_buf[it->u.ref] : NONE;
        PyObject *v = b == NONE ? Py_NewRef(Py_None) : PyLong_FromUnsignedLong(b);
        if (!v || PyList_Append(outs, v) < 0) Py_CLEAR(outs);
        Py_XDECREF(v);
    }
    if (!outs || PyDict_SetItemString(d, "outputs", outs) < 0) {
        Py_XDECREF(outs);
        return -1;
    }
    Py_DECREF(outs);
    PyObject *ok = PyBool_FromLong(s->nsteps == s->nkernels);
    if (PyDict_SetItemString(d, "kernels_only", ok) < 0) {
        Py_DECREF(ok);
        return -1;
    }
    Py_DECREF(ok);
    if (lg->env) { /* symbol j = size dim of graph input i: [(j, i, dim), ...] */
        PyObject *sl = PyList_New(0);
        for (uint32_t q = 0; sl && q < bd->srcs.nsym; q++) {
            PyObject *t = Py_BuildValue("(IIi)", bd->srcs.sym[q], bd->srcs.input[bd->srcs.which[q]], bd->srcs.dim[q]);
            if (!t || PyList_Append(sl, t) < 0) Py_CLEAR(sl);
            Py_XDECREF(t);
        }
        PyObject *ns = sl ? PyLong_FromUnsignedLong(em_sym_nsymbols(lg->env)) : NULL;
        int bad = !sl || !ns || PyDict_SetItemString(d, "symbols", sl) < 0 || PyDict_SetItemString(d, "nsymbols", ns) < 0;
        Py_XDECREF(sl);
        Py_XDECREF(ns);
        if (bad) return -1;
    }
    bd->result = Py_NewRef(d);
    return 1;
}

/* NVRTC compiles the source and the CUDA driver API loads it, on the graph's device. */
static int cuda_load(EmberBuild *bd) {
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    PyObject *torch = PyImport_ImportModule("torch");
    bd->device = torch ? PyObject_CallMethod(torch, "device", "si", "cuda", (int)lg->device) : NULL;
    Py_XDECREF(torch);
    if (!bd->device) return -1;
    if (s->nkernels) {
        Py_ssize_t srclen;
        const char *text = PyUnicode_AsUTF8AndSize(bd->src, &srclen);
        if (!text) return -1;
        bd->lib = em_cuda_module_load(text, (size_t)srclen, lg->device, bd->key, &bd->cached);
        if (!bd->lib) return -1; /* an NVRTC or driver failure: the eager backend runs it (build_internal_fallback) */
    }
    return 0;
}

/* Mode 2 (prefetch): the C compiler started, nothing loaded. */
static int c_prefetch(EmberBuild *bd) {
    Schedule *s = bd->s;
    Py_ssize_t srclen;
    const char *text = s->nkernels ? PyUnicode_AsUTF8AndSize(bd->src, &srclen) : NULL;
    if (text) em_cc_start(text, (size_t)srclen);
    bd->result = Py_NewRef(Py_None);
    return 1;
}

/* cc compiles the C source (or the disk cache has it) and dlopen loads it. */
static int c_load(EmberBuild *bd) {
    Schedule *s = bd->s;
    if (s->nkernels) {
        Py_ssize_t srclen;
        const char *text = PyUnicode_AsUTF8AndSize(bd->src, &srclen);
        if (!text) return -1;
        bd->handle = em_cc_load(text, (size_t)srclen, bd->key, &bd->cached);
        if (!bd->handle) {
            /* no C compiler, or it failed: "ember" is the default backend, so the program must
             * still run. The eager backend runs the graph, cache_info says why, and a
             * RuntimeWarning names the cause (once per process for a missing compiler, once per
             * graph for a failed compile: its message names the source and the compiler's log). */
            if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return -1; /* MemoryError ... */
            bd->cc_failed = 1;
            bd->result = cc_fallback(bd->d, bd->g);
            return 1;
        }
        bd->lib = PyCapsule_New(bd->handle, "ember.lib", lib_close);
        if (!bd->lib) {
            dlclose(bd->handle);
            return -1;
        }
    }
    return 0;
}

/* Compile and load the source. Modes 1 and 2 stop before: mode 1 answers with the CUDA source's
 * info, mode 2 (prefetch, CPU graphs only) with the C compiler started. */
static int build_load(EmberBuild *bd) {
    if (bd->mode == 1) return cuda_source_info(bd);
    if (bd->mode == 2) return c_prefetch(bd);
    return bd->cuda ? cuda_load(bd) : c_load(bd);
}

/* Memory planning: last use of each buffer (step index), and which buffers an extern sees. */
static int plan_last_uses(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    EmArena *a = bd->a;
    bd->nb = lg->nbufs;
    uint32_t nb = bd->nb;
    bd->last = em_arena_alloc(a, (nb + 1) * sizeof(uint32_t));
    bd->ext_seen = em_arena_alloc(a, nb + 1);
    bd->consumed = em_arena_alloc(a, nb + 1);
    bd->donor_of = em_arena_alloc(a, (s->nkernels + 1) * sizeof(int32_t));
    bd->extra_donor = em_arena_alloc(a, (nb + 1) * sizeof(uint32_t)); /* per extra output buffer */
    bd->out_donor = em_arena_alloc(a, (s->nsteps + 1) * sizeof(uint32_t)); /* per extern step: its out= */
    if (!bd->last || !bd->ext_seen || !bd->consumed || !bd->donor_of || !bd->extra_donor || !bd->out_donor) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t *last = bd->last;
    uint8_t *ext_seen = bd->ext_seen;
    for (uint32_t st = 0; st < s->nsteps; st++) {
        const SStep *sp = &s->steps[st];
        if (sp->kind == SSTEP_KERNEL) {
            const SKernel *k = &s->kernels[sp->index];
            for (uint32_t q = 0; q < k->nin; q++) last[k->args[q]] = st + 1;
        } else if (sp->kind == SSTEP_VIEW) {
            ext_seen[sp->index] |= SEEN_ANY;
            ext_seen[lg->bufs[sp->index].index] |= SEEN_ANY;
            last[lg->bufs[sp->index].index] = st + 1;
        } else {
            const IRNode *n = &g->nodes[sp->index];
            uint8_t kept = fresh_call(lg, sp->index) ? 0 : SEEN_KEPT;
            for (uint32_t i = 0; i < n->nargs; i++) mark_ext_uses(s, &n->args[i], kept, st, ext_seen, last);
            for (uint32_t i = 0; i < n->nkwargs; i++) mark_ext_uses(s, &n->kwargs[i], kept, st, ext_seen, last);
        }
    }
    if (g->output) { /* what the user gets: its buffers, and the bases of its views, are never reused */
        const IRNode *n = &g->nodes[g->output];
        for (uint32_t i = 0; i < n->nargs; i++) mark_ext_uses(s, &n->args[i], SEEN_KEPT, NONE, ext_seen, last);
    }
    return 0;
}

/* A kernel output whose own tensor no call reads, only views of it (x.view(-1, 64) of a
 * layer_norm for a matmul, the transposed heads of a linear's bias epilogue for attention), is
 * allocated in the layout of one of those views when that layout covers the same elements
 * (dense, offset 0): that view is the kernel's output itself, the others are made from it */
static int plan_view_forms(EmberBuild *bd) {
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    uint32_t nb = bd->nb;
    const uint8_t *ext_seen = bd->ext_seen;
    bd->form_of = em_arena_alloc(bd->a, (nb + 1) * sizeof(uint32_t));
    uint32_t *form_of = bd->form_of;
    if (!form_of) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t b = 0; b < nb; b++) form_of[b] = NONE;
    for (uint32_t st = 0; st < s->nsteps && !lg->env; st++) {
        const SStep *sp = &s->steps[st];
        if (sp->kind != SSTEP_VIEW) continue;
        const LBuf *vb = &lg->bufs[sp->index], *base = &lg->bufs[vb->index];
        if (base->kind != LBUF_NODE || (ext_seen[vb->index] & SEEN_DIRECT) || s->buf_output[vb->index] ||
            form_of[vb->index] != NONE || vb->offset != 0 || !dense_layout(vb) || !dense_layout(base) ||
            numel_of_buf(vb) != numel_of_buf(base))
            continue;
        form_of[vb->index] = sp->index;
    }
    return 0;
}

/* Donors: a kernel's output, a fused kernel's other outputs and an extern's out= take a buffer dead
 * by then (latest_dead), or, for a pointwise kernel, one it reads at the element it writes. */
static int plan_donors(EmberBuild *bd) {
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    EmArena *a = bd->a;
    uint32_t nb = bd->nb;
    const uint32_t *last = bd->last, *form_of = bd->form_of;
    const uint8_t *ext_seen = bd->ext_seen;
    uint8_t *consumed = bd->consumed;
    int32_t *donor_of = bd->donor_of;
    uint32_t *extra_donor = bd->extra_donor, *out_donor = bd->out_donor;
    /* candidates: kernel-made intermediates, and fresh extern results (matmul ...) only kernels read */
    uint32_t *pool = em_arena_alloc(a, (nb + 1) * sizeof(uint32_t));
    uint32_t npool = 0;
    if (!pool) {
        PyErr_NoMemory();
        return -1;
    }
    bd->ndonated = 0;
    for (uint32_t b = 0; b < nb; b++) extra_donor[b] = NONE;
    for (uint32_t st = 0; st < s->nsteps; st++) out_donor[st] = NONE;
    uint32_t since = 0; /* the last step that allocated (a result or output no dead buffer held), + 1 */
    for (uint32_t st = 0; st < s->nsteps; st++) {
        const SStep *sp = &s->steps[st];
        if (sp->kind == SSTEP_VIEW) continue;
        if (sp->kind != SSTEP_KERNEL) {
            const LVal *v = &lg->vals[sp->index];
            /* a matmul's result written into a buffer dead before the call (out=), as Inductor's
             * extern_kernels.mm(a, b, out=buf) into a reused buffer */
            uint32_t rb = v->kind == LV_EXTERN && v->has_load ? lg->nodes[v->lnode].buf : v->ext_call ? v->ext_buf : NONE;
            if (rb != NONE && lg->bufs[rb].out_kw && numel_of_buf(&lg->bufs[rb]) > 0) {
                uint32_t b = latest_dead(lg, pool, npool, consumed, last, since, st, rb, 1);
                if (b != NONE) {
                    consumed[b] = 1;
                    out_donor[st] = b;
                    bd->ndonated++;
                }
            }
            if (rb != NONE && lg->bufs[rb].fresh && out_donor[st] == NONE) since = st + 1;
            if (v->kind == LV_EXTERN && v->has_load) {
                uint32_t b = lg->nodes[v->lnode].buf;
                if (lg->bufs[b].fresh && !(ext_seen[b] & SEEN_KEPT) && !s->buf_output[b] && s->ir_buf[sp->index] == b)
                    pool[npool++] = b;
            } else if (v->ext_call && !(ext_seen[v->ext_buf] & SEEN_KEPT) && !s->buf_output[v->ext_buf]) {
                pool[npool++] = v->ext_buf; /* the matmul's result, read only by the kernels adding its bias */
            }
            continue;
        }
        const SKernel *k = &s->kernels[sp->index];
        uint32_t ob = k->args[k->nin];
        donor_of[sp->index] = -1;
        int allocates = form_of[ob] != NONE; /* this step allocates: since moves after its outputs */
        if (lg->bufs[ob].kind == LBUF_INPUT) { /* a scatter store into an input: the input is the output */
            donor_of[sp->index] = (int32_t)ob;
        } else if (form_of[ob] == NONE) {
            uint32_t pick = latest_dead(lg, pool, npool, consumed, last, since, st, ob, 1);
            for (uint32_t q = 0; q < npool; q++) { /* better: in place, a buffer read by this kernel alone */
                uint32_t b = pool[q];
                if (consumed[b] || last[b] != st + 1 || !can_hold(lg, b, ob, 1)) continue;
                int ok = 0;
                if (!k->reduction) {
                    /* in place: every read of b is at the element being written (a kernel of
                     * several outputs reads every element before it stores any: emit_loads_first
                     * in em_codegen_c.c). Never for a reduction kernel: its row cache may write
                     * the output row in one reduction pass while a later pass reads the inputs again */
                    ok = 1;
                    for (uint32_t l = 0; l < k->nloads && ok; l++)
                        if (k->loads[l].buf == b)
                            ok = !k->loads[l].nidx && !k->loads[l].mask && k->loads[l].offset == k->stores[0].offset &&
                                 memcmp(k->loads[l].strides, k->stores[0].strides, k->ndim * sizeof(int64_t)) == 0 &&
                                 k->loads[l].soffset == k->stores[0].soffset &&
                                 memcmp(k->loads[l].sstrides, k->stores[0].sstrides, k->ndim * sizeof(SymRef)) == 0;
                }
                if (ok) {
                    pick = b;
                    break;
                }
            }
            if (pick != NONE) {
                consumed[pick] = 1;
                donor_of[sp->index] = (int32_t)pick;
                bd->ndonated++;
            } else {
                allocates = 1;
            }
            if (!(ext_seen[ob] & SEEN_KEPT) && !s->buf_output[ob]) pool[npool++] = ob;
        }
        /* a fused kernel's other outputs: a buffer dead before this step, else allocated */
        for (uint32_t e = k->nin + 1; e < k->nargs; e++) {
            uint32_t eb = k->args[e];
            if (form_of[eb] != NONE || lg->bufs[eb].kind == LBUF_INPUT) continue; /* a scatter: in place */
            uint32_t b = lg->env ? NONE : latest_dead(lg, pool, npool, consumed, last, since, st, eb, 0); /* symbolic: the kernel allocates them */
            if (b != NONE) {
                consumed[b] = 1;
                extra_donor[eb] = b;
                bd->ndonated++;
            } else {
                allocates = 1;
            }
            if (!(ext_seen[eb] & SEEN_KEPT) && !s->buf_output[eb]) pool[npool++] = eb;
        }
        if (allocates) since = st + 1;
    }
    return 0;
}

/* The program graph: its placeholders, the index table, the extern list. */
static int program_begin(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    LGraph *lg = bd->lg;
    Prog *p = &bd->p;
    uint32_t nb = bd->nb;
    p->s = bd->s;
    p->ng = em_ir_new(bd->na);
    p->ir_new = em_arena_alloc(bd->na, g->nnodes * sizeof(uint32_t));
    p->buf_new = em_arena_alloc(bd->na, (nb + 1) * sizeof(uint32_t));
    bd->kernels = PyList_New(0);
    if (!p->ng || !p->ir_new || !p->buf_new || !bd->kernels) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < g->ninputs; i++) {
        const IRNode *n = &g->nodes[g->inputs[i]];
        IRRef r = em_ir_placeholder(p->ng, n->name, NULL);
        if (!r) {
            PyErr_NoMemory();
            return -1;
        }
        p->ir_new[g->inputs[i]] = r;
    }
    for (uint32_t b = 0; b < nb; b++)
        if (lg->bufs[b].kind == LBUF_INPUT) p->buf_new[b] = p->ir_new[g->inputs[lg->bufs[b].index]];
    /* the index table arange() and dropout's counters load (LBUF_INDEX): the code generators write
     * a load of it as its offset (SAccess.iota) and read no memory, so one element on the graph's
     * device, made once, stands for it (a valid pointer argument) */
    for (uint32_t b = 0; b < nb && !bd->index_table; b++) {
        if (lg->bufs[b].kind != LBUF_INDEX) continue;
        PyObject *torch = PyImport_ImportModule("torch");
        PyObject *ar = torch ? PyObject_GetAttrString(torch, "arange") : NULL;
        PyObject *kw = ar ? Py_BuildValue("{s:O,s:O}", "dtype", em_lower_dtype_obj(LDT_I64), "device",
                                          bd->cuda ? bd->device : cpu_device) : NULL;
        PyObject *n = kw ? PyLong_FromLong(1) : NULL;
        PyObject *targs = n ? PyTuple_Pack(1, n) : NULL;
        bd->index_table = targs ? PyObject_Call(ar, targs, kw) : NULL;
        Py_XDECREF(torch);
        Py_XDECREF(ar);
        Py_XDECREF(kw);
        Py_XDECREF(n);
        Py_XDECREF(targs);
        if (!bd->index_table || !em_arena_hold(p->ng->arena, bd->index_table)) return -1;
    }
    if (!parameter_type) {
        PyObject *nn = PyImport_ImportModule("torch.nn");
        parameter_type = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
        Py_XDECREF(nn);
        if (!parameter_type) return -1;
    }
    bd->ext_list = PyList_New(0); /* cache_info's extern_list: the torch calls, in program order */
    bd->gemm_list = PyList_New(0);
    if (!bd->ext_list || !bd->gemm_list) return -1;
    return 0;
}

/* A VIEW step: the kernel's output itself (form_of), or an ember._C.View call (as_strided). */
static int program_view(EmberBuild *bd, const SStep *sp) {
    const IRGraph *g = bd->g;
    LGraph *lg = bd->lg;
    Prog *p = &bd->p;
    const uint32_t *form_of = bd->form_of;
    const LBuf *vb = &lg->bufs[sp->index];
    if (form_of[vb->index] == sp->index) { /* the kernel's output is this view */
        p->buf_new[sp->index] = p->buf_new[vb->index];
        return 0;
    }
    const LBuf *base = &lg->bufs[vb->index];
    View *vo = PyObject_New(View, View_Type);
    if (!vo) return -1;
    vo->vectorcall = view_vectorcall;
    vo->offset = vb->offset;
    vo->size = em_int64_tuple(vb->ndim, vb->sizes);
    vo->stride = em_int64_tuple(vb->ndim, vb->strides);
    vo->base_size = base->kind == LBUF_EXTERN ? em_int64_tuple(base->ndim, base->sizes) : NULL;
    vo->base_stride = base->kind == LBUF_EXTERN ? em_int64_tuple(base->ndim, base->strides) : NULL;
    vo->name = PyUnicode_FromString(g->nodes[vb->ir].name);
    vo->input_base = base->kind == LBUF_INPUT;
    vo->cache_base = vo->cache_view = NULL;
    vo->cache_ptr = NULL;
    vo->prog = NULL;
    vo->si = (SymIn){0};
    vo->ndim = vb->ndim;
    vo->base_ndim = base->kind == LBUF_EXTERN ? base->ndim : -1;
    SymRef ve[4 * EM_LMAXDIM + 1];
    uint32_t nve = lg->env ? view_exprs(lg, vb, ve) : 0;
    uint8_t *vwant = nve ? em_arena_alloc(bd->na, em_sym_nsymbols(lg->env) + 1) : NULL; /* its symbols */
    if (nve && !vwant) {
        Py_DECREF(vo);
        PyErr_NoMemory();
        return -1;
    }
    if (nve && (exprs_mark_symbols(lg->env, ve, nve, vwant) < 0 ||
                !(vo->prog = em_sym_exprs_compile(lg->env, ve, nve)) ||
                symin_set(&vo->si, lg->env, &bd->srcs, vwant) < 0)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "ember: the size expressions of view %s: %s", g->nodes[vb->ir].name,
                         em_sym_error_text(em_sym_env_error(lg->env)));
        Py_DECREF(vo);
        return -1;
    }
    bd->ninput_views += vo->input_base && !nve;
    IRArg *vargs = em_arena_alloc(bd->na, (1 + vo->si.nsrcargs) * sizeof(IRArg));
    if (!vargs) {
        Py_DECREF(vo);
        PyErr_NoMemory();
        return -1;
    }
    vargs[0] = (IRArg){.kind = IRARG_NODE, .u.ref = p->buf_new[vb->index]};
    for (uint32_t q = 0; q < vo->si.nsrcargs; q++) /* the tensors whose sizes are the symbols */
        vargs[1 + q] = (IRArg){.kind = IRARG_NODE, .u.ref = p->ir_new[g->inputs[bd->srcs.input[q]]]};
    vo->input_base = vo->input_base && !nve; /* a symbolic view is not cached */
    IRRef r = 0;
    if (vo->size && vo->stride && vo->name && (base->kind != LBUF_EXTERN || (vo->base_size && vo->base_stride))) {
        r = vargs[0].u.ref ? em_ir_call(p->ng, IR_CALL_FUNCTION, (PyObject *)vo, vargs, 1 + vo->si.nsrcargs, NULL,
                                        NULL, 0, NULL)
                           : 0;
        if (!r && !PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "ember: view of a buffer without a value");
    }
    if (r && PyList_Append(bd->ext_list, vo->name) < 0) r = 0;
    Py_DECREF(vo);
    if (!r) return -1;
    p->buf_new[sp->index] = r;
    bd->nviews++;
    return 0;
}

/* The ember._C.Gemm that calls extern n's matrix product through cuBLASLt (runtime/em_runtime_gemm.c)
 * in a CUDA program (ember.config.cublaslt_gemm), recorded in bd->gemm_list with where its bias is
 * added (bias_in_kernel: the lowering passes None for the bias and the kernel that follows adds it,
 * LVal.ext_call); NULL (no exception) where n is not such a call. New reference. */
static PyObject *gemm_target(EmberBuild *bd, const IRNode *n, int bias_in_kernel) {
    if (!bd->cuda || n->kind != IR_CALL_FUNCTION || n->nkwargs || n->nargs > 3 || !em_config_bool("cublaslt_gemm", 1)) return NULL;
    int ndim[3] = {-1, -1, -1};
    for (uint32_t i = 0; i < n->nargs; i++) {
        const IRArg *a = &n->args[i];
        const IRMeta *m = a->kind == IRARG_NODE ? &bd->g->nodes[a->u.ref].meta : NULL;
        if (m && m->kind == IRMETA_TENSOR) ndim[i] = m->ndim;
    }
    PyObject *g = em_gemm_new(n->target, n->nargs, n->nkwargs, ndim);
    int bias_arg = g ? em_gemm_bias_arg(g, n->nargs) : -1;
    const IRArg *ba = bias_arg >= 0 ? &n->args[bias_arg] : NULL;
    const char *where = !ba || (ba->kind == IRARG_CONST && ba->u.obj == Py_None) ? "no bias"
                        : bias_in_kernel                                        ? "bias added by the next generated kernel"
                                                                                : "bias in cuBLASLt's epilogue";
    PyObject *nm = g ? PyUnicode_FromFormat("%s: %s", n->name, where) : NULL;
    if (g && (!nm || PyList_Append(bd->gemm_list, nm) < 0)) Py_CLEAR(g);
    Py_XDECREF(nm);
    return g;
}

/* An EXTERN step: the torch call, its arguments the program's values (out=: a dead buffer). */
static int program_extern(EmberBuild *bd, uint32_t st) {
    const IRGraph *g = bd->g;
    LGraph *lg = bd->lg;
    Prog *p = &bd->p;
    const SStep *sp = &bd->s->steps[st];
    EmArena *na = bd->na;
    const IRNode *n = &g->nodes[sp->index];
    if (!(lg->env && n->meta.sym)) { /* a size of a symbolic graph: read by the kernels themselves */
        PyObject *nm = PyUnicode_FromString(n->name);
        if (!nm || PyList_Append(bd->ext_list, nm) < 0) {
            Py_XDECREF(nm);
            return -1;
        }
        Py_DECREF(nm);
    }
    IRArg *args = n->nargs ? em_arena_alloc(na, n->nargs * sizeof(IRArg)) : NULL;
    IRArg *kw = n->nkwargs ? em_arena_alloc(na, n->nkwargs * sizeof(IRArg)) : NULL;
    if ((n->nargs && !args) || (n->nkwargs && !kw)) {
        PyErr_NoMemory();
        return -1;
    }
    const LVal *v = &lg->vals[sp->index];
    IRArg none = {.kind = IRARG_CONST, .u.obj = Py_None};
    if (v->ext_call && !em_arena_hold(p->ng->arena, Py_None)) return -1;
    for (uint32_t i = 0; i < n->nargs; i++) {
        if (v->ext_call && (int32_t)i == v->none_arg) args[i] = none;
        else if (copy_arg(p, &n->args[i], &args[i]) < 0) return -1;
    }
    for (uint32_t i = 0; i < n->nkwargs; i++) {
        if (v->ext_call && (int32_t)(n->nargs + i) == v->none_arg) kw[i] = none;
        else if (copy_arg(p, &n->kwargs[i], &kw[i]) < 0) return -1;
    }
    PyObject **kwn = n->kwnames;
    uint32_t nkw = n->nkwargs;
    uint32_t od = bd->out_donor[st];
    if (od != NONE) { /* out=: the dead buffer, in the result's layout */
        uint32_t rb = v->ext_call ? v->ext_buf : lg->nodes[v->lnode].buf;
        IRArg *kw2 = em_arena_alloc(na, (nkw + 1) * sizeof(IRArg));
        kwn = em_arena_alloc(na, (nkw + 1) * sizeof(PyObject *));
        if (!kw2 || !kwn) {
            PyErr_NoMemory();
            return -1;
        }
        if (nkw) {
            memcpy(kw2, kw, nkw * sizeof(IRArg));
            memcpy(kwn, n->kwnames, nkw * sizeof(PyObject *));
        }
        IRRef o = same_layout(&lg->bufs[od], &lg->bufs[rb]) ? p->buf_new[od] : relayout_node(p, p->buf_new[od], &lg->bufs[rb]);
        if (!o || !(kwn[nkw] = em_arena_hold(p->ng->arena, em_str("out")))) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "ember: out= without a value");
            return -1;
        }
        kw2[nkw++] = (IRArg){.kind = IRARG_NODE, .u.ref = o};
        kw = kw2;
    }
    PyObject *target = gemm_target(bd, n, v->ext_call);
    if (!target && PyErr_Occurred()) return -1;
    IRRef r = em_ir_call(p->ng, n->kind, target ? target : n->target, args, n->nargs, kwn, kw, nkw, NULL);
    Py_XDECREF(target); /* the new graph's arena holds it */
    if (!r) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    if (v->ext_call) {
        p->buf_new[v->ext_buf] = r; /* the value itself is the kernel's (bias added) */
        return 0;
    }
    p->ir_new[sp->index] = r;
    if (v->kind == LV_EXTERN && v->has_load) p->buf_new[lg->nodes[v->lnode].buf] = r;
    return 0;
}

/* The ember._C.Kernel of kernel step sp: the compiled function, its output's layout, the checks
 * it makes. New reference or NULL. */
static Kernel *kernel_new(EmberBuild *bd, const SStep *sp) {
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    const uint32_t *form_of = bd->form_of;
    const SKernel *k = &s->kernels[sp->index];
    Kernel *ko = PyObject_New(Kernel, Kernel_Type);
    if (!ko) return NULL;
    ko->meta = NULL;
    ko->si = (SymIn){0};
    ko->nmeta = 0;
    ko->in_ndim = NULL;
    ko->extra_ndim = NULL;
    ko->extra_dtype = NULL;
    ko->out_ndim = 0;
    ko->threshold = bd->opt.parallel_threshold;
    ko->vectorcall = kernel_vectorcall;
    ko->cuda = NULL;
    ko->out_device = Py_NewRef(cpu_device); /* CUDA: the graph's device, below */
    ko->lib = Py_NewRef(bd->lib);
    ko->nin = k->nin;
    ko->donor = -1;
    ko->donor_relayout = false;
    ko->nextra = k->nargs - k->nin - 1;
    ko->name = PyUnicode_FromFormat("ember_k%u", sp->index);
    ko->in_size = ko->in_stride = NULL;
    ko->checks = NULL;
    ko->nchecks = 0;
    const LBuf *ob = &lg->bufs[k->args[k->nin]];
    if (form_of[k->args[k->nin]] != NONE) ob = &lg->bufs[form_of[k->args[k->nin]]]; /* same memory, a view's layout */
    ko->out_elsize = !bd->cuda && bd->huge_pages ? em_ldt_size(ob->dtype) : 0;
    ko->out_bytes = ko->out_elsize;
    for (int j = 0; j < ob->ndim; j++) ko->out_bytes *= ob->sizes[j];
    ko->out_size = em_int64_tuple(ob->ndim, ob->sizes);
    ko->out_stride = em_int64_tuple(ob->ndim, ob->strides);
    ko->out_dtype = Py_XNewRef(em_lower_dtype_obj(ob->dtype));
    ko->numel = 1; /* rows x row length; a reduction over an empty row still runs (writes 0, 1, ...) */
    for (int j = 0; j < (k->reduction ? k->nouter : k->ndim); j++) ko->numel *= k->sizes[j];
    char fname[32];
    snprintf(fname, sizeof fname, "ember_k%u", sp->index);
    ko->set_threads = NULL;
    ko->mprog = NULL;
    if (bd->cuda) {
        ko->fn = NULL;
        Py_SETREF(ko->out_device, Py_NewRef(bd->device));
        ko->cuda = em_cuda_fn_new(bd->lib, fname, &bd->launch[sp->index]);
        if (!ko->cuda || (lg->env && kernel_set_symbolic(ko, NULL, fname, s, k, &bd->srcs) < 0)) {
            Py_DECREF(ko);
            return NULL;
        }
    } else {
        ko->fn = (KernelFn)dlsym(bd->handle, fname);
        /* the gather loads' bounds checks, to raise eager's error when the kernel reports one */
        for (uint32_t i = 0; i < k->nnodes; i++) ko->nchecks += k->nodes[i].op == LP_LOAD ? k->nodes[i].nidx : 0;
        for (uint32_t q = 0; q < k->nstores; q++) ko->nchecks += k->stores[q].scatter;
        if (ko->nchecks && !(ko->checks = calloc(ko->nchecks, sizeof(GatherCheck)))) {
            Py_DECREF(ko);
            PyErr_NoMemory();
            return NULL;
        }
        uint32_t c = 0;
        for (uint32_t i = 0; i < k->nnodes && ko->nchecks; i++)
            for (int t = 0; k->nodes[i].op == LP_LOAD && t < k->nodes[i].nidx; t++)
                ko->checks[c++] = (GatherCheck){em_codegen_gather_check(i, t), k->nodes[i].gsize[t],
                                                k->nodes[i].gerr[t], k->nodes[i].gdim[t]};
        for (uint32_t q = 0; q < k->nstores && ko->nchecks; q++) /* scatter stores: index_copy_'s error */
            if (k->stores[q].scatter)
                ko->checks[c++] = (GatherCheck){em_codegen_scatter_check(k, q), k->stores[q].sgsize, LGERR_INDEX_COPY,
                                                (int8_t)k->stores[q].sgdim};
        int64_t work = 1;
        for (int j = 0; j < k->ndim; j++) work *= k->sizes[j];
        if (work >= bd->opt.parallel_threshold || lg->env) ko->set_threads = (SetThreadsFn)dlsym(bd->handle, "ember_set_threads");
        if (lg->env && kernel_set_symbolic(ko, bd->handle, fname, s, k, &bd->srcs) < 0) {
            Py_DECREF(ko);
            return NULL;
        }
    }
    if (!ko->name || !ko->out_size || !ko->out_stride || !ko->out_dtype || (!ko->fn && !ko->cuda)) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "ember: kernel %s missing from the library", fname);
        Py_DECREF(ko);
        return NULL;
    }
    /* extern results are checked against their meta layout on each call */
    ko->in_size = calloc(k->nin + 1, sizeof(PyObject *));
    ko->in_stride = calloc(k->nin + 1, sizeof(PyObject *));
    if (!ko->in_size || !ko->in_stride) {
        Py_DECREF(ko);
        PyErr_NoMemory();
        return NULL;
    }
    for (uint32_t q = 0; q < k->nin; q++) {
        const LBuf *ib = &lg->bufs[k->args[q]];
        if (ib->kind != LBUF_EXTERN) continue;
        ko->in_size[q] = em_int64_tuple(ib->ndim, ib->sizes);
        ko->in_stride[q] = em_int64_tuple(ib->ndim, ib->strides);
        if (!ko->in_size[q] || !ko->in_stride[q]) {
            Py_DECREF(ko);
            return NULL;
        }
    }
    return ko;
}

/* A KERNEL step: the call of its Kernel with its inputs, its donor and other outputs, and the
 * tensors of its symbols; and its summary for cache_info. */
static int program_kernel(EmberBuild *bd, const SStep *sp) {
    const IRGraph *g = bd->g;
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    Prog *p = &bd->p;
    const uint32_t *form_of = bd->form_of, *extra_donor = bd->extra_donor;
    const SKernel *k = &s->kernels[sp->index];
    Kernel *ko = kernel_new(bd, sp);
    if (!ko) return -1;
    uint32_t nargs = k->nin;
    IRArg *args = em_arena_alloc(bd->na, (k->nargs + 1 + bd->srcs.n) * sizeof(IRArg));
    if (!args) {
        Py_DECREF(ko);
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t q = 0; q < k->nin; q++) {
        args[q].kind = IRARG_NODE;
        args[q].u.ref = p->buf_new[k->args[q]];
        if (lg->bufs[k->args[q]].kind == LBUF_INDEX) { /* the program's index table, a constant argument */
            args[q].kind = IRARG_CONST;
            args[q].u.obj = bd->index_table;
        }
    }
    int32_t dn = bd->donor_of[sp->index];
    if (dn >= 0) {
        uint32_t pos = NONE;
        for (uint32_t q = 0; q < k->nin; q++)
            if (k->args[q] == (uint32_t)dn) pos = q;
        if (pos == NONE) {
            pos = nargs;
            args[nargs].kind = IRARG_NODE;
            args[nargs++].u.ref = p->buf_new[dn];
        }
        ko->donor = (int32_t)pos;
        ko->donor_relayout = !same_layout(&lg->bufs[dn], &lg->bufs[k->args[k->nin]]);
    }
    for (uint32_t e = k->nin + 1; e < k->nargs && !lg->env; e++) { /* the other outputs, written in place */
        uint32_t eb = k->args[e];
        IRRef er = lg->bufs[eb].kind == LBUF_INPUT   ? p->buf_new[eb] /* a scatter store: the input, in place */
                   : extra_donor[eb] != NONE ? p->buf_new[extra_donor[eb]]
                                             : alloc_node(p, &lg->bufs[eb], form_of, bd->cuda ? bd->device : cpu_device);
        if (!er) {
            Py_DECREF(ko);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "ember: fused output without a value");
            return -1;
        }
        args[nargs].kind = IRARG_NODE;
        args[nargs++].u.ref = er;
        p->buf_new[eb] = er;
    }
    for (uint32_t q = 0; q < ko->si.nsrcargs; q++) { /* the tensors whose sizes are the symbols */
        args[nargs].kind = IRARG_NODE;
        args[nargs++].u.ref = p->ir_new[g->inputs[bd->srcs.input[q]]];
    }
    int bad = 0;
    for (uint32_t q = 0; q < nargs; q++) bad |= args[q].kind == IRARG_NODE && args[q].u.ref == 0;
    IRRef r = bad ? 0 : em_ir_call(p->ng, IR_CALL_FUNCTION, (PyObject *)ko, args, nargs, NULL, NULL, 0, NULL);
    Py_DECREF(ko);
    if (!r) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "ember: kernel argument without a value");
        return -1;
    }
    if (lg->env && k->nargs > k->nin + 1) { /* symbolic: the kernel returns (output, other outputs...) */
        for (uint32_t e = k->nin; e < k->nargs; e++) {
            IRRef gi = item_node(p, r, e - k->nin);
            if (!gi) return -1;
            p->buf_new[k->args[e]] = gi;
        }
    } else {
        p->buf_new[k->args[k->nin]] = r;
    }
    /* a summary for cache_info */
    PyObject *names = PyList_New(0);
    if (!names) return -1;
    for (uint32_t q = 0; q < k->nirs; q++) {
        PyObject *nm = PyUnicode_FromString(g->nodes[k->irs[q]].name);
        if (!nm || PyList_Append(names, nm) < 0) {
            Py_XDECREF(nm);
            Py_DECREF(names);
            return -1;
        }
        Py_DECREF(nm);
    }
    PyObject *kd = Py_BuildValue("{s:s,s:N,s:i,s:I}", "kind", k->reduction ? "reduction" : "pointwise", "nodes", names,
                                 "inplace", dn >= 0, "outputs", k->nstores);
    if (!kd || PyList_Append(bd->kernels, kd) < 0) {
        Py_XDECREF(kd);
        return -1;
    }
    Py_DECREF(kd);
    return 0;
}

/* The program: a new IR graph whose call nodes are the kernels, the extern calls and the views,
 * in step order. */
static int build_program(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    if (program_begin(bd) < 0) return -1;
    uint8_t *grouped = em_arena_alloc(bd->a, s->nsteps + 1); /* counter updates made one _foreach_add_ */
    if (!grouped) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t ngrouped = lg->env ? 0 : counter_group(s, g, grouped);
    for (uint32_t st = 0; st < s->nsteps; st++) {
        const SStep *sp = &s->steps[st];
        if (ngrouped && grouped[st]) {
            if (ngrouped == NONE) continue; /* made by the group's call already */
            if (counter_foreach(&bd->p, s, g, grouped, ngrouped, bd->ext_list) < 0) return -1;
            ngrouped = NONE;
            continue;
        }
        if (sp->kind == SSTEP_VIEW) {
            if (program_view(bd, sp) < 0) return -1;
            continue;
        }
        if (sp->kind == SSTEP_EXTERN) {
            if (program_extern(bd, st) < 0) return -1;
            continue;
        }
        if (program_kernel(bd, sp) < 0) return -1;
    }
    return 0;
}

/* The program's output, and the program on the eager backend: the answer. */
static int program_output(EmberBuild *bd) {
    const IRGraph *g = bd->g;
    Prog *p = &bd->p;
    const IRNode *out = &g->nodes[g->output];
    const IRArg *items = out->args[0].u.items;
    uint32_t no = out->args[0].n;
    IRRef *refs = em_arena_alloc(bd->na, (no + 1) * sizeof(IRRef));
    if (!refs) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < no; i++) {
        IRArg tmp;
        if (items[i].kind != IRARG_NODE || copy_arg(p, &items[i], &tmp) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "ember: graph output is not a node");
            return -1;
        }
        refs[i] = tmp.u.ref;
    }
    if (em_ir_set_output(p->ng, refs, no) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    bd->result = em_eager_graph_new(p->ng);
    if (!bd->result) return -1;
    return 0;
}

/* cache_info's entries of a compiled program. */
static int build_info(EmberBuild *bd) {
    LGraph *lg = bd->lg;
    Schedule *s = bd->s;
    PyObject *d = bd->d;
    PyObject *v;
#define SET(name, expr)                                                      \
    v = (expr);                                                              \
    if (!v || PyDict_SetItemString(d, name, v) < 0) {                        \
        Py_XDECREF(v);                                                       \
        Py_CLEAR(bd->result);                                                \
        return -1;                                                           \
    }                                                                        \
    Py_DECREF(v);
    SET("kernels", PyLong_FromUnsignedLong(s->nkernels));
    SET("kernel_list", Py_NewRef(bd->kernels));
    /* torch calls per run: the extern calls and the views made for them by as_strided */
    SET("externs", PyLong_FromUnsignedLong(lg->nextern + bd->nviews));
    SET("extern_list", Py_NewRef(bd->ext_list));
    if (bd->cuda) {
        SET("gemm", Py_BuildValue("{s:s,s:O}", "library", "cuBLASLt", "calls", bd->gemm_list));
    }
    SET("views", PyLong_FromUnsignedLong(bd->nviews));
    SET("input_views", PyLong_FromUnsignedLong(bd->ninput_views)); /* made once per nn.Parameter */
    SET("lowered", PyLong_FromUnsignedLong(lg->nlowered));
    SET("reused_buffers", PyLong_FromLong(bd->ndonated));
    SET("source", Py_NewRef(bd->src));
    SET("cache_key", PyUnicode_FromString(bd->key));
    SET("from_disk_cache", PyBool_FromLong(bd->cached));
    SET("device", PyUnicode_FromString(bd->cuda ? "cuda" : "cpu"));
    if (bd->cuda) {
        SET("launch", launch_list(bd->launch, s->nkernels));
    }
    bd->t_cc = em_now();
    SET("stage_times", Py_BuildValue("{s:d,s:d,s:d,s:d}", "lower", bd->t_lower - bd->t_start, "schedule",
                                     bd->t_schedule - bd->t_lower, "codegen", bd->t_codegen - bd->t_schedule, "cc_and_build",
                                     bd->t_cc - bd->t_codegen));
#undef SET
    return 0;
}

/* After a step failed: an internal failure of mode 0 runs the graph on the eager backend. */
static void build_internal_fallback(EmberBuild *bd) {
    PyObject *d = bd->d;
    if (bd->result || bd->cc_failed || bd->mode != 0 || !d || !PyErr_Occurred() ||
        PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        return;
    /* an internal failure of lowering/scheduling/building: never a crash, the eager backend
     * runs the graph and cache_info says why */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *msg = PyUnicode_FromFormat("backend \"ember\" failed (%S): ran by the eager backend", ev ? ev : Py_None);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    PyDict_Clear(d);
    em_cc_note_internal_fallback();
    if (msg && PyDict_SetItemString(d, "fallback", msg) == 0) bd->result = em_eager_graph_new(bd->g);
    Py_XDECREF(msg);
}

/* Releases what the build owns, all but bd->result. */
static void build_clear(EmberBuild *bd) {
    sym_sources_free(&bd->srcs);
    Py_XDECREF(bd->d);
    Py_XDECREF(bd->src);
    Py_XDECREF(bd->lib);
    Py_XDECREF(bd->kernels);
    Py_XDECREF(bd->device);
    Py_XDECREF(bd->ext_list);
    Py_XDECREF(bd->gemm_list);
    Py_XDECREF(bd->index_table);
    em_arena_free(bd->na);
    em_arena_free(bd->a);
}

/* mode 0: compile and load (CPU or CUDA by the graph's device); mode 1: CUDA code generation
 * only (tests without a GPU), returning the info dict itself; mode 2: prefetch (em_ember_prefetch).
 * Each step returns 0 to go on, else the compilation stops there: bd.result is its answer, or
 * NULL after an error (mode 0: build_internal_fallback runs the graph on the eager backend). */
static PyObject *ember_compile(const IRGraph *g, PyObject **info, int mode) {
    EmberBuild bd = {.g = g, .mode = mode};
    *info = NULL;
    if (build_begin(&bd) < 0) goto done;
    if (mode != 1 && build_check_autocast(&bd) != 0) goto done;
    if (build_lower(&bd) != 0) goto done;
    if (build_schedule(&bd) < 0) goto done;
    if (build_generate(&bd) != 0) goto done;
    if (build_load(&bd) != 0) goto done;
    if (plan_last_uses(&bd) < 0) goto done;
    if (plan_view_forms(&bd) < 0) goto done;
    if (plan_donors(&bd) < 0) goto done;
    if (build_program(&bd) < 0) goto done;
    if (program_output(&bd) < 0) goto done;
    if (build_info(&bd) < 0) goto done;
done:
    build_internal_fallback(&bd);
    if (bd.result) *info = Py_NewRef(bd.d);
    build_clear(&bd);
    return bd.result;
}


/* EMBER_TEST_CUDA_SOURCE=1 (tests without a GPU): a graph compiled for the CPU also goes through the
 * CUDA code generator, and its entry's info gets "cuda_test", the dict _C._ir_build(...,
 * cuda_source=True) returns (source, launch table, buffers; for a symbolic graph the symbols'
 * sources and the layouts as expressions): the symbolic graph the tracer made, for the emulator. */
PyObject *em_ember_compile(const IRGraph *g, PyObject **info) {
    PyObject *r = ember_compile(g, info, 0);
    const char *t = getenv("EMBER_TEST_CUDA_SOURCE");
    if (!r || !*info || !t || !*t || *t == '0' || !PyDict_Check(*info)) return r;
    PyObject *dev = PyDict_GetItemString(*info, "device");
    if (!dev || !PyUnicode_Check(dev) || PyUnicode_CompareWithASCIIString(dev, "cpu") != 0) return r;
    PyObject *ci = NULL, *c = ember_compile(g, &ci, 1);
    Py_XDECREF(ci);
    if (!c || PyDict_SetItemString(*info, "cuda_test", c) < 0) {
        Py_CLEAR(r);
        Py_CLEAR(*info);
    }
    Py_XDECREF(c);
    return r;
}

void em_ember_prefetch(const IRGraph *g) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *info = NULL, *r = ember_compile(g, &info, 2);
    Py_XDECREF(info);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

PyObject *em_ember_cuda_codegen(const IRGraph *g) {
    PyObject *info = NULL, *r = ember_compile(g, &info, 1);
    Py_XDECREF(info);
    return r;
}

int em_runtime_ember_init(PyObject *module) {
    PyObject *tp = PyType_FromModuleAndSpec(module, &kernel_spec, NULL);
    if (!tp) return -1;
    if (PyModule_AddObjectRef(module, "Kernel", tp) < 0) {
        Py_DECREF(tp);
        return -1;
    }
    Py_XSETREF(Kernel_Type, (PyTypeObject *)tp);
    tp = PyType_FromModuleAndSpec(module, &view_spec, NULL);
    if (!tp) return -1;
    if (PyModule_AddObjectRef(module, "View", tp) < 0) {
        Py_DECREF(tp);
        return -1;
    }
    Py_XSETREF(View_Type, (PyTypeObject *)tp);
    static PyMethodDef stats_def = {"_cc_stats", em_cc_stats, METH_NOARGS,
                                    "Compiler calls and disk-cache loads of backend \"ember\" in this process."};
    PyObject *f = PyCFunction_NewEx(&stats_def, NULL, NULL);
    if (!f || PyModule_AddObject(module, "_cc_stats", f) < 0) {
        Py_XDECREF(f);
        return -1;
    }
    return 0;
}
