/* core: the counter-based random numbers of ember's dropout. Philox-4x32-10 (Salmon et al.,
 * "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the round constants of Random123 and of
 * torch's at::Philox4_32 (aten/src/ATen/core/PhiloxRNGEngine.h): key = the 64-bit seed, counter =
 * (the element's 64-bit position, 0, 0), the first output word's top 24 bits scaled to [0, 1).
 * One definition, three uses: compiled into ember._C for the eager form of ember._C.philox_dropout
 * (em_runtime_random.c) and written as text into the C and CUDA kernels' preludes (EM_PHILOX_SRC),
 * so that a generated kernel and the eager form draw bitwise the same numbers. Q is the function's
 * qualifiers (static inline; static __device__ __forceinline__). */
#ifndef EM_PHILOX_H
#define EM_PHILOX_H

#define EM_PHILOX_DEF(Q)                                                                    \
    Q float em_philox_uniform(unsigned long long seed, unsigned long long ctr) {            \
        unsigned c0 = (unsigned)ctr, c1 = (unsigned)(ctr >> 32), c2 = 0u, c3 = 0u;          \
        unsigned k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32);                          \
        for (int r = 0; r < 10; r++) {                                                      \
            unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;            \
            unsigned n0 = (unsigned)(p1 >> 32) ^ c1 ^ k0, n2 = (unsigned)(p0 >> 32) ^ c3 ^ k1; \
            c1 = (unsigned)p1;                                                              \
            c3 = (unsigned)p0;                                                              \
            c0 = n0;                                                                        \
            c2 = n2;                                                                        \
            k0 += 0x9E3779B9u;                                                              \
            k1 += 0xBB67AE85u;                                                              \
        }                                                                                   \
        return (float)(c0 >> 8) * 5.9604644775390625e-8f;                                   \
    }

#define EM_PHILOX_STR_(...) #__VA_ARGS__
#define EM_PHILOX_XSTR_(...) EM_PHILOX_STR_(__VA_ARGS__)
/* The definition as a string literal (one line), for a generated translation unit. */
#define EM_PHILOX_SRC(Q) EM_PHILOX_XSTR_(EM_PHILOX_DEF(Q)) "\n"

#endif /* EM_PHILOX_H */
