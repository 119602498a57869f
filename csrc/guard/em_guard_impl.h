/* guard, private: the layouts shared by em_guard.c (builder, build, check), em_guard_tensor.c
 * (tensor match) and em_guard_render.c (text). Only the guard stage includes this file.
 * Invariant: a GuardSet is one malloc block; every PyObject pointer inside it is a strong
 * reference listed exactly once in gs->held, and em_guard_set_free releases that list. */
#ifndef EM_GUARD_IMPL_H
#define EM_GUARD_IMPL_H

#include "guard/em_guard.h"

/* ---- sources: how a value is reached from the frame ---- */
typedef enum {
    SRC_LOCAL,     /* fv->locals[index]; key = the local's name (rendering only, may be NULL) */
    SRC_GLOBAL,    /* fv->globals[key] */
    SRC_BUILTIN,   /* fv->builtins[key], and key not in fv->globals (LOAD_GLOBAL semantics) */
    SRC_CLOSURE,   /* contents of cell fv->closure[index]; key = the free variable's name */
    SRC_ATTR,      /* getattr(parent, key) */
    SRC_ITEM,      /* parent[index] (list/tuple) */
    SRC_DICT_ITEM, /* parent[key]; index 1: dict.__getitem__(parent, key), the dict part of a dict
                      subclass read without its Python __getitem__ */
    SRC_CELL,      /* the cell fv->closure[index] itself (a `nonlocal` store's target); key = name */
    SRC_CONST,     /* an object the set holds, always stable: a list or dict reached through guarded
                      constants (a class attribute), whose contents its children's guards check;
                      index = its address (identity), key = its type's name (rendering only) */
    SRC_CONVERT,   /* key(parent): the parent converted by the callable key, called on every check
                      (torch.from_numpy of a NumPy array input, whose tensor the graph takes) */
} SrcKind;

/* The part of a source that names the path; shared by builder and guard set so that one renderer
 * serves both. */
typedef struct EmSrcDesc {
    int32_t parent; /* -1 for frame roots */
    uint8_t kind;   /* SrcKind */
    Py_ssize_t index;
    PyObject *key;
} EmSrcDesc;

/* Renders source s of a table whose entries (each starting with an EmSrcDesc) lie stride bytes
 * apart: "L['x']", "G['torch']", "B['len']", "L['self'].fs[3]", "L['d']['k']". New str. */
PyObject *em_guard_render_src(const void *table, size_t stride, int32_t s);

/* ---- leaf kinds, in evaluation order (cheapest and most selective first). The set sorts its
 * leaves by this rank (stable), so every DICT_VERSION leaf comes first: the 3.12 watcher epoch
 * can then skip the whole group with one compare. ---- */
#define EM_GUARD_KINDS(_)  \
    _(DICT_VERSION)        \
    _(TYPE_VERSION)        \
    _(ID_MATCH)            \
    _(TYPE_MATCH)          \
    _(EQUALS)              \
    _(LEN)                 \
    _(DICT_KEYS)           \
    _(GLOBAL_STATE)        \
    _(SDP_FLAGS)           \
    _(TENSOR_MATCH)        \
    _(NO_OVERLAP)          \
    _(SYM)

typedef enum {
#define EM_GUARD_KIND_ENUM(name) GUARD_##name,
    EM_GUARD_KINDS(EM_GUARD_KIND_ENUM)
#undef EM_GUARD_KIND_ENUM
        GUARD__COUNT
} GuardKind;

/* ---- DLPack: the minimal layout ember needs, copied from DLPack v1.3
 * (torch/include/ATen/dlpack.h: DLDevice, DLDataType, DLTensor, DLPackExchangeAPIHeader,
 * DLPackExchangeAPI; DLPACK_MAJOR_VERSION 1, DLPACK_MINOR_VERSION 3). ember never includes torch
 * headers nor links libtorch: torch hands out this table as the PyCapsule
 * torch.Tensor.__dlpack_c_exchange_api__ named "dlpack_exchange_api". ---- */
typedef struct {
    int32_t device_type; /* DLDeviceType: kDLCPU = 1, kDLCUDA = 2, ... (a C enum, int-sized) */
    int32_t device_id;
} EmDLDevice;

