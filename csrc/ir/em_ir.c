/* ir: building the tensor graph — node array, fx-style unique names, the op table and its
 * lookups, tensor metadata, dead-code elimination and user counts.
 * Invariant: nodes are appended in topological order (every argument of node i refers to a node
 * below i) and keep it through DCE, which only deletes and renumbers. */
#include "ir/em_ir.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* The op table                                                                               */
/* ------------------------------------------------------------------------------------------ */

static const char *const op_pynames[] = {
#define IR_OP_NAME(name, py, cat) py,
    IR_OPS(IR_OP_NAME)
#undef IR_OP_NAME
};
static const IRCategory op_categories[] = {
#define IR_OP_CAT(name, py, cat) IRCAT_##cat,
    IR_OPS(IR_OP_CAT)
#undef IR_OP_CAT
};
static const char *const kind_names[] = {
#define IR_KIND_NAME(name, fx) fx,
    IR_KINDS(IR_KIND_NAME)
#undef IR_KIND_NAME
};

/* The qualified Python name of op ("torch.add"); "" for IROP_OTHER and out-of-range values. */
const char *em_ir_op_pyname(IROp op) { return (unsigned)op < IROP__COUNT ? op_pynames[op] : ""; }

/* The category later stages use; unknown ops are extern calls. */
IRCategory em_ir_op_category(IROp op) {
    return (unsigned)op < IROP__COUNT ? op_categories[op] : IRCAT_EXTERN;
}

/* The torch.fx opcode string of a node kind. */
const char *em_ir_kind_name(IRKind k) { return (unsigned)k < IR__NKINDS ? kind_names[k] : "?"; }

/* Other Python objects that mean the same op as a table entry: the operator module's functions
 * (what BINARY_OP records), functional aliases, and Tensor methods taken as functions. */
static const struct {
    const char *pyname;
    IROp op;
} op_aliases[] = {
    {"operator.add", IROP_ADD},           {"operator.sub", IROP_SUB},
    {"operator.mul", IROP_MUL},           {"operator.truediv", IROP_DIV},
    {"operator.neg", IROP_NEG},           {"operator.pow", IROP_POW},
    {"operator.matmul", IROP_MATMUL},     {"torch.true_divide", IROP_DIV},
    {"torch.nn.functional.relu", IROP_RELU}, {"torch.nn.functional.softmax", IROP_SOFTMAX},
    {"torch.nn.functional.tanh", IROP_TANH}, {"torch.nn.functional.sigmoid", IROP_SIGMOID},
    {"torch.special.expit", IROP_SIGMOID}, {"torch.Tensor.add", IROP_ADD},
    {"torch.Tensor.sub", IROP_SUB},       {"torch.Tensor.mul", IROP_MUL},
    {"torch.Tensor.div", IROP_DIV},       {"torch.Tensor.neg", IROP_NEG},
    {"torch.Tensor.pow", IROP_POW},       {"torch.Tensor.exp", IROP_EXP},
    {"torch.Tensor.log", IROP_LOG},       {"torch.Tensor.sin", IROP_SIN},
    {"torch.Tensor.cos", IROP_COS},       {"torch.Tensor.tanh", IROP_TANH},
    {"torch.Tensor.sigmoid", IROP_SIGMOID}, {"torch.Tensor.relu", IROP_RELU},
    {"torch.Tensor.abs", IROP_ABS},       {"torch.Tensor.sqrt", IROP_SQRT},
    {"torch.Tensor.rsqrt", IROP_RSQRT},   {"torch.Tensor.sum", IROP_SUM},
    {"torch.Tensor.mean", IROP_MEAN},     {"torch.Tensor.amax", IROP_AMAX},
    {"torch.Tensor.softmax", IROP_SOFTMAX}, {"torch.Tensor.reshape", IROP_RESHAPE},
    {"torch.Tensor.permute", IROP_PERMUTE}, {"torch.Tensor.transpose", IROP_TRANSPOSE},
    {"torch.Tensor.matmul", IROP_MATMUL}, {"torch.Tensor.__getitem__", IROP_GETITEM},
    {"torch.Tensor.__add__", IROP_ADD},   {"torch.Tensor.__sub__", IROP_SUB},
    {"torch.Tensor.__mul__", IROP_MUL},   {"torch.Tensor.__truediv__", IROP_DIV},
    {"torch.Tensor.__neg__", IROP_NEG},   {"torch.Tensor.__pow__", IROP_POW},
    {"torch.Tensor.__matmul__", IROP_MATMUL},
};
enum { NALIASES = sizeof(op_aliases) / sizeof(op_aliases[0]) };

/* call_method targets: the method name decides the op (x.add(y) is torch.add(x, y)). Reflected
 * dunders (__radd__, __rsub__) are left out: their operand order differs from the table's. */
static const struct {
    const char *name;
    IROp op;
} op_methods[] = {
    {"add", IROP_ADD},         {"sub", IROP_SUB},         {"mul", IROP_MUL},
    {"div", IROP_DIV},         {"true_divide", IROP_DIV}, {"neg", IROP_NEG},
    {"pow", IROP_POW},         {"exp", IROP_EXP},         {"log", IROP_LOG},
    {"sin", IROP_SIN},         {"cos", IROP_COS},         {"tanh", IROP_TANH},
    {"sigmoid", IROP_SIGMOID}, {"relu", IROP_RELU},       {"abs", IROP_ABS},
    {"sqrt", IROP_SQRT},       {"rsqrt", IROP_RSQRT},     {"sum", IROP_SUM},
    {"mean", IROP_MEAN},       {"amax", IROP_AMAX},       {"softmax", IROP_SOFTMAX},
    {"view", IROP_VIEW},       {"reshape", IROP_RESHAPE}, {"permute", IROP_PERMUTE},
    {"transpose", IROP_TRANSPOSE}, {"matmul", IROP_MATMUL}, {"__getitem__", IROP_GETITEM},
    {"__add__", IROP_ADD},     {"__sub__", IROP_SUB},     {"__mul__", IROP_MUL},
    {"__truediv__", IROP_DIV}, {"__neg__", IROP_NEG},     {"__pow__", IROP_POW},
    {"__matmul__", IROP_MATMUL},
};
enum { NMETHODS = sizeof(op_methods) / sizeof(op_methods[0]) };

/* The Python objects behind the table, resolved once and lazily. An entry is resolved only when
 * the root module of its name is already in sys.modules (operator is imported on demand): the IR
 * must not import torch as a side effect, and a torch target cannot reach the IR before torch is
 * imported. Process-wide like em_core's name table: ember supports one interpreter (em_module.c).
 * state: 0 = not tried yet, 1 = resolved (obj may be NULL when the name does not exist). */
typedef struct {
    PyObject *obj;
    int state;
} Resolved;
static Resolved op_resolved[IROP__COUNT];
static Resolved alias_resolved[NALIASES];

/* Resolves a dotted name ("torch.nn.functional.relu") into r. Leaves r unresolved (state 0) when
 * the root module is not loaded yet. Never leaves a Python exception set. */
