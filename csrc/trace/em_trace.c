/* trace: the driver, instruction decoding and the opcode loop of the symbolic interpreter.
 * Invariant: the loop never executes user bytecode for real; every instruction either updates the
 * abstract frame state (TFrame: pc, stack, locals) or records a break and stops with the frame
 * state left at the breaking instruction. Decoding reads PyCode_GetCode (de-specialised,
 * de-instrumented bytes) and maps opcode numbers to TrOp by *name*, so 3.11 and 3.12 share it. */
#include "trace/em_trace_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

TraceRT em_trace_rt;

static const char *const trop_names[] = {
    "",
#define TR_OP_NAME(name) #name,
    TR_OPCODES(TR_OP_NAME)
#undef TR_OP_NAME
};

/* CPython's code-object flags (Include/cpython/code.h). */
#define TR_CO_GENERATOR 0x20
#define TR_CO_COROUTINE 0x80
#define TR_CO_ITERABLE_COROUTINE 0x100
#define TR_CO_ASYNC_GENERATOR 0x200

/* ------------------------------------------------------------------------------------------- */
/* init                                                                                         */

/* Looks up a dotted attribute path from a root object; NULL without exception when missing. */
static PyObject *lookup_path(PyObject *root, const char *path) {
    PyObject *cur = Py_NewRef(root);
    char buf[128];
    const char *p = path;
    while (*p) {
        size_t n = strcspn(p, ".");
        if (n >= sizeof buf) {
            Py_DECREF(cur);
            return NULL;
        }
        memcpy(buf, p, n);
        buf[n] = 0;
        PyObject *next = PyObject_GetAttrString(cur, buf);
        Py_DECREF(cur);
        if (!next) {
            PyErr_Clear();
            return NULL;
        }
        cur = next;
        p += n;
        if (*p == '.') p++;
    }
    return cur;
}

/* Adds id(obj) -> code to a table dict, keeping obj alive (the table holds (obj, code)). */
static int table_add(PyObject *table, PyObject *obj, long code) {
    if (!obj) return 0;
    PyObject *key = PyLong_FromVoidPtr(obj);
    PyObject *val = Py_BuildValue("(Ol)", obj, code);
    int rc = (key && val) ? PyDict_SetItem(table, key, val) : -1;
    Py_XDECREF(key);
    Py_XDECREF(val);
    return rc;
}

/* Builtins the call stage handles (em_trace_call.c switches on these codes). */
static const char *const builtin_names[] = {
    "len", "isinstance", "issubclass", "type", "abs", "min", "max", "sum", "round", "divmod", "pow",
    "int", "float", "bool", "str", "tuple", "list", "dict", "range", "enumerate", "zip", "reversed",
    "sorted", "all", "any", "hasattr", "getattr", "callable", "iter", "next", "print", "super",
    "slice", "setattr", "open", "input", "id", "hash", "repr", "set", "frozenset", "delattr",
    "object", "chr", "ord", "map", "filter", NULL};

/* Torch functions evaluated at trace time (TQ codes in em_trace_call.c, same order). */
static const char *const torch_query_paths[] = {
    "is_grad_enabled", "get_default_dtype", "is_autocast_enabled", "backends.mha.get_fastpath_enabled",
    "overrides.has_torch_function", "overrides.has_torch_function_unary",
    "overrides.has_torch_function_variadic", "_C._get_tracing_state", "jit.is_scripting",
    "jit.is_tracing", "compiler.is_compiling", "compiler.is_dynamo_compiling", "is_tensor",
    "get_default_device", "_C._has_torch_function", "_C._has_torch_function_unary",
    "_C._has_torch_function_variadic", "is_floating_point", "is_complex", "numel",
    "_utils.is_compiling", "_jit_internal.is_scripting",
    /* evaluated for real (the default case): dispatch-mode queries, not guarded, like Dynamo */
    "_C._len_torch_dispatch_stack", "utils._python_dispatch.is_in_torch_dispatch_mode",
    "utils._python_dispatch._get_current_dispatch_mode",
    /* pure functions of Python values, folded when their arguments are constants */
    "broadcast_shapes", NULL};

static const char *const torch_factory_paths[] = {
    "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "logspace",
    "eye", "tensor", "as_tensor", "scalar_tensor", "empty_strided", "randperm", "normal",
    "tril_indices", "triu_indices", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "randint_like", NULL};

/* Builds the opcode tables and looks up the torch/builtin objects the tracer compares against.
 * Called once at module init; later calls return at once. */
int em_trace_init(PyObject *module) {
    TraceRT *rt = &em_trace_rt;
    PyObject *opcode = NULL, *opmap = NULL, *items = NULL, *caches = NULL, *jrel = NULL;
    PyObject *opname = NULL, *operator_mod = NULL, *builtins = NULL, *mm = NULL;
    if (rt->ready) return 0;
    opcode = PyImport_ImportModule("opcode");
    if (!opcode) goto error;
    opmap = PyObject_GetAttrString(opcode, "opmap");
    caches = PyObject_GetAttrString(opcode, "_inline_cache_entries");
    jrel = PyObject_GetAttrString(opcode, "hasjrel");
    opname = PyObject_GetAttrString(opcode, "opname");
    if (!opmap || !caches || !jrel || !opname) goto error;
    items = PyDict_Items(opmap);
    if (!items) goto error;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        const char *nm = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kv, 0));
        long num = PyLong_AsLong(PyTuple_GET_ITEM(kv, 1));
        if (!nm || num < 0 || num > 255) {
            PyErr_Clear();
            continue;
        }
        for (int k = 1; k < OP__COUNT; k++)
            if (strcmp(nm, trop_names[k]) == 0) rt->op_of[num] = (uint8_t)k;
        rt->jback[num] = strstr(nm, "BACKWARD") != NULL;
    }
    /* opcode._inline_cache_entries: a list indexed by opcode on 3.11 and 3.12, a dict by name on 3.13 */
    if (PyDict_Check(caches)) {
        Py_ssize_t pos = 0;
        PyObject *k, *c;
        while (PyDict_Next(caches, &pos, &k, &c)) {
            PyObject *num = PyDict_GetItemWithError(opmap, k);
            long o = num ? PyLong_AsLong(num) : -1;
            if (o >= 0 && o < 256) rt->ncache[o] = (uint8_t)PyLong_AsLong(c);
        }
    } else {
        for (Py_ssize_t i = 0; i < PySequence_Size(caches) && i < 256; i++) {
            PyObject *c = PySequence_GetItem(caches, i);
            if (!c) goto error;
            rt->ncache[i] = (uint8_t)PyLong_AsLong(c);
            Py_DECREF(c);
        }
    }
    for (Py_ssize_t i = 0; i < PySequence_Size(jrel); i++) {
        PyObject *c = PySequence_GetItem(jrel, i);
        if (!c) goto error;
        long num = PyLong_AsLong(c);
        Py_DECREF(c);
        if (num >= 0 && num < 256) rt->jrel[num] = true;
    }
    for (int i = 0; i < 256 && i < PySequence_Size(opname); i++) {
        rt->opname[i] = PySequence_GetItem(opname, i);
        if (!rt->opname[i]) goto error;
        PyUnicode_InternInPlace(&rt->opname[i]);
    }
    if (PyErr_Occurred()) goto error;

    rt->torch = PyImport_ImportModule("torch");
    if (!rt->torch) goto error;
    rt->Tensor = lookup_path(rt->torch, "Tensor");
    rt->TensorBase = lookup_path(rt->torch, "_C.TensorBase");
    if (!rt->TensorBase) rt->TensorBase = lookup_path(rt->torch, "_C._TensorBase");
    rt->Parameter = lookup_path(rt->torch, "nn.Parameter");
    rt->Module = lookup_path(rt->torch, "nn.Module");
    rt->Size = lookup_path(rt->torch, "Size");
    rt->dtype_type = lookup_path(rt->torch, "dtype");
    rt->device_type = lookup_path(rt->torch, "device");
    rt->set_grad_enabled = lookup_path(rt->torch, "_C._set_grad_enabled");
    rt->is_grad_enabled = lookup_path(rt->torch, "is_grad_enabled");
    rt->is_any_autocast_enabled = lookup_path(rt->torch, "_C._is_any_autocast_enabled");
    rt->get_default_device = lookup_path(rt->torch, "get_default_device");
    rt->no_grad_cls = lookup_path(rt->torch, "no_grad");
    rt->enable_grad_cls = lookup_path(rt->torch, "enable_grad");
    rt->set_grad_enabled_cls = lookup_path(rt->torch, "set_grad_enabled");
    /* absent on a torch without them: torch.autocast in a frame is then a graph break */
    rt->autocast_cls = lookup_path(rt->torch, "amp.autocast_mode.autocast");
    rt->enter_autocast = lookup_path(rt->torch, "amp.autocast_mode._enter_autocast");
    rt->exit_autocast = lookup_path(rt->torch, "amp.autocast_mode._exit_autocast");
    rt->autocast_legacy[0] = lookup_path(rt->torch, "cuda.amp.autocast_mode.autocast");
    rt->autocast_legacy[1] = lookup_path(rt->torch, "cpu.amp.autocast_mode.autocast");
    if (!rt->enter_autocast || !rt->exit_autocast) Py_CLEAR(rt->autocast_cls);
    rt->module_call = lookup_path(rt->torch, "nn.Module.__call__");
    rt->ModuleList = lookup_path(rt->torch, "nn.ModuleList");
    rt->Sequential = lookup_path(rt->torch, "nn.Sequential");
    rt->ModuleDict = lookup_path(rt->torch, "nn.ModuleDict");
    rt->mod_modules = lookup_path(rt->torch, "nn.Module.modules");
    rt->mod_children = lookup_path(rt->torch, "nn.Module.children");
    rt->mod_named_children = lookup_path(rt->torch, "nn.Module.named_children");
    rt->mod_named_modules = lookup_path(rt->torch, "nn.Module.named_modules");
    if (!rt->Tensor || !rt->TensorBase || !rt->Parameter || !rt->Module || !rt->Size ||
        !rt->dtype_type || !rt->device_type || !rt->set_grad_enabled ||
        !rt->is_grad_enabled || !rt->module_call || !rt->ModuleList || !rt->Sequential ||
        !rt->ModuleDict || !rt->no_grad_cls || !rt->enable_grad_cls || !rt->set_grad_enabled_cls) {
        PyErr_SetString(PyExc_ImportError, "ember.trace: torch is missing objects the tracer needs");
        goto error;
    }
    mm = PyImport_ImportModule("torch.nn.modules.module");
    if (!mm) goto error;
    static const char *const hook_names[4] = {"_global_forward_hooks", "_global_forward_pre_hooks",
                                              "_global_backward_hooks", "_global_backward_pre_hooks"};
    for (int i = 0; i < 4; i++) {
        rt->global_hooks[i] = PyObject_GetAttrString(mm, hook_names[i]);
        if (!rt->global_hooks[i]) PyErr_Clear(); /* older/newer torch: treat as absent */
    }

    operator_mod = PyImport_ImportModule("operator");
    if (!operator_mod) goto error;
    rt->operator_mod = Py_NewRef(operator_mod);
    /* NB_* order of Include/internal/pycore_opcode_utils.h (opcode._nb_ops), 3.11 == 3.12 */
    static const char *const nb_names[TR_NBINOPS] = {
        "add", "and_", "floordiv", "lshift", "matmul", "mul", "mod", "or_", "pow", "rshift", "sub",
        "truediv", "xor", "iadd", "iand", "ifloordiv", "ilshift", "imatmul", "imul", "imod", "ior",
        "ipow", "irshift", "isub", "itruediv", "ixor"};
    for (int i = 0; i < TR_NBINOPS; i++)
        if (!(rt->binop_fn[i] = PyObject_GetAttrString(operator_mod, nb_names[i]))) goto error;
    static const char *const cmp_names[TR_NCMP] = {"lt", "le", "eq", "ne", "gt", "ge"};
    for (int i = 0; i < TR_NCMP; i++)
        if (!(rt->cmp_fn[i] = PyObject_GetAttrString(operator_mod, cmp_names[i]))) goto error;
    if (!(rt->op_neg = PyObject_GetAttrString(operator_mod, "neg")) ||
        !(rt->op_pos = PyObject_GetAttrString(operator_mod, "pos")) ||
        !(rt->op_invert = PyObject_GetAttrString(operator_mod, "invert")) ||
        !(rt->op_not = PyObject_GetAttrString(operator_mod, "not_")) ||
        !(rt->op_getitem = PyObject_GetAttrString(operator_mod, "getitem")) ||
        !(rt->op_setitem = PyObject_GetAttrString(operator_mod, "setitem")) ||
        !(rt->op_delitem = PyObject_GetAttrString(operator_mod, "delitem")) ||
        !(rt->op_contains = PyObject_GetAttrString(operator_mod, "contains")) ||
        !(rt->op_truth = PyObject_GetAttrString(operator_mod, "truth")) ||
        !(rt->op_abs = PyObject_GetAttrString(operator_mod, "abs")))
        goto error;
    rt->math_mod = PyImport_ImportModule("math");
    if (!rt->math_mod) goto error;

    builtins = PyImport_ImportModule("builtins");
    if (!builtins) goto error;
    rt->builtins_dict = Py_NewRef(PyModule_GetDict(builtins));
    rt->bi_table = PyDict_New();
    rt->torch_query = PyDict_New();
    rt->torch_factory = PyDict_New();
    if (!rt->bi_table || !rt->torch_query || !rt->torch_factory) goto error;
    for (int i = 0; builtin_names[i]; i++) {
        PyObject *b = PyDict_GetItemString(rt->builtins_dict, builtin_names[i]);
        if (b && table_add(rt->bi_table, b, i + 1) < 0) goto error;
    }
    for (int i = 0; torch_query_paths[i]; i++) {
        PyObject *f = lookup_path(rt->torch, torch_query_paths[i]);
        int rc = table_add(rt->torch_query, f, i + 1);
        Py_XDECREF(f);
        if (rc < 0) goto error;
    }
    for (int i = 0; torch_factory_paths[i]; i++) {
        PyObject *f = lookup_path(rt->torch, torch_factory_paths[i]);
        int rc = table_add(rt->torch_factory, f, i + 1);
        Py_XDECREF(f);
        if (rc < 0) goto error;
    }
    {
        PyObject *finfo = lookup_path(rt->torch, "finfo"), *iinfo = lookup_path(rt->torch, "iinfo");
        rt->pure_classes = PyTuple_Pack(4, rt->Size, rt->device_type, finfo ? finfo : rt->Size,
                                        iinfo ? iinfo : rt->Size);
        Py_XDECREF(finfo);
        Py_XDECREF(iinfo);
        if (!rt->pure_classes) goto error;
    }
    rt->meta_str = PyUnicode_InternFromString("meta");
    if (!rt->meta_str) goto error;
    rt->meta_device = PyObject_CallOneArg(rt->device_type, rt->meta_str);
    if (!rt->meta_device) goto error;
    {
        PyObject *insp = PyImport_ImportModule("inspect");
        if (!insp) goto error;
        rt->inspect_signature = PyObject_GetAttrString(insp, "signature");
        rt->inspect_Signature = PyObject_GetAttrString(insp, "Signature");
        rt->inspect_Parameter = PyObject_GetAttrString(insp, "Parameter");
        Py_DECREF(insp);
        PyObject *en = PyImport_ImportModule("enum");
        if (!en) goto error;
        rt->enum_Enum = PyObject_GetAttrString(en, "Enum");
        Py_DECREF(en);
        if (!rt->enum_Enum) goto error;
        if (!rt->inspect_signature || !rt->inspect_Signature || !rt->inspect_Parameter) goto error;
        PyObject *cp = PyImport_ImportModule("copy");
        if (!cp) goto error;
        rt->copy_deepcopy = PyObject_GetAttrString(cp, "deepcopy");
        rt->copy_copy = PyObject_GetAttrString(cp, "copy");
        Py_DECREF(cp);
        if (!rt->copy_deepcopy || !rt->copy_copy) goto error;
    }
    rt->ready = true;
    Py_DECREF(opcode);
    Py_DECREF(opmap);
    Py_DECREF(items);
    Py_DECREF(caches);
    Py_DECREF(jrel);
    Py_DECREF(opname);
    Py_DECREF(operator_mod);
    Py_DECREF(builtins);
    Py_DECREF(mm);
    EM_UNUSED(module);
    return 0;
