/* runtime cc: the compile driver and its content-addressed on-disk cache. A translation unit is
 * compiled by the system C compiler into <dir>/<key>.so, key = hash(source, compiler identity,
 * flags, CPU), and loaded with dlopen. Invariant: an entry is loaded only if it is a regular
 * file owned by this user, not writable by others, and ends with a trailer whose hash matches its
 * content; anything else is removed and recompiled. Entries appear atomically (temp + rename),
 * so two processes compiling the same key both end with a complete file. */
#include "runtime/em_runtime.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static uint64_t n_compiles = 0, n_disk_hits = 0, n_internal = 0;

void em_cc_note_internal_fallback(void) { n_internal++; }

/* ---- a 128-bit non-cryptographic hash (two FNV-1a 64 lanes); the directory is private, so
 * it only has to separate honest inputs ---- */
typedef struct {
    uint64_t a, b;
} Hash128;

static void h_init(Hash128 *h) {
    h->a = 0xcbf29ce484222325ull;
    h->b = 0x84222325cbf29ce4ull;
}
static void h_update(Hash128 *h, const void *p, size_t n) {
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) {
        h->a = (h->a ^ s[i]) * 0x100000001b3ull;
        h->b = (h->b ^ (unsigned char)(s[i] ^ 0x5c)) * 0x100000001b3ull;
        h->b ^= h->b >> 29;
    }
}
static void h_str(Hash128 *h, const char *s) { h_update(h, s, strlen(s) + 1); }

#define TRAILER_MAGIC "EMBERSO1"
typedef struct {
    uint64_t a, b, len;
    char magic[8];
} Trailer;

/* ---- configuration (ember.config: cc, cflags, cache_dir) ---- */
static PyObject *config_str(const char *name) {
    PyObject *mod = PyImport_ImportModule("ember._config");
    if (!mod) return NULL;
    PyObject *cfg = PyObject_GetAttrString(mod, "config");
    Py_DECREF(mod);
    if (!cfg) return NULL;
    PyObject *v = PyObject_GetAttrString(cfg, name);
    Py_DECREF(cfg);
    if (!v) return NULL;
    if (v == Py_None) return v;
    if (!PyUnicode_Check(v)) {
        PyErr_Format(PyExc_TypeError, "ember.config.%s must be a str", name);
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

/* Finds prog on PATH (or as a path); fills resolved with its real path. -1 when absent. */
static int find_program(const char *prog, char *resolved) {
    char cand[PATH_MAX];
    if (strchr(prog, '/')) return realpath(prog, resolved) && access(resolved, X_OK) == 0 ? 0 : -1;
    const char *path = getenv("PATH");
    if (!path) path = "/usr/local/bin:/usr/bin:/bin";
    while (*path) {
        const char *e = strchr(path, ':');
        size_t len = e ? (size_t)(e - path) : strlen(path);
        if (len && len + strlen(prog) + 2 < sizeof cand) {
            memcpy(cand, path, len);
            cand[len] = '/';
            strcpy(cand + len + 1, prog);
            if (access(cand, X_OK) == 0 && realpath(cand, resolved)) return 0;
        }
        path += len + (e ? 1 : 0);
    }
    return -1;
}

/* The cache directory, created 0700; it must be ours and private. -1 with an exception. */
static int cache_dir(char *out, size_t size) {
    PyObject *v = config_str("cache_dir");
    if (!v) return -1;
    const char *d = v != Py_None ? PyUnicode_AsUTF8(v) : NULL;
    const char *env = getenv("EMBER_CACHE_DIR");
    if (d && *d) snprintf(out, size, "%s", d);
    else if (env && *env) snprintf(out, size, "%s", env);
    else if (getenv("XDG_CACHE_HOME") && *getenv("XDG_CACHE_HOME")) snprintf(out, size, "%s/ember", getenv("XDG_CACHE_HOME"));
    else if (getenv("HOME")) snprintf(out, size, "%s/.cache/ember", getenv("HOME"));
    else snprintf(out, size, "/tmp/ember-%u", (unsigned)geteuid());
    Py_DECREF(v);
    /* parents with default permissions, the directory itself 0700 */
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", out);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, 0755) < 0 && errno != EEXIST) break;
        *p = '/';
    }
    if (mkdir(out, 0700) < 0 && errno != EEXIST) {
        PyErr_Format(PyExc_RuntimeError, "ember: cannot create the compile cache directory %s: %s", out, strerror(errno));
        return -1;
    }
    struct stat st;
    if (lstat(out, &st) < 0 || !S_ISDIR(st.st_mode)) {
        PyErr_Format(PyExc_RuntimeError, "ember: the compile cache %s is not a directory", out);
        return -1;
    }
    if (st.st_uid != geteuid()) {
        PyErr_Format(PyExc_RuntimeError,
                     "ember: the compile cache directory %s belongs to another user; set EMBER_CACHE_DIR or "
                     "ember.config.cache_dir to a directory of your own",
                     out);
        return -1;
    }
    if ((st.st_mode & 077) && chmod(out, 0700) < 0) {
        PyErr_Format(PyExc_RuntimeError, "ember: cannot make the compile cache %s private: %s", out, strerror(errno));
        return -1;
    }
    return 0;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 65536;
            char *q = realloc(buf, cap + 1);
            if (!q) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = q;
        }
        size_t k = fread(buf + n, 1, cap - n, f);
        n += k;
        if (k == 0) break;
    }
    fclose(f);
    buf[n] = 0;
    *len = n;
    return buf;
}