static void ir_resolve(const char *dotted, Resolved *r) {
    char root[64];
    const char *dot = strchr(dotted, '.');
    size_t n = dot ? (size_t)(dot - dotted) : strlen(dotted);
    if (r->state || n == 0 || n >= sizeof root) return;
    memcpy(root, dotted, n);
    root[n] = '\0';
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *name = PyUnicode_FromString(root);
    PyObject *obj = NULL;
    if (name) {
        obj = PyImport_GetModule(name);
        if (!obj && !PyErr_Occurred() && strcmp(root, "operator") == 0) obj = PyImport_Import(name);
        Py_DECREF(name);
    }
    if (!obj) { /* root not loaded (yet): try again on a later lookup */
        PyErr_Clear();
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return;
    }
    const char *p = dot;
    while (p && obj) {
        const char *start = p + 1;
        const char *next = strchr(start, '.');
        size_t len = next ? (size_t)(next - start) : strlen(start);
        PyObject *attr = PyUnicode_FromStringAndSize(start, (Py_ssize_t)len);
        PyObject *child = attr ? PyObject_GetAttr(obj, attr) : NULL;
        Py_XDECREF(attr);
        Py_SETREF(obj, child);
        p = next;
    }
    PyErr_Clear();
    PyErr_Restore(exc_type, exc_value, exc_tb);
    r->obj = obj; /* kept for the life of the process, like the modules it comes from */
    r->state = 1;
}

/* The table op whose Python object is target (by identity), or IROP_OTHER. */
static IROp ir_lookup_function(PyObject *target) {
    for (int i = 1; i < IROP__COUNT; i++) {
        ir_resolve(op_pynames[i], &op_resolved[i]);
        if (op_resolved[i].obj == target) return (IROp)i;
    }
    for (int i = 0; i < NALIASES; i++) {
        ir_resolve(op_aliases[i].pyname, &alias_resolved[i]);
        if (alias_resolved[i].obj == target) return op_aliases[i].op;
    }
    return IROP_OTHER;
}

/* The table op of a call_method node with this method name, or IROP_OTHER. */
static IROp ir_lookup_method(PyObject *name) {
    const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (!s) {
        PyErr_Clear();
        return IROP_OTHER;
    }
    for (int i = 0; i < NMETHODS; i++)
        if (strcmp(op_methods[i].name, s) == 0) return op_methods[i].op;
    return IROP_OTHER;
}

/* The exact table entry (not an alias) whose object is target; IROP_OTHER if none. Used by
 * em_ir_target_qualname so that torch.nn.functional.gelu prints under its documented name. */
static IROp ir_lookup_exact(PyObject *target) {
    for (int i = 1; i < IROP__COUNT; i++) {
        ir_resolve(op_pynames[i], &op_resolved[i]);
        if (op_resolved[i].obj == target) return (IROp)i;
    }
    return IROP_OTHER;
}

bool em_ir_torch_callable(PyObject *fn) {
    if (PyCFunction_Check(fn)) { /* a builtin, not a method bound to an instance (a tensor) */
        PyObject *self = PyCFunction_GET_SELF(fn);
        return !self || PyModule_Check(self) || PyType_Check(self);
    }
    if (PyUnicode_Check(fn) || Py_IS_TYPE(fn, &PyMethodDescr_Type) || Py_IS_TYPE(fn, &PyWrapperDescr_Type)) return true;
    PyObject *mod = NULL;
    if (PyFunction_Check(fn)) {
        mod = Py_XNewRef(PyFunction_GET_MODULE(fn));
    } else {
        mod = PyObject_GetAttrString((PyObject *)Py_TYPE(fn), "__module__"); /* torch._ops.OpOverload */
        if (!mod) PyErr_Clear();
        if (mod && !(PyUnicode_Check(mod) && PyUnicode_CompareWithASCIIString(mod, "torch._ops") == 0)) Py_CLEAR(mod);
    }
    bool ok = false;
    if (mod && PyUnicode_Check(mod)) {
        const char *s = PyUnicode_AsUTF8(mod);
        if (!s) PyErr_Clear();
        ok = s && (strcmp(s, "torch") == 0 || strncmp(s, "torch.", 6) == 0);
    }
    Py_XDECREF(mod);
    return ok;
}

/* The qualified name under which a target is written in printed graphs and generated Python,
 * following torch.fx's _get_qualified_name (torch/fx/node.py) with readable fix-ups:
 * table entries by their table name, builtins bare ("len"), Tensor method descriptors as
 * "torch.Tensor.view", "_operator" as "operator", "torch._C._nn.gelu" as
 * "torch.nn.functional.gelu" (when that is the same object), "torch._ops" as "torch.ops".
 * A str target (call_method, placeholder) is returned as is. Falls back to repr(). New str. */
static PyObject *ir_target_qualname(PyObject *target);

PyObject *em_ir_target_qualname(PyObject *target) {
    /* torch's callables keep their name: asked for every node by the printer and the lowering's
     * rule lookup, it is found once per process (the dict holds only em_ir_torch_callable
     * targets, which keep nothing of the user's alive) */
    static PyObject *cache; /* one interpreter (em_module.c) */
    if (PyUnicode_Check(target)) return Py_NewRef(target);
    if (!em_ir_torch_callable(target)) return ir_target_qualname(target);
    if (!cache && !(cache = PyDict_New())) return NULL;
    PyObject *hit = PyDict_GetItemWithError(cache, target);
    if (hit) return Py_NewRef(hit);
    if (PyErr_Occurred()) PyErr_Clear(); /* unhashable: not cached */
    PyObject *q = ir_target_qualname(target);
    if (q && PyDict_SetItem(cache, target, q) < 0) PyErr_Clear();
    return q;
}

