/* codegen: scheduled kernels -> source text. The C code generator (em_codegen_c.c) writes one
 * C11 translation unit with OpenMP for all kernels of a graph; a CUDA C generator will read the
 * same Schedule. Invariant: the source depends only on the schedule (shapes, strides, dtypes,
 * ops), so equal graphs give equal text and share one compile-cache entry. */
#ifndef EM_CODEGEN_H
#define EM_CODEGEN_H

#include "schedule/em_schedule.h"

/* Knobs of the C generator. */
typedef struct EmCodegenOptions {
    int64_t parallel_threshold; /* elements of work below which a kernel runs on one thread */
    int64_t chunk;              /* elements per parallel chunk of a pointwise loop */
} EmCodegenOptions;

/* Kernel i is `void ember_k<i>(char *const *restrict args)`; args[j] is the data pointer of the
 * kernel's j-th argument buffer (SKernel.args). Returns a new str, NULL with an exception. */
PyObject *em_codegen_c(const Schedule *s, const EmCodegenOptions *opt);

#endif /* EM_CODEGEN_H */
