/* trace/resume: graph breaks. Splits a traced frame before the top frame's breaking instruction
 * into (1) the graph of everything traced so far, (2) a *stub*: a small code object that pushes
 * the breaking instruction's operands, runs that one instruction in Python (KW_NAMES/PRECALL/CALL
 * forms included), and calls a resume function with the value stack and the live locals, and
 * (3) *resume functions*: the ORIGINAL code behind a prefix that rebuilds the value stack from
 * arguments and jumps to the instruction after the break (Dynamo's resume_execution.py). A resume
 * function is a new frame, so the PEP 523 hook compiles it like any other (it may break again).
 * Invariants: resume code is always made from the original code object (resume-of-resume does not
 * nest; a constant marker names the original), keeps the original bytes at a fixed shift (so the
 * exception table and the line table shift with them and tracebacks show the user's lines), and
 * only renumbers local-variable opargs. Anything the split cannot rebuild records a break: the
 * frame then runs eagerly, as before. */
#include "trace/em_trace_int.h"

#include <string.h>

/* Include/internal/pycore_code.h (3.11 and 3.12): kinds of co_localspluskinds. */
#define TR_FAST_LOCAL 0x20
#define TR_FAST_CELL 0x40
#define TR_FAST_FREE 0x80
/* Include/cpython/code.h */
#define TR_CO_OPTIMIZED 0x1
#define TR_CO_NEWLOCALS 0x2
#define TR_CO_VARARGS 0x4
#define TR_CO_VARKEYWORDS 0x8
#define TR_CO_NESTED 0x10

/* opcode numbers by TrOp (the reverse of em_trace_rt.op_of), and which opcodes take a
 * localsplus index (LOAD_CLASSDEREF on 3.11, LOAD_FROM_DICT_OR_DEREF on 3.12 are not TrOps). */
static struct {
    bool ready;
    int opnum[OP__COUNT];
    bool local_op[256];
    bool super_op[256]; /* 3.13's LOAD_FAST_LOAD_FAST, STORE_FAST_STORE_FAST, STORE_FAST_LOAD_FAST */
    PyObject *marker; /* the first item of a resume code's marker constant (one interpreter) */
} rs;

static int resume_tables(void) {
    TraceRT *rt = &em_trace_rt;
    if (rs.ready) return 0;
    for (int k = 0; k < OP__COUNT; k++) rs.opnum[k] = -1;
    for (int o = 255; o >= 0; o--)
        if (rt->op_of[o]) rs.opnum[rt->op_of[o]] = o;
    for (int o = 0; o < 256; o++) {
        switch ((TrOp)rt->op_of[o]) {
        case OP_LOAD_FAST: case OP_LOAD_FAST_CHECK: case OP_LOAD_FAST_AND_CLEAR: case OP_STORE_FAST:
        case OP_DELETE_FAST: case OP_MAKE_CELL: case OP_LOAD_CLOSURE: case OP_LOAD_DEREF:
        case OP_STORE_DEREF: case OP_DELETE_DEREF:
            rs.local_op[o] = true;
            break;
        case OP_LOAD_FAST_LOAD_FAST: case OP_STORE_FAST_STORE_FAST: case OP_STORE_FAST_LOAD_FAST:
            rs.super_op[o] = true;
            break;
        default:
            if (rt->opname[o] && (PyUnicode_CompareWithASCIIString(rt->opname[o], "LOAD_CLASSDEREF") == 0 ||
                                  PyUnicode_CompareWithASCIIString(rt->opname[o], "LOAD_FROM_DICT_OR_DEREF") == 0))
                rs.local_op[o] = true;
        }
    }
    rs.marker = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    if (!rs.marker) return -1;
    rs.ready = true;
    return 0;
}

/* The marker constant of a resume code: (marker, original code, prefix units, map) where map[j] is
 * the resume code's localsplus index of the original's localsplus index j. Borrowed or NULL. */
static PyObject *resume_marker_of(PyCodeObject *code) {
    if (!rs.ready) return NULL;
    PyObject *consts = code->co_consts;
    Py_ssize_t n = consts ? PyTuple_GET_SIZE(consts) : 0;
    if (n == 0) return NULL;
    PyObject *m = PyTuple_GET_ITEM(consts, n - 1);
    if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 4 || PyTuple_GET_ITEM(m, 0) != rs.marker) return NULL;
    return m;
}

PyCodeObject *em_trace_resume_origin(PyCodeObject *code) {
    PyObject *m = resume_marker_of(code);
    return m ? (PyCodeObject *)PyTuple_GET_ITEM(m, 1) : NULL;
}