error:
    Py_XDECREF(opcode);
    Py_XDECREF(opmap);
    Py_XDECREF(items);
    Py_XDECREF(caches);
    Py_XDECREF(jrel);
    Py_XDECREF(opname);
    Py_XDECREF(operator_mod);
    Py_XDECREF(builtins);
    Py_XDECREF(mm);
    return -1;
}

/* ------------------------------------------------------------------------------------------- */
/* breaks                                                                                       */

/* Fills filename/lineno/opname of a break from the innermost frame's current instruction. */
static void break_location(Trace *T, EmBreakInfo *b) {
    TFrame *F = T->cur;
    if (!F) return;
    if (getenv("EMBER_DEBUG_BREAK_STACK")) { /* the inlined call stack at the break, innermost first */
        for (TFrame *G = F; G; G = G->parent) {
            int line = G->pc < G->nins ? PyCode_Addr2Line(G->code, (int)G->ins[G->pc].offset) : -1;
            const char *q = PyUnicode_AsUTF8(G->code->co_qualname), *fn = PyUnicode_AsUTF8(G->code->co_filename);
            fprintf(stderr, "  ember break stack: %s (%s:%d)\n", q ? q : "?", fn ? fn : "?", line);
        }
        PyErr_Clear();
    }
    b->filename = em_arena_hold(T->arena, F->code->co_filename);
    if (F->pc < F->nins) {
        TInstr *in = &F->ins[F->pc];
        b->lineno = PyCode_Addr2Line(F->code, (int)in->offset);
        b->opname = em_trace_rt.opname[in->opcode];
    }
}

int em_tr_break(Trace *T, EmBreak reason, const char *fmt, ...) {
    if (T->broke) return -1;
    T->broke = true;
    /* inside a torch.autocast block of the top frame the split is at its with statement: each
     * graph enters and exits its blocks (em_tr_autocast_enter) */
    T->res->brk_top_step = T->ac_top_step >= 0 ? T->ac_top_step : T->top_steps - 1;
    EmBreakInfo *b = &T->res->brk;
    b->reason = reason;
    b->lineno = -1;
    if (fmt) {
        PyObject *exc = em_tr_exc_get();
        va_list ap;
        va_start(ap, fmt);
        PyObject *d = PyUnicode_FromFormatV(fmt, ap);
        va_end(ap);
        if (!d) PyErr_Clear();
        b->detail = em_arena_hold_steal(T->arena, d);
        em_tr_exc_set(exc);
    }
    break_location(T, b);
    if (getenv("EMBER_DEBUG_BREAK_STACK")) {
        const char *d = b->detail ? PyUnicode_AsUTF8(b->detail) : NULL;
        fprintf(stderr, "ember break: %s: %s\n", em_break_name(reason), d ? d : "");
        PyErr_Clear();
    }
    return -1;
}

int em_tr_break_exc(Trace *T, EmBreak reason) {
    if (!PyErr_Occurred()) return em_tr_break(T, reason, NULL);
    if (PyErr_ExceptionMatches(PyExc_MemoryError) || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        return -1; /* propagates as a real error */
    PyObject *exc = em_tr_exc_get();
    PyObject *txt = exc ? PyObject_Str(exc) : NULL;
    if (!txt) PyErr_Clear();
    const char *tn = exc ? Py_TYPE(exc)->tp_name : "exception";
    if (txt)
        em_tr_break(T, reason, "%s: %U", tn, txt);
    else
        em_tr_break(T, reason, "%s", tn);
    Py_XDECREF(txt);
    Py_XDECREF(exc);
    return -1;
}

const char *em_tr_repr_cstr(Trace *T, PyObject *o) {
    /* only used on objects whose repr is plain C (types, functions, str); never user __repr__ */
    PyObject *r = NULL;
    if (PyType_Check(o))
        r = PyUnicode_FromString(((PyTypeObject *)o)->tp_name);
    else if (PyUnicode_Check(o))
        r = Py_NewRef(o);
    else if (PyFunction_Check(o))
        r = Py_NewRef(((PyFunctionObject *)o)->func_qualname);
    else
        r = PyUnicode_FromFormat("<%s object>", Py_TYPE(o)->tp_name);
    const char *s = r ? PyUnicode_AsUTF8(r) : NULL;
    if (!s) {
        PyErr_Clear();
        Py_XDECREF(r);
        return "?";
    }
    char *c = em_arena_strdup(T->arena, s);
    Py_DECREF(r);
    return c ? c : "?";
}

/* ------------------------------------------------------------------------------------------- */
/* decoding                                                                                     */

/* Decodes the code's instructions and exception table into F. Returns 0, 1 if the exception
 * table is malformed, -1 on error. */
static int decode(Trace *T, TFrame *F) {
    TraceRT *rt = &em_trace_rt;
    PyObject *bytes = PyCode_GetCode(F->code);
    if (!bytes) return -1;
    if (!PyBytes_Check(bytes)) {
        Py_DECREF(bytes);
        PyErr_SetString(PyExc_TypeError, "co_code is not bytes");
        return -1;
    }
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(bytes);
    uint32_t nunits = (uint32_t)(PyBytes_GET_SIZE(bytes) / 2);
    F->off2ins = em_arena_alloc(T->arena, sizeof(int32_t) * (nunits + 1));
    F->ins = em_arena_alloc(T->arena, sizeof(TInstr) * (nunits + 1));
    int32_t *tunit = em_arena_alloc(T->arena, sizeof(int32_t) * (nunits + 1));
    if (!F->off2ins || !F->ins || !tunit) {
        Py_DECREF(bytes);
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i <= nunits; i++) F->off2ins[i] = -1;
    uint32_t n = 0, i = 0, start = 0;
    int32_t ext = 0;
    bool in_ext = false;
    while (i < nunits) {
        uint8_t opc = b[2 * i], a = b[2 * i + 1];
        uint8_t op = rt->op_of[opc];
        if (op == OP_EXTENDED_ARG) {
            if (!in_ext) start = i;
            in_ext = true;
            ext = (ext | a) << 8;
            i++;
            continue;
        }
        if (op == OP_CACHE) { /* stray cache unit: skip */
            i++;
            continue;
        }
        TInstr *in = &F->ins[n];
        in->op = op;
        in->opcode = opc;
        in->arg = ext | a;
        in->offset = 2 * i;
        in->start = 2 * (in_ext ? start : i);
        in->target = -1;
        F->off2ins[in->start / 2] = (int32_t)n;
        F->off2ins[i] = (int32_t)n;
        uint32_t next = i + 1 + rt->ncache[opc];
        tunit[n] = -1;
        if (rt->jrel[opc]) /* relative to the instruction after the caches (dis._get_jump_target) */
            tunit[n] = rt->jback[opc] ? (int32_t)next - in->arg : (int32_t)next + in->arg;
        ext = 0;
        in_ext = false;
        n++;
        i = next;
    }
    Py_DECREF(bytes);
    F->nins = n;
    for (uint32_t k = 0; k < n; k++)
        if (tunit[k] >= 0 && (uint32_t)tunit[k] <= nunits) F->ins[k].target = F->off2ins[tunit[k]];
    /* exception table: (start, length, target, depth_lasti) entries, em_trace_exc.c */
    PyObject *et = F->code->co_exceptiontable;
    if (et && PyBytes_Check(et) && PyBytes_GET_SIZE(et) > 0)
        return em_tr_exc_decode(T, F, (const unsigned char *)PyBytes_AS_STRING(et), PyBytes_GET_SIZE(et), nunits);
    return 0;
}

TFrame *em_tr_frame_new(Trace *T, PyCodeObject *code, PyObject *globals, PyObject *builtins, GuardSrc gsrc) {
    TFrame *F = em_arena_alloc(T->arena, sizeof(TFrame));
    if (!F) {
        PyErr_NoMemory();
        return NULL;
    }
    F->code = (PyCodeObject *)em_arena_hold(T->arena, (PyObject *)code);
    F->globals = em_arena_hold(T->arena, globals);
    F->builtins = em_arena_hold(T->arena, builtins);
    F->gsrc = gsrc;
    F->nlocals = code->co_nlocalsplus;
    F->stackcap = code->co_stacksize + 4;
    F->locals = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(F->nlocals + 1));
    F->stack = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)F->stackcap);
    if (!F->locals || !F->stack) {
        PyErr_NoMemory();
        return NULL;
    }
    int rc = decode(T, F);
    if (rc < 0) return NULL;
    F->parent = T->cur;
    F->depth = T->cur ? T->cur->depth + 1 : 0;
    if (rc == 1) {
        TFrame *saved = T->cur;
        T->cur = F;
        em_tr_break(T, EM_BREAK_TRY_BLOCK, "%U has a malformed exception table", code->co_qualname);
        T->cur = saved;
        return NULL;
    }
    return F;
}

/* ------------------------------------------------------------------------------------------- */
/* the opcode loop                                                                              */

static int push(Trace *T, TFrame *F, TValue *v) {
    if (!v) return -1;
    if (F->sp >= F->stackcap) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack overflow");
    F->stack[F->sp++] = v;
    return 0;
}

static TValue *pop(Trace *T, TFrame *F) {
    if (F->sp <= 0) {
        em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
        return NULL;
    }
    return F->stack[--F->sp];
}

/* A call sequence's callable with its NULL: [NULL, callable] on 3.11 and 3.12, [callable, NULL] from
 * 3.13, where the NULL stands in the slot a method's self takes (Python/bytecodes.c, CALL). */
static int push_callable(Trace *T, TFrame *F, TValue *callable) {
    if (!callable) return -1;
#if EM_PY313
    if (push(T, F, callable) < 0) return -1;
    return push(T, F, T->null_value);
#else
    if (push(T, F, T->null_value) < 0) return -1;
    return push(T, F, callable);
#endif
}

static TValue *peek(Trace *T, TFrame *F, int n) { /* n >= 1: stack[-n] */
    if (n < 1 || F->sp < n) {
        em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
        return NULL;
    }
    return F->stack[F->sp - n];
}

static PyObject *co_name_at(Trace *T, TFrame *F, int i) {
    PyObject *names = F->code->co_names;
    if (i < 0 || i >= PyTuple_GET_SIZE(names)) {
        em_tr_break(T, EM_BREAK_INTERNAL, "name index out of range");
        return NULL;
    }
    return PyTuple_GET_ITEM(names, i);
}

static PyObject *co_const_at(Trace *T, TFrame *F, int i) {
    PyObject *consts = F->code->co_consts;
    if (i < 0 || i >= PyTuple_GET_SIZE(consts)) {
        em_tr_break(T, EM_BREAK_INTERNAL, "constant index out of range");
        return NULL;
    }
    return PyTuple_GET_ITEM(consts, i);
}

/* LOAD_GLOBAL: reads the frame's globals (then builtins) for real and guards the dicts' versions.
 * Values from globals are stable: the version guard fixes them (architecture.md, guard policy). */
