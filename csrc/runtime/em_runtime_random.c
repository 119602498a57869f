/* runtime: the eager forms of the random ops ember's training graphs call (backend "ember" with
 * ember.config.fallback_random False, csrc/autograd). A generated kernel computes the same values
 * (the lowering of ember._C.philox_dropout, csrc/lower); these run when a node stays an extern call
 * (a graph that does not lower, a compile that failed) and give the meta results the autograd stage
 * builds its graphs from.
 *
 *   ember._C.philox_seeds(like, count) -> int64 tensor of count seeds on like's device, drawn from
 *       torch's generator of that device (torch.randint over the whole int64 range, as Inductor's
 *       inductor_seeds); on device "meta": an empty meta tensor, nothing drawn.
 *   ember._C.philox_dropout(input, seeds, index, p) -> input * noise, noise[e] = 1 / (1 - p) in
 *       input's dtype where em_philox_uniform(seeds[index], e) < float32(1 - p), else 0; e is the
 *       element's row-major position in input's shape (core/em_philox.h). Its own backward: the
 *       gradient of input is philox_dropout(grad, seeds, index, p), the same mask. */
#include "core/em_philox.h"
#include "runtime/em_runtime.h"

EM_PHILOX_DEF(static inline)

/* torch.<name> (new reference) */
static PyObject *torch_fn(const char *name) {
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *f = torch ? PyObject_GetAttrString(torch, name) : NULL;
    Py_XDECREF(torch);
    return f;
}

/* 1 when tensor t is on device "meta", 0 otherwise, -1 with an exception. */
static int on_meta(PyObject *t) {
    PyObject *v = PyObject_GetAttrString(t, "is_meta");
    int r = v ? PyObject_IsTrue(v) : -1;
    Py_XDECREF(v);
    return r;
}

static PyObject *philox_seeds(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    EM_UNUSED(self);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "philox_seeds(like, count) takes 2 arguments");
        return NULL;
    }
    long long count = PyLong_AsLongLong(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    int meta = on_meta(args[0]);
    if (meta < 0) return NULL;
    PyObject *device = PyObject_GetAttrString(args[0], "device");
    PyObject *f = device ? torch_fn(meta ? "empty" : "randint") : NULL;
    PyObject *dt = f ? torch_fn("int64") : NULL;
    PyObject *kw = dt ? Py_BuildValue("{s:O,s:O}", "device", device, "dtype", dt) : NULL;
    PyObject *a = !kw ? NULL
                  : meta ? Py_BuildValue("((L))", count)
                         : Py_BuildValue("(LL(L))", (long long)INT64_MIN, (long long)INT64_MAX, count);
    PyObject *r = a ? PyObject_Call(f, a, kw) : NULL;
    Py_XDECREF(device);
    Py_XDECREF(f);
    Py_XDECREF(dt);
    Py_XDECREF(kw);
    Py_XDECREF(a);
    return r;
}

