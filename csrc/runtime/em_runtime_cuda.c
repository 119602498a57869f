/* runtime cuda: NVRTC and the CUDA driver API, loaded with dlopen at run time (DESIGN.md: building
 * ember never needs CUDA; the few prototypes and enums used are declared here, from the CUDA
 * driver API and NVRTC reference manuals). Compiled binaries (cubin for the device's sm_XY, PTX
 * when NVRTC does not know the device) go to the content-addressed compile cache, keyed by source,
 * NVRTC version and architecture. Kernels run in the device's primary context (the one torch uses)
 * on torch's current stream. Invariant: every driver or NVRTC failure becomes a Python exception
 * that names the kernel or the library; nothing here aborts the process. */
#include "runtime/em_runtime.h"

#include "codegen/em_codegen.h"

#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the CUDA driver API (cuda.h), declared by hand ---- */
typedef int CUresult; /* CUDA_SUCCESS = 0 */
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
enum {
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
};

/* ---- NVRTC (nvrtc.h) ---- */
typedef int nvrtcResult; /* NVRTC_SUCCESS = 0 */
typedef struct _nvrtcProgram *nvrtcProgram;

#define CU_FUNCS(_)                                                                                      \
    _(cuInit, CUresult, (unsigned int))                                                                  \
    _(cuDriverGetVersion, CUresult, (int *))                                                             \
    _(cuDeviceGet, CUresult, (CUdevice *, int))                                                          \
    _(cuDeviceGetCount, CUresult, (int *))                                                               \
    _(cuDeviceGetAttribute, CUresult, (int *, int, CUdevice))                                            \
    _(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *, CUdevice))                                       \
    _(cuCtxGetCurrent, CUresult, (CUcontext *))                                                          \
    _(cuCtxSetCurrent, CUresult, (CUcontext))                                                            \
    _(cuModuleLoadData, CUresult, (CUmodule *, const void *))                                            \
    _(cuModuleUnload, CUresult, (CUmodule))                                                              \
    _(cuModuleGetFunction, CUresult, (CUfunction *, CUmodule, const char *))                             \
    _(cuLaunchKernel, CUresult,                                                                          \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, \
       void **))                                                                                         \
    _(cuStreamSynchronize, CUresult, (CUstream))                                                         \
    _(cuGetErrorName, CUresult, (CUresult, const char **))                                               \
    _(cuGetErrorString, CUresult, (CUresult, const char **))

#define NVRTC_FUNCS(_)                                                                                   \
    _(nvrtcVersion, nvrtcResult, (int *, int *))                                                         \
    _(nvrtcGetErrorString, const char *, (nvrtcResult))                                                  \
    _(nvrtcCreateProgram, nvrtcResult,                                                                   \
      (nvrtcProgram *, const char *, const char *, int, const char *const *, const char *const *))      \
    _(nvrtcCompileProgram, nvrtcResult, (nvrtcProgram, int, const char *const *))                        \
    _(nvrtcDestroyProgram, nvrtcResult, (nvrtcProgram *))                                                \
    _(nvrtcGetProgramLogSize, nvrtcResult, (nvrtcProgram, size_t *))                                     \
    _(nvrtcGetProgramLog, nvrtcResult, (nvrtcProgram, char *))                                           \
    _(nvrtcGetPTXSize, nvrtcResult, (nvrtcProgram, size_t *))                                            \
    _(nvrtcGetPTX, nvrtcResult, (nvrtcProgram, char *))                                                  \
    _(nvrtcGetCUBINSize, nvrtcResult, (nvrtcProgram, size_t *))                                          \
    _(nvrtcGetCUBIN, nvrtcResult, (nvrtcProgram, char *))                                                \
    _(nvrtcGetNumSupportedArchs, nvrtcResult, (int *))                                                   \
    _(nvrtcGetSupportedArchs, nvrtcResult, (int *))

typedef struct {
#define DECL(name, ret, args) ret(*name) args;
    CU_FUNCS(DECL)
    NVRTC_FUNCS(DECL)
#undef DECL
    void *libcuda, *libnvrtc;
    int nvrtc_tried, cuda_tried;
    const char *nvrtc_why, *cuda_why; /* why a library is unusable (static text) */
    char nvrtc_path[PATH_MAX];
    int nvrtc_major, nvrtc_minor, max_arch; /* max_arch: highest sm NVRTC supports, e.g. 120 */
    int launch_blocking;                    /* CUDA_LAUNCH_BLOCKING=1 */
    PyObject *raw_stream;                   /* torch._C._cuda_getCurrentRawStream */
    struct {
        CUcontext ctx;
        int sms, major, minor, ready;
    } dev[64];
} CudaLib;