/* Is path a trustworthy cache entry? */
static int entry_valid(const char *path) {
    struct stat st;
    if (lstat(path, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 022)) return 0;
    size_t len;
    char *buf = read_file(path, &len);
    if (!buf) return 0;
    int ok = 0;
    if (len > sizeof(Trailer)) {
        Trailer t;
        memcpy(&t, buf + len - sizeof t, sizeof t);
        Hash128 h;
        h_init(&h);
        h_update(&h, buf, len - sizeof t);
        ok = memcmp(t.magic, TRAILER_MAGIC, 8) == 0 && t.len == len - sizeof t && t.a == h.a && t.b == h.b;
    }
    free(buf);
    return ok;
}

static int write_all(int fd, const void *p, size_t n) {
    const char *s = p;
    while (n) {
        ssize_t k = write(fd, s, n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        s += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Splits flags on spaces into argv (modifies buf). */
static int split_flags(char *buf, char **argv, int max) {
    int n = 0;
    for (char *p = strtok(buf, " \t\n"); p && n < max; p = strtok(NULL, " \t\n")) argv[n++] = p;
    return n;
}

static char cpu_id[256];

static const char *cpu_identity(void) {
    if (cpu_id[0]) return cpu_id;
    size_t len;
    char *s = read_file("/proc/cpuinfo", &len);
    Hash128 h;
    h_init(&h);
    if (s) {
        /* model name and flags of the first CPU: -march=native code depends on them */
        char *end = strstr(s, "\n\n");
        h_update(&h, s, end ? (size_t)(end - s) : len);
        free(s);
    }
    snprintf(cpu_id, sizeof cpu_id, "%016llx%016llx", (unsigned long long)h.a, (unsigned long long)h.b);
    return cpu_id;
}

/* Libraries this process has loaded, by key, each holding one dlopen reference of its own: a graph
 * compiled again (after ember.reset, or for a new guard set) finds its kernels mapped already and
 * takes a reference with RTLD_NOLOAD instead of reading, verifying and mapping the file again. The
 * key names the content (source, compiler, flags, CPU), so a loaded library stays right for its key
 * whatever later happens to the file. Called with the GIL held. */
typedef struct {
    char key[33];
    char *path;
    void *handle;
} LoadedLib;
static LoadedLib *loaded;
static size_t nloaded, caploaded;

static void *loaded_take(const char *key) {
    for (size_t i = 0; i < nloaded; i++)
        if (memcmp(loaded[i].key, key, 33) == 0) {
            void *h = dlopen(loaded[i].path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
            if (h == loaded[i].handle) return h;
            if (h) dlclose(h);
            return NULL;
        }
    return NULL;
}

/* Keeps a reference to handle (loaded from path) for later loads of key; best effort. */
static void loaded_keep(const char *key, const char *path, void *handle) {
    if (nloaded == caploaded) {
        size_t cap = caploaded ? 2 * caploaded : 32;
        LoadedLib *n = realloc(loaded, cap * sizeof *n);
        if (!n) return;
        loaded = n;
        caploaded = cap;
    }
    char *p = strdup(path);
    void *h = p ? dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD) : NULL;
    if (h != handle) {
        if (h) dlclose(h);
        free(p);
        return;
    }
    memcpy(loaded[nloaded].key, key, 33);
    loaded[nloaded].path = p;
    loaded[nloaded].handle = h;
    nloaded++;
}

/* One compile: the configuration read for it, its key and its entry's path. */
typedef struct {
    PyObject *ccv, *flagsv, *ldv;
    const char *cc, *flags, *ld;
    char ccpath[PATH_MAX], dir[PATH_MAX], path[PATH_MAX + 64];
    char key[33];
} CcJob;

/* A compiler process started by em_cc_start and not waited for yet. */
typedef struct {
    char key[33];
    pid_t pid;
    int spawn_rc;
    char tmp[PATH_MAX + 96], logp[PATH_MAX + 96], cpath[PATH_MAX + 64];
} CcRun;
static CcRun **pending;
static size_t npending, cappending;

static void job_clear(CcJob *j) {
    Py_CLEAR(j->ccv);
    Py_CLEAR(j->flagsv);
    Py_CLEAR(j->ldv);
}

/* Reads the configuration, finds the compiler and computes the key. -1 with an exception. */
static int job_setup(CcJob *j, const char *source, size_t srclen) {
    memset(j, 0, sizeof *j);
    j->ccv = config_str("cc");
    j->flagsv = config_str("cflags");
    j->ldv = config_str("ldflags");
    if (!j->ccv || !j->flagsv || !j->ldv) return -1;
    j->cc = j->ccv != Py_None ? PyUnicode_AsUTF8(j->ccv) : NULL;
    if (!j->cc || !*j->cc) j->cc = getenv("CC") && *getenv("CC") ? getenv("CC") : "cc";
    j->flags = j->flagsv != Py_None ? PyUnicode_AsUTF8(j->flagsv) : "";
    j->ld = j->ldv != Py_None ? PyUnicode_AsUTF8(j->ldv) : NULL;
    if (!j->flags || (j->ldv != Py_None && !j->ld)) return -1;
    if (find_program(j->cc, j->ccpath) < 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "ember: backend \"ember\" needs a C compiler, and %s was not found (set ember.config.cc or $CC); "
                     "backend=\"eager\" needs none",
                     j->cc);
        return -1;
    }
    struct stat st;
    if (stat(j->ccpath, &st) < 0) {
        PyErr_Format(PyExc_RuntimeError, "ember: cannot stat the C compiler %s", j->ccpath);
        return -1;
    }
    /* the key: source, compiler identity (path, size, mtime: no compiler call), flags, CPU */
    Hash128 h;
    h_init(&h);
    h_update(&h, source, srclen);
    h_str(&h, j->ccpath);
    h_update(&h, &st.st_size, sizeof st.st_size);
    h_update(&h, &st.st_mtime, sizeof st.st_mtime);
    h_str(&h, j->flags);
    if (j->ld) h_str(&h, j->ld);
    h_str(&h, cpu_identity());
    snprintf(j->key, 33, "%016llx%016llx", (unsigned long long)h.a, (unsigned long long)h.b);
    if (cache_dir(j->dir, sizeof j->dir) < 0) return -1;
    snprintf(j->path, sizeof j->path, "%s/%s.so", j->dir, j->key);
    return 0;
}

/* The entry already mapped by this process or valid on disk, loaded; NULL (no exception) when there
 * is none (a corrupt, truncated, foreign or unloadable one is removed). */
static void *job_cached(CcJob *j) {
    void *handle = loaded_take(j->key);
    if (handle) return handle;
    if (entry_valid(j->path)) {
        handle = dlopen(j->path, RTLD_NOW | RTLD_LOCAL);
        if (handle) {
            loaded_keep(j->key, j->path, handle);
            return handle;
        }
    }
    unlink(j->path);
    return NULL;
}

/* Writes the source next to the entry and starts the compiler into a temporary file. -1 with an
 * exception (the source could not be written); a failed spawn is reported by job_finish. */
static int job_spawn(CcJob *j, const char *source, size_t srclen, CcRun *r) {
    static unsigned counter = 0;
    counter++;
    memcpy(r->key, j->key, 33);
    snprintf(r->cpath, sizeof r->cpath, "%s/%s.c", j->dir, j->key);
    snprintf(r->tmp, sizeof r->tmp, "%s/tmp-%s-%d-%u.so", j->dir, j->key, (int)getpid(), counter);
    snprintf(r->logp, sizeof r->logp, "%s/tmp-%s-%d-%u.log", j->dir, j->key, (int)getpid(), counter);
    {
        /* the readable source next to the entry (written atomically too) */
        char ctmp[PATH_MAX + 96];
        snprintf(ctmp, sizeof ctmp, "%s/tmp-%s-%d-%u.c", j->dir, j->key, (int)getpid(), counter);
        int fd = open(ctmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || write_all(fd, source, srclen) < 0 || close(fd) < 0 || rename(ctmp, r->cpath) < 0) {
            PyErr_Format(PyExc_RuntimeError, "ember: cannot write %s: %s", ctmp, strerror(errno));
            unlink(ctmp);
            return -1;
        }
    }
    char *flagbuf = strdup(j->flags), *ldflags = j->ld ? strdup(j->ld) : NULL;
    if (!flagbuf || (j->ld && !ldflags)) {
        free(flagbuf);
        free(ldflags);
        PyErr_NoMemory();
        return -1;
    }
    char *argv[80];
    int argc = 0;
    argv[argc++] = (char *)j->cc;
    argc += split_flags(flagbuf, argv + argc, 70);
    argv[argc++] = "-o";
    argv[argc++] = r->tmp;
    argv[argc++] = r->cpath;
    if (ldflags) argc += split_flags(ldflags, argv + argc, 76 - argc);
    argv[argc] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, r->logp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 2, 1);
    r->spawn_rc = posix_spawn(&r->pid, j->ccpath, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    free(flagbuf);
    free(ldflags);
    n_compiles++;
    return 0;
}

/* Waits for the compiler, appends the trailer, publishes the entry atomically. 0, or -1 with an
 * exception naming the compiler's log. */
static int run_finish(const CcRun *r, const char *cc, const char *flags, const char *path) {
    int status = 0;
    if (r->spawn_rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        while (waitpid(r->pid, &status, 0) < 0 && errno == EINTR) {
        }
        Py_END_ALLOW_THREADS
    }
    if (r->spawn_rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        size_t ln = 0;
        char *log = read_file(r->logp, &ln);
        if (log && ln > 4000) log[4000] = 0;
        PyErr_Format(PyExc_RuntimeError, "ember: the C compiler failed (%s %s, source %s):\n%s", cc, flags, r->cpath,
                     r->spawn_rc != 0 ? strerror(r->spawn_rc) : log ? log : "(no output)");
        free(log);
        unlink(r->tmp);
        unlink(r->logp);
        return -1;
    }
    unlink(r->logp);
    /* append the trailer, then publish */
    size_t len;
    char *buf = read_file(r->tmp, &len);
    if (!buf) {
        PyErr_Format(PyExc_RuntimeError, "ember: cannot read %s", r->tmp);
        unlink(r->tmp);
        return -1;
    }
    Hash128 th;
    h_init(&th);
    h_update(&th, buf, len);
    free(buf);
    Trailer t = {th.a, th.b, len, {0}};
    memcpy(t.magic, TRAILER_MAGIC, 8);
    int fd = open(r->tmp, O_WRONLY | O_APPEND);
    if (fd < 0 || write_all(fd, &t, sizeof t) < 0 || fchmod(fd, 0600) < 0 || close(fd) < 0 || rename(r->tmp, path) < 0) {
        PyErr_Format(PyExc_RuntimeError, "ember: cannot publish %s: %s", path, strerror(errno));
        unlink(r->tmp);
        return -1;
    }
    return 0;
}

/* The started compile of key, taken out of the pending list (NULL: none). */
static CcRun *pending_take(const char *key) {
    for (size_t i = 0; i < npending; i++)
        if (memcmp(pending[i]->key, key, 33) == 0) {
            CcRun *r = pending[i];
            pending[i] = pending[--npending];
            return r;
        }
    return NULL;
}

/* Compiles (or finds in the cache, or waits for the compile em_cc_start began) source and dlopens
 * it. Returns the handle, NULL with an exception. *key_out (33 bytes) receives the cache key. */
void *em_cc_load(const char *source, size_t srclen, char *key_out, int *was_cached) {
    CcJob j;
    void *handle = NULL;
    *was_cached = 0;
    if (job_setup(&j, source, srclen) < 0) goto done;
    memcpy(key_out, j.key, 33);
    CcRun *r = pending_take(j.key);
    if (!r && (handle = job_cached(&j))) {
        *was_cached = 1;
        n_disk_hits++;
        goto done;
    }
    CcRun local;
    if (!r) {
        if (job_spawn(&j, source, srclen, &local) < 0) goto done;
        r = &local;
    }
    int rc = run_finish(r, j.cc, j.flags, j.path);
    if (r != &local) free(r);
    if (rc < 0) goto done;
    handle = dlopen(j.path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) PyErr_Format(PyExc_RuntimeError, "ember: dlopen(%s) failed: %s", j.path, dlerror());
    else loaded_keep(j.key, j.path, handle);
done:
    job_clear(&j);
    return handle;
}

/* Starts compiling source in the background when it is not in the cache (nor started already):
 * em_cc_load of the same source then waits for that compiler process instead of starting one, so
 * that the two graphs of a training region compile at once. Best effort: never raises. */
void em_cc_start(const char *source, size_t srclen) {
    CcJob j;
    CcRun *r = NULL;
    if (job_setup(&j, source, srclen) < 0) goto done;
    for (size_t i = 0; i < npending; i++)
        if (memcmp(pending[i]->key, j.key, 33) == 0) goto done;
    void *mapped = loaded_take(j.key);
    if (mapped) dlclose(mapped); /* (loaded_take's dlopen counted one more reference) */
    if (mapped || entry_valid(j.path)) goto done;
    if (npending == cappending) {
        size_t cap = cappending ? 2 * cappending : 8;
        CcRun **n = realloc(pending, cap * sizeof *n);
        if (!n) goto done;
        pending = n;
        cappending = cap;
    }
    r = malloc(sizeof *r);
    if (!r || job_spawn(&j, source, srclen, r) < 0) goto done;
    pending[npending++] = r;
    r = NULL;
done:
    free(r);
    job_clear(&j);
    PyErr_Clear();
}

/* Waits for every compile em_cc_start began that nothing loaded (its entry is published, or its
 * files removed when it failed). Never raises. */
void em_cc_drain(void) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    while (npending) {
        CcRun *r = pending[--npending];
        char dir[PATH_MAX], path[PATH_MAX + 64];
        if (cache_dir(dir, sizeof dir) == 0) {
            snprintf(path, sizeof path, "%s/%s.so", dir, r->key);
            run_finish(r, "cc", "", path);
        }
        free(r);
        PyErr_Clear();
    }
    PyErr_Restore(et, ev, tb);
}

/* ember._C._cc_stats() -> {"compiles": n, "disk_hits": n, "internal_fallbacks": n} for this
 * process (disk_hits: libraries loaded with no compiler call, from the cache directory or already
 * mapped by this process; internal_fallbacks: graphs backend "ember" handed to the eager backend
 * after an internal failure). */
PyObject *em_cc_stats(PyObject *self, PyObject *noargs) {
    return Py_BuildValue("{s:K,s:K,s:K}", "compiles", (unsigned long long)n_compiles, "disk_hits",
                         (unsigned long long)n_disk_hits, "internal_fallbacks", (unsigned long long)n_internal);
}

/* ---- content-addressed blobs for other compilers (CUDA binaries from NVRTC, em_runtime_cuda.c):
 * <dir>/<key><ext>, with the same ownership/permission checks and content trailer as the .so
 * entries, published by temp + rename. ---- */

void em_cc_key(const void *const *parts, const size_t *lens, int n, char *key_out) {
    Hash128 h;
    h_init(&h);
    for (int i = 0; i < n; i++) {
        h_update(&h, parts[i], lens[i]);
        h_update(&h, "\0", 1);
    }
    snprintf(key_out, 33, "%016llx%016llx", (unsigned long long)h.a, (unsigned long long)h.b);
}

char *em_cc_blob_get(const char *key, const char *ext, size_t *len) {
    char dir[PATH_MAX], path[PATH_MAX + 64];
    if (cache_dir(dir, sizeof dir) < 0) return NULL;
    snprintf(path, sizeof path, "%s/%s%s", dir, key, ext);
    if (!entry_valid(path)) {
        unlink(path);
        return NULL;
    }
    size_t n;
    char *buf = read_file(path, &n);
    if (!buf || n <= sizeof(Trailer)) {
        free(buf);
        return NULL;
    }
    *len = n - sizeof(Trailer);
    n_disk_hits++;
    return buf;
}

int em_cc_blob_put(const char *key, const char *ext, const void *data, size_t len, const char *source, size_t srclen,
                   const char *src_ext) {
    char dir[PATH_MAX], path[PATH_MAX + 64], tmp[PATH_MAX + 96];
    static unsigned counter = 0;
    if (cache_dir(dir, sizeof dir) < 0) return -1;
    counter++;
    if (source) {
        snprintf(path, sizeof path, "%s/%s%s", dir, key, src_ext);
        snprintf(tmp, sizeof tmp, "%s/tmp-%s-%d-%u%s", dir, key, (int)getpid(), counter, src_ext);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || write_all(fd, source, srclen) < 0 || close(fd) < 0 || rename(tmp, path) < 0) unlink(tmp);
    }
    snprintf(path, sizeof path, "%s/%s%s", dir, key, ext);
    snprintf(tmp, sizeof tmp, "%s/tmp-%s-%d-%u%s", dir, key, (int)getpid(), counter, ext);
    Hash128 th;
    h_init(&th);
    h_update(&th, data, len);
    Trailer t = {th.a, th.b, len, {0}};
    memcpy(t.magic, TRAILER_MAGIC, 8);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int ok = fd >= 0 && write_all(fd, data, len) == 0 && write_all(fd, &t, sizeof t) == 0;
    if (fd >= 0 && close(fd) < 0) ok = 0;
    if (!ok || rename(tmp, path) < 0) {
        unlink(tmp);
        PyErr_Format(PyExc_RuntimeError, "ember: cannot write the cache entry %s: %s", path, strerror(errno));
        return -1;
    }
    n_compiles++;
    return 0;
}