static PyObject *ir_target_qualname(PyObject *target) {
    PyObject *name = NULL, *module = NULL, *result = NULL;
    IROp op = ir_lookup_exact(target);
    if (op != IROP_OTHER) return PyUnicode_FromString(op_pynames[op]);

    name = PyObject_GetAttrString(target, "__name__");
    if (!name || !PyUnicode_Check(name)) goto fallback;
    PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */
    if (builtins && PyDict_GetItemWithError(builtins, name) == target) {
        result = Py_NewRef(name);
        goto done;
    }
    if (PyErr_Occurred()) goto fallback;
    if (Py_IS_TYPE(target, &PyMethodDescr_Type) || Py_IS_TYPE(target, &PyWrapperDescr_Type)) {
        PyTypeObject *owner = PyDescr_TYPE(target);
        const char *tn = owner ? owner->tp_name : "";
        if (strcmp(tn, "torch._C.TensorBase") == 0 || strcmp(tn, "torch._C._TensorBase") == 0 ||
            strcmp(tn, "Tensor") == 0) {
            result = PyUnicode_FromFormat("torch.Tensor.%U", name);
            goto done;
        }
        result = PyUnicode_FromFormat("%s.%U", tn, name);
        goto done;
    }
    module = PyObject_GetAttrString(target, "__module__");
    if (!module) goto fallback;
    if (!PyUnicode_Check(module)) {
        PyObject *qual = PyObject_GetAttrString(target, "__qualname__");
        if (qual && PyUnicode_Check(qual)) {
            Py_DECREF(name);
            name = qual;
        } else {
            Py_XDECREF(qual);
        }
        PyErr_Clear();
        result = Py_NewRef(name);
        goto done;
    }
    const char *m = PyUnicode_AsUTF8(module);
    if (!m) goto fallback;
    if (strcmp(m, "_operator") == 0) {
        result = PyUnicode_FromFormat("operator.%U", name);
    } else if (strcmp(m, "torch._C._nn") == 0) {
        Resolved fn = {0};
        ir_resolve("torch.nn.functional", &fn);
        PyObject *same = fn.obj ? PyObject_GetAttr(fn.obj, name) : NULL;
        PyErr_Clear();
        result = PyUnicode_FromFormat("%s.%U", same == target ? "torch.nn.functional" : m, name);
        Py_XDECREF(same);
        Py_XDECREF(fn.obj);
    } else if (strncmp(m, "torch._ops", 10) == 0) {
        result = PyUnicode_FromFormat("torch.ops%s.%U", m + 10, name);
    } else {
        PyObject *qual = PyObject_GetAttrString(target, "__qualname__");
        /* a qualname naming nested scopes ("f.<locals>.g") is no Python path: keep __name__ then;
         * builtins report their class ("_VariableFunctionsClass.sin"), also no path */
        if (qual && PyUnicode_Check(qual) && PyUnicode_FindChar(qual, '<', 0, PyUnicode_GetLength(qual), 1) < 0 &&
            !PyCFunction_Check(target)) {
            result = PyUnicode_FromFormat("%s.%U", m, qual);
        } else {
            result = PyUnicode_FromFormat("%s.%U", m, name);
        }
        Py_XDECREF(qual);
        PyErr_Clear();
    }
done:
    Py_XDECREF(name);
    Py_XDECREF(module);
    if (result) return result;
fallback:
    PyErr_Clear();
    Py_XDECREF(name);
    Py_XDECREF(module);
    return PyObject_Repr(target);
}

/* ------------------------------------------------------------------------------------------ */
/* fx-style names                                                                             */
/* ------------------------------------------------------------------------------------------ */

/* The namespace of a graph, as torch.fx's _Namespace (torch/fx/graph.py): the set of used names
 * and, per base name, the last numeric suffix handed out. One open-addressing table keyed by the
 * string serves both. It lives beside the public IRGraph (em_ir_new allocates both at once). */
typedef struct {
    const char *key; /* arena string; NULL = empty */
    bool used;       /* key is a node name */
    bool counted;    /* count is the _base_count of key */
    long count;
} NameSlot;

typedef struct {
    IRGraph g; /* first: an IRGraph * from em_ir_new points at this struct */
    NameSlot *slots;
    uint32_t nslots, nfilled;
} IRGraphFull;

/* FNV-1a over a C string. */
static uint64_t ir_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* The slot of key (created when create is set); NULL on OOM or when absent and !create. */
static NameSlot *ir_name_slot(IRGraphFull *gf, const char *key, bool create) {
    if (create && (gf->nfilled + 1) * 2 > gf->nslots) {
        uint32_t ncap = gf->nslots ? gf->nslots * 2 : 64;
        NameSlot *ns = em_arena_alloc(gf->g.arena, ncap * sizeof(NameSlot));
        if (!ns) return NULL;
        for (uint32_t i = 0; i < gf->nslots; i++) {
            if (!gf->slots[i].key) continue;
            uint32_t j = (uint32_t)ir_hash(gf->slots[i].key) & (ncap - 1);
            while (ns[j].key) j = (j + 1) & (ncap - 1);
            ns[j] = gf->slots[i];
        }
        gf->slots = ns;
        gf->nslots = ncap;
    }
    if (!gf->nslots) return NULL;
    uint32_t j = (uint32_t)ir_hash(key) & (gf->nslots - 1);
    while (gf->slots[j].key) {
        if (strcmp(gf->slots[j].key, key) == 0) return &gf->slots[j];
        j = (j + 1) & (gf->nslots - 1);
    }
    if (!create) return NULL;
    gf->slots[j].key = em_arena_strdup(gf->g.arena, key);
    if (!gf->slots[j].key) return NULL;
    gf->nfilled++;
    return &gf->slots[j];
}

/* Names a node may not take: Python keywords, builtins, and the names torch.fx adds to every
 * generated module's globals (_register_custom_builtin in torch/fx/graph.py). */
static bool ir_name_illegal(const char *s) {
    static const char *const reserved[] = {
        "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class",
        "continue", "def", "del", "elif", "else", "except", "finally", "for", "from", "global",
        "if", "import", "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return",
        "try", "while", "with", "yield", "inf", "nan", "NoneType", "torch", "device", "fx_pytree",
        "pytree"};
    for (size_t i = 0; i < sizeof reserved / sizeof reserved[0]; i++)
        if (strcmp(reserved[i], s) == 0) return true;
    static PyObject *d; /* builtins.__dict__, alive as long as the interpreter (em_module.c: one) */
    if (!d) {
        PyObject *mod = PyImport_AddModule("builtins"); /* borrowed */
        d = mod ? Py_XNewRef(PyModule_GetDict(mod)) : NULL;
    }
    bool found = d && PyDict_GetItemString(d, s) != NULL;
    PyErr_Clear();
    return found;
}

enum { NAME_MAX_LEN = 200 };

/* torch.fx's _snake_case: "_" before an upper-case letter that follows a lower-case one, then
 * lower case. Magic names ("__add__") lose their underscores first when strip_magic is set
 * (fx does so for str targets only). Writes at most cap-1 bytes. */
static void ir_snake_case(const char *s, bool strip_magic, char *out, size_t cap) {
    size_t n = strlen(s), o = 0;
    if (strip_magic && n >= 4 && strncmp(s, "__", 2) == 0 && strncmp(s + n - 2, "__", 2) == 0) {
        s += 2;
        n -= 4;
    }
    for (size_t i = 0; i < n && o + 2 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (i > 0 && isupper(c) && islower((unsigned char)s[i - 1])) out[o++] = '_';
        out[o++] = (char)tolower(c);
    }
    out[o] = '\0';
}

/* Makes candidate a unique, legal name in g and returns it (arena); NULL on OOM.
 * Mirrors torch.fx _Namespace.create_name: sanitize, split "base_N", skip illegal names, bump N
 * until unused, remember N per base. */
