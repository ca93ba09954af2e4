/* A CPU emulation of the subset of CUDA C that libgwtf's kernels use, so that
 * tests/cuda_emulated.rs can run the kernels (src/cuda/kernels/*.cu, unchanged)
 * on machines without a GPU. Each kernel unit is compiled as C++ after this
 * header, and the units are linked with cuda_emu.cpp into one shared library.
 *
 * Model: launches run one at a time (a lock serializes the threads of the
 * process), the blocks of a launch one after another (in a shuffled order);
 * inside a block every CUDA thread is a fiber with its own stack. A fiber runs
 * until it reaches __syncthreads() or a warp shuffle, which are barriers over
 * the block or the warp; at every round the fibers run in a freshly shuffled
 * order. So a kernel whose result depends on an unsynchronized order between
 * its threads or blocks (a race) gives a result that depends on the shuffle.
 * What this does not model: floating-point differences of CUDA's libdevice
 * (expf, tanhf, ... are the host's), memory coalescing, timing. */
#pragma once
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <type_traits>
#include <utility>

struct gwtf_emu_dim3 {
    unsigned int x, y, z;
};
/* One emulated device per process: launches from several threads take turns. */
extern gwtf_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
/* Blocks run one at a time, so a static is the block's shared memory. */
#define __shared__ static

struct float2 {
    float x, y;
};

extern "C" void gwtf_emu_syncthreads(void);
extern "C" float gwtf_emu_shfl_xor(float v, int lane_mask);

/* The asm memory clobbers make the compiler reload shared memory after a barrier. */
inline void __syncthreads(void) {
    __asm__ __volatile__("" ::: "memory");
    gwtf_emu_syncthreads();
    __asm__ __volatile__("" ::: "memory");
}
inline float __shfl_xor_sync(unsigned int mask, float v, int lane_mask) {
    (void)mask; /* every call in our kernels is by a whole warp */
    __asm__ __volatile__("" ::: "memory");
    float r = gwtf_emu_shfl_xor(v, lane_mask);
    __asm__ __volatile__("" ::: "memory");
    return r;
}

inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
/* Round to nearest, ties to even (the default rounding mode). */
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
/* Fibers of a thread never interleave inside a call: a plain add is atomic here. */
inline float atomicAdd(float *p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}

/* Registration of a kernel under its name: the launcher receives the arguments
 * as cuLaunchKernel does, an array of pointers to each argument's value. */
typedef void (*gwtf_emu_fn)(void);
typedef void (*gwtf_emu_invoker)(gwtf_emu_fn, void **);
extern "C" int gwtf_emu_register(const char *name, gwtf_emu_fn fn, gwtf_emu_invoker invoke);

template <typename... A, size_t... I>
void gwtf_emu_call(void (*k)(A...), void **p, std::index_sequence<I...>) {
    k(*static_cast<typename std::remove_reference<A>::type *>(p[I])...);
}
template <typename... A> void gwtf_emu_invoke(gwtf_emu_fn fn, void **p) {
    gwtf_emu_call(reinterpret_cast<void (*)(A...)>(fn), p, std::index_sequence_for<A...>{});
}
template <typename... A> int gwtf_emu_register_kernel(const char *name, void (*k)(A...)) {
    return gwtf_emu_register(name, reinterpret_cast<gwtf_emu_fn>(k), &gwtf_emu_invoke<A...>);
}
#define GWTF_EMU_REGISTER(k) static int gwtf_emu_reg_##k = gwtf_emu_register_kernel(#k, &k);
