/* ir verifier: checks the structural invariants every pass relies on (QBE runs one after each
 * pass in debug builds). It reads the graph only and never touches the Python error state.
 * Invariant checked: topological order, placeholders first and listed in g->inputs, one output
 * node (last), unique names, well-formed arguments and metas. */
#include "ir/em_ir.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* Writes the failure message (printf style) and returns -1. */
static int ir_fail(char *buf, size_t bufsize, const char *fmt, ...) {
    if (buf && bufsize) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, bufsize, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* Checks one argument (recursively) of node `user`: node refs point at earlier nodes that are
 * not the output node, constants are non-NULL, tuples/lists have their items. */
static int ir_verify_arg(const IRGraph *g, IRRef user, const IRArg *a, int depth, char *buf, size_t bufsize) {
    const char *uname = g->nodes[user].name ? g->nodes[user].name : "?";
    if (depth > 64) return ir_fail(buf, bufsize, "node %u (%s): arguments nested too deeply", user, uname);
    switch (a->kind) {
    case IRARG_NODE:
        if (a->u.ref == 0 || a->u.ref >= user)
            return ir_fail(buf, bufsize, "node %u (%s): argument refers to node %u, not an earlier node", user,
                           uname, a->u.ref);
        if (g->nodes[a->u.ref].kind == IR_OUTPUT)
            return ir_fail(buf, bufsize, "node %u (%s): argument refers to the output node", user, uname);
        return 0;
    case IRARG_CONST:
        if (!a->u.obj) return ir_fail(buf, bufsize, "node %u (%s): constant argument is NULL", user, uname);
        return 0;
    case IRARG_TUPLE:
    case IRARG_LIST:
        if (a->n && !a->u.items)
            return ir_fail(buf, bufsize, "node %u (%s): tuple/list argument without items", user, uname);
        for (uint32_t i = 0; i < a->n; i++)
            if (ir_verify_arg(g, user, &a->u.items[i], depth + 1, buf, bufsize) < 0) return -1;
        return 0;
    }
    return ir_fail(buf, bufsize, "node %u (%s): argument of unknown kind %d", user, uname, (int)a->kind);
}

/* Checks a meta: tensors have a dtype, a device and non-negative sizes; tuples their items. */
static int ir_verify_meta(const IRGraph *g, IRRef i, const IRMeta *m, int depth, char *buf, size_t bufsize) {
    const char *name = g->nodes[i].name ? g->nodes[i].name : "?";
    if (depth > 16) return ir_fail(buf, bufsize, "node %u (%s): meta nested too deeply", i, name);
    switch (m->kind) {
    case IRMETA_TENSOR:
        if (m->ndim < 0) return ir_fail(buf, bufsize, "node %u (%s): tensor meta with ndim %d", i, name, m->ndim);
        if (m->ndim > 0 && (!m->sizes || !m->strides))
            return ir_fail(buf, bufsize, "node %u (%s): tensor meta without sizes or strides", i, name);
        for (int32_t d = 0; d < m->ndim; d++)
            if (m->sizes[d] < 0)
                return ir_fail(buf, bufsize, "node %u (%s): tensor meta with size %lld in dim %d", i, name,
                               (long long)m->sizes[d], d);
        if (!m->dtype || !m->device)
            return ir_fail(buf, bufsize, "node %u (%s): tensor meta without dtype or device", i, name);
        return 0;
    case IRMETA_TUPLE:
        if (m->nitems && !m->items) return ir_fail(buf, bufsize, "node %u (%s): tuple meta without items", i, name);
        for (uint32_t k = 0; k < m->nitems; k++)
            if (ir_verify_meta(g, i, &m->items[k], depth + 1, buf, bufsize) < 0) return -1;
        return 0;
    case IRMETA_NONE:
    case IRMETA_OTHER:
        return 0;
    }
    return ir_fail(buf, bufsize, "node %u (%s): meta of unknown kind %d", i, name, (int)m->kind);
}

/* FNV-1a over a C string, for the name-uniqueness table. */
static uint64_t ir_verify_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* One pass over the nodes for order, kinds, arguments and metas, then a hash table for names.
 * The first problem found is described in buf. */
int em_ir_verify(const IRGraph *g, char *buf, size_t bufsize) {
    if (buf && bufsize) buf[0] = '\0';
    if (!g || !g->nodes || g->nnodes == 0) return ir_fail(buf, bufsize, "graph has no node array");
    if (g->nnodes > g->cap) return ir_fail(buf, bufsize, "graph has %u nodes but room for %u", g->nnodes, g->cap);
    uint32_t nplaceholders = 0, noutputs = 0;
    bool calls_seen = false;
    for (IRRef i = 1; i < g->nnodes; i++) {
        const IRNode *n = &g->nodes[i];
        const char *name = n->name ? n->name : "?";
        if (!n->name || !n->name[0]) return ir_fail(buf, bufsize, "node %u has no name", i);
        if ((unsigned)n->kind >= IR__NKINDS) return ir_fail(buf, bufsize, "node %u (%s): bad kind %d", i, name, (int)n->kind);
        if ((unsigned)n->op >= IROP__COUNT) return ir_fail(buf, bufsize, "node %u (%s): bad op %d", i, name, (int)n->op);
        if (!n->target) return ir_fail(buf, bufsize, "node %u (%s): no target", i, name);
        if (n->nargs && !n->args) return ir_fail(buf, bufsize, "node %u (%s): %u args but no array", i, name, n->nargs);
        if (n->nkwargs && (!n->kwargs || !n->kwnames))
            return ir_fail(buf, bufsize, "node %u (%s): %u kwargs but no arrays", i, name, n->nkwargs);
        if (noutputs) return ir_fail(buf, bufsize, "node %u (%s) comes after the output node", i, name);
        switch (n->kind) {
        case IR_PLACEHOLDER:
            if (calls_seen) return ir_fail(buf, bufsize, "placeholder %u (%s) comes after a call node", i, name);
            if (!PyUnicode_Check(n->target))
                return ir_fail(buf, bufsize, "placeholder %u (%s): target is not a str", i, name);
            if (n->nargs || n->nkwargs) return ir_fail(buf, bufsize, "placeholder %u (%s) has arguments", i, name);
            if (nplaceholders >= g->ninputs || g->inputs[nplaceholders] != i)
                return ir_fail(buf, bufsize, "placeholder %u (%s) is not graph input %u", i, name, nplaceholders);
            nplaceholders++;
            break;
        case IR_CALL_METHOD:
            if (!PyUnicode_Check(n->target))
                return ir_fail(buf, bufsize, "call_method %u (%s): target is not a str", i, name);
            if (n->nargs < 1) return ir_fail(buf, bufsize, "call_method %u (%s): no self argument", i, name);
            calls_seen = true;
            break;
        case IR_CALL_FUNCTION:
            if (!PyCallable_Check(n->target))
                return ir_fail(buf, bufsize, "call_function %u (%s): target is not callable", i, name);
            calls_seen = true;
            break;
        case IR_OUTPUT:
            if (n->nargs != 1 || n->nkwargs || (n->args[0].kind != IRARG_TUPLE && n->args[0].kind != IRARG_LIST))
                return ir_fail(buf, bufsize, "output %u (%s): args must be one tuple of results", i, name);
            if (g->output != i) return ir_fail(buf, bufsize, "output node %u is not g->output (%u)", i, g->output);
            noutputs++;
            break;
        default:
            break;
        }
        for (uint32_t k = 0; k < n->nargs; k++)
            if (ir_verify_arg(g, i, &n->args[k], 0, buf, bufsize) < 0) return -1;
        for (uint32_t k = 0; k < n->nkwargs; k++) {
            if (!n->kwnames[k] || !PyUnicode_Check(n->kwnames[k]))
                return ir_fail(buf, bufsize, "node %u (%s): keyword name %u is not a str", i, name, k);
            if (ir_verify_arg(g, i, &n->kwargs[k], 0, buf, bufsize) < 0) return -1;
        }
        if (ir_verify_meta(g, i, &n->meta, 0, buf, bufsize) < 0) return -1;
    }
    if (nplaceholders != g->ninputs)
        return ir_fail(buf, bufsize, "graph lists %u inputs but has %u placeholders", g->ninputs, nplaceholders);
    if (noutputs != 1) return ir_fail(buf, bufsize, "graph has %u output nodes, expected 1", noutputs);

    /* unique names: open addressing over the node names */
    uint32_t cap = 16;
    while (cap < g->nnodes * 2) cap *= 2;
    const char **table = calloc(cap, sizeof(char *));
    if (!table) return ir_fail(buf, bufsize, "out of memory while checking names");
    int rc = 0;
    for (IRRef i = 1; i < g->nnodes && rc == 0; i++) {
        const char *s = g->nodes[i].name;
        uint32_t j = (uint32_t)ir_verify_hash(s) & (cap - 1);
        while (table[j]) {
            if (strcmp(table[j], s) == 0) {
                rc = ir_fail(buf, bufsize, "node %u: name %s is used twice", i, s);
                break;
            }
            j = (j + 1) & (cap - 1);
        }
        table[j] = s;
    }
    free(table);
    return rc;
}