static const char *ir_unique_name(IRGraphFull *gf, const char *candidate) {
    char buf[NAME_MAX_LEN + 64], base[NAME_MAX_LEN + 32];
    size_t o = 0;
    bool in_bad = false;
    /* sanitize: runs of characters outside [0-9a-zA-Z_] become one "_" */
    for (const char *p = candidate; *p && o < NAME_MAX_LEN; p++) {
        unsigned char c = (unsigned char)*p;
        if (isalnum(c) || c == '_') {
            if (c >= 0x80) goto bad; /* isalnum in a non-C locale */
            buf[o++] = (char)c;
            in_bad = false;
            continue;
        }
    bad:
        if (!in_bad) buf[o++] = '_';
        in_bad = true;
    }
    buf[o] = '\0';
    if (o == 0) strcpy(buf, "_unnamed");
    if (isdigit((unsigned char)buf[0])) {
        memmove(buf + 1, buf, strlen(buf) + 1);
        buf[0] = '_';
    }
    /* split ^(base)(?:_(\d+))?$ with base as short as possible: the suffix is after the last "_" */
    size_t len = strlen(buf);
    char *us = strrchr(buf, '_');
    long num = -1;
    size_t baselen = len;
    if (us && us > buf && us[1] != '\0' && strlen(us + 1) <= 9) {
        bool digits = true;
        for (const char *p = us + 1; *p; p++) digits = digits && isdigit((unsigned char)*p);
        if (digits) {
            num = strtol(us + 1, NULL, 10);
            baselen = (size_t)(us - buf);
        }
    }
    memcpy(base, buf, baselen);
    base[baselen] = '\0';

    NameSlot *cs = ir_name_slot(gf, buf, false);
    if (num < 0 || (cs && cs->used)) {
        NameSlot *bs = ir_name_slot(gf, base, false);
        num = bs && bs->counted ? bs->count : 0;
        if (ir_name_illegal(buf)) {
            num++;
            snprintf(buf, sizeof buf, "%s_%ld", base, num);
        }
    }
    for (;;) {
        cs = ir_name_slot(gf, buf, false);
        if (!cs || !cs->used) break;
        num++;
        snprintf(buf, sizeof buf, "%s_%ld", base, num);
    }
    cs = ir_name_slot(gf, buf, true);
    if (!cs) return NULL;
    cs->used = true;
    NameSlot *bs = ir_name_slot(gf, base, true);
    if (!bs) return NULL;
    bs->counted = true;
    bs->count = num;
    return cs->key;
}

/* ------------------------------------------------------------------------------------------ */
/* Building                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* A new, empty graph in arena a (node 0 reserved). NULL on OOM, no exception set. */
IRGraph *em_ir_new(EmArena *a) {
    IRGraphFull *gf = em_arena_alloc(a, sizeof(IRGraphFull));
    if (!gf) return NULL;
    IRGraph *g = &gf->g;
    g->arena = a;
    g->cap = 64;
    g->nodes = em_arena_alloc(a, g->cap * sizeof(IRNode));
    if (!g->nodes) return NULL;
    g->nnodes = 1; /* IRRef 0 = "none" */
    g->nodes[0].kind = IR_PLACEHOLDER;
    g->nodes[0].name = "";
    g->nodes[0].lineno = -1;
    g->nodes[0].meta.kind = IRMETA_NONE;
    return g;
}

/* Appends a zeroed node and returns its ref, 0 on OOM. */
static IRRef ir_append(IRGraph *g) {
    if (g->nnodes == g->cap) {
        uint32_t ncap = g->cap * 2;
        IRNode *nn = em_arena_realloc(g->arena, g->nodes, g->cap * sizeof(IRNode), ncap * sizeof(IRNode));
        if (!nn) return 0;
        g->nodes = nn;
        g->cap = ncap;
    }
    IRRef r = g->nnodes++;
    memset(&g->nodes[r], 0, sizeof(IRNode));
    g->nodes[r].lineno = -1;
    g->nodes[r].meta.kind = IRMETA_NONE;
    return r;
}

/* Deep-copies n arguments (nested tuples/lists included) into the arena. NULL on OOM
 * (or n == 0, which callers treat as "no arguments"). */
static IRArg *ir_copy_args(EmArena *a, const IRArg *src, uint32_t n) {
    if (n == 0) return NULL;
    IRArg *dst = em_arena_alloc(a, n * sizeof(IRArg));
    if (!dst) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        dst[i] = src[i];
        if ((src[i].kind == IRARG_TUPLE || src[i].kind == IRARG_LIST) && src[i].n) {
            dst[i].u.items = ir_copy_args(a, src[i].u.items, src[i].n);
            if (!dst[i].u.items) return NULL;
        }
    }
    return dst;
}

/* Is s a Python identifier made of ASCII letters, digits and "_"? */
static bool ir_is_identifier(const char *s) {
    if (!s || !*s || isdigit((unsigned char)*s)) return false;
    for (; *s; s++)
        if (!(((unsigned char)*s < 0x80) && (isalnum((unsigned char)*s) || *s == '_'))) return false;
    return true;
}

/* Appends a placeholder and registers it as the next graph input (em_ir.h has the naming rule). */
IRRef em_ir_placeholder(IRGraph *g, const char *name, const IRMeta *meta) {
    IRGraphFull *gf = (IRGraphFull *)g;
    char cand[NAME_MAX_LEN + 8];
    ir_snake_case(name ? name : "", true, cand, sizeof cand);
    const char *uname = ir_unique_name(gf, cand);
    if (!uname) return 0;
    /* The target is the parameter name of the generated forward(): the given name when it is an
     * identifier no earlier input uses, else the (unique) node name. */
    const char *tname = name;
    if (!ir_is_identifier(name)) tname = uname;
    for (uint32_t i = 0; i < g->ninputs && tname != uname; i++) {
        PyObject *t = g->nodes[g->inputs[i]].target;
        const char *ts = t ? PyUnicode_AsUTF8(t) : NULL;
        if (ts && strcmp(ts, tname) == 0) tname = uname;
    }
    PyErr_Clear();
    PyObject *target = em_arena_hold_steal(g->arena, PyUnicode_FromString(tname));
    if (!target) {
        PyErr_Clear();
        return 0;
    }
    if (g->ninputs == g->capinputs) {
        uint32_t ncap = g->capinputs ? g->capinputs * 2 : 8;
        IRRef *ni = em_arena_realloc(g->arena, g->inputs, g->capinputs * sizeof(IRRef), ncap * sizeof(IRRef));
        if (!ni) return 0;
        g->inputs = ni;
        g->capinputs = ncap;
    }
    IRRef r = ir_append(g);
    if (!r) return 0;
    IRNode *n = &g->nodes[r];
    n->kind = IR_PLACEHOLDER;
    n->op = IROP_OTHER;
    n->target = target;
    n->name = uname;
    if (meta) n->meta = *meta;
    g->inputs[g->ninputs++] = r;
    return r;
}

/* The base of a call node's name: target.__name__ for functions (fx's _target_to_str), the
 * type's name for callable objects without one, the method name without dunder underscores for
 * methods, then snake case. */
static void ir_call_candidate(IRKind kind, PyObject *target, char *out, size_t cap) {
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    const char *s = NULL;
    PyObject *name = NULL;
    if (kind == IR_CALL_METHOD) {
        s = PyUnicode_Check(target) ? PyUnicode_AsUTF8(target) : NULL;
    } else {
        name = PyObject_GetAttrString(target, "__name__");
        s = name && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
        if (!s) { /* a callable object (module instance, partial): named after its type */
            PyErr_Clear();
            const char *tn = Py_TYPE(target)->tp_name, *dot = strrchr(tn, '.');
            s = dot ? dot + 1 : tn;
        }
    }
    ir_snake_case(s ? s : "call", kind == IR_CALL_METHOD, out, cap);
    Py_XDECREF(name);
    PyErr_Clear();
    PyErr_Restore(exc_type, exc_value, exc_tb);
}