static CudaLib L; /* process-wide: the libraries are process-wide too */

struct EmCudaFn {
    CUfunction fn;
    CUfunction fn64; /* symbolic kernel compiled for both index widths (launch.idx64 == 2): the 64-bit one */
    CUcontext ctx;
    int device;
    PyObject *device_index; /* int, for torch._C._cuda_getCurrentRawStream */
    EmCudaLaunch launch;
    unsigned grid;
    char name[32];
};

typedef struct {
    CUmodule mod;
    CUcontext ctx;
    int device;
} CudaModule;

/* ---------------------------------------------------------------------------------------------- */
/* Finding the libraries                                                                           */
/* ---------------------------------------------------------------------------------------------- */

static int has_prefix(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }

/* The soname version of "libnvrtc.so.13" (13), 0 for "libnvrtc.so", -1 for other files. */
static int nvrtc_file_major(const char *name) {
    if (strcmp(name, "libnvrtc.so") == 0) return 0;
    if (!has_prefix(name, "libnvrtc.so.")) return -1;
    return atoi(name + strlen("libnvrtc.so."));
}

/* Best libnvrtc in dir (preferring the soname major `want`, else the highest); 0 when found. */
static int scan_dir(const char *dir, int want, char *best, int *best_major) {
    if (strlen(dir) >= PATH_MAX - 300) return -1;
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *e;
    int found = -1;
    while ((e = readdir(d))) {
        int m = nvrtc_file_major(e->d_name);
        if (m < 0) continue;
        int better = *best_major < 0 || (want > 0 && m == want && *best_major != want) ||
                     ((want <= 0 || *best_major != want) && m > *best_major);
        if (better) {
            snprintf(best, PATH_MAX, "%s/%s", dir, e->d_name);
            *best_major = m;
            found = 0;
        }
    }
    closedir(d);
    return found;
}

/* torch.version.cuda's major ("13.0" -> 13), 0 when torch has no CUDA. */
static int torch_cuda_major(void) {
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch) {
        PyErr_Clear();
        return 0;
    }
    PyObject *v = PyObject_GetAttrString(torch, "version");
    PyObject *c = v ? PyObject_GetAttrString(v, "cuda") : NULL;
    int m = 0;
    if (c && PyUnicode_Check(c)) m = atoi(PyUnicode_AsUTF8(c));
    PyErr_Clear();
    Py_XDECREF(c);
    Py_XDECREF(v);
    Py_DECREF(torch);
    return m;
}

/* Candidate libnvrtc paths in the order DESIGN.md gives: the nvidia-* wheels in sys.path
 * (site-packages/nvidia/<pkg>/lib), torch/lib, then the system's loader path. */