int em_trace_graph_has_calls(const IRGraph *g) {
    for (uint32_t i = 1; i < g->nnodes; i++) {
        IRKind k = g->nodes[i].kind;
        if (k != IR_PLACEHOLDER && k != IR_OUTPUT) return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* bytes                                                                                        */

typedef struct Bytes {
    EmArena *a;
    EM_VEC(uint8_t) v;
} Bytes;

static int put(Bytes *B, uint8_t x) {
    if (EM_VEC_PUSH(B->a, B->v, x) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* One instruction with its EXTENDED_ARG prefixes and zeroed inline caches. */
static int emit_raw(Bytes *B, int opc, int arg) {
    int ext = rs.opnum[OP_EXTENDED_ARG];
    if (opc < 0 || ext < 0 || arg < 0) {
        PyErr_SetString(PyExc_SystemError, "ember: opcode missing on this Python");
        return -1;
    }
    for (int shift = 24; shift > 0; shift -= 8)
        if (arg >= (1 << shift) && (put(B, (uint8_t)ext) < 0 || put(B, (uint8_t)((arg >> shift) & 255)) < 0))
            return -1;
    if (put(B, (uint8_t)opc) < 0 || put(B, (uint8_t)(arg & 255)) < 0) return -1;
    for (int k = 0; k < em_trace_rt.ncache[opc]; k++)
        if (put(B, 0) < 0 || put(B, 0) < 0) return -1;
    return 0;
}

static int emit(Bytes *B, TrOp op, int arg) { return emit_raw(B, rs.opnum[op], arg); }

static int append(Bytes *B, const Bytes *src) {
    for (uint32_t i = 0; i < src->v.n; i++)
        if (put(B, src->v.items[i]) < 0) return -1;
    return 0;
}

/* Objects/locations.md: unsigned varint, 6-bit chunks, least significant first, bit 6 = more. */
static int put_uvarint(Bytes *B, unsigned v) {
    while (v >= 64) {
        if (put(B, (uint8_t)(64 | (v & 63))) < 0) return -1;
        v >>= 6;
    }
    return put(B, (uint8_t)v);
}

/* Line-table entries covering `units` code units: "no columns" entries (code 13) on `line`, or,
 * line < 0, "no location" entries (code 15), which leave the line state unchanged. */
static int put_lines(Bytes *B, uint32_t units, int delta_first, bool noloc) {
    bool first = true;
    while (units > 0) {
        uint32_t len = units > 8 ? 8 : units;
        units -= len;
        if (noloc) {
            if (put(B, (uint8_t)(0x80 | (15 << 3) | (len - 1))) < 0) return -1;
            continue;
        }
        int d = first ? delta_first : 0;
        first = false;
        if (put(B, (uint8_t)(0x80 | (13 << 3) | (len - 1))) < 0) return -1;
        if (put_uvarint(B, d < 0 ? ((unsigned)(-d) << 1) | 1u : (unsigned)d << 1) < 0) return -1;
    }
    return 0;
}

/* Objects/exception_handling_notes.txt: varint, 6-bit chunks, most significant first, bit 6 =
 * more; bit 7 marks the first byte of an entry. */
static int put_exc_varint(Bytes *B, unsigned v, bool start) {
    uint8_t chunks[6];
    int n = 0;
    do {
        chunks[n++] = v & 63;
        v >>= 6;
    } while (v && n < 6);
    for (int i = n - 1; i >= 0; i--) {
        uint8_t b = chunks[i] | (i > 0 ? 64 : 0) | (start && i == n - 1 ? 128 : 0);
        if (put(B, b) < 0) return -1;
    }
    return 0;
}

static Py_ssize_t exc_read(const unsigned char *p, Py_ssize_t n, Py_ssize_t i, unsigned *out) {
    if (i >= n) return -1;
    unsigned v = p[i] & 63;
    while (p[i] & 64) {
        if (++i >= n) return -1;
        v = (v << 6) | (p[i] & 63);
    }
    *out = v;
    return i + 1;
}

static PyObject *bytes_of(const Bytes *B) {
    return PyBytes_FromStringAndSize((const char *)B->v.items, (Py_ssize_t)B->v.n);
}

/* ------------------------------------------------------------------------------------------- */
/* the resume function's code                                                                   */

/* Resume code for the original code O continuing at O code unit `target` with a value stack of
 * nstack slots (stack_null[i]: slot i is the NULL of a call sequence). Its arguments are the
 * original's co_nlocals leading locals, each at its own index (an unbound one, !bound[j], arrives as
 * None and the prefix deletes it; a slot whose local is a cell holds a dummy), then the stack's
 * values. Plain locals thus keep their numbering: only cell and free opargs are renumbered, and
 * 3.13's superinstructions, which pack two local indices of 4 bits into one oparg, stay valid.
 * Cached in opts.resume_cache by (target, stack, bound). New reference, or NULL with a break
 * recorded / exception set. */
static PyObject *resume_code(Trace *T, PyCodeObject *O, uint32_t target, int nstack, const bool *stack_null,
                             const bool *bound) {
    int nO = O->co_nlocalsplus;
    const char *kinds = PyBytes_AS_STRING(O->co_localspluskinds);
    PyObject *key = NULL, *code = NULL, *varnames = NULL, *freevars = NULL, *consts = NULL, *marker = NULL;
    PyObject *map = NULL, *bytes = NULL, *lines = NULL, *exc = NULL, *qual = NULL, *orig = NULL, *empty = NULL;
    int *mapc = em_arena_alloc(T->arena, sizeof(int) * (size_t)(nO + 1));
    int *stack_arg = em_arena_alloc(T->arena, sizeof(int) * (size_t)(nstack + 1));
    if (!mapc || !stack_arg) return PyErr_NoMemory();

    /* the cache key: (target, b'stack nulls', b'bound locals') */
    {
        char *sb = em_arena_alloc(T->arena, (size_t)nstack + 1), *lb = em_arena_alloc(T->arena, (size_t)nO + 1);
        if (!sb || !lb) return PyErr_NoMemory();
        for (int i = 0; i < nstack; i++) sb[i] = stack_null[i] ? 'n' : 'v';
        for (int j = 0; j < nO; j++) lb[j] = bound[j] ? 'b' : '-';
        key = Py_BuildValue("(Iy#y#)", target, sb, (Py_ssize_t)nstack, lb, (Py_ssize_t)nO);
        if (!key) return NULL;
    }
    if (T->opts.resume_cache) {
        code = PyDict_GetItemWithError(T->opts.resume_cache, key);
        if (code) {
            Py_DECREF(key);
            return Py_NewRef(code);
        }
        if (PyErr_Occurred()) goto error;
    }

    varnames = PyList_New(0);
    freevars = PyList_New(0);
    if (!varnames || !freevars) goto error;
    int nplain = O->co_nlocals;
    for (int j = 0; j < nplain; j++) { /* the original's locals at their own indices */
        bool cell = ((unsigned char)kinds[j] & (TR_FAST_CELL | TR_FAST_FREE)) != 0;
        PyObject *nm = cell ? PyUnicode_FromFormat("___cell%d", j) : Py_NewRef(PyTuple_GET_ITEM(O->co_localsplusnames, j));
        if (!cell) mapc[j] = j;
        if (!nm || PyList_Append(varnames, nm) < 0) {
            Py_XDECREF(nm);
            goto error;
        }
        Py_DECREF(nm);
    }
    for (int i = 0; i < nstack; i++) {
        stack_arg[i] = -1;
        if (stack_null[i]) continue;
        PyObject *nm = PyUnicode_FromFormat("___stack%d", i);
        stack_arg[i] = (int)PyList_GET_SIZE(varnames);
        if (!nm || PyList_Append(varnames, nm) < 0) {
            Py_XDECREF(nm);
            goto error;
        }
        Py_DECREF(nm);
    }
    int argcount = (int)PyList_GET_SIZE(varnames);
    int nv = argcount;
    for (int j = 0; j < nO; j++) {
        if (!((unsigned char)kinds[j] & (TR_FAST_CELL | TR_FAST_FREE))) continue;
        mapc[j] = nv + (int)PyList_GET_SIZE(freevars);
        if (PyList_Append(freevars, PyTuple_GET_ITEM(O->co_localsplusnames, j)) < 0) goto error;
    }
    int nfree = (int)PyList_GET_SIZE(freevars);

    /* prefix: COPY_FREE_VARS, RESUME, the unbound locals deleted, the value stack, a jump to the
     * target in the copy */
    Bytes P = {.a = T->arena};
    if (nfree && emit(&P, OP_COPY_FREE_VARS, nfree) < 0) goto error;
    if (emit(&P, OP_RESUME, 0) < 0) goto error;
    for (int j = 0; j < nplain; j++)
        if (!bound[j] && !((unsigned char)kinds[j] & (TR_FAST_CELL | TR_FAST_FREE)) && emit(&P, OP_DELETE_FAST, j) < 0)
            goto error;
    for (int i = 0; i < nstack; i++)
        if ((stack_null[i] ? emit(&P, OP_PUSH_NULL, 0) : emit(&P, OP_LOAD_FAST, stack_arg[i])) < 0) goto error;
    /* the jump is relative to its own end, which is where the copy starts */
    if (emit(&P, OP_JUMP_FORWARD, (int)target) < 0) goto error;
    uint32_t prefix_units = P.v.n / 2;

    /* the original bytes, local opargs renumbered in place (same EXTENDED_ARG width) */
    orig = PyCode_GetCode(O);
    if (!orig) goto error;
    Py_ssize_t olen = PyBytes_GET_SIZE(orig);
    unsigned char *ob = em_arena_alloc(T->arena, (size_t)olen + 2);
    if (!ob) {
        PyErr_NoMemory();
        goto error;
    }
    memcpy(ob, PyBytes_AS_STRING(orig), (size_t)olen);
    {
        uint32_t nunits = (uint32_t)(olen / 2), i = 0, ext_start = 0;
        int ext = 0;
        bool in_ext = false;
        int extop = rs.opnum[OP_EXTENDED_ARG];
        while (i < nunits) {
            int opc = ob[2 * i], a = ob[2 * i + 1];
            if (opc == extop) {
                if (!in_ext) ext_start = i;
                in_ext = true;
                ext = (ext | a) << 8;
                i++;
                continue;
            }
            int full = ext | a;
            if (rs.super_op[opc]) { /* 3.13: two 4-bit local indices; plain ones keep theirs */
                int j1 = (full >> 4) & 15, j2 = full & 15;
                int m1 = j1 < nO ? mapc[j1] : 16, m2 = j2 < nO ? mapc[j2] : 16;
                if (m1 > 15 || m2 > 15 || in_ext) {
                    em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a cell in a superinstruction of a resume function");
                    goto error;
                }
                ob[2 * i + 1] = (unsigned char)((m1 << 4) | m2);
            } else if (rs.local_op[opc]) {
                if (full < 0 || full >= nO) {
                    em_tr_break(T, EM_BREAK_INTERNAL, "local index out of range in the resume copy");
                    goto error;
                }
                int nvx = mapc[full];
                uint32_t width = in_ext ? i - ext_start : 0;
                if (width < 3 && nvx >= (1 << (8 * (width + 1)))) {
                    em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "too many locals for a resume function");
                    goto error;
                }
                for (uint32_t k = 0; k < width; k++)
                    ob[2 * (ext_start + k) + 1] = (unsigned char)((nvx >> (8 * (width - k))) & 255);
                ob[2 * i + 1] = (unsigned char)(nvx & 255);
            }
            i += 1 + em_trace_rt.ncache[opc];
            ext = 0;
            in_ext = false;
        }
    }
    Bytes code_b = {.a = T->arena};
    if (append(&code_b, &P) < 0) goto error;
    for (Py_ssize_t k = 0; k < olen; k++)
        if (put(&code_b, ob[k]) < 0) goto error;
    bytes = bytes_of(&code_b);

    /* line table: "no location" over the prefix, then the original's (it starts from
     * co_firstlineno, which "no location" entries leave in place) */
    Bytes L = {.a = T->arena};
    if (put_lines(&L, prefix_units, 0, true) < 0) goto error;
    {
        const char *lt = PyBytes_AS_STRING(O->co_linetable);
        for (Py_ssize_t k = 0; k < PyBytes_GET_SIZE(O->co_linetable); k++)
            if (put(&L, (uint8_t)lt[k]) < 0) goto error;
    }
    lines = bytes_of(&L);

    /* exception table: the original's entries shifted by the prefix */
    Bytes E = {.a = T->arena};
    {
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(O->co_exceptiontable);
        Py_ssize_t n = PyBytes_GET_SIZE(O->co_exceptiontable), j = 0;
        while (j < n) {
            unsigned s, l, t, d;
            if ((j = exc_read(p, n, j, &s)) < 0 || (j = exc_read(p, n, j, &l)) < 0 ||
                (j = exc_read(p, n, j, &t)) < 0 || (j = exc_read(p, n, j, &d)) < 0) {
                em_tr_break(T, EM_BREAK_INTERNAL, "malformed exception table");
                goto error;
            }
            if (put_exc_varint(&E, s + prefix_units, true) < 0 || put_exc_varint(&E, l, false) < 0 ||
                put_exc_varint(&E, t + prefix_units, false) < 0 || put_exc_varint(&E, d, false) < 0)
                goto error;
        }
    }
    exc = bytes_of(&E);

    map = PyTuple_New(nO);
    if (!map) goto error;
    for (int j = 0; j < nO; j++) {
        PyObject *x = PyLong_FromLong(mapc[j]);
        if (!x) goto error;
        PyTuple_SET_ITEM(map, j, x);
    }
    marker = Py_BuildValue("(OOIO)", rs.marker, (PyObject *)O, prefix_units, map);
    if (!marker) goto error;
    {
        Py_ssize_t nc = PyTuple_GET_SIZE(O->co_consts);
        consts = PyTuple_New(nc + 1);
        if (!consts) goto error;
        for (Py_ssize_t k = 0; k < nc; k++) PyTuple_SET_ITEM(consts, k, Py_NewRef(PyTuple_GET_ITEM(O->co_consts, k)));
        PyTuple_SET_ITEM(consts, nc, Py_NewRef(marker));
    }
    qual = PyUnicode_FromFormat("<resume in %U>", O->co_qualname);
    empty = PyTuple_New(0);
    PyObject *vt = varnames ? PyList_AsTuple(varnames) : NULL, *ft = vt ? PyList_AsTuple(freevars) : NULL;
    if (!bytes || !lines || !exc || !qual || !empty || !vt || !ft) {
        Py_XDECREF(vt);
        Py_XDECREF(ft);
        goto error;
    }
    int flags = (O->co_flags & ~(TR_CO_VARARGS | TR_CO_VARKEYWORDS)) | (nfree ? TR_CO_NESTED : 0);
    int stacksize = O->co_stacksize > nstack ? O->co_stacksize : nstack;
    code = (PyObject *)PyCode_NewWithPosOnlyArgs(argcount, 0, 0, nv, stacksize, flags, bytes, consts, O->co_names,
                                                 vt, ft, empty, O->co_filename, O->co_name, qual,
                                                 O->co_firstlineno, lines, exc);
    Py_DECREF(vt);
    Py_DECREF(ft);
    if (!code) goto error;
    if (T->opts.resume_cache && PyDict_SetItem(T->opts.resume_cache, key, code) < 0) Py_CLEAR(code);
error:
    Py_XDECREF(key);
    Py_XDECREF(varnames);
    Py_XDECREF(freevars);
    Py_XDECREF(consts);
    Py_XDECREF(marker);
    Py_XDECREF(map);
    Py_XDECREF(bytes);
    Py_XDECREF(lines);
    Py_XDECREF(exc);
    Py_XDECREF(qual);
    Py_XDECREF(orig);
    Py_XDECREF(empty);
    return code;
}

/* ------------------------------------------------------------------------------------------- */
/* the stub                                                                                     */

enum { K_PLAIN, K_JUMP, K_EXIT };

typedef struct Brk {
    int opcode, arg, op;   /* the breaking instruction (original code numbering) */
    int kind;
    int consumed;
    int produced[2];       /* values it leaves: [0] falling through, [1] jumping */
    PyObject *kwnames;     /* pending KW_NAMES of a CALL, or NULL */
    int name_shift;        /* name-index ops: arg >> shift is the co_names index, else -1 */
    bool deref;            /* the arg is a localsplus index of a cell/free */
    bool method_load;      /* run as a plain LOAD_ATTR; the resume stack gets a NULL below it (above
                              it from 3.13) */
} Brk;

/* Which instructions can run alone in the stub, and how many stack values they take. */
static int classify(Trace *T, TFrame *F, const TInstr *in, Brk *b) {
    b->opcode = in->opcode;
    b->arg = in->arg;
    b->op = in->op;
    b->kind = K_PLAIN;
    b->name_shift = -1;
    b->deref = false;
    b->method_load = false;
    b->kwnames = NULL;
    b->produced[0] = b->produced[1] = 0;
    b->consumed = 0;
    int a = in->arg;
    switch ((TrOp)in->op) {
    case OP_CALL: b->consumed = a + 2; b->kwnames = F->kwnames; break;
    case OP_CALL_KW: /* 3.13: the names' tuple is an operand; kwnames only names it for stub_source */
        b->consumed = a + 3;
        if (F->sp >= 1 && !(b->kwnames = em_tr_kwnames_operand(T, F->stack[F->sp - 1]))) return -1;
        break;
    case OP_CALL_FUNCTION_EX: b->consumed = (a & 1) ? 4 : 3; break;
    case OP_POP_JUMP_IF_FALSE: case OP_POP_JUMP_IF_TRUE: case OP_POP_JUMP_IF_NONE: case OP_POP_JUMP_IF_NOT_NONE:
    case OP_POP_JUMP_FORWARD_IF_FALSE: case OP_POP_JUMP_FORWARD_IF_TRUE: case OP_POP_JUMP_FORWARD_IF_NONE:
    case OP_POP_JUMP_FORWARD_IF_NOT_NONE: case OP_POP_JUMP_BACKWARD_IF_FALSE: case OP_POP_JUMP_BACKWARD_IF_TRUE:
    case OP_POP_JUMP_BACKWARD_IF_NONE: case OP_POP_JUMP_BACKWARD_IF_NOT_NONE:
    case OP_JUMP_IF_FALSE_OR_POP: case OP_JUMP_IF_TRUE_OR_POP:
        b->consumed = 1;
        b->kind = K_JUMP;
        break;
    case OP_RETURN_VALUE: b->consumed = 1; b->kind = K_EXIT; break;
    case OP_RAISE_VARARGS: b->consumed = a; b->kind = K_EXIT; break;
    case OP_STORE_ATTR: b->consumed = 2; b->name_shift = 0; break;
    case OP_DELETE_ATTR: b->consumed = 1; b->name_shift = 0; break;
    case OP_STORE_GLOBAL: b->consumed = 1; b->name_shift = 0; break;
    case OP_DELETE_GLOBAL: b->consumed = 0; b->name_shift = 0; break;
    case OP_IMPORT_NAME: b->consumed = 2; b->name_shift = 0; break;
    case OP_STORE_SUBSCR: b->consumed = 3; break;
    case OP_DELETE_SUBSCR: b->consumed = 2; break;
    case OP_STORE_DEREF: b->consumed = 1; b->deref = true; break;
    case OP_DELETE_DEREF: case OP_LOAD_DEREF: b->consumed = 0; b->deref = true; break;
    case OP_BINARY_OP: case OP_COMPARE_OP: case OP_BINARY_SUBSCR: case OP_IS_OP: case OP_CONTAINS_OP:
        b->consumed = 2;
        break;
    case OP_UNARY_NEGATIVE: case OP_UNARY_POSITIVE: case OP_UNARY_NOT: case OP_UNARY_INVERT: case OP_GET_ITER:
    case OP_LIST_TO_TUPLE: case OP_CALL_INTRINSIC_1: case OP_UNPACK_SEQUENCE: case OP_UNPACK_EX:
    case OP_TO_BOOL: case OP_CONVERT_VALUE: case OP_FORMAT_SIMPLE:
        b->consumed = 1;
        break;
    case OP_FORMAT_WITH_SPEC: b->consumed = 2; break;
    case OP_LOAD_ATTR:
    case OP_LOAD_METHOD:
        /* A method load pushes [method, self] or [NULL, attribute] ([attribute, NULL] from 3.13),
         * which one known only when it runs. The stub loads the plain attribute (a bound method)
         * and the resume function's prefix pushes the NULL beside it: [NULL, bound] ([bound,
         * NULL]) calls the same as either form. */
        b->method_load = in->op == OP_LOAD_METHOD || (EM_PY312 && (a & 1));
        b->consumed = 1;
        b->name_shift = EM_PY312 ? 1 : 0;
        if (b->method_load) {
            b->opcode = rs.opnum[OP_LOAD_ATTR];
            b->arg = EM_PY312 ? (a & ~1) : a;
            b->produced[0] = 1;
            return 0;
        }
        break;
    case OP_FORMAT_VALUE: b->consumed = (a & 4) ? 2 : 1; break;
    case OP_BUILD_STRING: case OP_BUILD_TUPLE: case OP_BUILD_LIST: case OP_BUILD_SET: b->consumed = a; break;
    case OP_BUILD_MAP: b->consumed = 2 * a; break;
    case OP_BINARY_SLICE: b->consumed = 3; break;
    case OP_STORE_SLICE: b->consumed = 4; break;
    case OP_BEFORE_WITH: /* the with statement of a torch.autocast block that holds the break */
        if (!F->sp || F->stack[F->sp - 1]->kind != TV_AUTOCAST)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_OPCODE, "graph break at a with statement");
        b->consumed = 1;
        break;
    default:
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_OPCODE, "graph break at %U", em_trace_rt.opname[in->opcode]);
    }
    if (b->consumed > F->sp) return em_tr_break(T, EM_BREAK_INTERNAL, "stack shorter than the breaking instruction");
    if (b->kind == K_EXIT) return 0;
    for (int j = 0; j < (b->kind == K_JUMP ? 2 : 1); j++) {
        int eff = PyCompile_OpcodeStackEffectWithJump(b->opcode, b->arg, j);
        if (eff == PY_INVALID_STACK_EFFECT) {
            PyErr_Clear();
            return em_tr_break(T, EM_BREAK_INTERNAL, "no stack effect for %U", em_trace_rt.opname[in->opcode]);
        }
        if (!EM_PY312 && b->op == OP_CALL) /* 3.11 splits the pops between PRECALL and CALL */
            eff += PyCompile_OpcodeStackEffect(rs.opnum[OP_PRECALL], b->arg);
        b->produced[j] = b->consumed + eff;
        if (b->produced[j] < 0) return em_tr_break(T, EM_BREAK_INTERNAL, "negative stack result");
    }
    return 0;
}

/* The forward conditional jump with the same condition as op (3.11 spells direction in the name,
 * 3.12 only has forward ones). */
static int forward_jump_opnum(int op) {
    TrOp f;
    switch ((TrOp)op) {
    case OP_POP_JUMP_IF_FALSE: case OP_POP_JUMP_FORWARD_IF_FALSE: case OP_POP_JUMP_BACKWARD_IF_FALSE:
        f = EM_PY312 ? OP_POP_JUMP_IF_FALSE : OP_POP_JUMP_FORWARD_IF_FALSE;
        break;
    case OP_POP_JUMP_IF_TRUE: case OP_POP_JUMP_FORWARD_IF_TRUE: case OP_POP_JUMP_BACKWARD_IF_TRUE:
        f = EM_PY312 ? OP_POP_JUMP_IF_TRUE : OP_POP_JUMP_FORWARD_IF_TRUE;
        break;
    case OP_POP_JUMP_IF_NONE: case OP_POP_JUMP_FORWARD_IF_NONE: case OP_POP_JUMP_BACKWARD_IF_NONE:
        f = EM_PY312 ? OP_POP_JUMP_IF_NONE : OP_POP_JUMP_FORWARD_IF_NONE;
        break;
    case OP_POP_JUMP_IF_NOT_NONE: case OP_POP_JUMP_FORWARD_IF_NOT_NONE: case OP_POP_JUMP_BACKWARD_IF_NOT_NONE:
        f = EM_PY312 ? OP_POP_JUMP_IF_NOT_NONE : OP_POP_JUMP_FORWARD_IF_NOT_NONE;
        break;
    default:
        f = (TrOp)op; /* JUMP_IF_*_OR_POP: forward on 3.11 */
    }
    return rs.opnum[f];
}

/* Which of F's locals the code may still read from instruction `from` on (a backward dataflow over
 * F's instructions: LOAD_FAST* and DELETE_FAST read, STORE_FAST writes; jumps, fallthrough and the
 * handlers of the exception table are the edges), OR-ed into live[] (F's local numbering). A dead
 * local is not passed to the resume function, as Dynamo passes only live variables
 * (torch/_dynamo/bytecode_analysis.py, livevars_analysis): a tensor the rest of the frame never
 * reads is then no output of the graph (no memory held across the break, and no gradient work
 * for it in a training region). Code that may read its locals by name (locals(), vars(), eval,
 * exec, dir) or an instruction this analysis does not know keeps every local. 0, or -1 on OOM. */
static int live_locals(const TFrame *F, const PyCodeObject *code, uint32_t from, uint8_t *live) {
    static const char *const reflective[] = {"locals", "vars", "eval", "exec", "dir", "breakpoint", NULL};
    int nl = F->nlocals;
    uint32_t n = (uint32_t)F->nins;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(code->co_names); k++)
        for (int r = 0; reflective[r]; r++)
            if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(code->co_names, k), reflective[r]) == 0) goto all;
    for (uint32_t i = from; i < n; i++)
        if (F->ins[i].op == OP__UNKNOWN) goto all;
    /* in[i * nl + v]: local v may be read from instruction i on; iterate to the fixed point */
    uint8_t *in = calloc((size_t)n * (size_t)(nl ? nl : 1) + 1, 1);
    if (!in) {
        PyErr_NoMemory();
        return -1;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (uint32_t i = n; i-- > 0;) {
            const TInstr *t = &F->ins[i];
            uint8_t *row = in + (size_t)i * nl;
            bool term = t->op == OP_JUMP_FORWARD || t->op == OP_JUMP_BACKWARD || t->op == OP_JUMP_BACKWARD_NO_INTERRUPT ||
                        t->op == OP_RETURN_VALUE || t->op == OP_RETURN_CONST || t->op == OP_RAISE_VARARGS ||
                        t->op == OP_RERAISE;
            for (int v = 0; v < nl; v++) {
                uint8_t x = 0;
                if (!term && i + 1 < n) x |= in[(size_t)(i + 1) * nl + v];
                if (t->target >= 0 && (uint32_t)t->target < n) x |= in[(size_t)t->target * nl + v];
                for (uint32_t e = 0; e < F->nexc && !x; e++)
                    if (i >= F->exctab[e].start && i < F->exctab[e].end && F->exctab[e].target >= 0)
                        x |= in[(size_t)F->exctab[e].target * nl + v];
                if (t->op == OP_STORE_FAST && t->arg == v) x = 0;
                if ((t->op == OP_LOAD_FAST || t->op == OP_LOAD_FAST_CHECK || t->op == OP_LOAD_FAST_AND_CLEAR ||
                     t->op == OP_DELETE_FAST) && t->arg == v)
                    x = 1;
                int i1 = t->arg >> 4, i2 = t->arg & 15; /* 3.13's superinstructions */
                if (t->op == OP_LOAD_FAST_LOAD_FAST && (i1 == v || i2 == v)) x = 1;
                if (t->op == OP_STORE_FAST_STORE_FAST && (i1 == v || i2 == v)) x = 0;
                if (t->op == OP_STORE_FAST_LOAD_FAST && (i1 == v || i2 == v)) x = i1 != v; /* stores, then loads */
                if (x != row[v]) {
                    row[v] = x;
                    changed = true;
                }
            }
        }
    }
    for (int v = 0; v < nl && from < n; v++) live[v] |= in[(size_t)from * nl + v];
    free(in);
    return 0;