IRRef em_ir_call(IRGraph *g, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs,
                 PyObject *const *kwnames, const IRArg *kwargs, uint32_t nkwargs, const IRMeta *meta) {
    IRGraphFull *gf = (IRGraphFull *)g;
    EM_ASSERT(kind == IR_CALL_FUNCTION || kind == IR_CALL_METHOD);
    char cand[NAME_MAX_LEN + 8];
    ir_call_candidate(kind, target, cand, sizeof cand);
    const char *uname = ir_unique_name(gf, cand);
    if (!uname) return 0;
    IRArg *cargs = ir_copy_args(g->arena, args, nargs);
    IRArg *ckw = ir_copy_args(g->arena, kwargs, nkwargs);
    PyObject **cnames = nkwargs ? em_arena_alloc(g->arena, nkwargs * sizeof(PyObject *)) : NULL;
    if ((nargs && !cargs) || (nkwargs && (!ckw || !cnames))) return 0;
    for (uint32_t i = 0; i < nkwargs; i++) {
        cnames[i] = em_arena_hold(g->arena, kwnames[i]);
        if (!cnames[i]) return 0;
    }
    if (!em_arena_hold(g->arena, target)) return 0;
    IROp op = kind == IR_CALL_METHOD ? ir_lookup_method(target) : ir_lookup_function(target);
    IRRef r = ir_append(g);
    if (!r) return 0;
    IRNode *n = &g->nodes[r];
    n->kind = kind;
    n->op = op;
    n->target = target;
    n->args = cargs;
    n->nargs = nargs;
    n->nkwargs = nkwargs;
    n->kwnames = cnames;
    n->kwargs = ckw;
    n->name = uname;
    if (meta) n->meta = *meta;
    return r;
}

/* Appends the OUTPUT node, whose one argument is the tuple of result refs. -1 on OOM or when the
 * graph already has an output (no exception either way). */
int em_ir_set_output(IRGraph *g, const IRRef *refs, uint32_t n) {
    if (g->output) return -1; /* a graph has one output node */
    IRGraphFull *gf = (IRGraphFull *)g;
    const char *uname = ir_unique_name(gf, "output");
    PyObject *target = PyUnicode_InternFromString("output");
    if (!uname || !em_arena_hold_steal(g->arena, target)) {
        PyErr_Clear();
        return -1;
    }
    IRArg *items = n ? em_arena_alloc(g->arena, n * sizeof(IRArg)) : NULL;
    IRArg *arg = em_arena_alloc(g->arena, sizeof(IRArg));
    if ((n && !items) || !arg) return -1;
    for (uint32_t i = 0; i < n; i++) {
        items[i].kind = IRARG_NODE;
        items[i].u.ref = refs[i];
    }
    arg->kind = IRARG_TUPLE;
    arg->n = n;
    arg->u.items = items;
    IRRef r = ir_append(g);
    if (!r) return -1;
    IRNode *node = &g->nodes[r];
    node->kind = IR_OUTPUT;
    node->op = IROP_OTHER;
    node->target = target;
    node->args = arg;
    node->nargs = 1;
    node->name = uname;
    node->meta.kind = IRMETA_NONE;
    g->output = r;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Metadata                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* Reads a sequence of Python ints into n int64 values in the arena. -1 with exception. */
static int ir_read_ints(EmArena *a, PyObject *seq, int32_t *n, int64_t **out) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (!fast) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    int64_t *vals = len ? em_arena_alloc(a, (size_t)len * sizeof(int64_t)) : NULL;
    if (len && !vals) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        vals[i] = v;
    }
    Py_DECREF(fast);
    *n = (int32_t)len;
    *out = vals;
    return 0;
}

PyObject *em_ir_meta_empty(PyObject *sizes, PyObject *strides, PyObject *dtype) {
    static PyObject *empty_strided, *kwnames, *s_meta; /* one interpreter (em_module.c) */
    if (!kwnames && !(kwnames = Py_BuildValue("(ss)", "dtype", "device"))) return NULL;
    if (!s_meta && !(s_meta = PyUnicode_InternFromString("meta"))) return NULL;
    if (!em_lazy_attr(&empty_strided, "torch", "empty_strided")) return NULL;
    PyObject *call[4] = {sizes, strides, dtype, s_meta};
    return PyObject_Vectorcall(empty_strided, call, 2, kwnames);
}

/* Reads sizes, strides (elements), dtype, device and requires_grad of a tensor through its Python
 * attributes (compile time only). example is the tensor itself when it lives on "meta", else a new
 * meta tensor with the same sizes, strides and dtype (torch.empty_strided(..., device="meta")). */