static TValue *load_global(Trace *T, TFrame *F, PyObject *name) {
    if (F->gsrc == -2) { /* a global this trace stored (replayed after the graph) */
        TValue *stored = em_tr_effect_global(T, F, name);
        if (stored) return stored;
    }
    PyObject *v = PyDict_GetItemWithError(F->globals, name);
    if (!v && PyErr_Occurred()) return NULL;
    if (F->gsrc >= 0 ? em_tr_guard_dict(T, F->globals, F->gsrc, "", name) < 0
                     : em_tr_dict_version(T, F->globals, F->gsrc == -2 ? "G" : "globals", name) < 0)
        return NULL;
    GuardSrc s = -1;
    if (v) {
        if (F->gsrc == -2)
            s = em_guard_src_global(T->gb, name, v);
        else if (F->gsrc >= 0)
            s = em_guard_src_dict_item(T->gb, F->gsrc, name, v);
    } else {
        if (!PyDict_Check(F->builtins)) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "frame builtins is not a dict");
            return NULL;
        }
        v = PyDict_GetItemWithError(F->builtins, name);
        if (!v && PyErr_Occurred()) return NULL;
        if (!v) {
            em_tr_break(T, EM_BREAK_RAISE, "name '%U' is not defined", name);
            return NULL;
        }
        if (em_tr_dict_version(T, F->builtins, "B", name) < 0) return NULL;
        if (F->builtins == T->fv->builtins) s = em_guard_src_builtin(T->gb, name, v);
    }
    if (s >= 0) em_guard_src_stable(T->gb, s);
    return em_tr_wrap(T, v, s, true);
}

static TValue *cell_contents(Trace *T, TValue *c) {
    if (!c || c->kind != TV_CELL) {
        em_tr_break(T, EM_BREAK_INTERNAL, "deref of a non-cell");
        return NULL;
    }
    if (!c->u.cell.contents) {
        em_tr_break(T, EM_BREAK_RAISE, "free variable referenced before assignment");
        return NULL;
    }
    return c->u.cell.contents;
}

/* Is v None? Guards the value when it comes from an input. -1 on break. */
static int is_none(Trace *T, TValue *v, bool *out) {
    if (!(v = em_tr_realize(T, v))) return -1;
    if (v->kind == TV_CONST) {
        if (em_tr_use(T, v) < 0) return -1;
        *out = v->obj == Py_None;
        return 0;
    }
    if (v->kind == TV_NULL) return em_tr_break(T, EM_BREAK_INTERNAL, "None test of NULL");
    *out = false;
    return 0;
}

/* `a is b` on abstract values. */
static int is_same(Trace *T, TValue *a, TValue *b, bool *out) {
    if (!(a = em_tr_realize(T, a)) || !(b = em_tr_realize(T, b))) return -1;
    if (!(a = em_tr_sym_settle(T, a)) || !(b = em_tr_sym_settle(T, b))) return -1; /* `n > 3 is True` */
    if (a == b) {
        *out = true;
        return 0;
    }
    bool a_obj = a->obj && (a->kind == TV_CONST || a->kind == TV_OBJECT || a->kind == TV_NN_MODULE ||
                            (a->kind == TV_FUNCTION && a->obj));
    bool b_obj = b->obj && (b->kind == TV_CONST || b->kind == TV_OBJECT || b->kind == TV_NN_MODULE ||
                            (b->kind == TV_FUNCTION && b->obj));
    if (a_obj && b_obj && (a->by_type || b->by_type) && Py_TYPE(a->obj) != Py_TYPE(b->obj)) {
        /* an input object guarded by its type is not an object of another type (`out is None`):
         * no identity guard; the other side is guarded as any use of it */
        TValue *other = a->by_type ? b : a;
        if (!other->by_type && em_tr_use(T, other) < 0) return -1;
        *out = false;
        return 0;
    }
    if (a_obj && b_obj) {
        if (em_tr_use(T, a) < 0 || em_tr_use(T, b) < 0) return -1;
        *out = a->obj == b->obj;
        return 0;
    }
    /* a tensor made or guarded in the trace is never a constant/module/function */
    if (((a->kind == TV_TENSOR || a->kind == TV_NDARRAY) && b_obj) || ((b->kind == TV_TENSOR || b->kind == TV_NDARRAY) && a_obj)) {
        if (em_tr_use(T, a_obj ? a : b) < 0) return -1;
        *out = false;
        return 0;
    }
    if (a->kind == TV_TENSOR && b->kind == TV_TENSOR && a->u.t.ref && a->u.t.ref == b->u.t.ref) {
        *out = true; /* the same node result (an in-place op kept the value) */
        return 0;
    }
    if ((a->kind == TV_INSTANCE || b->kind == TV_INSTANCE) && a != b && b->kind != TV_LAZY && a->kind != TV_LAZY) {
        const TValue *in = a->kind == TV_INSTANCE && a->u.inst.input ? a : b->kind == TV_INSTANCE && b->u.inst.input ? b : NULL;
        const TValue *other = in == a ? b : a;
        if (in && other->obj && other->kind != TV_CONST)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "identity of a %s from an input, read by its contents",
                               ((PyTypeObject *)in->u.inst.cls)->tp_name);
        *out = false; /* an instance made in the trace is a fresh object (an input one: not a constant) */
        return 0;
    }
    if ((a->kind == TV_LIST || a->kind == TV_DICT) && a->mutable && a != b) {
        *out = false; /* a trace-made container is a fresh object */
        return 0;
    }
    if ((b->kind == TV_LIST || b->kind == TV_DICT) && b->mutable && a != b) {
        *out = false;
        return 0;
    }
    if (a_obj && b->kind != TV_TENSOR && b->kind != TV_OBJECT) {
        /* None vs a container/function made in the trace */
        if (a->obj == Py_None && (b->kind == TV_TUPLE || b->kind == TV_LIST || b->kind == TV_DICT ||
                                  b->kind == TV_FUNCTION || b->kind == TV_BOUND_METHOD)) {
            if (em_tr_use(T, a) < 0) return -1;
            *out = false;
            return 0;
        }
    }
    if (b_obj && b->obj == Py_None && (a->kind == TV_TUPLE || a->kind == TV_LIST || a->kind == TV_DICT ||
                                       a->kind == TV_FUNCTION || a->kind == TV_BOUND_METHOD)) {
        if (em_tr_use(T, b) < 0) return -1;
        *out = false;
        return 0;
    }
    return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "identity test between untracked values");
}

/* Builds the OutSpec for the top frame's return value. Tensor results become graph outputs
 * (deduplicated), input objects returned unchanged are fetched, constants are kept. */

/* True when cls is a structseq (torch.return_types.max) whose fields are all sequence fields
 * and number n: then cls(items_tuple) rebuilds the value exactly (Objects/structseq.c,
 * structseq_new_impl). A structseq with hidden fields (os.stat_result) is not. */
static bool is_plain_structseq(PyObject *cls, uint32_t n) {
    PyObject *nf = NULL, *ns = NULL;
    bool ok = false;
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) return false;
    nf = PyObject_GetAttrString(cls, "n_fields");
    ns = nf ? PyObject_GetAttrString(cls, "n_sequence_fields") : NULL;
    if (nf && ns && PyLong_Check(nf) && PyLong_Check(ns))
        ok = PyLong_AsLong(nf) == (long)n && PyLong_AsLong(ns) == (long)n;
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XDECREF(nf);
    Py_XDECREF(ns);
    return ok;
}

/* ---- what a returned object holds: one walk, several questions ----
 * An instance made in the trace is returned rebuilt: by calling its class with its rebuilt
 * construction arguments (the state its __init__ gives), or from its final state (OUT_NEW). The
 * first is wrong once something within changed after __init__ returned: an instance (transformers'
 * DynamicCache: the DynamicLayer objects whose keys and values update() sets), or a list or dict
 * __init__ made and the frame filled (appends and item stores mark nothing). */

typedef struct WalkQ {
    const TValue *(*hit)(const struct WalkQ *q, const TValue *w, int depth); /* w itself, or NULL */
    bool enter_instances; /* descend into instances' attributes and items */
    const TValue *root, *target;
} WalkQ;

/* The first w that q->hit names, over v and what it holds (instance attributes and items when
 * q->enter_instances, list and tuple items, dict values), depth-first, 8 levels at most. */
static const TValue *walk(const WalkQ *q, const TValue *v, int depth) {
    if (!v || depth > 8) return NULL;
    const TValue *d = q->hit(q, v, depth);
    if (d) return d;
    switch (v->kind) {
    case TV_INSTANCE:
        if (!q->enter_instances) return NULL;
        d = walk(q, v->u.inst.attrs, depth + 1);
        return d ? d : walk(q, v->u.inst.items, depth + 1);
    case TV_LIST: case TV_TUPLE:
        for (uint32_t i = 0; !d && i < v->u.seq.n; i++) d = walk(q, v->u.seq.items[i], depth + 1);
        return d;
    case TV_DICT:
        for (uint32_t i = 0; !d && i < v->u.dict.n; i++) d = walk(q, v->u.dict.vals[i], depth + 1);
        return d;
    default:
        return NULL;
    }
}

static const TValue *hit_dirty(const WalkQ *q, const TValue *w, int depth) {
    EM_UNUSED(q);
    EM_UNUSED(depth);
    return w->kind == TV_INSTANCE && w->u.inst.dirty ? w : NULL;
}

static const TValue *hit_target(const WalkQ *q, const TValue *w, int depth) {
    EM_UNUSED(depth);
    return w == q->target ? w : NULL;
}

static const TValue *hit_container(const WalkQ *q, const TValue *w, int depth) {
    EM_UNUSED(q);
    return (w->kind == TV_LIST || w->kind == TV_DICT) && w->mutable && depth > 0 ? w : NULL;
}

/* Is w reached from instance root's construction arguments? */
static bool from_args(const TValue *root, const TValue *w) {
    WalkQ q = {hit_target, true, NULL, w};
    if (walk(&q, root->u.inst.args, 0)) return true;
    uint32_t nkw = root->u.inst.kwnames ? (uint32_t)PyTuple_GET_SIZE(root->u.inst.kwnames) : 0;
    for (uint32_t i = 0; i < nkw; i++)
        if (walk(&q, root->u.inst.kwvals[i], 0)) return true;
    return false;
}

/* a changed instance within q->root that its construction arguments do not reach: calling its
 * class would lose the change of an object its own __init__ made */
static const TValue *hit_dirty_beyond_args(const WalkQ *q, const TValue *w, int depth) {
    EM_UNUSED(depth);
    return w != q->root && hit_dirty(q, w, depth) && !from_args(q->root, w) ? w : NULL;
}

/* A changed instance within v (v itself first), or NULL. */
static const TValue *dirty_within(const TValue *v) {
    WalkQ q = {hit_dirty, true, NULL, NULL};
    return walk(&q, v, 0);
}

/* A list or dict made in the trace that instance v holds, not through another instance (those
 * decide for themselves), or NULL. */
static const TValue *container_within(const TValue *v) {
    WalkQ q = {hit_container, false, NULL, NULL};
    const TValue *d = walk(&q, v->u.inst.attrs, 0);
    return d ? d : walk(&q, v->u.inst.items, 0);
}

static const TValue *dirty_beyond_args(const TValue *root) {
    WalkQ q = {hit_dirty_beyond_args, true, root, NULL};
    return walk(&q, root, 0);
}

/* Can instance v be rebuilt from its __dict__ alone (OUT_NEW): a Python class whose instances
 * object.__new__ makes, with a __dict__ and no dict part (not a dict subclass), no class in its
 * MRO with non-empty __slots__ (abc.ABC's empty ones hold nothing). */
static bool plain_class(const TValue *v) {
    PyTypeObject *tp = (PyTypeObject *)v->u.inst.cls;
    if (v->u.inst.items || !(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || tp->tp_new != PyBaseObject_Type.tp_new ||
        tp->tp_dictoffset == 0 || tp->tp_itemsize != 0 || !tp->tp_mro || PyType_IsSubtype(tp, &PyDict_Type) ||
        PyType_IsSubtype(tp, &PyList_Type) || PyType_IsSubtype(tp, &PyTuple_Type))
        return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tp->tp_mro); i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(tp->tp_mro, i);
        if (base == &PyBaseObject_Type) continue;
        /* a static builtin base (its tp_dict is NULL from 3.12): state outside __dict__ maybe */
        if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE) || !base->tp_dict) return false;
        PyObject *slots = PyDict_GetItemWithError(base->tp_dict, em_str("__slots__"));
        Py_ssize_t n = slots ? PyObject_Size(slots) : 0;
        if (PyErr_Occurred()) return PyErr_Clear(), false;
        if (n != 0) return false;
    }
    return true;
}

