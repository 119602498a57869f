/* runtime: the stage's module initialisation, the one place that calls each runtime file's init.
 * Invariant: the runtime files do not call each other's init functions; em_module.c calls only
 * em_runtime_init, which registers every type and function of the stage, in this order. */
#include "runtime/em_runtime.h"

/* EagerGraph and AutocastOff first (the eager backend, em_runtime_eager.c), then backend "ember"'s
 * Kernel, View and _cc_stats (em_runtime_ember.c), NVRTC and the driver API (em_runtime_cuda.c),
 * the Philox helpers (em_runtime_random.c), skinny_linear (em_runtime_skinny.c), the Gemm type
 * (em_runtime_gemm.c), CudaGraphs (em_runtime_cudagraph.c) and the test
 * helpers (em_runtime_testing.c). */
int em_runtime_add_functions(PyObject *module, PyMethodDef *defs) {
    PyObject *modname = PyUnicode_FromString("ember._C");
    if (!modname) return -1;
    for (PyMethodDef *d = defs; d->ml_name; d++) {
        PyObject *f = PyCFunction_NewEx(d, NULL, modname);
        if (!f || PyModule_AddObject(module, d->ml_name, f) < 0) {
            Py_XDECREF(f);
            Py_DECREF(modname);
            return -1;
        }
    }
    Py_DECREF(modname);
    return 0;
}

int em_runtime_init(PyObject *module) {
    if (em_runtime_eager_init(module) < 0) return -1;
    if (em_runtime_ember_init(module) < 0) return -1;
    if (em_runtime_cuda_init(module) < 0) return -1;
    if (em_runtime_random_init(module) < 0) return -1;
    if (em_runtime_skinny_init(module) < 0) return -1;
    if (em_runtime_gemm_init(module) < 0) return -1;
    if (em_runtime_cudagraph_init(module) < 0) return -1;
    return em_runtime_testing_init(module);
}