int em_ir_meta_from_tensor(EmArena *a, PyObject *tensor, PyObject *device_override, IRMeta *out) {
    PyObject *shape = NULL, *stride = NULL, *dtype = NULL, *device = NULL, *rg = NULL;
    PyObject *example = NULL, *is_meta = NULL;
    IRMeta m = {0};
    m.kind = IRMETA_TENSOR;
    int32_t nstride = 0;
    shape = PyObject_GetAttr(tensor, em_str("shape"));
    if (!shape || ir_read_ints(a, shape, &m.ndim, &m.sizes) < 0) goto error;
    stride = PyObject_CallMethodNoArgs(tensor, em_str("stride"));
    if (!stride || ir_read_ints(a, stride, &nstride, &m.strides) < 0) goto error;
    if (nstride != m.ndim) {
        PyErr_SetString(PyExc_ValueError, "ember: tensor stride() and shape disagree in length");
        goto error;
    }
    dtype = PyObject_GetAttr(tensor, em_str("dtype"));
    device = PyObject_GetAttr(tensor, em_str("device"));
    rg = PyObject_GetAttr(tensor, em_str("requires_grad"));
    if (!dtype || !device || !rg) goto error;
    int truth = PyObject_IsTrue(rg);
    if (truth < 0) goto error;
    m.requires_grad = truth;
    is_meta = PyObject_GetAttr(tensor, em_str("is_meta"));
    if (!is_meta) goto error;
    truth = PyObject_IsTrue(is_meta);
    if (truth < 0) goto error;
    if (truth) {
        example = Py_NewRef(tensor);
    } else if (!(example = em_ir_meta_empty(shape, stride, dtype))) {
        goto error;
    }
    m.dtype = em_arena_hold(a, dtype);
    m.device = em_arena_hold(a, device_override ? device_override : device);
    m.example = em_arena_hold(a, example);
    if (!m.dtype || !m.device || !m.example) {
        PyErr_NoMemory();
        goto error;
    }
    *out = m;
    Py_DECREF(shape);
    Py_DECREF(stride);
    Py_DECREF(dtype);
    Py_DECREF(device);
    Py_DECREF(rg);
    Py_DECREF(is_meta);
    Py_DECREF(example);
    return 0;
error:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(rg);
    Py_XDECREF(is_meta);
    Py_XDECREF(example);
    return -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Users and dead-code elimination                                                            */
/* ------------------------------------------------------------------------------------------ */

/* Calls visit(ctx, arg) for every node reference inside args (nested tuples/lists included). */
static void ir_each_ref(IRArg *args, uint32_t n, void (*visit)(void *, IRArg *), void *ctx) {
    for (uint32_t i = 0; i < n; i++) {
        if (args[i].kind == IRARG_NODE) visit(ctx, &args[i]);
        else if (args[i].kind == IRARG_TUPLE || args[i].kind == IRARG_LIST)
            ir_each_ref(args[i].u.items, args[i].n, visit, ctx);
    }
}

typedef struct {
    IRGraph *g;
    IRRef user;     /* the node whose arguments are visited */
    IRRef *stamp;   /* stamp[r] = last user counted for r (counts distinct users, as fx's users) */
    int delta;
} UseCtx;

/* Adds delta to the user count of the referenced node, once per user node. */
static void ir_count_visit(void *p, IRArg *arg) {
    UseCtx *c = p;
    IRRef r = arg->u.ref;
    if (r == 0 || r >= c->g->nnodes || c->stamp[r] == c->user) return;
    c->stamp[r] = c->user;
    c->g->nodes[r].nusers = (uint32_t)((int64_t)c->g->nodes[r].nusers + c->delta);
}

/* Counts, for every node, the distinct nodes that use it (like len(fx_node.users)); the output
 * node counts as one user. */
void em_ir_count_users(IRGraph *g) {
    IRRef stackstamp[256];
    IRRef *stamp = g->nnodes <= 256 ? stackstamp : malloc(g->nnodes * sizeof(IRRef));
    if (!stamp) return; /* OOM: leave the counts as they were */
    memset(stamp, 0, g->nnodes * sizeof(IRRef));
    for (uint32_t i = 0; i < g->nnodes; i++) g->nodes[i].nusers = 0;
    UseCtx c = {g, 0, stamp, 1};
    for (IRRef i = 1; i < g->nnodes; i++) {
        c.user = i;
        ir_each_ref(g->nodes[i].args, g->nodes[i].nargs, ir_count_visit, &c);
        ir_each_ref(g->nodes[i].kwargs, g->nodes[i].nkwargs, ir_count_visit, &c);
    }
    if (stamp != stackstamp) free(stamp);
}

/* Does the name say "mutates its input"? "add_", "copy_" — but not dunders like "__add__". */
static bool ir_name_inplace(const char *s) {
    size_t n = strlen(s);
    if (n < 2 || s[n - 1] != '_') return false;
    return !(n >= 4 && s[0] == '_' && s[1] == '_' && s[n - 2] == '_');
}

int em_ir_arg_reads(const IRArg *a, IRRef r) {
    if (a->kind == IRARG_NODE) return a->u.ref == r;
    int k = 0;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) k += em_ir_arg_reads(&a->u.items[i], r);
    return k;
}

int em_ir_node_reads(const IRNode *n, IRRef r) {
    int k = 0;
    for (uint32_t i = 0; i < n->nargs; i++) k += em_ir_arg_reads(&n->args[i], r);
    for (uint32_t i = 0; i < n->nkwargs; i++) k += em_ir_arg_reads(&n->kwargs[i], r);
    return k;
}

static bool arg_reads_marked(const IRArg *a, const uint8_t *mark) {
    if (a->kind == IRARG_NODE) return mark[a->u.ref] != 0;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (arg_reads_marked(&a->u.items[i], mark)) return true;
    return false;
}

bool em_ir_node_reads_marked(const IRNode *n, const uint8_t *mark) {
    for (uint32_t i = 0; i < n->nargs; i++)
        if (arg_reads_marked(&n->args[i], mark)) return true;
    for (uint32_t i = 0; i < n->nkwargs; i++)
        if (arg_reads_marked(&n->kwargs[i], mark)) return true;
    return false;
}

/* Functions that DCE must keep even when their result is unused: writes through operator
 * (setitem, in-place operators and their dunders), global state (seeds, grad mode), autograd
 * side effects (backward, hooks), and random ops, whose RNG
 * consumption must match eager even when the value is dropped. Matched by __name__: keeping an
 * op too many is always safe. */
static const char *const impure_names[] = {
    "setitem", "delitem", "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod",
    "ipow", "ilshift", "irshift", "iand", "ior", "ixor", "iconcat", "manual_seed", "seed",
    "set_rng_state", "_set_grad_enabled", "set_grad_enabled", "dropout", "dropout1d",
    "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "feature_dropout",
    "native_dropout", "rrelu", "gumbel_softmax", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "bernoulli", "multinomial", "normal", "poisson",
    "uniform", "exponential", "geometric", "cauchy", "log_normal", "random", "shuffle", "print",
    "backward", "retain_grad", "register_hook", "record_stream", "__setitem__", "__delitem__",
    "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__ilshift__", "__irshift__", "__iand__", "__ior__", "__ixor__"};

/* The only ops DCE deletes: views and selections that have no side effect and cannot fail once
 * shape inference on meta tensors accepted them. Any other op is kept even when its result is
 * unused, because eager would still run it: it may raise an error meta tensors do not model
 * (layer_norm on mixed CPU dtypes), or update state through an argument (batch_norm's running
 * statistics in training mode). Both were found by ember.testing.program_gen
 * (tests/regressions/gen_498.py, gen_6746.py). */
static const char *const removable_names[] = {
    "getitem", "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "T", "mT",
    "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten", "movedim", "narrow",
    "select", "unbind", "split", "chunk", "detach", "alias", "real", "imag", "diagonal"};

/* May DCE delete node n when nobody uses its result? */
static bool ir_node_removable(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return false;
    for (uint32_t i = 0; i < n->nkwargs; i++) { /* out=..., inplace=True write into an argument */
        const char *k = PyUnicode_AsUTF8(n->kwnames[i]);
        if (!k) {
            PyErr_Clear();
            return false;
        }
        if (strcmp(k, "out") == 0) return false;
        if (strcmp(k, "inplace") == 0) {
            const IRArg *v = &n->kwargs[i];
            if (v->kind != IRARG_CONST || v->u.obj != Py_False) return false;
        }
    }
    PyObject *name = NULL;
    const char *s = NULL;
    if (n->kind == IR_CALL_METHOD) {
        s = PyUnicode_Check(n->target) ? PyUnicode_AsUTF8(n->target) : NULL;
    } else {
        name = PyObject_GetAttrString(n->target, "__name__");
        s = name && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    }
    bool removable = false;
    if (s && !ir_name_inplace(s)) {
        for (size_t i = 0; !removable && i < sizeof removable_names / sizeof removable_names[0]; i++)
            if (strcmp(s, removable_names[i]) == 0) removable = true;
        for (size_t i = 0; removable && i < sizeof impure_names / sizeof impure_names[0]; i++)
            if (strcmp(s, impure_names[i]) == 0) removable = false;
    }
    Py_XDECREF(name);
    PyErr_Clear();
    return removable;
}

typedef struct {
    const IRRef *map;
} RemapCtx;

/* Rewrites a node reference through the old->new map. */
static void ir_remap_visit(void *p, IRArg *arg) {
    const RemapCtx *c = p;
    arg->u.ref = c->map[arg->u.ref];
}