static int out_spec(Trace *T, OutCtx *C, TValue *v, OutSpec *o, int depth) {
    if (depth > 64) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return value nested too deep");
    if (C->split) { /* values live at a graph break (em_trace_resume.c) */
        int r = em_tr_split_value_spec(T, C, v, o, depth);
        if (r != 1) return r;
    }
    if (v->kind == TV_LAZY && v->src < 0 && !(v = em_tr_realize(T, v))) /* made in the trace (a local import) */
        return -1;
    if (v->kind == TV_LAZY && v->src >= 0) { /* an input object returned as is */
        PyObject *o_ = v->obj;
        if (PyObject_TypeCheck(o_, (PyTypeObject *)em_trace_rt.TensorBase)) {
            if (!(v = em_tr_realize(T, v))) return -1;
        } else {
            int slot = em_guard_fetch(T->gb, v->src);
            if (slot < 0) return -1;
            o->kind = OUT_FETCH;
            o->index = (uint32_t)slot;
            return 0;
        }
    }
    if (((v->kind == TV_SYMINT && v->symbool) || v->kind == TV_SYMFLOAT) && !(v = em_tr_sym_settle(T, v)))
        return -1; /* leaves as a constant (its sizes guarded) */
    switch (v->kind) {
    case TV_NDARRAY:
        return em_tr_np_out_spec(T, C, v, o, depth);
    case TV_SYMINT: /* a size returned: a graph output computed from sym_size nodes */
    case TV_TENSOR: {
        uint32_t r;
        if (v->kind == TV_SYMINT) {
            IRArg a;
            PyObject *hint = NULL;
            if (em_tr_sym_arg(T, v, &a, &hint) < 0) return -1;
            Py_DECREF(hint);
            if (a.kind != IRARG_NODE) { /* became a constant */
                o->kind = OUT_CONST;
                o->obj = a.u.obj;
                return 0;
            }
            r = a.u.ref;
        } else {
            r = em_tr_tensor_ref(T, v);
        }
        if (!r) return -1;
        uint32_t k;
        for (k = 0; k < C->refs.n; k++)
            if (C->refs.items[k] == r) break;
        if (k == C->refs.n && EM_VEC_PUSH(T->arena, C->refs, r) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        o->kind = OUT_GRAPH;
        o->index = k;
        return 0;
    }
    case TV_CONST:
        if (PySet_CheckExact(v->obj))
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of a set"); /* one object, many calls */
        if (v->src >= 0 && !v->guarded && !v->stable) {
            int slot = em_guard_fetch(T->gb, v->src);
            if (slot < 0) return -1;
            o->kind = OUT_FETCH;
            o->index = (uint32_t)slot;
            return 0;
        }
        o->kind = OUT_CONST;
        o->obj = v->obj;
        return 0;
    case TV_TUPLE:
    case TV_LIST: {
        if (v->src >= 0 && !v->mutable) { /* an input container, never mutated (that would break) */
            int slot = em_guard_fetch(T->gb, v->src);
            if (slot < 0) return -1;
            o->kind = OUT_FETCH;
            o->index = (uint32_t)slot;
            return 0;
        }
        PyObject *cls = v->u.seq.cls;
        if (v->kind == TV_TUPLE && cls) {
            if (cls != em_trace_rt.Size && !PyObject_HasAttrString(cls, "_fields") && !is_plain_structseq(cls, v->u.seq.n))
                return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of a %s structseq",
                                   ((PyTypeObject *)cls)->tp_name);
            o->kind = OUT_NAMEDTUPLE;
            o->obj = cls;
        } else {
            o->kind = v->kind == TV_TUPLE ? OUT_TUPLE : OUT_LIST;
        }
        o->n = v->u.seq.n;
        o->items = em_arena_alloc(T->arena, sizeof(OutSpec) * (o->n + 1));
        if (!o->items) {
            PyErr_NoMemory();
            return -1;
        }
        for (uint32_t i = 0; i < o->n; i++)
            if (out_spec(T, C, v->u.seq.items[i], &o->items[i], depth + 1) < 0) return -1;
        return 0;
    }
    case TV_DICT: {
        if (v->src >= 0 && !v->mutable) {
            int slot = em_guard_fetch(T->gb, v->src);
            if (slot < 0) return -1;
            o->kind = OUT_FETCH;
            o->index = (uint32_t)slot;
            return 0;
        }
        o->kind = OUT_DICT;
        o->n = v->u.dict.n;
        PyObject *keys = PyTuple_New(o->n);
        if (!keys) return -1;
        for (uint32_t i = 0; i < o->n; i++) PyTuple_SET_ITEM(keys, i, Py_NewRef(v->u.dict.keys[i]));
        o->obj = em_arena_hold_steal(T->arena, keys);
        o->items = em_arena_alloc(T->arena, sizeof(OutSpec) * (o->n + 1));
        if (!o->obj || !o->items) {
            PyErr_NoMemory();
            return -1;
        }
        for (uint32_t i = 0; i < o->n; i++)
            if (out_spec(T, C, v->u.dict.vals[i], &o->items[i], depth + 1) < 0) return -1;
        return 0;
    }
    case TV_INSTANCE: {
        if (v->u.inst.input) { /* an input object, never mutated here (that breaks): itself */
            int slot = em_guard_fetch(T->gb, v->src);
            if (slot < 0) return -1;
            o->kind = OUT_FETCH;
            o->index = (uint32_t)slot;
            return 0;
        }
        /* rebuilt after the graph by calling its class with the rebuilt construction arguments */
        { /* one object reached twice (returned, or live at a break) would come back as two */
            for (uint32_t i = 0; i < C->seen.n; i++)
                if (C->seen.items[i] == v)
                    return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a %s made in the frame reached twice (one object, rebuilt as two)",
                                       ((PyTypeObject *)v->u.inst.cls)->tp_name);
            if (EM_VEC_PUSH(T->arena, C->seen, v) < 0) {
                PyErr_NoMemory();
                return -1;
            }
        }
        const TValue *dirty = dirty_within(v), *held = container_within(v);
        if ((dirty || held) && plain_class(v)) {
            /* changed after its __init__ (itself or an object within): its final state, without
             * running __init__ again (Dynamo reconstructs such objects so too) */
            o->kind = OUT_NEW;
            o->obj = v->u.inst.cls;
            o->n = 1;
            if (!(o->items = em_arena_alloc(T->arena, sizeof(OutSpec)))) {
                PyErr_NoMemory();
                return -1;
            }
            return out_spec(T, C, v->u.inst.attrs, &o->items[0], depth + 1);
        }
        if (dirty == v)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of a %s mutated after construction",
                               ((PyTypeObject *)v->u.inst.cls)->tp_name);
        if (held)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of a %s holding a %s made in the frame",
                               ((PyTypeObject *)v->u.inst.cls)->tp_name, held->kind == TV_LIST ? "list" : "dict");
        if (dirty && !(dirty = dirty_beyond_args(v))) {
            /* every changed object within comes from the construction arguments: rebuilt there */
        } else if (dirty)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of a %s whose %s was mutated after construction",
                               ((PyTypeObject *)v->u.inst.cls)->tp_name, ((PyTypeObject *)dirty->u.inst.cls)->tp_name);
        uint32_t nkw = v->u.inst.kwnames ? (uint32_t)PyTuple_GET_SIZE(v->u.inst.kwnames) : 0;
        TValue *kw = em_tr_dict(T);
        if (!kw) return -1;
        for (uint32_t i = 0; i < nkw; i++)
            if (em_tr_dict_set(T, kw, PyTuple_GET_ITEM(v->u.inst.kwnames, i), v->u.inst.kwvals[i]) < 0) return -1;
        TValue *parts[2] = {v->u.inst.args, kw};
        for (int p = 0; p < 2; p++) {
            TValue **items;
            uint32_t n;
            if (p == 0 ? em_tr_items(T, parts[0], &items, &n) < 0 : 0) return -1;
            for (uint32_t i = 0; p == 0 && i < n; i++) {
                TValue *a = em_tr_realize(T, items[i]);
                if (!a) return -1;
                if (a->mutable && a->kind != TV_INSTANCE)
                    return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of an object built from a mutable container");
            }
        }
        for (uint32_t i = 0; i < nkw; i++) {
            TValue *a = em_tr_realize(T, v->u.inst.kwvals[i]);
            if (!a) return -1;
            if (a->mutable && a->kind != TV_INSTANCE)
                return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of an object built from a mutable container");
        }
        o->kind = OUT_CALL;
        o->obj = v->u.inst.cls;
        o->n = 2;
        o->items = em_arena_alloc(T->arena, sizeof(OutSpec) * 2);
        if (!o->items) {
            PyErr_NoMemory();
            return -1;
        }
        if (out_spec(T, C, parts[0], &o->items[0], depth + 1) < 0) return -1;
        o->items[0].kind = OUT_TUPLE;
        return out_spec(T, C, parts[1], &o->items[1], depth + 1);
    }
    case TV_NN_MODULE:
    case TV_OBJECT:
    case TV_FUNCTION:
        if (v->src >= 0) {
            int slot = em_guard_fetch(T->gb, v->src);
            if (slot < 0) return -1;
            o->kind = OUT_FETCH;
            o->index = (uint32_t)slot;
            return 0;
        }
        if (v->obj && v->kind != TV_NN_MODULE) {
            o->kind = OUT_CONST;
            o->obj = v->obj;
            return 0;
        }
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of a function made in the traced code");
    default:
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "return of a value of kind %d", (int)v->kind);
    }
}

/* Deep-copies an IRArg with node refs remapped. */
static int remap_arg(Trace *T, const IRArg *a, IRArg *o, const uint32_t *map) {
    *o = *a;
    if (a->kind == IRARG_NODE) {
        o->u.ref = map[a->u.ref];
        return o->u.ref ? 0 : em_tr_break(T, EM_BREAK_INTERNAL, "argument refers to a missing node");
    }
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        o->u.items = em_arena_alloc(T->arena, sizeof(IRArg) * (a->n + 1));
        if (!o->u.items) {
            PyErr_NoMemory();
            return -1;
        }
        for (uint32_t i = 0; i < a->n; i++)
            if (remap_arg(T, &a->u.items[i], &o->u.items[i], map) < 0) return -1;
    }
    return 0;
}

/* Turns the recorded nodes into the IRGraph: placeholders first (in order of first use), then the
 * calls in recording order, then the output; fills the result's graph inputs. */
/* An input the graph updates in place (`cache.index_copy_(2, pos, k)`) whose updated value later
 * nodes read can stay an in-place extern call only if no other tensor input shares its memory:
 * kernels read inputs when they are scheduled, not in program order (em_lower.c). When the example
 * inputs share none, that is guarded (NO_OVERLAP, as AOTAutograd checks its mutated inputs'
 * aliasing) and the graph says so (inputs_apart); otherwise nothing is added and the lowering
 * keeps its stricter rule. */
static int guard_updated_inputs_apart(Trace *T, IRGraph *g) {
    uint32_t nin = g->ninputs, nmut = 0, n = 0;
    GuardSrc *srcs = em_arena_alloc(T->arena, sizeof(GuardSrc) * (nin + 1));
    uintptr_t *ext = em_arena_alloc(T->arena, sizeof(uintptr_t) * 2 * (nin + 1));
    uint8_t *mut = em_arena_alloc(T->arena, nin + 1);
    if (!srcs || !ext || !mut) {
        PyErr_NoMemory();
        return -1;
    }
    bool read_later = false; /* some update's result is read: the case the guard is for */
    for (uint32_t i = 0; i < nin; i++) {
        IRRef in = g->inputs[i];
        mut[i] = 0;
        for (IRRef r = in + 1; r < g->nnodes; r++) {
            const IRNode *u = &g->nodes[r];
            if (!em_ir_mutates(u) || u->nargs < 1 || u->args[0].kind != IRARG_NODE || u->args[0].u.ref != in) continue;
            mut[i] = 1; /* every updated input is covered, read later or not */
            for (IRRef w = r + 1; w < g->nnodes && !read_later; w++) read_later = em_ir_node_reads(&g->nodes[w], r) != 0;
        }
        nmut += mut[i];
    }
    if (!nmut || !read_later) return 0;
    for (int pass = 0; pass < 2; pass++) { /* the updated inputs first */
        for (uint32_t i = 0; i < nin; i++) {
            TNode *nd = &T->nodes.items[T->inputs.items[i]];
            if (mut[i] != (pass == 0) || g->nodes[g->inputs[i]].meta.kind != IRMETA_TENSOR) continue;
            if (!nd->real || nd->src < 0 || em_guard_tensor_extent(nd->real, &ext[2 * n], &ext[2 * n + 1]) < 0) return 0;
            srcs[n++] = nd->src;
        }
        if (pass == 0 && n != nmut) return 0;
    }
    if (!em_guard_extents_apart(ext, nmut, n)) return 0; /* they share memory now: the stricter rule */
    if (em_guard_no_overlap(T->gb, srcs, nmut, n) < 0) return -1;
    g->inputs_apart = true;
    return 0;
}