typedef struct {
    uint8_t code; /* DLDataTypeCode: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6 */
    uint8_t bits;
    uint16_t lanes;
} EmDLDataType;

enum { EM_DL_INT = 0, EM_DL_UINT = 1, EM_DL_COMPLEX = 5 };

typedef struct {
    void *data;
    EmDLDevice device;
    int32_t ndim;
    EmDLDataType dtype;
    int64_t *shape;   /* ndim entries; may be NULL when ndim == 0 */
    int64_t *strides; /* in elements; may be NULL when ndim == 0 */
    uint64_t byte_offset;
} EmDLTensor;

typedef struct EmDLPackAPIHeader {
    struct {
        uint32_t major, minor;
    } version;
    struct EmDLPackAPIHeader *prev_api;
} EmDLPackAPIHeader;

typedef struct EmDLPackAPI {
    EmDLPackAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    /* 0 on success; -1 with a Python exception set (sparse, meta, quantized, bit dtypes). */
    int (*dltensor_from_py_object_no_sync)(void *py_object, EmDLTensor *out);
    void *current_work_stream;
} EmDLPackAPI;

/* ---- TENSOR_MATCH expectation, recorded at compile time with the same path that checks it.
 * dims points at 2*ndim int64 right after the struct: sizes, then strides. ---- */
typedef struct EmTensorMeta {
    const EmDLPackAPI *api; /* NULL: read attributes (older torch, or DLPack refused this tensor) */
    int32_t ndim;
    EmDLDataType dtype;
    EmDLDevice device;
    uint8_t requires_grad;
    uint8_t check_dtype_obj; /* DLPack: also compare v.dtype (int1..int8 share {kDLInt, 8, 1}) */
    uint8_t check_conj;      /* complex dtype: compare is_conj() / is_neg() */
    uint8_t conj, neg;
    PyObject *dtype_obj;  /* torch.dtype: rendering, attribute path, 8-bit ints */
    PyObject *device_obj; /* torch.device: rendering, attribute path */
    PyObject *layout_obj; /* torch.layout: attribute path only (DLPack describes strided tensors only) */
    int64_t *dims;
    uint64_t dynmask;     /* dims whose size is symbolic (not compared here: the SYM leaf checks
                             them); then strides must be those of a dense tensor in dim order
                             `order` (innermost first), as the traced example's were */
    int8_t order[32];
} EmTensorMeta;

/* The DLPack table of a tensor type, or NULL (no exception). */
const EmDLPackAPI *em_guard_dlpack_api(PyTypeObject *tp);
/* v.size(dim) through api (NULL: attribute path). 0, or -1 (no exception left). */
int em_guard_tensor_size(const EmDLPackAPI *api, PyObject *v, int dim, int64_t *out);

/* The NO_OVERLAP leaf: the memory of tensors src[0..nmut) (inputs the graph updates in place)
 * overlaps no other tensor of src[0..n) (set sources), by [first byte, last byte] ranges from
 * DLPack: the lowering then keeps such an update an extern call whose result later kernels read
 * (em_lower.c, input_update_read_later). Lives in the set's block. */
typedef struct GOverlap {
    uint32_t n, nmut;
    int32_t src[];
} GOverlap;

/* The SYM leaf (one per set, owned by GuardSet.sym): the symbols' sizes are read from their
 * tensors (src remapped to the set's sources, dim, DLPack table) into an array on the stack and
 * the compiled program checks every relation the trace relied on (csrc/sym, em_sym_prog_check). */
typedef struct GSymInfo {
    struct SymProg *prog;
    uint32_t n;
    int32_t *src;
    int32_t *dim;
    const EmDLPackAPI **api;
    PyObject *lines; /* list of str: the relations as Python (strong) */
} GSymInfo;

/* Records t. The meta and its dims live in arena a; its objects are held by the arena.
 * NULL with an exception if t is not a tensor that can be described (e.g. sparse). */