/* Dead-code elimination in one backward sweep (uses of a removed node are released before the
 * nodes they refer to are visited), then one compaction that keeps the order. Placeholders and
 * the output are never removed. Leaves user counts fresh and the Python error state untouched. */
int em_ir_dce(IRGraph *g, IRRef *refmap) {
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    IRRef *map = malloc((size_t)g->nnodes * sizeof(IRRef) + g->nnodes);
    if (!map) {
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return -1;
    }
    bool *dead = (bool *)(map + g->nnodes);
    memset(dead, 0, g->nnodes);
    em_ir_count_users(g);
    /* Backwards: a dead node releases its uses, which may kill earlier nodes in the same pass. */
    IRRef stackstamp[256];
    IRRef *stamp = g->nnodes <= 256 ? stackstamp : calloc(g->nnodes, sizeof(IRRef));
    if (!stamp) {
        free(map);
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return -1;
    }
    if (stamp == stackstamp) memset(stamp, 0, g->nnodes * sizeof(IRRef));
    UseCtx c = {g, 0, stamp, -1};
    int removed = 0;
    for (IRRef i = g->nnodes - 1; i >= 1; i--) {
        IRNode *n = &g->nodes[i];
        if (n->nusers != 0 || !ir_node_removable(n)) continue;
        dead[i] = true;
        removed++;
        c.user = i;
        ir_each_ref(n->args, n->nargs, ir_count_visit, &c);
        ir_each_ref(n->kwargs, n->nkwargs, ir_count_visit, &c);
    }
    if (stamp != stackstamp) free(stamp);
    IRRef next = 1;
    map[0] = 0;
    for (IRRef i = 1; i < g->nnodes; i++) {
        if (dead[i]) {
            map[i] = 0;
            continue;
        }
        map[i] = next;
        if (next != i) g->nodes[next] = g->nodes[i];
        next++;
    }
    RemapCtx rc = {map};
    for (IRRef i = 1; i < next; i++) {
        ir_each_ref(g->nodes[i].args, g->nodes[i].nargs, ir_remap_visit, &rc);
        ir_each_ref(g->nodes[i].kwargs, g->nodes[i].nkwargs, ir_remap_visit, &rc);
    }
    for (uint32_t i = 0; i < g->ninputs; i++) g->inputs[i] = map[g->inputs[i]];
    if (g->output) g->output = map[g->output];
    if (refmap) memcpy(refmap, map, g->nnodes * sizeof(IRRef));
    g->nnodes = next;
    free(map);
    em_ir_count_users(g);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return removed;
}

/* A graph is symbolic when it has a ShapeEnv and some node's metadata uses it. */
static bool ir_meta_symbolic(const IRMeta *m) {
    if (m->sym_sizes || m->sym) return true;
    for (uint32_t i = 0; m->kind == IRMETA_TUPLE && i < m->nitems; i++)
        if (ir_meta_symbolic(&m->items[i])) return true;
    return false;
}

bool em_ir_is_symbolic(const IRGraph *g) {
    if (!g || !g->shape_env) return false;
    for (IRRef i = 1; i < g->nnodes; i++)
        if (ir_meta_symbolic(&g->nodes[i].meta)) return true;
    return false;
}

/* The operator module's in-place forms (x += y ...), also the names of Tensor's in-place dunders
 * (__iadd__ ...) without their underscores. */
static const char *const ir_inplace_operators[] = {"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv",
                                                   "imod", "ipow", "ilshift", "irshift", "iand", "ior", "ixor",
                                                   "iconcat"};

static bool ir_inplace_operator(const char *s, size_t n) {
    for (size_t i = 0; i < sizeof ir_inplace_operators / sizeof ir_inplace_operators[0]; i++)
        if (strlen(ir_inplace_operators[i]) == n && strncmp(s, ir_inplace_operators[i], n) == 0) return true;
    return false;
}

/* F.relu(x, True), F.leaky_relu(x, 0.1, True) ...: a Python function whose positional parameter
 * `inplace` receives something other than False (read from the function's code object; only
 * Python functions have one: asking a builtin for __code__ costs an AttributeError per node). */
static bool ir_inplace_positional(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION || n->nargs < 2 || !PyFunction_Check(n->target)) return false;
    PyCodeObject *co = (PyCodeObject *)PyFunction_GET_CODE(n->target);
    bool r = false;
    PyObject *names = PyObject_GetAttrString((PyObject *)co, "co_varnames");
    if (names && PyTuple_Check(names)) {
        for (int i = 0; i < co->co_argcount && i < PyTuple_GET_SIZE(names) && (uint32_t)i < n->nargs; i++) {
            PyObject *nm = PyTuple_GET_ITEM(names, i);
            const IRArg *a = &n->args[i];
            if (PyUnicode_Check(nm) && PyUnicode_CompareWithASCIIString(nm, "inplace") == 0)
                r = !(a->kind == IRARG_CONST && a->u.obj == Py_False);
        }
    }
    Py_XDECREF(names);
    if (PyErr_Occurred()) PyErr_Clear();
    return r;
}

bool em_ir_mutates(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return false;
    bool mut = false;
    PyObject *q = n->kind == IR_CALL_METHOD ? Py_NewRef(n->target) : em_ir_target_qualname(n->target);
    const char *s = q && PyUnicode_Check(q) ? PyUnicode_AsUTF8(q) : NULL;
    if (s) {
        const char *dot = strrchr(s, '.'), *base = dot ? dot + 1 : s;
        size_t len = strlen(base);
        bool op_module = strncmp(s, "operator.", 9) == 0 || strncmp(s, "_operator.", 10) == 0;
        if (strcmp(base, "setitem") == 0 || strcmp(base, "__setitem__") == 0)
            mut = true;
        else if (op_module) /* x += y on ints is no tensor update, nor is 0 += t (int.__iadd__ is t.__radd__) */
            mut = ir_inplace_operator(base, len) && n->meta.kind == IRMETA_TENSOR && n->nargs &&
                  n->args[0].kind == IRARG_NODE;
        else if (len > 4 && strncmp(base, "__", 2) == 0 && strcmp(base + len - 2, "__") == 0)
            mut = ir_inplace_operator(base + 2, len - 4); /* __iadd__, not __add__ or __invert__ */
        else
            mut = len > 1 && base[len - 1] == '_';
    }
    Py_XDECREF(q);
    PyErr_Clear();
    for (uint32_t k = 0; k < n->nkwargs && !mut; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return true; /* unknown: an update, the safe side */
        }
        if (strcmp(kw, "out") == 0) mut = true;
        if (strcmp(kw, "inplace") == 0 && !(n->kwargs[k].kind == IRARG_CONST && n->kwargs[k].u.obj == Py_False))
            mut = true;
    }
    return mut || ir_inplace_positional(n);
}

const IRArg *em_ir_mutated_arg(const IRNode *n) {
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kn = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kn) PyErr_Clear();
        else if (!strcmp(kn, "out")) return &n->kwargs[k];
    }
    return n->nargs ? &n->args[0] : NULL;
}