static int finish_graph(Trace *T, OutCtx *C) {
    EmTraceResult *res = T->res;
    IRGraph *g = em_ir_new(T->arena);
    uint32_t *map = em_arena_alloc(T->arena, sizeof(uint32_t) * (T->nodes.n + 1));
    uint32_t nin = T->inputs.n;
    res->input_fetch = em_arena_alloc(T->arena, sizeof(int) * (nin + 1));
    res->example_inputs = em_arena_alloc(T->arena, sizeof(PyObject *) * (nin + 1));
    if (!g || !map || !res->input_fetch || !res->example_inputs) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < nin; i++) {
        uint32_t r = T->inputs.items[i];
        TNode *nd = &T->nodes.items[r];
        int slot = em_guard_fetch(T->gb, nd->src);
        if (slot < 0) return -1;
        res->input_fetch[i] = slot;
        res->example_inputs[i] = nd->real;
        map[r] = em_ir_placeholder(g, nd->pname ? nd->pname : "input", &nd->meta);
        if (!map[r]) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
    }
    res->ninputs = nin;
    for (uint32_t r = 1; r < T->nodes.n; r++) {
        TNode *nd = &T->nodes.items[r];
        if (nd->kind == IR_PLACEHOLDER) continue;
        IRArg *args = em_arena_alloc(T->arena, sizeof(IRArg) * (nd->nargs + 1));
        IRArg *kws = em_arena_alloc(T->arena, sizeof(IRArg) * (nd->nkw + 1));
        if (!args || !kws) {
            PyErr_NoMemory();
            return -1;
        }
        for (uint32_t i = 0; i < nd->nargs; i++)
            if (remap_arg(T, &nd->args[i], &args[i], map) < 0) return -1;
        for (uint32_t i = 0; i < nd->nkw; i++)
            if (remap_arg(T, &nd->kwargs[i], &kws[i], map) < 0) return -1;
        map[r] = em_ir_call(g, nd->kind, nd->target, args, nd->nargs, nd->kwnames, kws, nd->nkw, &nd->meta);
        if (!map[r]) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
        IRNode *irn = em_ir_node(g, map[r]);
        irn->lineno = nd->lineno;
        irn->filename = nd->filename;
    }
    uint32_t *outs = em_arena_alloc(T->arena, sizeof(uint32_t) * (C->refs.n + 1));
    if (!outs) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < C->refs.n; i++) outs[i] = map[C->refs.items[i]];
    if (em_ir_set_output(g, outs, C->refs.n) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    if (em_ir_dce(g, NULL) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    char buf[256];
    buf[0] = 0;
    if (em_ir_verify(g, buf, sizeof buf) < 0) {
        PyErr_Clear();
        return em_tr_break(T, EM_BREAK_INTERNAL, "graph verification failed: %s", buf);
    }
    if (em_tr_sym_finish(T, g) < 0) return -1;
    if (guard_updated_inputs_apart(T, g) < 0) return -1;
    res->graph = g;
    return 0;
}

int em_tr_out_spec(Trace *T, OutCtx *C, TValue *v, OutSpec *o, int depth) { return out_spec(T, C, v, o, depth); }
int em_tr_finish_graph(Trace *T, OutCtx *C) { return finish_graph(T, C); }

/* RETURN_VALUE of the traced (top) frame. */
static int top_return(Trace *T, TValue *v) {
    OutCtx C;
    memset(&C, 0, sizeof C);
    OutSpec *o = em_arena_alloc(T->arena, sizeof(OutSpec));
    if (!o) {
        PyErr_NoMemory();
        return -1;
    }
    if (em_tr_overlay_check(T) < 0) return -1;
    if (out_spec(T, &C, v, o, 0) < 0) return -1;
    if (em_tr_effects_spec(T, &C) < 0) return -1;
    if (finish_graph(T, &C) < 0) return -1;
    T->res->out = o;
    return 0;
}

/* Conditional jump helper: 1 to jump, 0 to fall through, -1 on break. */
static int jump_cond(Trace *T, TrOp op, TValue *v) {
    bool b = false;
    switch (op) {
    case OP_POP_JUMP_IF_NONE: case OP_POP_JUMP_FORWARD_IF_NONE: case OP_POP_JUMP_BACKWARD_IF_NONE:
        if (is_none(T, v, &b) < 0) return -1;
        return b;
    case OP_POP_JUMP_IF_NOT_NONE: case OP_POP_JUMP_FORWARD_IF_NOT_NONE:
    case OP_POP_JUMP_BACKWARD_IF_NOT_NONE:
        if (is_none(T, v, &b) < 0) return -1;
        return !b;
    case OP_POP_JUMP_IF_TRUE: case OP_POP_JUMP_FORWARD_IF_TRUE: case OP_POP_JUMP_BACKWARD_IF_TRUE:
    case OP_JUMP_IF_TRUE_OR_POP:
        if (em_tr_truth(T, v, &b) < 0) return -1;
        return b;
    default:
        if (em_tr_truth(T, v, &b) < 0) return -1;
        return !b;
    }
}

/* Counts one loop iteration against opts.max_loop_iterations. */
static int count_loop(Trace *T) {
    if (++T->loop_iters > T->opts.max_loop_iterations)
        return em_tr_break(T, EM_BREAK_LOOP_LIMIT, "more than %d loop iterations", T->opts.max_loop_iterations);
    return 0;
}

/* Values of `UNPACK_SEQUENCE`/`UNPACK_EX`: pushes so that the first item ends on top. */
static int unpack(Trace *T, TFrame *F, TValue *seq, int before, int after, bool star) {
    TValue **items;
    uint32_t n;
    if (em_tr_items(T, seq, &items, &n) < 0) return -1;
    if (!star && n != (uint32_t)before)
        return em_tr_break(T, EM_BREAK_RAISE, "cannot unpack %u values into %d", n, before);
    if (star && n < (uint32_t)(before + after))
        return em_tr_break(T, EM_BREAK_RAISE, "not enough values to unpack");
    uint32_t total = star ? (uint32_t)(before + after + 1) : n;
    TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (total + 1));
    if (!r) {
        PyErr_NoMemory();
        return -1;
    }
    if (!star) {
        for (uint32_t i = 0; i < n; i++) r[i] = items[i];
    } else {
        for (int i = 0; i < before; i++) r[i] = items[i];
        TValue *mid = em_tr_list(T, items + before, n - (uint32_t)before - (uint32_t)after);
        if (!mid) return -1;
        r[before] = mid;
        for (int i = 0; i < after; i++) r[before + 1 + i] = items[n - (uint32_t)after + (uint32_t)i];
    }
    for (uint32_t i = total; i-- > 0;)
        if (push(T, F, r[i]) < 0) return -1;
    return 0;
}

/* MAKE_FUNCTION: a function value made during the trace (closures, lambdas, nested defs). */
static TValue *make_function(Trace *T, TFrame *F, int flags) {
    TValue *codev = pop(T, F), *closure = NULL, *kwdefaults = NULL, *defaults = NULL;
    if (!codev) return NULL;
    if ((flags & 8) && !(closure = pop(T, F))) return NULL;
    if ((flags & 4) && !pop(T, F)) return NULL; /* annotations: ignored */
    if ((flags & 2) && !(kwdefaults = pop(T, F))) return NULL;
    if ((flags & 1) && !(defaults = pop(T, F))) return NULL;
    if (codev->kind != TV_CONST || !PyCode_Check(codev->obj)) {
        em_tr_break(T, EM_BREAK_INTERNAL, "MAKE_FUNCTION without a code object");
        return NULL;
    }
    TValue *f = em_tr_new(T, TV_FUNCTION);
    if (!f) return NULL;
    PyCodeObject *co = (PyCodeObject *)codev->obj;
    f->u.fn.code = co;
    f->u.fn.globals = F->globals;
    f->u.fn.gsrc = F->gsrc;
    f->u.fn.name = co->co_qualname;
    f->u.fn.defaults = defaults ? em_tr_realize(T, defaults) : NULL;
    f->u.fn.kwdefaults = kwdefaults ? em_tr_realize(T, kwdefaults) : NULL;
    f->u.fn.closure = closure;
    if ((defaults && !f->u.fn.defaults) || (kwdefaults && !f->u.fn.kwdefaults)) return NULL;
    return f;
}

/* SET_FUNCTION_ATTRIBUTE (3.13) on a function made in the trace: flag 1 defaults, 2 keyword
 * defaults, 4 annotations (ignored), 8 the closure. */
static int set_function_attribute(Trace *T, TValue *f, int flag, TValue *v) {
    switch (flag) {
    case 1: return (f->u.fn.defaults = em_tr_realize(T, v)) ? 0 : -1;
    case 2: return (f->u.fn.kwdefaults = em_tr_realize(T, v)) ? 0 : -1;
    case 4: return 0;
    case 8: f->u.fn.closure = v; return 0;
    default: return em_tr_break(T, EM_BREAK_INTERNAL, "SET_FUNCTION_ATTRIBUTE %d", flag);
    }
}

/* DICT_UPDATE / DICT_MERGE / BUILD_MAP helpers: key of a dict entry (a constant). */
static PyObject *dict_key(Trace *T, TValue *k) {
    if (!(k = em_tr_realize(T, k))) return NULL;
    if (k->kind != TV_CONST) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "dict key that is not a constant");
        return NULL;
    }
    if (em_tr_use(T, k) < 0) return NULL;
    if (PyObject_Hash(k->obj) == -1) {
        em_tr_break_exc(T, EM_BREAK_RAISE);
        return NULL;
    }
    return k->obj;
}

static int dict_update(Trace *T, TValue *d, TValue *src) {
    if (!(src = em_tr_realize(T, src))) return -1;
    if (d->kind != TV_DICT || !d->mutable) return em_tr_break(T, EM_BREAK_INTERNAL, "DICT_UPDATE target");
    if (src->kind != TV_DICT)
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "** of a value that is not a dict");
    for (uint32_t i = 0; i < src->u.dict.n; i++)
        if (em_tr_dict_set(T, d, src->u.dict.keys[i], src->u.dict.vals[i]) < 0) return -1;
    return 0;
}

PyObject *em_tr_kwnames_operand(Trace *T, TValue *v) {
    PyObject *k = em_tr_to_py_const(T, v);
    if (!k || !PyTuple_CheckExact(k)) {
        Py_XDECREF(k);
        if (!T->broke) em_tr_break(T, EM_BREAK_INTERNAL, "CALL_KW without a tuple of names");
        return NULL;
    }
    return em_arena_hold_steal(T->arena, k);
}

/* Executes one CALL-like sequence whose callee and arguments are on the stack: CALL (the keyword
 * names, if any, from the KW_NAMES before it, 3.11 and 3.12) or CALL_KW (kw_on_stack: the names'
 * tuple on top, 3.13). Stack: [NULL, callable | method, self, args...] up to 3.12, [callable, NULL |
 * method, self, args...] from 3.13. */
static int do_call(Trace *T, TFrame *F, int n, bool kw_on_stack) {
    int extra = kw_on_stack ? 1 : 0;
    if (F->sp < n + 2 + extra) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow at CALL");
    TValue **base = &F->stack[F->sp - n - 2 - extra];
    TValue *callee;
    TValue **args;
    uint32_t nargs;
#if EM_PY313
    callee = base[0];
    bool plain = base[1]->kind == TV_NULL;
#else
    callee = base[0]->kind == TV_NULL ? base[1] : base[0];
    bool plain = base[0]->kind == TV_NULL;
#endif
    args = plain ? base + 2 : base + 1;
    nargs = plain ? (uint32_t)n : (uint32_t)n + 1;
    PyObject *kwnames = F->kwnames;
    F->kwnames = NULL;
    if (kw_on_stack && !(kwnames = em_tr_kwnames_operand(T, F->stack[F->sp - 1]))) return -1;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    if (nkw > nargs) return em_tr_break(T, EM_BREAK_INTERNAL, "KW_NAMES longer than the call");
    TValue *r = em_tr_call(T, callee, args, nargs - nkw, nkw ? kwnames : NULL, args + (nargs - nkw));
    if (!r) return -1;
    F->sp -= n + 2 + extra;
    return push(T, F, r);
}

/* BEFORE_WITH: [mgr] -> [mgr.__exit__, mgr.__enter__()]. Grad-mode managers (no_grad,
 * enable_grad, set_grad_enabled: their __exit__ restores the mode and never swallows an
 * exception, torch/autograd/grad_mode.py) record the mode change; torch.autocast records its
 * _enter_autocast node; a manager with Python __enter__/__exit__ is inlined. */
static int before_with(Trace *T, TFrame *F) {
    TValue *m = pop(T, F);
    if (!m || !(m = em_tr_realize(T, m))) return -1;
    if (m->kind == TV_OBJECT && m->obj && em_tr_is_autocast(m->obj) && !(m = em_tr_autocast_of(T, m))) return -1;
    if (m->kind == TV_INSTANCE || (m->kind == TV_OBJECT && m->obj && !PyType_Check(m->obj)))
        return em_tr_with_enter(T, F, m); /* a manager with Python __enter__/__exit__ */
    if (m->kind == TV_AUTOCAST && !m->u.ac.exit) {
        TValue *exit = em_tr_autocast_enter(T, m);
        if (!exit || push(T, F, exit) < 0) return -1;
        return push(T, F, m); /* autocast.__enter__ returns self */
    }
    if (m->kind != TV_GRAD_MODE || m->u.gm.exit) {
        const char *what = m->obj ? Py_TYPE(m->obj)->tp_name : "value";
        if (m->obj && PyType_Check(m->obj)) what = ((PyTypeObject *)m->obj)->tp_name;
        return em_tr_break(T, EM_BREAK_TRY_BLOCK, "with block on a %s", what);
    }
    if (T->grad_statement)
        return em_tr_break(T, EM_BREAK_TRY_BLOCK, "grad-mode with-block in a frame with a set_grad_enabled statement");
    T->grad_with = true;
    TValue *exit = em_tr_new(T, TV_GRAD_MODE);
    if (!exit) return -1;
    exit->u.gm = m->u.gm;
    exit->u.gm.exit = true;
    if (!m->u.gm.applied) {
        exit->u.gm.prev = T->grad_enabled;
        if (em_tr_set_grad_mode(T, m->u.gm.mode) < 0) return -1;
    }
    if (push(T, F, exit) < 0) return -1;
    return push(T, F, em_tr_const(T, Py_None));
}

/* CALL_FUNCTION_EX: f(*args, **kwargs). Stack: [NULL, f, args, kwargs?], [f, NULL, args, kwargs?] from
 * 3.13. */