EmTensorMeta *em_guard_tensor_record(EmArena *a, PyObject *t);
size_t em_guard_tensor_meta_size(const EmTensorMeta *m);
/* Copies m into dst (em_guard_tensor_meta_size(m) bytes, 8-aligned); dims are re-pointed. The
 * object pointers are copied as is: the caller takes references for the set. */
EmTensorMeta *em_guard_tensor_meta_copy(const EmTensorMeta *m, void *dst);
/* 1 if v (whose exact type the caller already checked) matches m, else 0. Never leaves an
 * exception set. */
int em_guard_tensor_check(const EmTensorMeta *m, PyObject *v);
/* "check_tensor(<src>, torch.float32, device='cpu', size=[2, 3], stride=[3, 1], requires_grad=False)". */
PyObject *em_guard_tensor_render(const EmTensorMeta *m, PyTypeObject *tp, PyObject *src_text);

/* ---- the compact guard set ---- */
typedef struct GSrc {
    EmSrcDesc d;     /* key is strong */
    PyObject *value; /* stable source: the compile-time object (strong); else NULL */
} GSrc;

/* EQUALS fast paths, chosen at build time from the expected constant. */
enum { EQ_NONE, EQ_BOOL, EQ_INT, EQ_FLOAT, EQ_STR, EQ_OTHER };

/* DICT_VERSION detail: the dict's name for rendering and the content the trace relied on. A keyed
 * leaf (em_guard_dict_key) keeps the keys read and the objects they held (NULL: absent); a whole
 * leaf (em_guard_dict_version: iteration, a hook dict being empty) keeps every item in iteration
 * order. The version tag is only the fast path: when it moved, this content is compared. */
typedef struct GDictInfo {
    int32_t owner;   /* the dict's name: source owner's text followed by how; how alone if owner < 0 */
    const char *how;
    uint32_t nkeys; /* pairs in kv */
    uint8_t whole;  /* 1: kv is the whole content, in order; 0: the keys read */
    PyObject **kv;  /* key0, value0, key1, value1, ... (strong) */
} GDictInfo;

/* The dict group's fast path, packed so that the steady state is one tight loop of loads and
 * compares (3.11 has no dict watchers): slot i belongs to leaf i. */
typedef struct GDictSlot {
    PyObject *dict; /* = leaf[i].obj */
    uint64_t tag;   /* the version last seen with the recorded content, or EM_DICT_TAG_UNSEEN */
} GDictSlot;
/* A slot tag no dict has (dict tags keep their low 8 watcher bits clear, em_guard.c dict_tag): the
 * dict's stores may not move its tag (an instance __dict__ sharing inline values where
 * em_guard_state.inline_tag_unseen), so its content is compared whenever its group is walked. */
#define EM_DICT_TAG_UNSEEN ((uint64_t)1)

typedef struct GLeaf {
    uint8_t kind;   /* GuardKind */
    uint8_t sub;    /* EQUALS: EQ_*; GLOBAL_STATE: bit 0 grad, bit 1 autocast cpu, bit 2 autocast cuda, bits
                     * 3-4 / 5-6 the cpu / cuda autocast dtype when on (AC_DT_*); SDP_FLAGS: which
                     * scaled_dot_product_attention backends are enabled (em_guard.c, sdp_flags_read) */
    int32_t src;    /* -1 for DICT_VERSION, TYPE_VERSION, GLOBAL_STATE, SDP_FLAGS */
    PyObject *obj;  /* strong. TYPE_MATCH, LEN, TENSOR_MATCH, TYPE_VERSION: the type; ID_MATCH: the
                       object; EQUALS: the constant; DICT_KEYS: tuple of keys; DICT_VERSION: the
                       dict; GLOBAL_STATE: the default dtype */
    uint64_t tag;   /* TYPE_VERSION: version (moved forward when the snapshot still matches; 0: the
                       type has no tag, the snapshot is compared at every check); LEN: length.
                       DICT_VERSION keeps its tag in GuardSet.dslot */
    const void *aux; /* DICT_VERSION: GDictInfo *; DICT_KEYS: the exact type; TYPE_VERSION: snapshot
                        (mro, dict copies, resolution) re-verified when the tag changed;
                        TENSOR_MATCH: EmTensorMeta * */
} GLeaf;