all:
    memset(live, 1, (size_t)nl);
    return 0;
}

/* Zero-argument super() finds its object in localsplus[0] of the running frame (Objects/typeobject.c,
 * super_init_without_args; on 3.12 only the plain `super()` call does, LOAD_SUPER_ATTR takes it from
 * the stack). A resume function keeps the original's local 0 at index 0 (resume_code), but when it
 * is a cell (the resume function holds it as a free variable) or unbound at the break, in a method
 * whose code may call super() (it has a __class__ free variable), the split cannot rebuild that:
 * break. */
static int check_super_self(Trace *T, PyCodeObject *O, const char *kinds, const bool *bound) {
    if (O->co_argcount + O->co_kwonlyargcount == 0) return 0;
    bool has_class = false;
    for (int j = 0; j < O->co_nlocalsplus && !has_class; j++)
        if (((unsigned char)kinds[j] & TR_FAST_FREE) &&
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(O->co_localsplusnames, j), "__class__") == 0)
            has_class = true;
    if (!has_class) return 0;
    if (((unsigned char)kinds[0] & (TR_FAST_CELL | TR_FAST_FREE)) || !bound[0])
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "super() in a method whose first argument is a cell or unbound at the break");
    return 0;
}

typedef struct StubLayout {
    int nres;          /* resume functions (arguments 0..nres) */
    int nbelow;        /* non-NULL stack values below the operands */
    int nops;          /* non-NULL operands */
    int nlocals;       /* bound plain locals */
    int ntemps;        /* results of the instruction */
    int nfree;         /* cells + frees (only when the instruction reads them) */
    int nplain;        /* the original's co_nlocals: the resume functions' leading arguments */
    const int *plain;  /* plain[j], j < nplain: the bound local l for original local j (stub
                          local ix_local(S, l)), or -1: None is passed (unbound, dead, or a cell) */
} StubLayout;