static int do_call_ex(Trace *T, TFrame *F, int flags) {
    int need = (flags & 1) ? 4 : 3;
    if (F->sp < need) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow at CALL_FUNCTION_EX");
    TValue *kw = (flags & 1) ? F->stack[F->sp - 1] : NULL;
    TValue *argv = F->stack[F->sp - need + 2];
    TValue *callee = F->stack[F->sp - need + (EM_PY313 ? 0 : 1)];
    TValue **items;
    uint32_t n;
    if (em_tr_items(T, argv, &items, &n) < 0) return -1;
    PyObject *kwnames = NULL;
    TValue **kwvals = NULL;
    uint32_t nkw = 0;
    if (kw) {
        if (!(kw = em_tr_realize(T, kw))) return -1;
        if (kw->kind != TV_DICT) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "** of a non-dict");
        nkw = kw->u.dict.n;
        PyObject *names = PyTuple_New(nkw);
        if (!names) return -1;
        for (uint32_t i = 0; i < nkw; i++) {
            if (!PyUnicode_Check(kw->u.dict.keys[i])) {
                Py_DECREF(names);
                return em_tr_break(T, EM_BREAK_RAISE, "keywords must be strings");
            }
            PyTuple_SET_ITEM(names, i, Py_NewRef(kw->u.dict.keys[i]));
        }
        kwnames = em_arena_hold_steal(T->arena, names);
        kwvals = kw->u.dict.vals;
        if (!kwnames) return -1;
    }
    TValue **all = em_arena_alloc(T->arena, sizeof(TValue *) * (n + nkw + 1));
    if (!all) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) all[i] = items[i];
    for (uint32_t i = 0; i < nkw; i++) all[n + i] = kwvals[i];
    TValue *r = em_tr_call(T, callee, all, n, nkw ? kwnames : NULL, all + n);
    if (!r) return -1;
    F->sp -= need;
    return push(T, F, r);
}

/* super(cls, self).name for LOAD_SUPER_ATTR (3.12). */
static TValue *super_attr(Trace *T, TFrame *F, PyObject *name) {
    TValue *self = pop(T, F), *cls = NULL, *gs = NULL;
    if (!self || !(cls = pop(T, F)) || !(gs = pop(T, F))) return NULL;
    if (!(cls = em_tr_realize(T, cls)) || !(gs = em_tr_realize(T, gs))) return NULL;
    if (gs->kind != TV_OBJECT || gs->obj != (PyObject *)&PySuper_Type || !cls->obj || !PyType_Check(cls->obj)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "super() with an unusual class or super");
        return NULL;
    }
    TValue *s = em_tr_new(T, TV_SUPER);
    if (!s) return NULL;
    s->u.sup.self = self;
    s->u.sup.cls = cls->obj;
    return em_tr_getattr(T, s, name, NULL);
}

static TValue *format_value(Trace *T, TValue *v, TValue *spec, int conv) {
    if (!(v = em_tr_realize(T, v))) return NULL;
    if (v->kind == TV_TENSOR) {
        em_tr_break(T, EM_BREAK_TENSOR_TO_PYTHON, "formatting a tensor");
        return NULL;
    }
    PyObject *o = em_tr_to_py_const(T, v);
    if (!o) {
        if (!T->broke && !PyErr_Occurred())
            em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "f-string of a value that is not a constant");
        return NULL;
    }
    if (!PyUnicode_Check(o) && !PyLong_Check(o) && !PyFloat_Check(o) && !PyBool_Check(o) && o != Py_None &&
        !PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.dtype_type) && !PyTuple_Check(o)) {
        Py_DECREF(o);
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "f-string of a %s", Py_TYPE(o)->tp_name);
        return NULL;
    }
    PyObject *c = conv == 1 ? PyObject_Str(o) : conv == 2 ? PyObject_Repr(o) : conv == 3 ? PyObject_ASCII(o) : Py_NewRef(o);
    Py_DECREF(o);
    if (!c) {
        em_tr_break_exc(T, EM_BREAK_RAISE);
        return NULL;
    }
    PyObject *sp = NULL;
    if (spec) {
        if (!(spec = em_tr_realize(T, spec)) || spec->kind != TV_CONST) {
            Py_DECREF(c);
            if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "format spec");
            return NULL;
        }
        sp = spec->obj;
    }
    PyObject *r = PyObject_Format(c, sp);
    Py_DECREF(c);
    if (!r) {
        em_tr_break_exc(T, EM_BREAK_RAISE);
        return NULL;
    }
    return em_tr_const_steal(T, r);
}

static bool is_unbound(TValue *v) { return v == NULL || v->kind == TV_NULL; }