struct GuardSet {
    uint32_t nsrc, nleaf, nfetch, nheld;
    uint32_t ndict;       /* leaves [0, ndict) are DICT_VERSION */
    uint64_t dict_epoch;  /* epoch (3.12: dict watcher; 3.11: probe of the global dict version
                             counter) at which the DICT_VERSION group last passed */
    uint32_t ndict_unseen; /* DICT_VERSION slots whose stores the watchers may miss: never skipped */
    GSrc *src;
    GLeaf *leaf;
    GDictSlot *dslot;     /* ndict slots, one per DICT_VERSION leaf */
    int32_t *fetch;       /* fetch slot -> source */
    PyObject **held;
    GSymInfo *sym;        /* the SYM leaf's detail (malloc), or NULL */
    /* A check's values of the sources (all NULL between checks) and the sources it resolved: a
     * check costs what it reads, not the number of sources (516 for a ModuleList of 100 modules,
     * most of them read only by the dict group). A check nested in one of the same set (a guard read
     * running Python that enters the same code) allocates its own (scratch_busy). */
    PyObject **scratch;
    int32_t *scratch_set;
    uint8_t scratch_busy;
};

/* ---- process-wide state of the guard stage. ember supports one interpreter (em_module.c),
 * so this is per-interpreter state; em_guard_init fills it, em_guard_fini clears it. ---- */
#define EM_SDP_FLAGS 5 /* the flags GUARD_SDP_FLAGS reads (em_guard.c, sdp_flags_read) */

typedef struct EmGuardState {
    int torch_ready;
    PyTypeObject *tensor_type;   /* torch.Tensor */
    PyObject *is_grad_enabled;   /* torch.is_grad_enabled */
    PyObject *is_autocast_enabled; /* torch.is_autocast_enabled(device_type) (torch >= 2.4) */
    PyObject *is_any_autocast_enabled; /* torch._C._is_any_autocast_enabled, or NULL */
    PyObject *get_default_dtype; /* torch.get_default_dtype */
    PyObject *get_autocast_dtype; /* torch.get_autocast_dtype(device_type) (torch >= 2.4) */
    PyObject *sdp_enabled[EM_SDP_FLAGS]; /* torch._C._get_{flash,mem_efficient,math,cudnn}_sdp_enabled and
                                          * _get_math_sdp_allow_fp16_bf16_reduction (NULL: not read yet) */
    PyObject *dt_float16, *dt_bfloat16; /* torch.float16, torch.bfloat16 */
    PyObject *str_cpu, *str_cuda;
    PyObject *s_requires_grad, *s_is_conj, *s_is_neg, *s_shape, *s_stride, *s_dtype, *s_device, *s_layout,
        *s_dlpack_api, *s_data_ptr, *s_module, *s_qualname;
    int watcher_id;              /* 3.12 dict watcher, -1 if none */
    /* 3.13: a store through an object's inline values does not move its __dict__'s tag / does not
     * fire the dict watchers (both on 3.13.0, gh-125608): found by trying it at init (em_guard.c,
     * probe_inline_values) */
    int inline_tag_unseen, inline_watch_unseen;
    uint64_t dict_epoch;         /* 3.12: bumped on every event of a watched dict; 3.11: bumped
                                    when the probe saw another dict change (em_guard.c) */
    PyObject *probe_dict;        /* 3.11: the private dict whose tag reads the global counter */
    uint64_t probe_last;
    int probe_flip;
    uint64_t group_walks, group_skips; /* dict groups compared slot by slot / passed at once
                                          (ember._C._guard_stats) */
    uint64_t window_gen;         /* 3.11: bumped by every guard check and window opening: a nested
                                    one closes the window around a graph callable (em_guard.h) */
} EmGuardState;

extern EmGuardState em_guard_state;

/* Imports torch and resolves the callables and the tensor type (compile time only).
 * 0, or -1 with an exception. */
int em_guard_torch_ready(void);

/* Python text of a type: "torch.Tensor", "int", "mymod.Mod". New str. */
PyObject *em_guard_type_text(PyTypeObject *tp);

#endif /* EM_GUARD_IMPL_H */