/* stub local indices */
static int ix_below(const StubLayout *S, int i) { return S->nres + i; }
static int ix_op(const StubLayout *S, int i) { return S->nres + S->nbelow + i; }
static int ix_local(const StubLayout *S, int i) { return S->nres + S->nbelow + S->nops + i; }
static int ix_temp(const StubLayout *S, int i) { return S->nres + S->nbelow + S->nops + S->nlocals + i; }
static int nvars(const StubLayout *S) { return S->nres + S->nbelow + S->nops + S->nlocals + S->ntemps; }

/* Stores the instruction's R results, calls resume function k with (the original's leading locals,
 * below, results) (resume_code) and returns its result. */
static int call_block(Bytes *B, const StubLayout *S, int k, int R) {
    for (int r = R - 1; r >= 0; r--)
        if (emit(B, OP_STORE_FAST, ix_temp(S, r)) < 0) return -1;
    if (EM_PY313 ? emit(B, OP_LOAD_FAST, k) < 0 || emit(B, OP_PUSH_NULL, 0) < 0
                 : emit(B, OP_PUSH_NULL, 0) < 0 || emit(B, OP_LOAD_FAST, k) < 0)
        return -1;
    for (int j = 0; j < S->nplain; j++) /* constant 0 of the stub is None */
        if ((S->plain[j] >= 0 ? emit(B, OP_LOAD_FAST, ix_local(S, S->plain[j])) : emit(B, OP_LOAD_CONST, 0)) < 0) return -1;
    for (int i = 0; i < S->nbelow; i++)
        if (emit(B, OP_LOAD_FAST, ix_below(S, i)) < 0) return -1;
    for (int r = 0; r < R; r++)
        if (emit(B, OP_LOAD_FAST, ix_temp(S, r)) < 0) return -1;
    int n = S->nplain + S->nbelow + R;
    if (!EM_PY312 && emit(B, OP_PRECALL, n) < 0) return -1;
    if (emit(B, OP_CALL, n) < 0) return -1;
    return emit(B, OP_RETURN_VALUE, 0);
}