int em_tr_run_frame(Trace *T, TFrame *F) {
    TraceRT *rt = &em_trace_rt;
    TFrame *saved = T->cur;
    T->cur = F;
resume:
    while (!F->returned) {
        if (F->pc >= F->nins) {
            em_tr_break(T, EM_BREAK_INTERNAL, "ran past the end of the code");
            goto fail;
        }
        if (F == T->top) {
            /* a re-trace that stops before the top frame's breaking instruction: split there */
            if (T->top_steps == T->stop_at) return em_tr_split_here(T, F) < 0 ? -1 : 1;
            T->top_steps++;
        }
        if (++T->ninstr > T->opts.max_instructions) {
            em_tr_break(T, EM_BREAK_LOOP_LIMIT, "more than %d instructions", T->opts.max_instructions);
            goto fail;
        }
        TInstr *in = &F->ins[F->pc];
        int arg = in->arg;
        uint32_t next = F->pc + 1;
        TValue *a, *b, *c, *r;
        switch ((TrOp)in->op) {
        case OP_NOP: case OP_RESUME: case OP_PRECALL: case OP_COPY_FREE_VARS: case OP_EXTENDED_ARG:
        case OP_CACHE:
            break;
        case OP_PUSH_NULL:
            if (push(T, F, T->null_value) < 0) goto fail;
            break;
        case OP_POP_TOP:
            if (!pop(T, F)) goto fail;
            break;
        case OP_END_FOR: /* POP_TOP twice on 3.12; once on 3.13, where a POP_TOP follows */
            if (!pop(T, F) || (!EM_PY313 && !pop(T, F))) goto fail;
            break;
        case OP_COPY:
            if (!(a = peek(T, F, arg)) || push(T, F, a) < 0) goto fail;
            break;
        case OP_SWAP:
            if (!(a = peek(T, F, arg))) goto fail;
            F->stack[F->sp - arg] = F->stack[F->sp - 1];
            F->stack[F->sp - 1] = a;
            break;
        case OP_LOAD_CONST: {
            PyObject *k = co_const_at(T, F, arg);
            if (!k || push(T, F, em_tr_const(T, k)) < 0) goto fail;
            break;
        }
        case OP_RETURN_CONST: {
            PyObject *k = co_const_at(T, F, arg);
            if (!k || !(r = em_tr_const(T, k))) goto fail;
            F->retval = r;
            F->returned = true;
            break;
        }
        case OP_RETURN_VALUE:
            if (!(r = pop(T, F))) goto fail;
            F->retval = r;
            F->returned = true;
            break;
        case OP_LOAD_FAST: case OP_LOAD_FAST_CHECK:
            if (arg >= F->nlocals) goto internal;
            if (is_unbound(F->locals[arg])) {
                em_tr_break(T, EM_BREAK_RAISE, "local variable referenced before assignment");
                goto fail;
            }
            if (push(T, F, F->locals[arg]) < 0) goto fail;
            break;
        case OP_LOAD_FAST_AND_CLEAR:
            if (arg >= F->nlocals) goto internal;
            if (push(T, F, F->locals[arg] ? F->locals[arg] : T->null_value) < 0) goto fail;
            F->locals[arg] = NULL;
            break;
        case OP_STORE_FAST:
            if (arg >= F->nlocals || !(a = pop(T, F))) goto fail_or_internal;
            F->locals[arg] = a->kind == TV_NULL ? NULL : a;
            break;
        case OP_LOAD_FAST_LOAD_FAST: case OP_STORE_FAST_STORE_FAST: case OP_STORE_FAST_LOAD_FAST: {
            /* 3.13's superinstructions: two local indices of 4 bits each (Python/bytecodes.c) */
            int i1 = arg >> 4, i2 = arg & 15;
            if (i1 >= F->nlocals || i2 >= F->nlocals) goto internal;
            if (in->op != OP_LOAD_FAST_LOAD_FAST) { /* STORE_FAST i1 */
                if (!(a = pop(T, F))) goto fail;
                F->locals[i1] = a->kind == TV_NULL ? NULL : a;
            }
            if (in->op == OP_STORE_FAST_STORE_FAST) { /* STORE_FAST i2 */
                if (!(a = pop(T, F))) goto fail;
                F->locals[i2] = a->kind == TV_NULL ? NULL : a;
                break;
            }
            for (int k = in->op == OP_LOAD_FAST_LOAD_FAST ? 0 : 1; k < 2; k++) { /* LOAD_FAST i1?, i2 */
                TValue *v = F->locals[k == 0 ? i1 : i2];
                if (is_unbound(v)) {
                    em_tr_break(T, EM_BREAK_RAISE, "local variable referenced before assignment");
                    goto fail;
                }
                if (push(T, F, v) < 0) goto fail;
            }
            break;
        }
        case OP_DELETE_FAST:
            if (arg >= F->nlocals) goto internal;
            F->locals[arg] = NULL;
            break;
        case OP_MAKE_CELL: {
            if (arg >= F->nlocals) goto internal;
            TValue *cell = em_tr_new(T, TV_CELL);
            if (!cell) goto fail;
            cell->mutable = true;
            cell->u.cell.contents = F->locals[arg];
            F->locals[arg] = cell;
            break;
        }
        case OP_LOAD_CLOSURE:
            if (arg >= F->nlocals || !F->locals[arg]) goto internal;
            if (push(T, F, F->locals[arg]) < 0) goto fail;
            break;
        case OP_LOAD_DEREF:
            if (arg >= F->nlocals) goto internal;
            if (!(a = cell_contents(T, F->locals[arg])) || push(T, F, a) < 0) goto fail;
            break;
        case OP_STORE_DEREF:
            if (arg >= F->nlocals || !(a = pop(T, F))) goto fail_or_internal;
            if (!F->locals[arg] || F->locals[arg]->kind != TV_CELL) goto internal;
            if (!F->locals[arg]->mutable) {
                if (em_tr_effect_store_cell(T, F->locals[arg], a) < 0) goto fail;
                break;
            }
            F->locals[arg]->u.cell.contents = a;
            break;
        case OP_DELETE_DEREF:
            if (arg >= F->nlocals || !F->locals[arg] || F->locals[arg]->kind != TV_CELL) goto internal;
            if (!F->locals[arg]->mutable) {
                em_tr_break(T, EM_BREAK_SIDE_EFFECT, "delete of a closure variable");
                goto fail;
            }
            F->locals[arg]->u.cell.contents = NULL;
            break;
        case OP_LOAD_GLOBAL: {
            PyObject *name = co_name_at(T, F, arg >> 1);
            if (!name) goto fail;
            r = load_global(T, F, name);
            if (((arg & 1) ? push_callable(T, F, r) : push(T, F, r)) < 0) goto fail;
            break;
        }
        case OP_LOAD_ATTR: case OP_LOAD_METHOD: {
            bool method = in->op == OP_LOAD_METHOD || (EM_PY312 && (arg & 1));
            PyObject *name = co_name_at(T, F, (EM_PY312 && in->op == OP_LOAD_ATTR) ? arg >> 1 : arg);
            if (!name || !(a = pop(T, F))) goto fail;
            if (!(r = em_tr_getattr(T, a, name, NULL))) goto fail;
            if ((method ? push_callable(T, F, r) : push(T, F, r)) < 0) goto fail;
            break;
        }
        case OP_LOAD_SUPER_ATTR: {
            PyObject *name = co_name_at(T, F, arg >> 2);
            if (!name || !(r = super_attr(T, F, name))) goto fail;
            if (((arg & 1) ? push_callable(T, F, r) : push(T, F, r)) < 0) goto fail;
            break;
        }
        case OP_STORE_ATTR: { /* TOS.name = TOS1 */
            PyObject *name = co_name_at(T, F, arg);
            if (!name || !(a = pop(T, F)) || !(b = pop(T, F)) || em_tr_store_attr(T, a, name, b) < 0) goto fail;
            break;
        }
        case OP_DELETE_ATTR: {
            PyObject *name = co_name_at(T, F, arg);
            if (!name || !(a = pop(T, F)) || em_tr_store_attr(T, a, name, NULL) < 0) goto fail;
            break;
        }
        case OP_STORE_GLOBAL: {
            PyObject *name = co_name_at(T, F, arg);
            if (!name || !(a = pop(T, F))) goto fail;
            if (em_tr_effect_store_global(T, F, name, a) < 0) goto fail;
            break;
        }
        case OP_DELETE_GLOBAL:
            em_tr_break(T, EM_BREAK_SIDE_EFFECT, "store to a global");
            goto fail;
        case OP_UNARY_NEGATIVE: case OP_UNARY_POSITIVE: case OP_UNARY_INVERT:
            if (!(a = pop(T, F))) goto fail;
            r = em_tr_unary(T, in->op == OP_UNARY_NEGATIVE ? rt->op_neg : in->op == OP_UNARY_POSITIVE ? rt->op_pos : rt->op_invert, a);
            if (push(T, F, r) < 0) goto fail;
            break;
        case OP_UNARY_NOT: case OP_TO_BOOL: { /* TO_BOOL (3.13): bool(TOS) before a branch or `not` */
            bool t = false;
            if (!(a = pop(T, F)) || em_tr_truth(T, a, &t) < 0) goto fail;
            if (in->op == OP_UNARY_NOT) t = !t;
            if (push(T, F, em_tr_const(T, t ? Py_True : Py_False)) < 0) goto fail;
            break;
        }
        case OP_CALL_INTRINSIC_1:
            if (!(a = pop(T, F))) goto fail;
            if (arg == 5)
                r = em_tr_unary(T, rt->op_pos, a);
            else if (arg == 6) {
                TValue **items;
                uint32_t n;
                if (em_tr_items(T, a, &items, &n) < 0) goto fail;
                r = em_tr_tuple(T, items, n);
            } else if (arg == 1) {
                em_tr_break(T, EM_BREAK_PRINT, "expression printed by the REPL");
                goto fail;
            } else if (arg == 3) { /* INTRINSIC_STOPITERATION_ERROR: a generator's handler; a
                                      StopIteration would become RuntimeError */
                if (a->kind == TV_OBJECT && a->obj && PyErr_GivenExceptionMatches(a->obj, PyExc_StopIteration)) {
                    em_tr_break(T, EM_BREAK_GENERATOR, "StopIteration inside a generator");
                    goto fail;
                }
                r = a;
            } else {
                em_tr_break(T, EM_BREAK_UNSUPPORTED_OPCODE, "CALL_INTRINSIC_1 %d", arg);
                goto fail;
            }
            if (push(T, F, r) < 0) goto fail;
            break;
        case OP_LIST_TO_TUPLE: {
            TValue **items;
            uint32_t n;
            if (!(a = pop(T, F)) || em_tr_items(T, a, &items, &n) < 0) goto fail;
            if (push(T, F, em_tr_tuple(T, items, n)) < 0) goto fail;
            break;
        }
        case OP_BINARY_OP:
            if (!(b = pop(T, F)) || !(a = pop(T, F))) goto fail;
            if (arg < 0 || arg >= TR_NBINOPS) goto internal;
            if (push(T, F, em_tr_binop(T, arg, a, b)) < 0) goto fail;
            break;
        case OP_COMPARE_OP: {
            /* the comparison in the oparg's high bits: arg (3.11), arg >> 4 (3.12), arg >> 5 (3.13,
             * where bit 4 asks for bool() of the result: the TO_BOOL of a branch folded in) */
            int cmp = EM_PY313 ? arg >> 5 : EM_PY312 ? arg >> 4 : arg;
            if (cmp < 0 || cmp >= TR_NCMP) goto internal;
            if (!(b = pop(T, F)) || !(a = pop(T, F))) goto fail;
            if (!(r = em_tr_compare(T, cmp, a, b))) goto fail;
            if (EM_PY313 && (arg & 16)) {
                bool t = false;
                if (em_tr_truth(T, r, &t) < 0) goto fail;
                r = em_tr_const(T, t ? Py_True : Py_False);
            }
            if (push(T, F, r) < 0) goto fail;
            break;
        }
        case OP_IS_OP: {
            bool same = false;
            if (!(b = pop(T, F)) || !(a = pop(T, F)) || is_same(T, a, b, &same) < 0) goto fail;
            if (push(T, F, em_tr_const(T, (same ^ (arg != 0)) ? Py_True : Py_False)) < 0) goto fail;
            break;
        }
        case OP_CONTAINS_OP:
            if (!(b = pop(T, F)) || !(a = pop(T, F))) goto fail;
            if (!(r = em_tr_contains(T, b, a))) goto fail;
            if (arg && r->kind == TV_CONST) r = em_tr_const(T, r->obj == Py_True ? Py_False : Py_True);
            if (push(T, F, r) < 0) goto fail;
            break;
        case OP_BINARY_SUBSCR:
            if (!(b = pop(T, F)) || !(a = pop(T, F))) goto fail;
            if (push(T, F, em_tr_getitem(T, a, b)) < 0) goto fail;
            break;
        case OP_BINARY_SLICE: {
            TValue *end = pop(T, F), *start = end ? pop(T, F) : NULL;
            if (!end || !start || !(a = pop(T, F))) goto fail;
            TValue *sl = em_tr_new(T, TV_SLICE);
            if (!sl) goto fail;
            sl->u.sl.start = start;
            sl->u.sl.stop = end;
            if (push(T, F, em_tr_getitem(T, a, sl)) < 0) goto fail;
            break;
        }
        case OP_STORE_SUBSCR:
            if (!(b = pop(T, F)) || !(a = pop(T, F)) || !(c = pop(T, F))) goto fail;
            if (em_tr_setitem(T, a, b, c) < 0) goto fail;
            break;
        case OP_STORE_SLICE: {
            TValue *end = pop(T, F), *start = end ? pop(T, F) : NULL;
            if (!end || !start || !(a = pop(T, F)) || !(c = pop(T, F))) goto fail;
            TValue *sl = em_tr_new(T, TV_SLICE);
            if (!sl) goto fail;
            sl->u.sl.start = start;
            sl->u.sl.stop = end;
            if (em_tr_setitem(T, a, sl, c) < 0) goto fail;
            break;
        }
        case OP_DELETE_SUBSCR:
            if (!(b = pop(T, F)) || !(a = pop(T, F))) goto fail;
            if (em_tr_setitem(T, a, b, NULL) < 0) goto fail;
            break;
        case OP_BUILD_TUPLE: case OP_BUILD_LIST: {
            if (arg > F->sp) goto internal;
            TValue **items = &F->stack[F->sp - arg];
            r = in->op == OP_BUILD_TUPLE ? em_tr_tuple(T, items, (uint32_t)arg) : em_tr_list(T, items, (uint32_t)arg);
            if (!r) goto fail;
            F->sp -= arg;
            if (push(T, F, r) < 0) goto fail;
            break;
        }
        case OP_BUILD_MAP: {
            if (2 * arg > F->sp) goto internal;
            TValue **kv = &F->stack[F->sp - 2 * arg];
            if (!(r = em_tr_dict(T))) goto fail;
            for (int i = 0; i < arg; i++) {
                PyObject *key = dict_key(T, kv[2 * i]);
                if (!key || em_tr_dict_set(T, r, key, kv[2 * i + 1]) < 0) goto fail;
            }
            F->sp -= 2 * arg;
            if (push(T, F, r) < 0) goto fail;
            break;
        }
        case OP_BUILD_CONST_KEY_MAP: {
            if (!(a = pop(T, F))) goto fail;
            if (a->kind != TV_TUPLE || a->u.seq.n != (uint32_t)arg || arg > F->sp) goto internal;
            TValue **vals = &F->stack[F->sp - arg];
            if (!(r = em_tr_dict(T))) goto fail;
            for (int i = 0; i < arg; i++) {
                PyObject *key = dict_key(T, a->u.seq.items[i]);
                if (!key || em_tr_dict_set(T, r, key, vals[i]) < 0) goto fail;
            }
            F->sp -= arg;
            if (push(T, F, r) < 0) goto fail;
            break;
        }
        case OP_BUILD_SLICE: {
            TValue *step = NULL;
            if (arg == 3 && !(step = pop(T, F))) goto fail;
            if (!(b = pop(T, F)) || !(a = pop(T, F))) goto fail;
            if (!(r = em_tr_new(T, TV_SLICE))) goto fail;
            r->u.sl.start = a;
            r->u.sl.stop = b;
            r->u.sl.step = step;
            if (push(T, F, r) < 0) goto fail;
            break;
        }
        case OP_BUILD_STRING: {
            if (arg > F->sp) goto internal;
            PyObject *parts = PyTuple_New(arg);
            if (!parts) goto fail;
            for (int i = 0; i < arg; i++) {
                TValue *p = em_tr_realize(T, F->stack[F->sp - arg + i]);
                if (!p || p->kind != TV_CONST || !PyUnicode_Check(p->obj) || em_tr_use(T, p) < 0) {
                    Py_DECREF(parts);
                    if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "string build from a non-constant");
                    goto fail;
                }
                PyTuple_SET_ITEM(parts, i, Py_NewRef(p->obj));
            }
            PyObject *empty = PyUnicode_FromString("");
            PyObject *s = empty ? PyUnicode_Join(empty, parts) : NULL;
            Py_XDECREF(empty);
            Py_DECREF(parts);
            if (!s) goto fail;
            F->sp -= arg;
            if (push(T, F, em_tr_const_steal(T, s)) < 0) goto fail;
            break;
        }
        case OP_LIST_APPEND:
            if (!(a = pop(T, F)) || !(b = peek(T, F, arg))) goto fail;
            if (em_tr_list_push(T, b, a) < 0) goto fail;
            break;
        case OP_LIST_EXTEND: {
            TValue **items;
            uint32_t n;
            if (!(a = pop(T, F)) || !(b = peek(T, F, arg))) goto fail;
            if (em_tr_items(T, a, &items, &n) < 0) goto fail;
            for (uint32_t i = 0; i < n; i++)
                if (em_tr_list_push(T, b, items[i]) < 0) goto fail;
            break;
        }
        case OP_DICT_UPDATE: case OP_DICT_MERGE:
            if (!(a = pop(T, F)) || !(b = peek(T, F, arg))) goto fail;
            if (dict_update(T, b, a) < 0) goto fail;
            break;
        case OP_MAP_ADD: {
            TValue *val = pop(T, F), *key = val ? pop(T, F) : NULL;
            if (!val || !key || !(b = peek(T, F, arg))) goto fail;
            PyObject *k = dict_key(T, key);
            if (!k || b->kind != TV_DICT || em_tr_dict_set(T, b, k, val) < 0) goto fail_or_internal;
            break;
        }
        case OP_UNPACK_SEQUENCE:
            if (!(a = pop(T, F)) || unpack(T, F, a, arg, 0, false) < 0) goto fail;
            break;
        case OP_UNPACK_EX:
            if (!(a = pop(T, F)) || unpack(T, F, a, arg & 0xff, arg >> 8, true) < 0) goto fail;
            break;
        case OP_FORMAT_VALUE: {
            TValue *spec = NULL;
            if ((arg & 4) && !(spec = pop(T, F))) goto fail;
            if (!(a = pop(T, F))) goto fail;
            if (push(T, F, format_value(T, a, spec, arg & 3)) < 0) goto fail;
            break;
        }
        case OP_CONVERT_VALUE: case OP_FORMAT_SIMPLE: case OP_FORMAT_WITH_SPEC: {
            /* 3.13 splits FORMAT_VALUE: CONVERT_VALUE (1 str, 2 repr, 3 ascii), then a format */
            TValue *spec = NULL;
            if (in->op == OP_FORMAT_WITH_SPEC && !(spec = pop(T, F))) goto fail;
            if (!(a = pop(T, F))) goto fail;
            if (push(T, F, format_value(T, a, spec, in->op == OP_CONVERT_VALUE ? arg : 0)) < 0) goto fail;
            break;
        }
        case OP_GET_ITER:
            if (!(a = pop(T, F))) goto fail;
            if (push(T, F, em_tr_iter(T, a)) < 0) goto fail;
            break;
        case OP_FOR_ITER: {
            if (!(a = peek(T, F, 1))) goto fail;
            int rc = em_tr_iter_next(T, a, &r);
            if (rc < 0) goto fail;
            if (rc == 1) {
                if (count_loop(T) < 0 || push(T, F, r) < 0) goto fail;
            } else {
                if (in->target < 0) goto internal;
                F->sp--;
                next = (uint32_t)in->target;
                /* 3.12: the target is END_FOR, which the interpreter skips; 3.13 skips END_FOR and
                 * the POP_TOP after it (Python/bytecodes.c, FOR_ITER) */
                if (next < F->nins && F->ins[next].op == OP_END_FOR) {
                    next++;
                    if (EM_PY313 && next < F->nins && F->ins[next].op == OP_POP_TOP) next++;
                }
            }
            break;
        }
        case OP_JUMP_FORWARD: case OP_JUMP_BACKWARD: case OP_JUMP_BACKWARD_NO_INTERRUPT:
            if (in->target < 0) goto internal;
            if (in->op != OP_JUMP_FORWARD && count_loop(T) < 0) goto fail;
            next = (uint32_t)in->target;
            break;
        case OP_POP_JUMP_IF_FALSE: case OP_POP_JUMP_IF_TRUE: case OP_POP_JUMP_IF_NONE:
        case OP_POP_JUMP_IF_NOT_NONE: case OP_POP_JUMP_FORWARD_IF_FALSE: case OP_POP_JUMP_FORWARD_IF_TRUE:
        case OP_POP_JUMP_FORWARD_IF_NONE: case OP_POP_JUMP_FORWARD_IF_NOT_NONE:
        case OP_POP_JUMP_BACKWARD_IF_FALSE: case OP_POP_JUMP_BACKWARD_IF_TRUE:
        case OP_POP_JUMP_BACKWARD_IF_NONE: case OP_POP_JUMP_BACKWARD_IF_NOT_NONE: {
            if (in->target < 0) goto internal;
            if (!(a = pop(T, F))) goto fail;
            int j = jump_cond(T, (TrOp)in->op, a);
            if (j < 0) goto fail;
            if (j) {
                if (rt->jback[in->opcode] && count_loop(T) < 0) goto fail;
                next = (uint32_t)in->target;
            }
            break;
        }
        case OP_JUMP_IF_FALSE_OR_POP: case OP_JUMP_IF_TRUE_OR_POP: {
            if (in->target < 0) goto internal;
            if (!(a = peek(T, F, 1))) goto fail;
            int j = jump_cond(T, (TrOp)in->op, a);
            if (j < 0) goto fail;
            if (j)
                next = (uint32_t)in->target;
            else
                F->sp--;
            break;
        }
        case OP_KW_NAMES: {
            PyObject *k = co_const_at(T, F, arg);
            if (!k) goto fail;
            if (!PyTuple_Check(k)) goto internal;
            F->kwnames = k;
            break;
        }
        case OP_CALL: case OP_CALL_KW:
            if (do_call(T, F, arg, in->op == OP_CALL_KW) < 0) goto fail;
            break;
        case OP_CALL_FUNCTION_EX:
            if (do_call_ex(T, F, arg) < 0) goto fail;
            break;
        case OP_MAKE_FUNCTION:
            if (push(T, F, make_function(T, F, arg)) < 0) goto fail;
            break;
        case OP_SET_FUNCTION_ATTRIBUTE: /* 3.13: [attr, f] -> [f], what MAKE_FUNCTION's flags did */
            if (!(a = pop(T, F)) || !(b = pop(T, F))) goto fail;
            if (a->kind != TV_FUNCTION || a->obj || set_function_attribute(T, a, arg, b) < 0) goto fail_or_internal;
            if (push(T, F, a) < 0) goto fail;
            break;
        case OP_RAISE_VARARGS: case OP_RERAISE: case OP_PUSH_EXC_INFO: case OP_POP_EXCEPT:
        case OP_CHECK_EXC_MATCH: case OP_WITH_EXCEPT_START:
            if (em_tr_exc_op(T, F, in->op, arg) < 0) goto fail;
            break;
        case OP_LOAD_ASSERTION_ERROR:
            if (push(T, F, em_tr_object(T, PyExc_AssertionError, -1)) < 0) goto fail;
            break;
        case OP_RETURN_GENERATOR:
            if (!F->is_gen) {
                em_tr_break(T, EM_BREAK_GENERATOR, NULL);
                goto fail;
            }
            if (push(T, F, em_tr_const(T, Py_None)) < 0) goto fail;
            break;
        case OP_YIELD_VALUE:
            if (!F->is_gen) {
                em_tr_break(T, EM_BREAK_GENERATOR, NULL);
                goto fail;
            }
            if (!(a = pop(T, F))) goto fail;
            if (EM_VEC_PUSH(T->arena, F->yields, a) < 0) {
                PyErr_NoMemory();
                goto fail;
            }
            if (push(T, F, em_tr_const(T, Py_None)) < 0) goto fail;
            if (F->lazy) { /* consumed step by step: suspend here; the next next() resumes at pc */
                F->pc = next;
                T->cur = saved;
                return 1;
            }
            break;
        case OP_SEND: case OP_GET_YIELD_FROM_ITER:
            em_tr_break(T, EM_BREAK_GENERATOR, "yield from / await");
            goto fail;
        case OP_BUILD_SET: case OP_SET_ADD: case OP_SET_UPDATE:
            if (em_tr_set_op(T, F, in->op, arg) < 0) goto fail;
            break;
        case OP_IMPORT_NAME: case OP_IMPORT_FROM:
            if (em_tr_import(T, F, in->op, arg) < 0) goto fail;
            break;
        case OP_BEFORE_WITH:
            if (before_with(T, F) < 0) goto fail;
            break;
        default:
            em_tr_break(T, EM_BREAK_UNSUPPORTED_OPCODE, "%U", rt->opname[in->opcode]);
            goto fail;
        }
        F->pc = next;
    }
    T->cur = saved;
    return 0;