static void load_nvrtc(void) {
    if (L.nvrtc_tried) return;
    L.nvrtc_tried = 1;
    int want = torch_cuda_major();
    const char *env = getenv("EMBER_NVRTC");
    void *h = NULL;
    if (env && *env) {
        h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (h) snprintf(L.nvrtc_path, sizeof L.nvrtc_path, "%s", env);
    }
    /* already loaded by torch (it uses NVRTC for its jiterator)? */
    static const char *const sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", NULL};
    for (int i = 0; !h && sonames[i]; i++) {
        h = dlopen(sonames[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
        if (h) snprintf(L.nvrtc_path, sizeof L.nvrtc_path, "%s (already loaded)", sonames[i]);
    }
    if (!h) {
        char best[PATH_MAX] = "";
        int best_major = -1;
        PyObject *sys_path = PySys_GetObject("path"); /* borrowed */
        Py_ssize_t n = sys_path && PyList_Check(sys_path) ? PyList_GET_SIZE(sys_path) : 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *p = PyList_GET_ITEM(sys_path, i);
            const char *ps = PyUnicode_Check(p) ? PyUnicode_AsUTF8(p) : NULL;
            if (!ps) {
                PyErr_Clear();
                continue;
            }
            char nv[PATH_MAX];
            snprintf(nv, sizeof nv, "%s/nvidia", ps);
            DIR *d = opendir(nv);
            if (d) {
                struct dirent *e;
                while ((e = readdir(d))) {
                    if (e->d_name[0] == '.') continue;
                    char lib[PATH_MAX + 300];
                    if (snprintf(lib, sizeof lib, "%s/%s/lib", nv, e->d_name) >= (int)sizeof lib) continue;
                    scan_dir(lib, want, best, &best_major);
                }
                closedir(d);
            }
            if (best_major < 0) {
                char tl[PATH_MAX];
                snprintf(tl, sizeof tl, "%s/torch/lib", ps);
                scan_dir(tl, want, best, &best_major);
            }
        }
        if (best_major >= 0) {
            h = dlopen(best, RTLD_NOW | RTLD_LOCAL);
            if (h) snprintf(L.nvrtc_path, sizeof L.nvrtc_path, "%s", best);
        }
    }
    static const char *const system[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", "/usr/local/cuda/lib64/libnvrtc.so.13",
                                         "/usr/local/cuda/lib64/libnvrtc.so.12", "/usr/local/cuda/lib64/libnvrtc.so", NULL};
    for (int i = 0; !h && system[i]; i++) {
        h = dlopen(system[i], RTLD_NOW | RTLD_LOCAL);
        if (h) snprintf(L.nvrtc_path, sizeof L.nvrtc_path, "%s", system[i]);
    }
    if (!h) {
        L.nvrtc_why = "NVRTC (libnvrtc.so) was not found in the nvidia-* wheels, torch/lib or the system "
                      "(pip install nvidia-cuda-nvrtc)";
        return;
    }
#define LOOK(name, ret, args)                                          \
    L.name = (ret(*) args)dlsym(h, #name);                             \
    if (!L.name && strcmp(#name, "nvrtcGetCUBINSize") && strcmp(#name, "nvrtcGetCUBIN") && \
        strcmp(#name, "nvrtcGetNumSupportedArchs") && strcmp(#name, "nvrtcGetSupportedArchs")) { \
        L.nvrtc_why = "libnvrtc lacks " #name;                         \
        dlclose(h);                                                    \
        return;                                                        \
    }
    NVRTC_FUNCS(LOOK)
#undef LOOK
    L.libnvrtc = h;
    L.nvrtcVersion(&L.nvrtc_major, &L.nvrtc_minor);
    L.max_arch = 0;
    int na = 0;
    if (L.nvrtcGetNumSupportedArchs && L.nvrtcGetSupportedArchs && L.nvrtcGetNumSupportedArchs(&na) == 0 && na > 0 && na < 256) {
        int archs[256];
        if (L.nvrtcGetSupportedArchs(archs) == 0)
            for (int i = 0; i < na; i++)
                if (archs[i] > L.max_arch) L.max_arch = archs[i];
    }
}

static void load_cuda(void) {
    if (L.cuda_tried) return;
    L.cuda_tried = 1;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        L.cuda_why = "the CUDA driver (libcuda.so.1) was not found: no GPU driver on this machine";
        return;
    }
#define LOOK(name, ret, args)                      \
    L.name = (ret(*) args)dlsym(h, #name);         \
    if (!L.name) {                                 \
        L.cuda_why = "libcuda lacks " #name;       \
        dlclose(h);                                \
        return;                                    \
    }
    CU_FUNCS(LOOK)
#undef LOOK
    if (L.cuInit(0) != 0) {
        L.cuda_why = "cuInit failed: no usable CUDA device";
        return;
    }
    const char *lb = getenv("CUDA_LAUNCH_BLOCKING");
    L.launch_blocking = lb && strcmp(lb, "1") == 0;
    L.libcuda = h;
}

static void cu_error(CUresult rc, const char *what, const char *name) {
    const char *en = NULL, *es = NULL;
    if (L.cuGetErrorName) L.cuGetErrorName(rc, &en);
    if (L.cuGetErrorString) L.cuGetErrorString(rc, &es);
    PyErr_Format(PyExc_RuntimeError, "ember: %s%s%s failed: %s (%d): %s", what, name ? " of kernel " : "", name ? name : "",
                 en ? en : "CUDA error", rc, es ? es : "");
}

/* The device's primary context and properties, made ready once. -1 with an exception. */
static int device_ready(int device) {
    if (device < 0 || device >= 64) {
        PyErr_Format(PyExc_RuntimeError, "ember: CUDA device %d is out of range", device);
        return -1;
    }
    if (L.dev[device].ready) return 0;
    CUdevice dv;
    CUresult rc;
    if ((rc = L.cuDeviceGet(&dv, device)) != 0) return cu_error(rc, "cuDeviceGet", NULL), -1;
    if ((rc = L.cuDevicePrimaryCtxRetain(&L.dev[device].ctx, dv)) != 0) return cu_error(rc, "cuDevicePrimaryCtxRetain", NULL), -1;
    int sms = 0, ma = 0, mi = 0;
    if ((rc = L.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dv)) != 0 ||
        (rc = L.cuDeviceGetAttribute(&ma, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dv)) != 0 ||
        (rc = L.cuDeviceGetAttribute(&mi, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dv)) != 0)
        return cu_error(rc, "cuDeviceGetAttribute", NULL), -1;
    L.dev[device].sms = sms > 0 ? sms : 1;
    L.dev[device].major = ma;
    L.dev[device].minor = mi;
    L.dev[device].ready = 1;
    return 0;
}

int em_cuda_available(int device, const char **why) {
    load_nvrtc();
    if (!L.libnvrtc) {
        *why = L.nvrtc_why;
        return 0;
    }
    load_cuda();
    if (!L.libcuda) {
        *why = L.cuda_why;
        return 0;
    }
    int n = 0;
    if (L.cuDeviceGetCount(&n) != 0 || device >= n) {
        *why = "the graph's CUDA device is not visible to the driver";
        return 0;
    }
    if (!L.raw_stream) {
        PyObject *c = PyImport_ImportModule("torch._C");
        L.raw_stream = c ? PyObject_GetAttrString(c, "_cuda_getCurrentRawStream") : NULL;
        Py_XDECREF(c);
        if (!L.raw_stream) {
            PyErr_Clear();
            *why = "this torch has no torch._C._cuda_getCurrentRawStream (a CPU-only build)";
            return 0;
        }
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* NVRTC                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

/* Compiles source for arch ("sm_90": cubin, "compute_90": PTX). Returns a malloc'd binary (PTX is
 * NUL-terminated), NULL with an exception carrying NVRTC's log. */
static char *nvrtc_compile(const char *source, const char *arch, size_t *len) {
    nvrtcProgram prog = NULL;
    char *out = NULL, *log = NULL;
    nvrtcResult rc = L.nvrtcCreateProgram(&prog, source, "ember_kernels.cu", 0, NULL, NULL);
    if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "ember: nvrtcCreateProgram failed: %s", L.nvrtcGetErrorString(rc));
        return NULL;
    }
    char archopt[64];
    snprintf(archopt, sizeof archopt, "--gpu-architecture=%s", arch);
    const char *opts[] = {archopt, "--std=c++17", "-default-device"};
    int cubin = has_prefix(arch, "sm_");
    Py_BEGIN_ALLOW_THREADS
    rc = L.nvrtcCompileProgram(prog, 3, opts);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        size_t ln = 0;
        L.nvrtcGetProgramLogSize(prog, &ln);
        log = malloc(ln + 1);
        if (log) {
            log[0] = 0;
            L.nvrtcGetProgramLog(prog, log);
            log[ln] = 0;
            if (ln > 6000) log[6000] = 0;
        }
        PyErr_Format(PyExc_RuntimeError, "ember: NVRTC %d.%d failed to compile the generated CUDA C for %s: %s\n%s", L.nvrtc_major,
                     L.nvrtc_minor, arch, L.nvrtcGetErrorString(rc), log ? log : "");
        goto done;
    }
    size_t n = 0;
    if (cubin && (!L.nvrtcGetCUBINSize || !L.nvrtcGetCUBIN)) {
        PyErr_SetString(PyExc_RuntimeError, "ember: this NVRTC cannot produce cubin");
        goto done;
    }
    rc = cubin ? L.nvrtcGetCUBINSize(prog, &n) : L.nvrtcGetPTXSize(prog, &n);
    if (rc != 0 || !(out = malloc(n + 1))) {
        if (rc == 0) PyErr_NoMemory();
        else PyErr_Format(PyExc_RuntimeError, "ember: NVRTC: %s", L.nvrtcGetErrorString(rc));
        goto done;
    }
    rc = cubin ? L.nvrtcGetCUBIN(prog, out) : L.nvrtcGetPTX(prog, out);
    if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "ember: NVRTC: %s", L.nvrtcGetErrorString(rc));
        free(out);
        out = NULL;
        goto done;
    }
    out[n] = 0;
    *len = n;
done:
    free(log);
    L.nvrtcDestroyProgram(&prog);
    return out;
}