/* The `inplace` parameter's index among a Python function's positional arguments, or -1. */
static int ir_inplace_index(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION || !PyFunction_Check(n->target)) return -1;
    PyCodeObject *co = (PyCodeObject *)PyFunction_GET_CODE(n->target);
    PyObject *names = PyObject_GetAttrString((PyObject *)co, "co_varnames");
    int at = -1;
    for (int i = 0; names && PyTuple_Check(names) && i < co->co_argcount && i < PyTuple_GET_SIZE(names) && at < 0; i++) {
        PyObject *nm = PyTuple_GET_ITEM(names, i);
        if (PyUnicode_Check(nm) && PyUnicode_CompareWithASCIIString(nm, "inplace") == 0) at = i;
    }
    Py_XDECREF(names);
    PyErr_Clear();
    return at;
}

int em_ir_functional_form(const IRNode *n, IRKind *kind, PyObject **target, int *inplace_arg) {
    static const char *const no_form[] = {"copy_", "zero_", "fill_", "set_", "resize_", "resize_as_", "requires_grad_",
                                          "share_memory_", "detach_", "normal_", "uniform_", "bernoulli_",
                                          "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
                                          "squeeze_", "unsqueeze_", "t_", "transpose_", "swapaxes_", "swapdims_",
                                          "as_strided_", "setitem", "__setitem__", "iconcat"};
    *target = NULL;
    *inplace_arg = -1;
    if (!em_ir_mutates(n)) return -1;
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) return PyErr_Clear(), -1;
        if (!strcmp(kw, "out")) return -1;
        if (!strcmp(kw, "inplace")) *inplace_arg = (int)(n->nargs + k);
    }
    if (*inplace_arg < 0 && ir_inplace_positional(n)) *inplace_arg = ir_inplace_index(n);
    if (*inplace_arg >= 0) { /* F.relu(x, inplace=True): the same function */
        *kind = n->kind;
        *target = Py_NewRef(n->target);
        return 0;
    }
    PyObject *q = n->kind == IR_CALL_METHOD ? Py_NewRef(n->target) : em_ir_target_qualname(n->target);
    const char *s = q && PyUnicode_Check(q) ? PyUnicode_AsUTF8(q) : NULL;
    const char *dot = s ? strrchr(s, '.') : NULL, *base = dot ? dot + 1 : s;
    size_t len = base ? strlen(base) : 0;
    for (size_t i = 0; base && i < sizeof no_form / sizeof no_form[0]; i++)
        if (!strcmp(base, no_form[i])) base = NULL;
    char name[64] = "";
    const char *module = NULL;
    if (!base || len + 1 >= sizeof name) {
        /* none */
    } else if (len > 4 && !strncmp(base, "__", 2) && !strcmp(base + len - 2, "__")) { /* x.__iadd__(y) */
        snprintf(name, sizeof name, "%.*s", (int)(len - 5), base + 3);
        module = "operator";
    } else if (n->kind == IR_CALL_FUNCTION && dot && (!strncmp(s, "operator.", 9) || !strncmp(s, "_operator.", 10))) {
        snprintf(name, sizeof name, "%s", base + 1); /* operator.iadd -> add */
        module = "operator";
    } else if (base[len - 1] == '_') {
        snprintf(name, sizeof name, "%.*s", (int)(len - 1), base);
    }
    PyObject *t = NULL;
    if (base && name[0] && module) {
        PyObject *m = PyImport_ImportModule(module);
        t = m ? PyObject_GetAttrString(m, name) : NULL;
        Py_XDECREF(m);
        *kind = IR_CALL_FUNCTION;
    } else if (base && name[0] && n->kind == IR_CALL_METHOD && base[len - 1] == '_') {
        PyObject *torch = PyImport_ImportModule("torch");
        PyObject *tt = torch ? PyObject_GetAttrString(torch, "Tensor") : NULL;
        t = tt && PyObject_HasAttrString(tt, name) ? PyUnicode_InternFromString(name) : NULL;
        Py_XDECREF(torch);
        Py_XDECREF(tt);
        *kind = IR_CALL_METHOD;
    } else if (base && name[0] && n->kind == IR_CALL_FUNCTION && dot && base[len - 1] == '_') { /* torch.relu_ */
        char mod[200];
        snprintf(mod, sizeof mod, "%.*s", (int)(dot - s), s);
        PyObject *m = PyImport_ImportModule(mod);
        t = m ? PyObject_GetAttrString(m, name) : NULL;
        Py_XDECREF(m);
        *kind = IR_CALL_FUNCTION;
    }
    Py_XDECREF(q);
    PyErr_Clear();
    if (!t) return -1;
    *target = t;
    return 0;
}

bool em_ir_meta_contiguous(const IRMeta *m) {
    if (!m || m->kind != IRMETA_TENSOR || !m->strides) return false;
    int64_t st = 1;
    for (int32_t d = m->ndim - 1; d >= 0; d--) {
        if (m->sizes[d] != 1 && m->strides[d] != st) return false;
        st *= m->sizes[d];
    }
    return true;
}

bool em_ir_meta_foldable(const IRMeta *m) {
    if (!m || m->kind != IRMETA_TENSOR || !m->strides) return false;
    for (int32_t i = 0; i + 2 < m->ndim; i++)
        if (m->strides[i] != m->strides[i + 1] * m->sizes[i + 1]) return false;
    return true;
}

bool em_ir_meta_on_cpu(const IRMeta *m) {
    if (!m || m->kind != IRMETA_TENSOR || !m->device) return false;
    PyObject *t = PyObject_GetAttrString(m->device, "type");
    bool cpu = t && PyUnicode_Check(t) && !PyUnicode_CompareWithASCIIString(t, "cpu");
    Py_XDECREF(t);
    PyErr_Clear();
    return cpu;
}

bool em_ir_layout_needs_fake(PyObject *fn) {
    static PyObject *sdpa = NULL; /* torch.nn.functional.scaled_dot_product_attention; one interpreter */
    if (!sdpa && !em_lazy_attr(&sdpa, "torch.nn.functional", "scaled_dot_product_attention")) {
        PyErr_Clear();
        return false;
    }
    return fn == sdpa;
}

int em_ir_autocast_node(const IRNode *n) {
    static PyObject *enter = NULL, *exit_ = NULL; /* torch.amp.autocast_mode.*; one interpreter */
    if (n->kind != IR_CALL_FUNCTION) return 0;
    if ((!enter && !em_lazy_attr(&enter, "torch.amp.autocast_mode", "_enter_autocast")) ||
        (!exit_ && !em_lazy_attr(&exit_, "torch.amp.autocast_mode", "_exit_autocast"))) {
        PyErr_Clear();
        return 0;
    }
    return n->target == enter ? 1 : n->target == exit_ ? 2 : 0;
}

bool em_ir_has_autocast(const IRGraph *g) {
    for (IRRef r = 1; r < g->nnodes; r++)
        if (em_ir_autocast_node(em_ir_node(g, r)) == 1) return true;
    return false;
}

bool em_ir_meta_channels_last(const IRMeta *m) {
    if (!m || m->kind != IRMETA_TENSOR || (m->ndim != 4 && m->ndim != 5) || !m->strides) return false;
    return m->sizes[1] > 1 && m->strides[1] == 1 && !em_ir_meta_contiguous(m);
}