static int add_name(PyObject *list, const char *fmt, int i) {
    PyObject *nm = PyUnicode_FromFormat(fmt, i);
    int rc = nm ? PyList_Append(list, nm) : -1;
    Py_XDECREF(nm);
    return rc;
}

/* The stub's code object. ops_null[i]: operand i is a NULL; local_names: the bound locals' names;
 * cellfree_names: the original's cells and frees (used when b->deref). lineno: the break's line. */
static PyObject *stub_code(Trace *T, PyCodeObject *O, const Brk *b, const StubLayout *S, const bool *ops_null,
                           int nopslots, PyObject *local_names, PyObject *cellfree_names, const int *deref_map,
                           int lineno) {
    PyObject *code = NULL, *varnames = PyList_New(0), *names = NULL, *consts = NULL, *bytes = NULL;
    PyObject *lines = NULL, *exc = NULL, *qual = NULL, *vt = NULL, *ft = NULL, *empty = NULL;
    if (!varnames) return NULL;
    for (int i = 0; i < S->nres; i++)
        if (add_name(varnames, "___resume%d", i) < 0) goto error;
    for (int i = 0; i < S->nbelow; i++)
        if (add_name(varnames, "___stack%d", i) < 0) goto error;
    for (int i = 0; i < S->nops; i++)
        if (add_name(varnames, "___operand%d", i) < 0) goto error;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(local_names); i++)
        if (PyList_Append(varnames, PyTuple_GET_ITEM(local_names, i)) < 0) goto error;
    for (int i = 0; i < S->ntemps; i++)
        if (add_name(varnames, "___result%d", i) < 0) goto error;

    int arg = b->arg;
    if (b->name_shift >= 0) {
        PyObject *nm = PyTuple_GET_ITEM(O->co_names, arg >> b->name_shift);
        names = PyTuple_Pack(1, nm);
        arg = arg & ((1 << b->name_shift) - 1);
    } else {
        names = PyTuple_New(0);
    }
    consts = b->kwnames ? PyTuple_Pack(2, Py_None, b->kwnames) : PyTuple_Pack(1, Py_None);
    if (!names || !consts) goto error;
    if (b->deref) arg = deref_map[arg];

    Bytes B = {.a = T->arena};
    if (S->nfree && emit(&B, OP_COPY_FREE_VARS, S->nfree) < 0) goto error;
    if (emit(&B, OP_RESUME, 0) < 0) goto error;
    for (int i = 0, k = 0; i < nopslots; i++) {
        if (ops_null[i]) {
            if (emit(&B, OP_PUSH_NULL, 0) < 0) goto error;
        } else if (emit(&B, OP_LOAD_FAST, ix_op(S, k++)) < 0) {
            goto error;
        }
    }
    if (b->op == OP_CALL) {
        if (b->kwnames && emit(&B, OP_KW_NAMES, 1) < 0) goto error;
        if (!EM_PY312 && emit(&B, OP_PRECALL, b->arg) < 0) goto error;
    }
    if (b->kind == K_JUMP) {
        Bytes ft_b = {.a = T->arena};
        if (call_block(&ft_b, S, 0, b->produced[0]) < 0) goto error;
        /* 3.13's POP_JUMP_IF_TRUE/FALSE take a bool: the TO_BOOL before them */
        if (EM_PY313 && (b->op == OP_POP_JUMP_IF_FALSE || b->op == OP_POP_JUMP_IF_TRUE) && emit(&B, OP_TO_BOOL, 0) < 0)
            goto error;
        if (emit_raw(&B, forward_jump_opnum(b->op), (int)(ft_b.v.n / 2)) < 0) goto error;
        if (append(&B, &ft_b) < 0 || call_block(&B, S, 1, b->produced[1]) < 0) goto error;
    } else {
        if (emit_raw(&B, b->opcode, arg) < 0) goto error;
        if (b->kind == K_PLAIN && call_block(&B, S, 0, b->produced[0]) < 0) goto error;
    }
    bytes = bytes_of(&B);
    Bytes L = {.a = T->arena};
    if (put_lines(&L, B.v.n / 2, lineno >= 0 ? lineno - O->co_firstlineno : 0, lineno < 0) < 0) goto error;
    lines = bytes_of(&L);
    exc = PyBytes_FromStringAndSize("", 0);
    qual = PyUnicode_FromFormat("<graph break in %U>", O->co_qualname);
    vt = PyList_AsTuple(varnames);
    ft = S->nfree ? Py_NewRef(cellfree_names) : PyTuple_New(0);
    empty = PyTuple_New(0);
    if (!bytes || !lines || !exc || !qual || !vt || !ft || !empty) goto error;
    int stack = nopslots;
    for (int j = 0; j < 2; j++) /* the call of a resume function: NULL, function, arguments */
        if (2 + S->nplain + S->nbelow + b->produced[j] > stack) stack = 2 + S->nplain + S->nbelow + b->produced[j];
    code = (PyObject *)PyCode_NewWithPosOnlyArgs(S->nres + S->nbelow + S->nops + S->nlocals, 0, 0, nvars(S), stack + 2,
                                                 TR_CO_OPTIMIZED | TR_CO_NEWLOCALS | (S->nfree ? TR_CO_NESTED : 0),
                                                 bytes, consts, names, vt, ft, empty, O->co_filename, O->co_name, qual,
                                                 O->co_firstlineno, lines, exc);
error:
    Py_XDECREF(varnames);
    Py_XDECREF(names);
    Py_XDECREF(consts);
    Py_XDECREF(bytes);
    Py_XDECREF(lines);
    Py_XDECREF(exc);
    Py_XDECREF(qual);
    Py_XDECREF(vt);
    Py_XDECREF(ft);
    Py_XDECREF(empty);
    return code;
}

/* The stub as Python source (debug dumps, ember.debug): the body of a function whose parameters
 * are the stub's arguments, doing what stub_code's bytecode does. Made next to the code object
 * so a dump needs no decompiler. Py_None (new reference) for instructions it does not spell:
 * those entries run from C in a dump. */
static int src_add(PyObject **acc, PyObject *part) {
    if (!part) return -1;
    PyObject *r = PyUnicode_Concat(*acc, part);
    Py_DECREF(part);
    Py_SETREF(*acc, r);
    return r ? 0 : -1;
}

static PyObject *src_call_resume(const StubLayout *S, int k, int R, PyObject *local_names) {
    PyObject *acc = PyUnicode_FromFormat("return ___resume%d(", k);
    int n = 0;
    for (int j = 0; acc && j < S->nplain; j++) {
        PyObject *a = S->plain[j] >= 0 ? PyUnicode_FromFormat("%s%U", n ? ", " : "", PyTuple_GET_ITEM(local_names, S->plain[j]))
                                       : PyUnicode_FromFormat("%sNone", n ? ", " : "");
        n++;
        if (src_add(&acc, a) < 0) return NULL;
    }
    for (int i = 0; acc && i < S->nbelow; i++)
        if (src_add(&acc, PyUnicode_FromFormat("%s___stack%d", n++ ? ", " : "", i)) < 0) return NULL;
    for (int r = 0; acc && r < R; r++)
        if (src_add(&acc, PyUnicode_FromFormat("%s___result%d", n++ ? ", " : "", r)) < 0) return NULL;
    if (acc && src_add(&acc, PyUnicode_FromString(")\n")) < 0) return NULL;
    return acc;
}

