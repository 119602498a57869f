/* ir, symbolic sizes: the bridge between IR metadata with symbolic sizes and ember._fake.sym_run,
 * which runs an op on fake tensors whose sizes are torch SymInts mirroring the ShapeEnv's symbols.
 * Used by the tracer (an op with a symbolic argument and no C shape rule) and by the autograd stage
 * (every node of a symbolic joint graph). Both render a value's sizes in symbol style for torch and
 * read torch's results back as expression trees. */
#include "ir/em_ir.h"
#include "sym/em_sym.h"

#include <string.h>

static PyObject *render(ShapeEnv *env, uint32_t e) {
    char buf[512];
    em_sym_render(env, em_sym_simplify(env, e), SYM_STYLE_SYMBOLS, buf, sizeof buf);
    return PyUnicode_FromString(buf);
}

PyObject *em_ir_sym_value_tree(struct ShapeEnv *env, const IRMeta *m) {
    if (m->kind == IRMETA_OTHER && m->sym) {
        PyObject *s = render(env, m->sym);
        return s ? Py_BuildValue("(sN)", "S", s) : NULL;
    }
    if (m->kind == IRMETA_OTHER && m->example) return Py_NewRef(m->example); /* a static value: itself */
    if (m->kind != IRMETA_TENSOR) {
        PyErr_SetString(PyExc_NotImplementedError, "ember: a non-tensor node in a symbolic call");
        return NULL;
    }
    PyObject *sz = Py_NewRef(Py_None), *st = Py_NewRef(Py_None);
    if (m->sym_sizes) {
        Py_SETREF(sz, PyTuple_New(m->ndim));
        Py_SETREF(st, PyTuple_New(m->ndim));
        for (int i = 0; sz && st && i < m->ndim; i++) {
            PyObject *a = render(env, m->sym_sizes[i]), *b = render(env, m->sym_strides[i]);
            if (!a || !b) {
                Py_XDECREF(a);
                Py_XDECREF(b);
                Py_CLEAR(sz);
                break;
            }
            PyTuple_SET_ITEM(sz, i, a);
            PyTuple_SET_ITEM(st, i, b);
        }
    }
    PyObject *r = sz && st ? Py_BuildValue("(sOOOOO)", "T", m->example, m->device ? m->device : Py_None, sz, st,
                                           m->requires_grad ? Py_True : Py_False)
                           : NULL;
    Py_XDECREF(sz);
    Py_XDECREF(st);
    return r;
}

uint32_t em_ir_sym_from_tree(struct ShapeEnv *env, PyObject *tree) {
    if (!PyTuple_Check(tree) || PyTuple_GET_SIZE(tree) < 2 || !PyUnicode_Check(PyTuple_GET_ITEM(tree, 0))) {
        PyErr_SetString(PyExc_TypeError, "ember: a size tree is (op, ...)");
        return SYM_NONE;
    }
    const char *op = PyUnicode_AsUTF8(PyTuple_GET_ITEM(tree, 0));
    if (!op) return SYM_NONE;
    if (!strcmp(op, "const") || !strcmp(op, "sym")) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tree, 1));
        if (v == -1 && PyErr_Occurred()) return SYM_NONE;
        if (!strcmp(op, "const")) return em_sym_const(env, v);
        if (v < 0 || v >= (long long)em_sym_nsymbols(env)) {
            PyErr_SetString(PyExc_IndexError, "ember: no such symbol");
            return SYM_NONE;
        }
        return em_sym_symbol(env, (uint32_t)v);
    }
    if (PyTuple_GET_SIZE(tree) != 3) {
        PyErr_SetString(PyExc_TypeError, "ember: a binary size op takes two operands");
        return SYM_NONE;
    }
    SymRef a = em_ir_sym_from_tree(env, PyTuple_GET_ITEM(tree, 1));
    if (PyErr_Occurred()) return SYM_NONE;
    SymRef b = em_ir_sym_from_tree(env, PyTuple_GET_ITEM(tree, 2));
    if (PyErr_Occurred()) return SYM_NONE;
    int known;
    SymRef r = em_sym_binop_named(env, op, a, b, &known);
    if (known) return r;
    PyErr_Format(PyExc_ValueError, "ember: unknown size op %s", op);
    return SYM_NONE;
}
