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
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A graph's kernels are compiled as at most this many NVRTC programs at once, about
 * EM_NVRTC_KERNELS_PER_PROGRAM kernels each: a program's fixed cost (the prelude, NVRTC's set-up,
 * ~50 ms) against ~35 ms per kernel (H100 host: the transformer's 86-kernel backward, 4.5 s as one
 * program, 0.6 s as 16 at once). */
#define EM_NVRTC_MAX_PROGRAMS 32
#define EM_NVRTC_KERNELS_PER_PROGRAM 4

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
    CUDA_ERROR_NOT_FOUND = 500,
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
    _(cuStreamIsCapturing, CUresult, (CUstream, int *))                                                  \
    _(cuOccupancyMaxActiveBlocksPerMultiprocessor, CUresult, (int *, CUfunction, int, size_t))           \
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
    /* blocks of 2^j threads that fit on an SM at once (registers, shared memory), for fn ([0]) and
     * fn64 ([1]); 0 = not asked yet (fit_per_sm) */
    int32_t fits[2][11];
    char name[32];
};

/* A graph's kernels: one module per NVRTC program they were compiled as (nvrtc_compile_programs) */
typedef struct {
    CUcontext ctx;
    int device;
    int nmod;
    CUmodule mod[]; /* nmod */
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

/* One NVRTC program: source in, binary (cubin for "sm_XY", NUL-terminated PTX for "compute_XY") or
 * the failing call's result and NVRTC's log out. nvrtc_run touches no Python object: the threads
 * of nvrtc_run_all run it without the GIL (NVRTC's API may be called from several threads at once,
 * one program per thread). */
typedef struct {
    char *src;       /* NUL-terminated; freed by nvrtc_job_free when own_src */
    int own_src;
    const char *arch;
    char *bin;       /* malloc'd, len bytes (+ the NUL of PTX) */
    size_t len;
    nvrtcResult rc;  /* 0, or the failing call's result */
    const char *what; /* the failing call, NULL when it compiled */
    char *log;       /* NVRTC's log of a failed compile (at most 6000 bytes) */
    int oom;
} NvrtcJob;

static void nvrtc_run(NvrtcJob *j) {
    nvrtcProgram prog = NULL;
    j->what = "nvrtcCreateProgram";
    if ((j->rc = L.nvrtcCreateProgram(&prog, j->src, "ember_kernels.cu", 0, NULL, NULL)) != 0) return;
    char archopt[64];
    snprintf(archopt, sizeof archopt, "--gpu-architecture=%s", j->arch);
    const char *opts[] = {archopt, "--std=c++17", "-default-device"};
    int cubin = has_prefix(j->arch, "sm_");
    j->what = "nvrtcCompileProgram";
    if ((j->rc = L.nvrtcCompileProgram(prog, 3, opts)) != 0) {
        size_t ln = 0;
        L.nvrtcGetProgramLogSize(prog, &ln);
        if ((j->log = malloc(ln + 1))) {
            j->log[0] = 0;
            L.nvrtcGetProgramLog(prog, j->log);
            j->log[ln] = 0;
            if (ln > 6000) j->log[6000] = 0;
        }
        goto done;
    }
    j->what = cubin ? "nvrtcGetCUBIN" : "nvrtcGetPTX";
    if (cubin && (!L.nvrtcGetCUBINSize || !L.nvrtcGetCUBIN)) {
        j->rc = -1;
        goto done;
    }
    size_t n = 0;
    if ((j->rc = cubin ? L.nvrtcGetCUBINSize(prog, &n) : L.nvrtcGetPTXSize(prog, &n)) != 0) goto done;
    if (!(j->bin = malloc(n + 1))) {
        j->oom = 1;
        goto done;
    }
    if ((j->rc = cubin ? L.nvrtcGetCUBIN(prog, j->bin) : L.nvrtcGetPTX(prog, j->bin)) != 0) {
        free(j->bin);
        j->bin = NULL;
        goto done;
    }
    j->bin[n] = 0;
    j->len = n;
    j->what = NULL;
done:
    L.nvrtcDestroyProgram(&prog);
}

static void *nvrtc_thread(void *j) {
    nvrtc_run(j);
    return NULL;
}

static void nvrtc_job_free(NvrtcJob *j) {
    if (j->own_src) free(j->src);
    free(j->bin);
    free(j->log);
    memset(j, 0, sizeof *j);
}

/* Raises the first failure among jobs[0..n) (-1), 0 when all compiled. */
static int nvrtc_raise(const NvrtcJob *jobs, int n) {
    for (int i = 0; i < n; i++) {
        const NvrtcJob *j = &jobs[i];
        if (j->oom) {
            PyErr_NoMemory();
            return -1;
        }
        if (!j->what) continue;
        if (j->rc == -1) PyErr_SetString(PyExc_RuntimeError, "ember: this NVRTC cannot produce cubin");
        else if (j->log)
            PyErr_Format(PyExc_RuntimeError, "ember: NVRTC %d.%d failed to compile the generated CUDA C for %s: %s\n%s",
                         L.nvrtc_major, L.nvrtc_minor, j->arch, L.nvrtcGetErrorString(j->rc), j->log);
        else PyErr_Format(PyExc_RuntimeError, "ember: %s failed: %s", j->what, L.nvrtcGetErrorString(j->rc));
        return -1;
    }
    return 0;
}

/* Runs jobs[0..n) at once, one thread each (the caller's thread runs the last), without the GIL.
 * A thread that cannot be started runs its job in the caller's thread after the others. */
static void nvrtc_run_all(NvrtcJob *jobs, int n) {
    pthread_t tid[EM_NVRTC_MAX_PROGRAMS];
    int started[EM_NVRTC_MAX_PROGRAMS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i + 1 < n; i++) started[i] = pthread_create(&tid[i], NULL, nvrtc_thread, &jobs[i]) == 0;
    nvrtc_run(&jobs[n - 1]);
    for (int i = 0; i + 1 < n; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else nvrtc_run(&jobs[i]);
    }
    Py_END_ALLOW_THREADS
}

/* Compiles source (NUL-terminated) for arch as one program. Returns a malloc'd binary (PTX is
 * NUL-terminated), NULL with an exception carrying NVRTC's log. */
static char *nvrtc_compile(const char *source, const char *arch, size_t *len) {
    NvrtcJob j = {.src = (char *)source, .arch = arch};
    nvrtc_run_all(&j, 1);
    if (nvrtc_raise(&j, 1) < 0) {
        nvrtc_job_free(&j);
        return NULL;
    }
    char *bin = j.bin;
    *len = j.len;
    j.bin = NULL;
    nvrtc_job_free(&j);
    return bin;
}

/* Offsets of the kernels' first lines in a generated source (EM_CUDA_KERNEL_MARK and a digit at
 * the start of a line, em_codegen.h), at most cap of them (at NULL: only counted). Returns the
 * count. */
static int kernel_starts(const char *src, size_t n, size_t *at, int cap) {
    const size_t ml = strlen(EM_CUDA_KERNEL_MARK);
    int k = 0;
    for (size_t i = 0; i + ml < n && k < cap; i++) {
        if ((i == 0 || src[i - 1] == '\n') && memcmp(src + i, EM_CUDA_KERNEL_MARK, ml) == 0 && src[i + ml] >= '0' &&
            src[i + ml] <= '9') {
            if (at) at[k] = i;
            k++;
        }
    }
    return k;
}

/* The threads a compile may use: ember.config.compile_threads, else the CPUs this process may run
 * on (torch._inductor.config.compile_threads' default, also capped at 32). */
static int compile_threads(void) {
    PyObject *v = em_config_attr("compile_threads");
    long t = v && v != Py_None ? PyLong_AsLong(v) : 0;
    Py_XDECREF(v);
    if (PyErr_Occurred()) PyErr_Clear();
    if (t <= 0) {
        cpu_set_t set;
        t = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    }
    return t < 1 ? 1 : t > EM_NVRTC_MAX_PROGRAMS ? EM_NVRTC_MAX_PROGRAMS : (int)t;
}

/* Compiles a generated source as up to `programs` NVRTC programs at once: the prelude followed by
 * a run of whole kernels of about the same size each (a source without kernel marks: one
 * program). jobs (EM_NVRTC_MAX_PROGRAMS entries) receive the binaries; returns their count, -1 with
 * an exception (NVRTC's log of the first program that failed). The compiled code is the same as
 * one program's: no kernel reads another's text (em_codegen.h, EM_CUDA_KERNEL_MARK). */
static int nvrtc_compile_programs(const char *src, size_t n, const char *arch, int programs, NvrtcJob *jobs) {
    enum { MAXK = 4096 };
    size_t *at = malloc(MAXK * sizeof *at);
    if (!at) return PyErr_NoMemory(), -1;
    int nk = kernel_starts(src, n, at, MAXK);
    if (programs > nk) programs = nk;
    if (programs > EM_NVRTC_MAX_PROGRAMS) programs = EM_NVRTC_MAX_PROGRAMS;
    int np = 0;
    if (programs <= 1 || nk >= MAXK) {
        jobs[np++] = (NvrtcJob){.src = (char *)src, .arch = arch};
    } else {
        /* kernels [first, k) make program np once their bytes reach an equal share of what is left
         * for the programs left, or once as many kernels are left as programs after this one */
        const size_t pre = at[0];
        int first = 0;
        for (int k = 1; k <= nk && np < programs; k++) {
            size_t end = k < nk ? at[k] : n, left = n - at[first];
            int more = programs - np - 1; /* programs after this one */
            if (k < nk && (more == 0 || ((end - at[first]) * (size_t)(more + 1) < left && nk - k > more))) continue;
            size_t len = pre + (end - at[first]);
            char *s = malloc(len + 1);
            if (!s) {
                for (int q = 0; q < np; q++) nvrtc_job_free(&jobs[q]);
                free(at);
                return PyErr_NoMemory(), -1;
            }
            memcpy(s, src, pre);
            memcpy(s + pre, src + at[first], end - at[first]);
            s[len] = 0;
            jobs[np++] = (NvrtcJob){.src = s, .own_src = 1, .arch = arch};
            first = k;
        }
    }
    free(at);
    nvrtc_run_all(jobs, np);
    if (nvrtc_raise(jobs, np) < 0) {
        for (int q = 0; q < np; q++) nvrtc_job_free(&jobs[q]);
        return -1;
    }
    return np;
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
    if (L.libcuda && m->nmod) {
        CUcontext prev = NULL;
        if (L.cuCtxGetCurrent(&prev) == 0 && prev != m->ctx) L.cuCtxSetCurrent(m->ctx);
        for (int i = 0; i < m->nmod; i++)
            if (m->mod[i]) L.cuModuleUnload(m->mod[i]);
        if (prev && prev != m->ctx) L.cuCtxSetCurrent(prev);
    }
    free(m);
}

/* A cache entry of a graph's binaries: "EMNVRTC1", the count n (u64), n lengths (u64), then the
 * binaries one after the other. */
static const char BUNDLE_MAGIC[8] = {'E', 'M', 'N', 'V', 'R', 'T', 'C', '1'};

static char *bundle_pack(const NvrtcJob *jobs, int n, size_t *len) {
    size_t total = 16 + 8 * (size_t)n;
    for (int i = 0; i < n; i++) total += jobs[i].len + 1;
    char *b = malloc(total);
    if (!b) return (char *)PyErr_NoMemory();
    memcpy(b, BUNDLE_MAGIC, 8);
    uint64_t v = (uint64_t)n;
    memcpy(b + 8, &v, 8);
    size_t off = 16 + 8 * (size_t)n;
    for (int i = 0; i < n; i++) {
        v = jobs[i].len + 1; /* with the NUL that ends PTX */
        memcpy(b + 16 + 8 * (size_t)i, &v, 8);
        memcpy(b + off, jobs[i].bin, jobs[i].len + 1);
        off += jobs[i].len + 1;
    }
    *len = total;
    return b;
}

/* The binaries of a bundle: their count (<= EM_NVRTC_MAX_PROGRAMS) with bins[i] pointing into b,
 * 0 when b is not a well-formed bundle (then it is compiled again). */
static int bundle_unpack(const char *b, size_t len, const char **bins) {
    uint64_t n, l;
    if (len < 16 || memcmp(b, BUNDLE_MAGIC, 8) != 0) return 0;
    memcpy(&n, b + 8, 8);
    if (n < 1 || n > EM_NVRTC_MAX_PROGRAMS || len < 16 + 8 * n) return 0;
    size_t off = 16 + 8 * (size_t)n;
    for (uint64_t i = 0; i < n; i++) {
        memcpy(&l, b + 16 + 8 * i, 8);
        if (l < 1 || l > len - off || b[off + l - 1] != 0) return 0;
        bins[i] = b + off;
        off += l;
    }
    return off == len ? (int)n : 0;
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
    const char *ext = has_prefix(arch, "sm_") ? ".cubins" : ".ptxs";
    const char *opt = "--std=c++17 -default-device";
    const void *parts[] = {source, ver, arch, opt};
    size_t lens[] = {srclen, strlen(ver), strlen(arch), strlen(opt)};
    em_cc_key(parts, lens, 4, key_out);
    size_t len = 0;
    const char *bins[EM_NVRTC_MAX_PROGRAMS];
    char *blob = em_cc_blob_get(key_out, ext, &len);
    if (!blob && PyErr_Occurred()) return NULL;
    int n = blob ? bundle_unpack(blob, len, bins) : 0;
    if (n) *was_cached = 1;
    else {
        free(blob);
        /* about EM_NVRTC_KERNELS_PER_PROGRAM kernels per program, at most one program per thread */
        NvrtcJob jobs[EM_NVRTC_MAX_PROGRAMS];
        int want = (kernel_starts(source, srclen, NULL, INT_MAX) + EM_NVRTC_KERNELS_PER_PROGRAM - 1) /
                   EM_NVRTC_KERNELS_PER_PROGRAM;
        int threads = compile_threads();
        int np = nvrtc_compile_programs(source, srclen, arch, want < threads ? want : threads, jobs);
        if (np < 0) return NULL;
        blob = bundle_pack(jobs, np, &len);
        for (int q = 0; q < np; q++) nvrtc_job_free(&jobs[q]);
        if (!blob) return NULL;
        if (em_cc_blob_put(key_out, ext, blob, len, source, srclen, ".cu") < 0) {
            free(blob);
            return NULL;
        }
        n = bundle_unpack(blob, len, bins);
    }
    CudaModule *m = calloc(1, sizeof *m + (size_t)n * sizeof(CUmodule));
    if (!m) {
        free(blob);
        return PyErr_NoMemory();
    }
    m->ctx = L.dev[device].ctx;
    m->device = device;
    CUcontext prev = NULL;
    CUresult rc = L.cuCtxGetCurrent(&prev);
    if (rc == 0 && prev != m->ctx) rc = L.cuCtxSetCurrent(m->ctx);
    for (int i = 0; rc == 0 && i < n; i++)
        if ((rc = L.cuModuleLoadData(&m->mod[i], bins[i])) == 0) m->nmod++;
    free(blob);
    PyObject *cap = rc == 0 ? PyCapsule_New(m, "ember.cumodule", module_close) : NULL;
    if (!cap) {
        for (int i = 0; i < m->nmod; i++) L.cuModuleUnload(m->mod[i]);
        free(m);
        if (rc != 0) cu_error(rc, "cuModuleLoadData", NULL);
    }
    if (prev && prev != L.dev[device].ctx) L.cuCtxSetCurrent(prev);
    return cap;
}

/* The kernel called name in one of m's modules (cuModuleGetFunction's result for the last). */
static CUresult module_function(const CudaModule *m, const char *name, CUfunction *fn) {
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    for (int i = 0; i < m->nmod && rc == CUDA_ERROR_NOT_FOUND; i++) rc = L.cuModuleGetFunction(fn, m->mod[i], name);
    return rc;
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

/* per_sm (the code generator's blocks per SM for a full SM, 2048 threads) capped at the blocks of
 * `block` threads of kernel v (0: fn, 1: fn64) that the device really holds at once, which its
 * registers can make fewer: a grid of 4 blocks of 512 per SM for a kernel of 40 registers a thread
 * (3 fit) ran its last quarter as a second wave, nearly doubling the time (a split variance over
 * 64M floats on the H200). Asked once per kernel and block size (cuOccupancyMaxActiveBlocksPerMultiprocessor). */
static int32_t fit_per_sm(EmCudaFn *f, int v, int32_t block, int32_t per_sm) {
    if (per_sm <= 0 || block <= 0) return per_sm;
    int j = 0;
    while (j < 10 && (1 << j) < block) j++;
    int32_t *fit = &f->fits[v][j];
    if (*fit == 0) { /* in the kernel's context; a failure is not kept (asked again next time) */
        CUcontext prev = NULL;
        int n = 0;
        if (L.cuCtxGetCurrent(&prev) == 0 && (prev == f->ctx || L.cuCtxSetCurrent(f->ctx) == 0)) {
            if (L.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, v ? f->fn64 : f->fn, block, 0) == 0 && n > 0)
                *fit = n;
            if (prev && prev != f->ctx) L.cuCtxSetCurrent(prev);
        }
    }
    return *fit > 0 && *fit < per_sm ? *fit : per_sm;
}

int em_cuda_device_is_current(int device) {
    if (device < 0 || device >= 64 || !L.dev[device].ready) return 0;
    CUcontext c = NULL;
    return L.cuCtxGetCurrent(&c) == 0 && c == L.dev[device].ctx;
}

int em_cuda_fn_device(const EmCudaFn *f) { return f->device; }

int em_cuda_current_stream(int device, void **stream, int *capturing) {
    const char *why = NULL;
    if (device < 0 || device >= 64) {
        PyErr_Format(PyExc_ValueError, "ember: CUDA device %d", device);
        return -1;
    }
    if (!(L.dev[device].ready && L.raw_stream)) { /* the first call for this device */
        if (!em_cuda_available(device, &why)) {
            PyErr_Format(PyExc_RuntimeError, "ember: CUDA is unusable: %s", why);
            return -1;
        }
        if (device_ready(device) < 0) return -1;
    }
    PyObject *d = PyLong_FromLong(device);
    PyObject *s = d ? PyObject_CallOneArg(L.raw_stream, d) : NULL;
    Py_XDECREF(d);
    if (!s) return -1;
    *stream = PyLong_AsVoidPtr(s);
    Py_DECREF(s);
    if (PyErr_Occurred()) return -1;
    int status = 0; /* CUstreamCaptureStatus: NONE 0, ACTIVE 1, INVALIDATED 2 */
    CUresult rc = L.cuStreamIsCapturing((CUstream)*stream, &status);
    if (rc != 0) {
        cu_error(rc, "cuStreamIsCapturing", "the current stream");
        return -1;
    }
    *capturing = status != 0;
    return 0;
}

EmCudaFn *em_cuda_fn_new(PyObject *module, const char *name, const EmCudaLaunch *launch) {
    CudaModule *m = PyCapsule_GetPointer(module, "ember.cumodule");
    if (!m) return NULL;
    EmCudaFn *f = calloc(1, sizeof *f);
    if (!f) return (EmCudaFn *)PyErr_NoMemory();
    CUresult rc = module_function(m, name, &f->fn);
    if (rc != 0) {
        free(f);
        cu_error(rc, "cuModuleGetFunction", name);
        return NULL;
    }
    if (launch->sym && launch->idx64 == 2) {
        char n64[48];
        snprintf(n64, sizeof n64, "%s_64", name);
        rc = module_function(m, n64, &f->fn64);
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
    f->grid = grid_of(m->device, launch->blocks, launch->block, fit_per_sm(f, 0, launch->block, launch->per_sm));
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
    int64_t per = l->rows_per_block > 0 ? l->rows_per_block : (int64_t)l->vec * (l->unroll > 1 ? l->unroll : 1) * block;
    int64_t blocks = (c->units + per - 1) / per;
    if (l->split < 0) /* units: rows */
        blocks = l->cols ? (c->units + l->cols - 1) / l->cols * em_cuda_col_chunks(c->units, c->row, l->threads_per_row)
                         : c->units * em_cuda_split_chunks(c->units, c->row);
    const int v = l->idx64 == 2 && c->reach >= EM_CUDA_IDX32_LIMIT;
    const int32_t per_sm = fit_per_sm(f, v, block, l->rows_per_block > 0 ? 2048 / block : l->per_sm);
    return launch_fn(f, v ? f->fn64 : f->fn, grid_of(f->device, blocks, block, per_sm), (unsigned)block, ptrs, nptr,
                     c->sv);
}

/* ---------------------------------------------------------------------------------------------- */
/* Python entry points for tests and diagnostics                                                   */
/* ---------------------------------------------------------------------------------------------- */

/* ember._C._nvrtc_compile(source, arch="compute_90", programs=None) -> bytes (PTX text, or cubin
 * for "sm_XY"); with programs=n, a list of the binaries of the source compiled as at most n
 * programs at once (each the prelude and a run of whole kernels: what a graph's module is made of).
 * RuntimeError with NVRTC's log when it does not compile, or when NVRTC is not found. */
static PyObject *py_nvrtc_compile(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"source", "arch", "programs", NULL};
    const char *src, *arch = "compute_90";
    Py_ssize_t srclen;
    PyObject *programs = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s#|sO:_nvrtc_compile", kwlist, &src, &srclen, &arch, &programs))
        return NULL;
    long want = programs == Py_None ? 0 : PyLong_AsLong(programs);
    if (want == -1 && PyErr_Occurred()) return NULL;
    load_nvrtc();
    if (!L.libnvrtc) {
        PyErr_Format(PyExc_RuntimeError, "ember: %s", L.nvrtc_why);
        return NULL;
    }
    if (programs == Py_None) {
        size_t len = 0;
        char *bin = nvrtc_compile(src, arch, &len);
        if (!bin) return NULL;
        PyObject *r = PyBytes_FromStringAndSize(bin, (Py_ssize_t)len);
        free(bin);
        return r;
    }
    NvrtcJob jobs[EM_NVRTC_MAX_PROGRAMS];
    int np = nvrtc_compile_programs(src, (size_t)srclen, arch, want < 1 ? 1 : (int)want, jobs);
    if (np < 0) return NULL;
    PyObject *r = PyList_New(np);
    for (int i = 0; r && i < np; i++) {
        PyObject *b = PyBytes_FromStringAndSize(jobs[i].bin, (Py_ssize_t)jobs[i].len);
        if (!b) Py_CLEAR(r);
        else PyList_SET_ITEM(r, i, b);
    }
    for (int i = 0; i < np; i++) nvrtc_job_free(&jobs[i]);
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
         "Compiles CUDA C with NVRTC (tests): bytes of PTX, or cubin for arch='sm_XY'; programs=n: a list, one per program."},
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