/* The NVRTC target for a device of compute capability major.minor: its sm_XY when NVRTC knows it,
 * else PTX for the newest architecture NVRTC knows (the driver compiles it). */
static void target_arch(int major, int minor, char *out, size_t n) {
    int a = major * 10 + minor;
    if (L.max_arch && a > L.max_arch) snprintf(out, n, "compute_%d", L.max_arch);
    else snprintf(out, n, "sm_%d", a);
}

static void module_close(PyObject *cap) {
    CudaModule *m = PyCapsule_GetPointer(cap, "ember.cumodule");
    if (!m) {
        PyErr_Clear();
        return;
    }
    /* at interpreter exit the context may already be gone: the driver then reports an error,
     * which is ignored */
    if (L.libcuda && m->mod) {
        CUcontext prev = NULL;
        if (L.cuCtxGetCurrent(&prev) == 0 && prev != m->ctx) L.cuCtxSetCurrent(m->ctx);
        L.cuModuleUnload(m->mod);
        if (prev && prev != m->ctx) L.cuCtxSetCurrent(prev);
    }
    free(m);
}

PyObject *em_cuda_module_load(const char *source, size_t srclen, int device, char *key_out, int *was_cached) {
    *was_cached = 0;
    const char *why = NULL;
    if (!em_cuda_available(device, &why)) {
        PyErr_Format(PyExc_RuntimeError, "ember: %s", why);
        return NULL;
    }
    if (device_ready(device) < 0) return NULL;
    char arch[32], ver[32];
    target_arch(L.dev[device].major, L.dev[device].minor, arch, sizeof arch);
    snprintf(ver, sizeof ver, "nvrtc %d.%d", L.nvrtc_major, L.nvrtc_minor);
    const char *ext = has_prefix(arch, "sm_") ? ".cubin" : ".ptx";
    const void *parts[] = {source, ver, arch, "--std=c++17 -default-device"};
    size_t lens[] = {srclen, strlen(ver), strlen(arch), strlen("--std=c++17 -default-device")};
    em_cc_key(parts, lens, 4, key_out);
    size_t len = 0;
    char *bin = em_cc_blob_get(key_out, ext, &len);
    if (!bin && PyErr_Occurred()) return NULL;
    if (bin) *was_cached = 1;
    else {
        bin = nvrtc_compile(source, arch, &len);
        if (!bin) return NULL;
        if (em_cc_blob_put(key_out, ext, bin, len + (ext[1] == 'p' ? 1 : 0), source, srclen, ".cu") < 0) {
            free(bin);
            return NULL;
        }
    }
    CudaModule *m = calloc(1, sizeof *m);
    if (!m) {
        free(bin);
        return PyErr_NoMemory();
    }
    m->ctx = L.dev[device].ctx;
    m->device = device;
    CUcontext prev = NULL;
    CUresult rc = L.cuCtxGetCurrent(&prev);
    if (rc == 0 && prev != m->ctx) rc = L.cuCtxSetCurrent(m->ctx);
    if (rc == 0) rc = L.cuModuleLoadData(&m->mod, bin);
    if (prev && prev != m->ctx) L.cuCtxSetCurrent(prev);
    free(bin);
    if (rc != 0) {
        free(m);
        cu_error(rc, "cuModuleLoadData", NULL);
        return NULL;
    }
    PyObject *cap = PyCapsule_New(m, "ember.cumodule", module_close);
    if (!cap) {
        L.cuModuleUnload(m->mod);
        free(m);
    }
    return cap;
}

