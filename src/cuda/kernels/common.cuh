// Shared helpers for libgwtf's kernels. Compiled by NVRTC at run time with
// --fmad=false, so that a*b+c is not contracted into an FMA and the results
// match the CPU twins in src/model/kernels.rs and src/model/ops.rs.
#pragma once

typedef unsigned long long gwtf_size;

// Grid-stride loop over [0, n).
#define GWTF_FOR(i, n)                                                          \
    for (gwtf_size i = (gwtf_size)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (gwtf_size)blockDim.x * gridDim.x)

// Block-wide reductions over blockDim.x (a power of two, <= 1024) threads.
// `identity` pads the lanes past the last warp (0 for absolute values, -inf otherwise).
__device__ __forceinline__ float gwtf_block_max(float v, float *shared, float identity) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (threadIdx.x < warps) ? shared[threadIdx.x] : identity;
    if (warp == 0)
        for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (threadIdx.x == 0) shared[0] = v;
    __syncthreads();
    v = shared[0];
    __syncthreads();
    return v;
}

__device__ __forceinline__ float gwtf_block_sum(float v, float *shared) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (threadIdx.x < warps) ? shared[threadIdx.x] : 0.0f;
    if (warp == 0)
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (threadIdx.x == 0) shared[0] = v;
    __syncthreads();
    v = shared[0];
    __syncthreads();
    return v;
}