static PyObject *stub_source(const Brk *b, const StubLayout *S, const bool *ops_null, int nopslots,
                             PyObject *local_names) {
    PyObject *acc = NULL;
    int ops[64], nops = 0; /* operand slot -> ___operand index, -1 for a NULL */
    if (nopslots > 64 || b->deref) return Py_NewRef(Py_None);
    for (int i = 0, k = 0; i < nopslots; i++) ops[nops++] = ops_null[i] ? -1 : k++;
    if (b->kind == K_PLAIN && (b->op == OP_CALL || b->op == OP_CALL_KW) && b->produced[0] == 1 && nopslots >= 2) {
        /* [NULL, callable, args...] or [callable, self, args...] (Python/bytecodes.c CALL); 3.13:
         * [callable, NULL, args...] or [callable, self, args...], CALL_KW: the names' tuple on top */
        int callee = EM_PY313 ? ops[0] : ops[ops[0] < 0 ? 1 : 0];
        int argstart = EM_PY313 ? (ops[1] < 0 ? 2 : 1) : (ops[0] < 0 ? 2 : 1);
        int nargs = nopslots - argstart - (b->op == OP_CALL_KW ? 1 : 0);
        Py_ssize_t nkw = b->kwnames ? PyTuple_GET_SIZE(b->kwnames) : 0;
        if (callee < 0 || nkw > nargs) return Py_NewRef(Py_None);
        acc = PyUnicode_FromFormat("___result0 = ___operand%d(", callee);
        for (int i = 0; acc && i < nargs; i++) {
            int slot = ops[argstart + i];
            if (slot < 0) {
                Py_DECREF(acc);
                return Py_NewRef(Py_None);
            }
            PyObject *kw = i >= nargs - nkw ? PyTuple_GET_ITEM(b->kwnames, i - (nargs - nkw)) : NULL;
            if (src_add(&acc, kw ? PyUnicode_FromFormat("%s%U=___operand%d", i ? ", " : "", kw, slot)
                                 : PyUnicode_FromFormat("%s___operand%d", i ? ", " : "", slot)) < 0)
                return NULL;
        }
        if (acc && src_add(&acc, PyUnicode_FromString(")\n")) < 0) return NULL;
        if (acc && src_add(&acc, src_call_resume(S, 0, 1, local_names)) < 0) return NULL;
        return acc;
    }
    if (b->kind == K_JUMP && nopslots == 1 && ops[0] == 0 && b->produced[0] == 0 && b->produced[1] == 0) {
        const char *cond;
        switch ((TrOp)b->op) {
        case OP_POP_JUMP_IF_FALSE: case OP_POP_JUMP_FORWARD_IF_FALSE: case OP_POP_JUMP_BACKWARD_IF_FALSE:
            cond = "not ___operand0"; break;
        case OP_POP_JUMP_IF_TRUE: case OP_POP_JUMP_FORWARD_IF_TRUE: case OP_POP_JUMP_BACKWARD_IF_TRUE:
            cond = "___operand0"; break;
        case OP_POP_JUMP_IF_NONE: case OP_POP_JUMP_FORWARD_IF_NONE: case OP_POP_JUMP_BACKWARD_IF_NONE:
            cond = "___operand0 is None"; break;
        case OP_POP_JUMP_IF_NOT_NONE: case OP_POP_JUMP_FORWARD_IF_NOT_NONE: case OP_POP_JUMP_BACKWARD_IF_NOT_NONE:
            cond = "___operand0 is not None"; break;
        default:
            return Py_NewRef(Py_None);
        }
        acc = PyUnicode_FromFormat("if %s:\n    ", cond);
        if (acc && src_add(&acc, src_call_resume(S, 1, 0, local_names)) < 0) return NULL;
        if (acc && src_add(&acc, src_call_resume(S, 0, 0, local_names)) < 0) return NULL;
        return acc;
    }
    if (b->kind == K_PLAIN && b->op == OP_TO_BOOL && nopslots == 1 && ops[0] == 0) {
        acc = PyUnicode_FromString("___result0 = bool(___operand0)\n");
        if (acc && src_add(&acc, src_call_resume(S, 0, 1, local_names)) < 0) return NULL;
        return acc;
    }
    if (b->kind == K_EXIT && b->op == OP_RETURN_VALUE && nopslots == 1 && ops[0] == 0)
        return PyUnicode_FromString("return ___operand0\n");
    return Py_NewRef(Py_None);
}

/* ------------------------------------------------------------------------------------------- */
/* values live at the break                                                                     */

static int fetch_spec(Trace *T, GuardSrc src, OutSpec *o) {
    int slot = em_guard_fetch(T->gb, src);
    if (slot < 0) return -1;
    o->kind = OUT_FETCH;
    o->index = (uint32_t)slot;
    return 0;
}

static int wrap1(Trace *T, OutCtx *C, OutKind kind, PyObject *obj, TValue *inner, OutSpec *o, int depth) {
    o->kind = kind;
    o->obj = obj;
    o->n = 1;
    o->items = em_arena_alloc(T->arena, sizeof(OutSpec));
    if (!o->items) {
        PyErr_NoMemory();
        return -1;
    }
    return em_tr_out_spec(T, C, inner, &o->items[0], depth + 1);
}

/* A grad-mode manager (or its bound __exit__) as a real object with the state the trace knows:
 * torch/autograd/grad_mode.py keeps it in `prev` (and `mode`); __exit__ sets the mode to prev. */
static PyObject *grad_manager(Trace *T, TValue *v) {
    TraceRT *rt = &em_trace_rt;
    PyObject *cls = v->u.gm.applied ? rt->set_grad_enabled_cls : v->u.gm.mode ? rt->enable_grad_cls : rt->no_grad_cls;
    PyObject *obj = PyObject_CallMethod((PyObject *)&PyBaseObject_Type, "__new__", "O", cls);
    if (!obj) return NULL;
    if (PyObject_SetAttrString(obj, "prev", v->u.gm.prev ? Py_True : Py_False) < 0 ||
        (v->u.gm.applied && PyObject_SetAttrString(obj, "mode", v->u.gm.mode ? Py_True : Py_False) < 0)) {
        Py_DECREF(obj);
        return NULL;
    }
    if (v->u.gm.exit) Py_SETREF(obj, PyObject_GetAttrString(obj, "__exit__"));
    return em_arena_hold_steal(T->arena, obj);
}