/* The grid of a launch: the blocks the work needs, at most per_sm resident blocks on every SM when
 * per_sm > 0, and at most EM_CUDA_MAX_THREADS threads (the index headroom); the kernels loop
 * grid-stride over what is left. */
static unsigned grid_of(int device, int64_t blocks, int32_t block, int32_t per_sm) {
    int64_t cap = EM_CUDA_MAX_THREADS / (block > 0 ? block : 1);
    if (per_sm > 0 && (int64_t)L.dev[device].sms * per_sm < cap) cap = (int64_t)L.dev[device].sms * per_sm;
    int64_t g = blocks < cap ? blocks : cap;
    return (unsigned)(g < 1 ? 1 : g);
}

EmCudaFn *em_cuda_fn_new(PyObject *module, const char *name, const EmCudaLaunch *launch) {
    CudaModule *m = PyCapsule_GetPointer(module, "ember.cumodule");
    if (!m) return NULL;
    EmCudaFn *f = calloc(1, sizeof *f);
    if (!f) return (EmCudaFn *)PyErr_NoMemory();
    CUresult rc = L.cuModuleGetFunction(&f->fn, m->mod, name);
    if (rc != 0) {
        free(f);
        cu_error(rc, "cuModuleGetFunction", name);
        return NULL;
    }
    if (launch->sym && launch->idx64 == 2) {
        char n64[48];
        snprintf(n64, sizeof n64, "%s_64", name);
        rc = L.cuModuleGetFunction(&f->fn64, m->mod, n64);
        if (rc != 0) {
            free(f);
            cu_error(rc, "cuModuleGetFunction", n64);
            return NULL;
        }
    }
    f->ctx = m->ctx;
    f->device = m->device;
    f->launch = *launch;
    snprintf(f->name, sizeof f->name, "%s", name);
    f->grid = grid_of(m->device, launch->blocks, launch->block, launch->per_sm);
    f->device_index = PyLong_FromLong(m->device);
    if (!f->device_index) {
        free(f);
        return NULL;
    }
    return f;
}

