/* 16-lane float vectors and their horizontal sum, shared by the native kernels (GCC vector
 * extensions: the compiler picks the instructions -march allows). */
#ifndef SLOTSERVE_SIMD_H
#define SLOTSERVE_SIMD_H
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

#ifdef __clang__
#define SHUF(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define SHUF(x, ...) __builtin_shuffle(x, (v16i){__VA_ARGS__})
#endif

static inline float hsum(v16 x) {
    x += SHUF(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += SHUF(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += SHUF(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += SHUF(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

#endif