int em_tr_split_value_spec(Trace *T, OutCtx *C, TValue *v, OutSpec *o, int depth) {
    if (v->kind == TV_LAZY && v->src >= 0) return fetch_spec(T, v->src, o);
    switch (v->kind) {
    case TV_NULL:
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a NULL value inside a live value");
    case TV_TENSOR:
        /* an input (maybe mutated in place by the graph) keeps its identity */
        if (v->src >= 0) return fetch_spec(T, v->src, o);
        return 1;
    case TV_LIST:
    case TV_DICT:
        if (v->mutable) {
            for (uint32_t i = 0; i < C->seen.n; i++)
                if (C->seen.items[i] == v)
                    return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a container made in the frame is live twice at a break");
            if (EM_VEC_PUSH(T->arena, C->seen, v) < 0) {
                PyErr_NoMemory();
                return -1;
            }
        }
        return 1;
    case TV_TENSOR_METHOD:
        return wrap1(T, C, OUT_ATTR, v->u.tm.name, v->u.tm.self, o, depth);
    case TV_BOUND_METHOD:
        if (!v->u.bm.func && v->u.bm.name) return wrap1(T, C, OUT_ATTR, v->u.bm.name, v->u.bm.self, o, depth);
        if (v->u.bm.func && v->u.bm.func->kind == TV_FUNCTION && v->u.bm.func->obj)
            return wrap1(T, C, OUT_METHOD, v->u.bm.func->obj, v->u.bm.self, o, depth);
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a method made in the frame is live at a break");
    case TV_ITERATOR: {
        if (v->u.it.kind != IT_ARRAY)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an iterator over a list or generator is live at a break");
        uint32_t pos = v->u.it.pos < v->u.it.n ? v->u.it.pos : v->u.it.n;
        TValue *rest = em_tr_tuple(T, v->u.it.items + pos, v->u.it.n - pos);
        if (!rest) return -1;
        return wrap1(T, C, OUT_ITER, NULL, rest, o, depth);
    }
    case TV_SLICE: {
        PyObject *s = em_tr_to_py_const(T, v);
        if (!s) {
            if (PyErr_Occurred()) return -1;
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a slice of non-constants is live at a break");
        }
        o->kind = OUT_CONST;
        o->obj = em_arena_hold_steal(T->arena, s);
        return o->obj ? 0 : -1;
    }
    case TV_AUTOCAST:
        /* a split inside a block of the top frame is at its with statement (em_tr_break), so only
         * the manager itself (not entered: the stub enters it) can be live here */
        if (v->u.ac.exit) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a torch.autocast block is open at a break");
        o->kind = OUT_CONST;
        o->obj = v->u.ac.mgr;
        return 0;
    case TV_GRAD_MODE: {
        PyObject *m = grad_manager(T, v);
        if (!m) return em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
        o->kind = OUT_CONST;
        o->obj = m;
        return 0;
    }
    case TV_OBJECT:
        /* the tracer lets an exception class stand for `Cls(args)` (only `raise` uses it) */
        if (v->src < 0 && v->obj && PyType_Check(v->obj) &&
            PyType_IsSubtype((PyTypeObject *)v->obj, (PyTypeObject *)PyExc_BaseException))
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an exception made in the frame is live at a break");
        return 1;
    case TV_FUNCTION: {
        if (v->obj || v->src >= 0) return 1;
        /* a function made in the frame: rebuilt from its code, globals, closure cells (the
         * frame's own, shared with the resume functions) and defaults */
        o->kind = OUT_FUNCTION;
        o->obj = (PyObject *)v->u.fn.code;
        o->n = 4;
        o->items = em_arena_alloc(T->arena, sizeof(OutSpec) * 4);
        if (!o->items) {
            PyErr_NoMemory();
            return -1;
        }
        o->items[0].kind = OUT_CONST;
        o->items[0].obj = v->u.fn.globals;
        TValue *parts[3] = {v->u.fn.closure, v->u.fn.defaults, v->u.fn.kwdefaults};
        for (int i = 0; i < 3; i++) {
            if (!parts[i]) {
                o->items[1 + i].kind = OUT_CONST;
                o->items[1 + i].obj = Py_None;
            } else if (em_tr_out_spec(T, C, parts[i], &o->items[1 + i], depth + 1) < 0) {
                return -1;
            }
        }
        return 0;
    }
    case TV_CELL:
        for (uint32_t k = 0; k < C->ncells; k++)
            if (C->cells[k] == v) {
                o->kind = OUT_CELL;
                o->index = k;
                return 0;
            }
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a cell of an inlined function is live at a break");
    case TV_SUPER:
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a super() value is live at a break");
    default:
        return 1;
    }
}

/* ------------------------------------------------------------------------------------------- */
/* the split                                                                                    */

static bool is_null(const TValue *v) { return v == NULL || v->kind == TV_NULL; }

/* Is the bound __exit__ of a real torch.autocast object on F's stack: is F a resume function that
 * starts inside an autocast block, whose stub entered it? Such a frame is not split again: a stub
 * or graph that raised there would skip the block's __exit__, which only the frame's own bytecode
 * (its exception table) runs; the frame runs as Python and the calls in it are compiled. */
static bool autocast_exit_live(const TFrame *F) {
    PyObject *cls = em_trace_rt.autocast_cls;
    for (int i = 0; cls && i < F->sp; i++) {
        PyObject *o = F->stack[i] ? F->stack[i]->obj : NULL;
        if (o && PyMethod_Check(o) && PyObject_TypeCheck(PyMethod_GET_SELF(o), (PyTypeObject *)cls)) return true;
    }
    return false;
}

int em_tr_split_here(Trace *T, TFrame *F) {
    if (resume_tables() < 0) return -1;
    PyCodeObject *C = F->code, *O = C;
    PyObject *marker = resume_marker_of(C), *rmap = NULL;
    uint32_t prefix = 0;
    if (marker) {
        O = (PyCodeObject *)PyTuple_GET_ITEM(marker, 1);
        prefix = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(marker, 2));
        rmap = PyTuple_GET_ITEM(marker, 3);
    }
    TInstr *in = &F->ins[F->pc];
    if (in->start < 2 * prefix) return em_tr_break(T, EM_BREAK_INTERNAL, "break inside a resume prefix");
    if (em_tr_overlay_settled(T) < 0) return -1; /* the graph cannot make such a store */
    if (autocast_exit_live(F))
        return em_tr_break(T, EM_BREAK_TRY_BLOCK, "a torch.autocast block entered before this function is open");
    if (em_tr_in_try(F, F->pc)) /* the stub would raise outside the except / finally clause */
        return em_tr_break(T, EM_BREAK_TRY_BLOCK, "a break inside a try block");
    Brk b;
    /* bi: the instruction the stub runs; after: where its fall-through resumes */
    const TInstr *bi = in;
    uint32_t after = (uint32_t)F->pc + 1;
#if EM_PY313
    /* 3.13 takes a branch's truth in an instruction of its own: TO_BOOL, or COMPARE_OP with oparg
     * bit 4 (bool() folded into the comparison), then POP_JUMP_IF_TRUE/FALSE on a bool. A break
     * there splits as 3.12's does at its jump: a tensor comparison goes into the graph (as in
     * torch.compile's), and the stub takes the truth, jumps, and calls one of two resume functions,
     * one per branch. */
    const TInstr *jmp = F->pc + 1 < F->nins ? &F->ins[F->pc + 1] : NULL;
    if (jmp && (jmp->op == OP_POP_JUMP_IF_FALSE || jmp->op == OP_POP_JUMP_IF_TRUE) && jmp->target >= 0 &&
        (in->op == OP_TO_BOOL ||
         (in->op == OP_COMPARE_OP && (in->arg & 16) && T->split_reason == EM_BREAK_DATA_DEPENDENT_BRANCH))) {
        if (in->op == OP_COMPARE_OP) {
            if (F->sp < 2) return em_tr_break(T, EM_BREAK_INTERNAL, "stack shorter than the comparison");
            TValue *r = em_tr_compare(T, in->arg >> 5, F->stack[F->sp - 2], F->stack[F->sp - 1]);
            if (!r) return -1;
            F->sp -= 2;
            F->stack[F->sp++] = r;
        }
        bi = jmp;
        after = (uint32_t)F->pc + 2;
    }