void em_cuda_fn_free(EmCudaFn *f) {
    if (!f) return;
    Py_XDECREF(f->device_index);
    free(f);
}

enum { NPARAM_STACK = 32 };

/* cuLaunchKernel of fn with the data pointers (and, when extra is not NULL, one more parameter whose
 * bytes extra points at: the em_sv struct of a symbolic kernel) on torch's current stream. */
static int launch_fn(EmCudaFn *f, CUfunction fn, unsigned grid, unsigned block, char *const *ptrs, uint32_t nptr,
                     const void *extra) {
    /* torch's current stream on the kernel's device (what torch.cuda.current_stream(d).cuda_stream
     * returns), so that the kernel is ordered with torch's own work and the caching allocator */
    PyObject *s = PyObject_CallOneArg(L.raw_stream, f->device_index);
    if (!s) return -1;
    CUstream stream = (CUstream)PyLong_AsVoidPtr(s);
    Py_DECREF(s);
    if (PyErr_Occurred()) return -1;
    /* cuLaunchKernel's kernelParams: one pointer per kernel parameter, pointing at its value */
    unsigned long long vbuf[NPARAM_STACK];
    void *pbuf[NPARAM_STACK + 1];
    unsigned long long *vals = vbuf;
    void **params = pbuf;
    if (nptr > NPARAM_STACK) {
        vals = PyMem_Malloc(nptr * sizeof *vals);
        params = PyMem_Malloc((nptr + 1) * sizeof *params);
        if (!vals || !params) {
            PyMem_Free(vals);
            PyMem_Free(params);
            PyErr_NoMemory();
            return -1;
        }
    }
    for (uint32_t i = 0; i < nptr; i++) {
        vals[i] = (unsigned long long)(uintptr_t)ptrs[i];
        params[i] = &vals[i];
    }
    if (extra) params[nptr] = (void *)(uintptr_t)extra;
    CUcontext prev = NULL;
    CUresult rc = L.cuCtxGetCurrent(&prev);
    const char *what = "cuCtxGetCurrent";
    if (rc == 0 && prev != f->ctx) {
        rc = L.cuCtxSetCurrent(f->ctx);
        what = "cuCtxSetCurrent";
    }
    if (rc == 0) {
        rc = L.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, params, NULL);
        what = "launch";
        if (rc == 0 && L.launch_blocking) {
            rc = L.cuStreamSynchronize(stream);
            what = "execution";
        }
    }
    if (prev && prev != f->ctx) L.cuCtxSetCurrent(prev);
    if (vals != vbuf) {
        PyMem_Free(vals);
        PyMem_Free(params);
    }
    if (rc != 0) {
        cu_error(rc, what, f->name);
        return -1;
    }
    return 0;
}