static PyObject *philox_dropout(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    EM_UNUSED(self);
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "philox_dropout(input, seeds, index, p) takes 4 arguments");
        return NULL;
    }
    PyObject *x = args[0], *seeds = args[1];
    long long index = PyLong_AsLongLong(args[2]);
    double p = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (!(p > 0.0 && p < 1.0) || index < 0) {
        PyErr_Format(PyExc_ValueError, "philox_dropout: p must lie in (0, 1) and index be >= 0, got %g and %lld", p,
                     index);
        return NULL;
    }
    PyObject *shape = NULL, *dtype = NULL, *device = NULL, *noise = NULL, *r = NULL, *seed_t = NULL, *mask = NULL;
    shape = PyObject_GetAttrString(x, "shape");
    dtype = shape ? PyObject_GetAttrString(x, "dtype") : NULL;
    device = dtype ? PyObject_GetAttrString(x, "device") : NULL;
    int meta = device ? on_meta(x) : -1;
    if (meta < 0) goto done;
    if (meta) { /* the result's meta: what x * noise gives (layout, dtype) */
        PyObject *f = torch_fn("empty");
        PyObject *kw = f ? Py_BuildValue("{s:O,s:O}", "dtype", dtype, "device", device) : NULL;
        PyObject *a = kw ? PyTuple_Pack(1, shape) : NULL;
        noise = a ? PyObject_Call(f, a, kw) : NULL;
        Py_XDECREF(f);
        Py_XDECREF(kw);
        Py_XDECREF(a);
    } else {
        /* the seed: seeds[index] as a Python int (a device sync on CUDA: this is the fallback) */
        seed_t = PyObject_GetItem(seeds, args[2]);
        PyObject *sv = seed_t ? PyObject_CallMethod(seed_t, "item", NULL) : NULL;
        long long seed = sv ? PyLong_AsLongLong(sv) : 0;
        Py_XDECREF(sv);
        PyObject *nobj = PyErr_Occurred() ? NULL : PyObject_CallMethod(x, "numel", NULL);
        long long n = nobj ? PyLong_AsLongLong(nobj) : -1;
        Py_XDECREF(nobj);
        if (n < 0 || PyErr_Occurred()) goto done;
        PyObject *f = torch_fn("empty"), *bool_t = torch_fn("bool");
        /* on the CPU, filled here: device="cpu" whatever torch.set_default_device says (a CUDA
         * default made this a device pointer written by the host) */
        PyObject *kw = f && bool_t ? Py_BuildValue("{s:O,s:s}", "dtype", bool_t, "device", "cpu") : NULL;
        PyObject *a = kw ? Py_BuildValue("((L))", n) : NULL;
        mask = a ? PyObject_Call(f, a, kw) : NULL;
        Py_XDECREF(f);
        Py_XDECREF(bool_t);
        Py_XDECREF(kw);
        Py_XDECREF(a);
        PyObject *ptr = mask ? PyObject_CallMethod(mask, "data_ptr", NULL) : NULL;
        unsigned char *m = ptr ? (unsigned char *)PyLong_AsVoidPtr(ptr) : NULL;
        Py_XDECREF(ptr);
        if (!m && n > 0) goto done;
        const float keep = (float)(1.0 - p);
        Py_BEGIN_ALLOW_THREADS
        for (long long e = 0; e < n; e++) m[e] = em_philox_uniform((unsigned long long)seed, (unsigned long long)e) < keep;
        Py_END_ALLOW_THREADS
        /* noise = mask.to(dtype) * (1 / (1 - p)): the scale rounded to the dtype as torch does for a
         * tensor times a Python float; then moved to x's device with x's shape */
        PyObject *mt = PyObject_CallMethod(mask, "to", "O", dtype);
        PyObject *sc = mt ? PyObject_CallMethod(mt, "mul_", "d", 1.0 / (1.0 - p)) : NULL;
        PyObject *md = sc ? PyObject_CallMethod(sc, "to", "O", device) : NULL;
        noise = md ? PyObject_CallMethod(md, "view", "O", shape) : NULL;
        Py_XDECREF(mt);
        Py_XDECREF(sc);
        Py_XDECREF(md);
    }
    if (noise) r = PyNumber_Multiply(x, noise);
done:
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(noise);
    Py_XDECREF(seed_t);
    Py_XDECREF(mask);
    return r;
}

int em_runtime_random_init(PyObject *module) {
    static PyMethodDef defs[] = {
        {"philox_seeds", (PyCFunction)(void (*)(void))philox_seeds, METH_FASTCALL,
         "philox_seeds(like, count): int64 tensor of count seeds on like's device (torch.randint)."},
        {"philox_dropout", (PyCFunction)(void (*)(void))philox_dropout, METH_FASTCALL,
         "philox_dropout(input, seeds, index, p): dropout with Philox random numbers (em_philox.h)."},
        {NULL, NULL, 0, NULL},
    };
    return em_runtime_add_functions(module, defs);
}