internal:
    em_tr_break(T, EM_BREAK_INTERNAL, "malformed operand of %U", rt->opname[F->ins[F->pc].opcode]);
fail:
fail_or_internal:
    if (em_tr_exc_unwind(T, F) > 0) goto resume; /* a handler of F catches the raised exception */
    if (!T->broke && !PyErr_Occurred())
        em_tr_break(T, EM_BREAK_INTERNAL, "malformed operand of %U", rt->opname[F->ins[F->pc].opcode]);
    /* T->cur stays at the innermost frame of the break: its state is the break point */
    return -1;
}

/* ------------------------------------------------------------------------------------------- */
/* the entry point                                                                              */

/* Sets up the top frame from the frame view: arguments become lazily wrapped values with local
 * sources, the closure's cells become input cells whose contents have closure sources. */
static TFrame *top_frame(Trace *T, PyObject *func, PyCodeObject *code, const EmFrameView *fv) {
    TFrame *F = em_tr_frame_new(T, code, fv->globals, fv->builtins, -2);
    if (!F) return NULL;
    PyObject *names = code->co_localsplusnames;
    int n = (int)(fv->nlocals < F->nlocals ? fv->nlocals : F->nlocals);
    int nfree = code->co_nfreevars;
    for (int i = 0; i < n && i < F->nlocals - nfree; i++) {
        PyObject *o = fv->locals[i];
        if (!o) continue;
        GuardSrc s = em_guard_src_local(T->gb, i, PyTuple_GET_ITEM(names, i), o);
        if (s < 0 || !(F->locals[i] = em_tr_wrap(T, o, s, false))) return NULL;
    }
    if (code->co_flags & 0x08) { /* CO_VARKEYWORDS: the binding made a fresh **kwargs dict for this
                                     call, so the frame may mutate it (kwargs.pop(...)) unobserved */
        int ik = code->co_argcount + code->co_kwonlyargcount + ((code->co_flags & 0x04) ? 1 : 0);
        if (ik < F->nlocals && F->locals[ik]) {
            TValue *kw = em_tr_realize(T, F->locals[ik]);
            if (!kw) return NULL;
            if (kw->kind == TV_DICT) kw->mutable = true;
        }
    }
    if (nfree) {
        PyObject *clo = fv->closure;
        if (!clo && func && PyFunction_Check(func)) clo = PyFunction_GET_CLOSURE(func);
        if (!clo || !PyTuple_Check(clo) || PyTuple_GET_SIZE(clo) != nfree) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "frame closure does not match the code");
            return NULL;
        }
        for (int i = 0; i < nfree; i++) {
            int li = F->nlocals - nfree + i;
            PyObject *cellobj = PyTuple_GET_ITEM(clo, i);
            TValue *cell = em_tr_new(T, TV_CELL);
            if (!cell) return NULL;
            if (!PyCell_Check(cellobj)) {
                em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "closure item is not a cell");
                return NULL;
            }
            PyObject *contents = PyCell_GET(cellobj);
            if (contents) {
                GuardSrc s = em_guard_src_closure(T->gb, i, PyTuple_GET_ITEM(names, li), contents);
                if (s < 0 || !(cell->u.cell.contents = em_tr_wrap(T, contents, s, false))) return NULL;
            }
            if ((cell->u.cell.self = em_guard_src_cell(T->gb, i, PyTuple_GET_ITEM(names, li), cellobj)) < 0) return NULL;
            cell->u.cell.has_self = true;
            cell->obj = em_arena_hold(T->arena, cellobj);
            if (em_tr_effect_container_seen(T, cell) < 0) return NULL;
            F->locals[li] = cell;
        }
    }
    return F;
}

static int trace_once(PyObject *func, PyCodeObject *code, const EmFrameView *fv, const EmTraceOptions *opts,
                      long stop_at, EmBreak split_reason, EmTraceResult *res) {
    Trace T;
    memset(res, 0, sizeof *res);
    memset(&T, 0, sizeof T);
    T.stop_at = stop_at;
    T.split_reason = split_reason;
    T.ac_top_step = -1;
    res->brk_top_step = -1;
    res->brk.reason = EM_BREAK_NONE;
    res->brk.lineno = -1;
    if (!em_trace_rt.ready) {
        PyErr_SetString(PyExc_RuntimeError, "ember: em_trace_init was not called");
        return -1;
    }
    res->arena = em_arena_new();
    if (!res->arena) {
        PyErr_NoMemory();
        return -1;
    }
    T.arena = res->arena;
    T.res = res;
    T.fv = fv;
    T.func = func;
    T.opts.max_inline_depth = opts && opts->max_inline_depth > 0 ? opts->max_inline_depth : 64;
    T.opts.max_loop_iterations = opts && opts->max_loop_iterations > 0 ? opts->max_loop_iterations : 10000;
    T.opts.max_instructions = opts && opts->max_instructions > 0 ? opts->max_instructions : 1000000;
    T.opts.resume_cache = opts ? opts->resume_cache : NULL;
    T.opts.dynamic = opts ? opts->dynamic : -1;
    T.opts.batch_static = opts ? opts->batch_static : 0;
    T.opts.frame_state = opts ? opts->frame_state : NULL;
    T.opts.shape_rules = opts ? opts->shape_rules : 1;
    T.opts.meta_memo = opts ? opts->meta_memo : 1;
    T.gb = em_guard_builder_new(T.arena);
    res->guards = T.gb;
    if (!T.gb) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    if (EM_VEC_PUSH(T.arena, T.nodes, (TNode){0}) < 0) { /* ref 0 = none */
        PyErr_NoMemory();
        return -1;
    }
    T.null_value = em_tr_new(&T, TV_NULL);
    if (!T.null_value) return -1;
    int rc = -1;
    res->grad_restore = -1;
    bool grad_at_entry = false;
    if (em_guard_global_state(T.gb) < 0) goto done;
    {
        PyObject *ge = PyObject_CallNoArgs(em_trace_rt.is_grad_enabled);
        if (!ge) goto done;
        T.grad_enabled = ge == Py_True;
        Py_DECREF(ge);
        PyObject *ac = em_trace_rt.is_any_autocast_enabled ? PyObject_CallNoArgs(em_trace_rt.is_any_autocast_enabled)
                                                           : Py_NewRef(Py_False);
        if (!ac) goto done;
        T.autocast = ac == Py_True;
        Py_DECREF(ac);
    }
    grad_at_entry = T.grad_enabled;
    if (code->co_flags & (TR_CO_GENERATOR | TR_CO_COROUTINE | TR_CO_ITERABLE_COROUTINE | TR_CO_ASYNC_GENERATOR)) {
        em_tr_break(&T, EM_BREAK_GENERATOR, "%U is a generator or coroutine", code->co_qualname);
        rc = -1;
        goto done;
    }
    TFrame *F = top_frame(&T, func, code, fv);
    if (!F) goto done;
    T.top = F;
    rc = em_tr_run_frame(&T, F);
    if (rc < 0) goto done;
    if (rc == 1) { /* stopped at stop_at and split (res->split, res->graph) */
        rc = 0;
        if (T.grad_changed && T.grad_with && res->split) res->split->restore_grad = grad_at_entry;
        goto done;
    }
    rc = top_return(&T, F->retval);
done:
    em_tr_autocast_unwind(&T);
    if (T.grad_changed) {
        /* meta calls leave the process in the trace's current grad mode (run_meta): give the caller
         * back the mode the frame was entered with, keeping any pending exception */
        PyObject *exc = em_tr_exc_get();
        PyObject *r = PyObject_CallOneArg(em_trace_rt.set_grad_enabled, grad_at_entry ? Py_True : Py_False);
        if (!r && !exc) return -1;
        Py_XDECREF(r);
        if (exc) {
            PyErr_Clear();
            em_tr_exc_set(exc);
        }
        if (rc == 0 && !T.broke && T.grad_with) res->grad_restore = grad_at_entry;
        if (rc == 0 && res->split && T.grad_with) res->grad_restore = grad_at_entry;
    }
    if (rc != 0 || T.broke) {
        if (PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError) || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
                res->graph = NULL;
                return -1;
            }
            if (T.broke)
                PyErr_Clear();
            else if (em_tr_break_exc(&T, EM_BREAK_INTERNAL) < 0 && PyErr_Occurred())
                return -1;
        }
        if (!T.broke) em_tr_break(&T, EM_BREAK_INTERNAL, "trace failed without a reason");
        res->graph = NULL;
        res->out = NULL;
    }
    /* the guards gathered so far are valid for a fallback entry too */
    if (em_tr_flush_dict_guards(&T) < 0) return -1;
    return 0;
}

/* Break reasons after which the frame may be split: the instruction can run in Python. */
static bool splittable_reason(EmBreak r) {
    switch (r) {
    case EM_BREAK_UNSUPPORTED_OPCODE: case EM_BREAK_DATA_DEPENDENT_BRANCH: case EM_BREAK_TENSOR_TO_PYTHON:
    case EM_BREAK_UNSUPPORTED_CALL: case EM_BREAK_UNSUPPORTED_ATTRIBUTE: case EM_BREAK_UNSUPPORTED_VALUE:
    case EM_BREAK_SIDE_EFFECT: case EM_BREAK_PRINT: case EM_BREAK_RAISE: case EM_BREAK_META_FAILED:
    case EM_BREAK_INLINE_DEPTH: case EM_BREAK_HOOKS: case EM_BREAK_TRY_BLOCK:
        return true;
    default:
        return false;
    }
}

/* Traces the frame; at a break that allows it, traces again up to the top frame's instruction in
 * progress at the break (a break inside an inlined call stops at the call) and splits the frame
 * there (em_tr_split_here). Re-tracing, rather than reusing the broken trace, drops whatever the
 * breaking instruction recorded before it broke (Dynamo restarts the analysis the same way). */
int em_trace_frame(PyObject *func, PyCodeObject *code, const EmFrameView *fv, const EmTraceOptions *opts,
                   EmTraceResult *res) {
    if (trace_once(func, code, fv, opts, -1, EM_BREAK_NONE, res) < 0) return -1;
    if (res->graph || !opts || !opts->split || res->brk_top_step < 0 || !splittable_reason(res->brk.reason))
        return 0;
    EmTraceResult res2;
    if (trace_once(func, code, fv, opts, res->brk_top_step, res->brk.reason, &res2) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError) || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
            em_arena_free(res2.arena);
            return -1;
        }
        PyErr_Clear();
        em_arena_free(res2.arena);
        return 0;
    }
    if (!res2.split || !res2.graph) { /* the state at the break cannot be rebuilt: fallback */
        em_arena_free(res2.arena);
        return 0;
    }
    /* the split keeps the first trace's break (reason, detail, user line) */
    res2.brk.reason = res->brk.reason;
    res2.brk.lineno = res->brk.lineno;
    res2.brk.detail = em_arena_hold(res2.arena, res->brk.detail);
    res2.brk.filename = em_arena_hold(res2.arena, res->brk.filename);
    res2.brk.opname = em_arena_hold(res2.arena, res->brk.opname);
    em_arena_free(res->arena);
    *res = res2;
    return 0;
}