int em_cuda_launch(EmCudaFn *f, char *const *ptrs, uint32_t nptr) {
    if (f->launch.blocks <= 0) return 0;
    return launch_fn(f, f->fn, f->grid, (unsigned)f->launch.block, ptrs, nptr, NULL);
}

int em_cuda_launch_sym(EmCudaFn *f, char *const *ptrs, uint32_t nptr, const EmCudaCall *c) {
    const EmCudaLaunch *l = &f->launch;
    if (c->units <= 0) return 0;
    /* this call's launch shape: the rules of choose_launch (em_codegen_cuda.c) on this call's sizes */
    int32_t block = l->block_dyn ? em_cuda_row_block(c->row) : l->block;
    int64_t per = l->rows_per_block > 0 ? l->rows_per_block : (int64_t)l->vec * block;
    int64_t blocks = (c->units + per - 1) / per;
    int32_t per_sm = l->rows_per_block > 0 ? 2048 / block : l->per_sm;
    CUfunction fn = l->idx64 == 2 && c->reach >= EM_CUDA_IDX32_LIMIT ? f->fn64 : f->fn;
    return launch_fn(f, fn, grid_of(f->device, blocks, block, per_sm), (unsigned)block, ptrs, nptr, c->sv);
}

/* ---------------------------------------------------------------------------------------------- */
/* Python entry points for tests and diagnostics                                                   */
/* ---------------------------------------------------------------------------------------------- */

/* ember._C._nvrtc_compile(source, arch="compute_90") -> bytes (PTX text, or cubin for "sm_XY").
 * RuntimeError with NVRTC's log when it does not compile, or when NVRTC is not found. */
static PyObject *py_nvrtc_compile(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"source", "arch", NULL};
    const char *src, *arch = "compute_90";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|s:_nvrtc_compile", kwlist, &src, &arch)) return NULL;
    load_nvrtc();
    if (!L.libnvrtc) {
        PyErr_Format(PyExc_RuntimeError, "ember: %s", L.nvrtc_why);
        return NULL;
    }
    size_t len = 0;
    char *bin = nvrtc_compile(src, arch, &len);
    if (!bin) return NULL;
    PyObject *r = PyBytes_FromStringAndSize(bin, (Py_ssize_t)len);
    free(bin);
    return r;
}

/* ember._C._cuda_info() -> dict: where NVRTC was found and its version, whether the driver
 * loaded, and why not. Loads NVRTC (and the driver only if load_driver=True). */
static PyObject *py_cuda_info(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"load_driver", NULL};
    int drv = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p:_cuda_info", kwlist, &drv)) return NULL;
    load_nvrtc();
    if (drv) load_cuda();
    int dver = 0;
    if (L.libcuda) L.cuDriverGetVersion(&dver);
    return Py_BuildValue("{s:s,s:s,s:(ii),s:i,s:O,s:s,s:i}", "nvrtc", L.libnvrtc ? L.nvrtc_path : "",
                         "nvrtc_error", L.nvrtc_why ? L.nvrtc_why : "", "nvrtc_version", L.nvrtc_major, L.nvrtc_minor,
                         "nvrtc_max_arch", L.max_arch, "driver", L.libcuda ? Py_True : Py_False, "driver_error",
                         L.cuda_why ? L.cuda_why : "", "driver_version", dver);
}

int em_runtime_cuda_init(PyObject *module) {
    static PyMethodDef defs[] = {
        {"_nvrtc_compile", (PyCFunction)(void (*)(void))py_nvrtc_compile, METH_VARARGS | METH_KEYWORDS,
         "Compiles CUDA C with NVRTC (tests): bytes of PTX, or cubin for arch='sm_XY'."},
        {"_cuda_info", (PyCFunction)(void (*)(void))py_cuda_info, METH_VARARGS | METH_KEYWORDS,
         "Where NVRTC and the CUDA driver were found, versions, or why not."},
        {NULL, NULL, 0, NULL},
    };
    for (PyMethodDef *d = defs; d->ml_name; d++) {
        PyObject *f = PyCFunction_NewEx(d, NULL, NULL);
        if (!f || PyModule_AddObject(module, d->ml_name, f) < 0) {
            Py_XDECREF(f);
            return -1;
        }
    }
    return 0;
}