#endif
    if (classify(T, F, bi, &b) < 0) return -1;
    if (b.kind != K_EXIT && after >= (uint32_t)F->nins) return em_tr_break(T, EM_BREAK_INTERNAL, "break at the last instruction");
    if (b.kind == K_JUMP && bi->target < 0) return em_tr_break(T, EM_BREAK_INTERNAL, "jump without a target");

    int nO = O->co_nlocalsplus;
    const char *kinds = PyBytes_AS_STRING(O->co_localspluskinds);
    TValue **olocal = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(nO + 1));
    bool *bound = em_arena_alloc(T->arena, (size_t)nO + 1);
    int *deref_map = em_arena_alloc(T->arena, sizeof(int) * (size_t)(nO + 1));
    bool *stack_null = em_arena_alloc(T->arena, (size_t)F->sp + 2);
    EmSplit *sp = em_arena_alloc(T->arena, sizeof(EmSplit));
    if (!olocal || !bound || !deref_map || !stack_null || !sp) {
        PyErr_NoMemory();
        return -1;
    }
    sp->restore_grad = -1;
    /* the locals the rest of the frame may read (from the breaking instruction on: both of its
     * successors and its handler); local 0 always (zero-argument super() reads it) */
    uint8_t *live = em_arena_alloc(T->arena, (size_t)F->nlocals + 1);
    if (!live) {
        PyErr_NoMemory();
        return -1;
    }
    memset(live, b.kind == K_EXIT || in->op == OP_STORE_FAST, (size_t)F->nlocals + 1);
    if (!live[0] && live_locals(F, C, (uint32_t)F->pc, live) < 0) return -1;
    int ncf = 0, nlocals = 0;
    for (int j = 0; j < nO; j++) {
        int r = rmap ? (int)PyLong_AsLong(PyTuple_GET_ITEM(rmap, j)) : j;
        if (r < 0 || r >= F->nlocals) return em_tr_break(T, EM_BREAK_INTERNAL, "resume map out of range");
        olocal[j] = F->locals[r];
        bool cf = ((unsigned char)kinds[j] & (TR_FAST_CELL | TR_FAST_FREE)) != 0;
        bound[j] = !cf && !is_null(olocal[j]) && (live[r] || j == 0);
        nlocals += bound[j];
        if (cf) deref_map[j] = ncf++;
    }
    /* the cells: input cells (the frame's closure) are passed on, cells made by MAKE_CELL are new */
    sp->ncells = (uint32_t)ncf;
    sp->cell_closure = em_arena_alloc(T->arena, sizeof(int32_t) * (size_t)(ncf + 1));
    sp->cell_value = em_arena_alloc(T->arena, sizeof(int32_t) * (size_t)(ncf + 1));
    PyObject *cellfree_names = PyTuple_New(ncf), *local_names = PyTuple_New(nlocals);
    if (!sp->cell_closure || !sp->cell_value || !cellfree_names || !local_names) {
        Py_XDECREF(cellfree_names);
        Py_XDECREF(local_names);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    em_arena_hold_steal(T->arena, cellfree_names);
    em_arena_hold_steal(T->arena, local_names);
    int cfirst_free = F->nlocals - C->co_nfreevars;
    TValue **newcell_contents = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(ncf + 1));
    if (!newcell_contents) {
        PyErr_NoMemory();
        return -1;
    }
    int nnew = 0;
    for (int j = 0, k = 0, l = 0; j < nO; j++) {
        PyObject *nm = PyTuple_GET_ITEM(O->co_localsplusnames, j);
        if (bound[j]) PyTuple_SET_ITEM(local_names, l++, Py_NewRef(nm));
        if (!((unsigned char)kinds[j] & (TR_FAST_CELL | TR_FAST_FREE))) continue;
        PyTuple_SET_ITEM(cellfree_names, k, Py_NewRef(nm));
        TValue *c = olocal[j];
        int r = rmap ? (int)PyLong_AsLong(PyTuple_GET_ITEM(rmap, j)) : j;
        if (!c || c->kind != TV_CELL) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a cell is not made yet at the break");
        if (r >= cfirst_free && !c->mutable) {
            sp->cell_closure[k] = r - cfirst_free;
            sp->cell_value[k] = -1;
        } else {
            sp->cell_closure[k] = -1;
            sp->cell_value[k] = is_null(c->u.cell.contents) ? -1 : nnew;
            if (!is_null(c->u.cell.contents)) newcell_contents[nnew++] = c->u.cell.contents;
        }
        k++;
    }
    for (int i = 0; i < F->sp; i++) stack_null[i] = is_null(F->stack[i]);
    int nopslots = b.consumed, nbelow_slots = F->sp - b.consumed;
    StubLayout S = {0};
    S.nres = b.kind == K_JUMP ? 2 : b.kind == K_PLAIN ? 1 : 0;
    for (int i = 0; i < nbelow_slots; i++) S.nbelow += !stack_null[i];
    for (int i = nbelow_slots; i < F->sp; i++) S.nops += !stack_null[i];
    S.nlocals = nlocals;
    S.ntemps = b.kind == K_EXIT ? 0 : b.produced[0];
    if (b.kind == K_JUMP && b.produced[1] > S.ntemps) S.ntemps = b.produced[1];
    S.nfree = b.deref ? ncf : 0;
    if (check_super_self(T, O, kinds, bound) < 0) return -1;
    S.nplain = O->co_nlocals;
    int *plain = em_arena_alloc(T->arena, sizeof(int) * (size_t)(S.nplain + 1));
    if (!plain) {
        PyErr_NoMemory();
        return -1;
    }
    for (int j = 0, l = 0; j < S.nplain; j++) plain[j] = bound[j] ? l++ : -1;
    S.plain = plain;
    sp->stub_closure = b.deref;
    for (int j = 0; j < nO; j++) /* stub localsplus index of each cell/free */
        if ((unsigned char)kinds[j] & (TR_FAST_CELL | TR_FAST_FREE)) deref_map[j] += nvars(&S);
    if (b.deref && rmap) { /* the instruction's operand is in the resume code's numbering */
        int oj = -1;
        for (int j = 0; j < nO && oj < 0; j++)
            if (PyLong_AsLong(PyTuple_GET_ITEM(rmap, j)) == b.arg) oj = j;
        b.arg = oj;
    }
    if (b.deref && (b.arg < 0 || b.arg >= nO || !((unsigned char)kinds[b.arg] & (TR_FAST_CELL | TR_FAST_FREE))))
        return em_tr_break(T, EM_BREAK_INTERNAL, "deref of a non-cell at the break");

    /* the values: stub arguments (stack below, operands, bound locals), then new cells' contents */
    uint32_t nvals = (uint32_t)(S.nbelow + S.nops + S.nlocals + nnew);
    OutSpec *vals = em_arena_alloc(T->arena, sizeof(OutSpec));
    OutCtx Cx;
    memset(&Cx, 0, sizeof Cx);
    Cx.split = true;
    if (!vals || !(vals->items = em_arena_alloc(T->arena, sizeof(OutSpec) * (nvals + 1)))) {
        PyErr_NoMemory();
        return -1;
    }
    vals->kind = OUT_TUPLE;
    vals->n = nvals;
    Cx.cells = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(ncf + 1));
    TValue **top = em_arena_alloc(T->arena, sizeof(TValue *) * (nvals + 1));
    if (!Cx.cells || !top) {
        PyErr_NoMemory();
        return -1;
    }
    for (int j = 0; j < nO; j++)
        if ((unsigned char)kinds[j] & (TR_FAST_CELL | TR_FAST_FREE)) Cx.cells[Cx.ncells++] = olocal[j];
    uint32_t vi = 0;
    for (int i = 0; i < F->sp; i++)
        if (!stack_null[i]) top[vi++] = F->stack[i];
    for (int j = 0; j < nO; j++)
        if (bound[j]) top[vi++] = olocal[j];
    /* a new cell's content i is value first_new + i (one pass: remapping content by content in
     * place mixed up two cells once a value index equalled a later content's index, as when no
     * plain local is bound and x0 and acc_v1 are both cells: program_gen seed 220373) */
    uint32_t first_new = vi;
    for (int k = 0; k < ncf; k++)
        if (sp->cell_value[k] >= 0) sp->cell_value[k] += (int32_t)first_new;
    for (int i = 0; i < nnew; i++) top[vi++] = newcell_contents[i];
    for (uint32_t i = 0; i < nvals; i++) {
        /* a function or container made in the frame that is live more than once (a local and
         * the callee on the stack) is rebuilt once: later items refer to the first */
        TValue *v = top[i];
        bool shared = (v->kind == TV_FUNCTION && !v->obj && v->src < 0) ||
                      ((v->kind == TV_LIST || v->kind == TV_DICT) && v->mutable);
        uint32_t first = i;
        for (uint32_t k = 0; shared && k < i && first == i; k++)
            if (top[k] == v) first = k;
        if (first < i) {
            vals->items[i].kind = OUT_REF;
            vals->items[i].index = first;
        } else if (em_tr_out_spec(T, &Cx, v, &vals->items[i], 1) < 0) {
            return -1;
        }
    }
    sp->values = vals;
    sp->nargs = (uint32_t)(S.nbelow + S.nops + S.nlocals);

    /* resume functions: the stack after the instruction is the part below plus its results */
    uint32_t base = 2 * prefix;
    sp->offset = in->offset - base;
    sp->nresume = S.nres;
    for (int k = 0; k < S.nres; k++) {
        int R = b.produced[k], nullm = b.method_load ? 1 : 0;
        int nst = nbelow_slots + nullm + R;
        bool *rnull = em_arena_alloc(T->arena, (size_t)nst + 1);
        if (!rnull) {
            PyErr_NoMemory();
            return -1;
        }
        for (int i = 0; i < nbelow_slots; i++) rnull[i] = stack_null[i];
        for (int i = nbelow_slots; i < nst; i++) rnull[i] = false;
        if (nullm) rnull[EM_PY313 ? nst - 1 : nbelow_slots] = true; /* push_callable's order */
        const TInstr *to = k == 0 ? &F->ins[after] : &F->ins[bi->target];
        if (to->start < base) return em_tr_break(T, EM_BREAK_INTERNAL, "resume target inside the prefix");
        PyObject *rc = resume_code(T, O, (to->start - base) / 2, nst, rnull, bound);
        if (!rc) return T->broke ? -1 : em_tr_break_exc(T, EM_BREAK_INTERNAL);
        sp->resume[k] = em_arena_hold_steal(T->arena, rc);
    }
    sp->stub = stub_code(T, O, &b, &S, stack_null + nbelow_slots, nopslots, local_names, cellfree_names, deref_map,
                         T->res->brk.lineno >= 0 ? T->res->brk.lineno : PyCode_Addr2Line(C, (int)in->offset));
    if (!sp->stub) return T->broke ? -1 : em_tr_break_exc(T, EM_BREAK_INTERNAL);
    em_arena_hold_steal(T->arena, sp->stub);
    sp->stub_source = stub_source(&b, &S, stack_null + nbelow_slots, nopslots, local_names);
    if (!sp->stub_source) return em_tr_break_exc(T, EM_BREAK_INTERNAL);
    em_arena_hold_steal(T->arena, sp->stub_source);
    if (em_tr_effects_spec(T, &Cx) < 0) return -1;
    if (em_tr_finish_graph(T, &Cx) < 0) return -1;
    T->res->split = sp;
    return 0;
}
