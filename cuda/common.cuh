// The one header every kernel source includes.
//
// Under nvcc (__CUDACC__) it pulls in the real CUDA headers; under a host C++ compiler it
// pulls in the emulation header (cuda/emu/cuda_emu.h), so the same .cu sources build the
// GPU fatbin and the CPU-emulated kernels the tests compare against the Rust reference.
//
// Rules the kernels follow so that both builds mean the same thing:
// - entry points are `SD_KERNEL void sd_<op>(...)` (extern "C", fixed names) and each is
//   listed once with SD_REGISTER(name) after its definition;
// - shared memory is declared only with SD_SHARED(type, name, count) (a plain __shared__
//   is a compile error in the emulation, which could not give it per-block storage);
// - warp shuffles use the full mask, and blocks are whole warps wherever one is used;
// - sizes arrive as int, indices are computed in size_t (no 32-bit overflow).
#pragma once

#ifdef __CUDACC__
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#define SD_KERNEL extern "C" __global__
#define SD_SHARED(type, name, count) __shared__ type name[count]
#define SD_REGISTER(name)
#else
#include "emu/cuda_emu.h"
#define SD_KERNEL extern "C" __global__
#define SD_SHARED(type, name, count) SD_EMU_SHARED(type, name, count)
#define SD_REGISTER(name) SD_EMU_REGISTER(name)
#endif

#define SD_FULL_MASK 0xffffffffu
#define SD_NO_INDEX 0xffffffffu

__device__ __forceinline__ float sd_ld(const __nv_bfloat16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ void sd_st(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// The two bf16 values packed in one 32-bit word (low half first, as in memory).
__device__ __forceinline__ float sd_bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float sd_bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// FP8 E4M3 (float8_e4m3fn): bias 7, no infinities, S.1111.111 is NaN. Exact in f32.
__device__ __forceinline__ float sd_fp8_e4m3(unsigned byte) {
    const unsigned e = (byte >> 3) & 15u, m = byte & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u);
    const float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8u + m), (int)e - 10);
    return (byte & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ float sd_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SD_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float sd_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SD_FULL_MASK, v, o));
    return v;
}

// Sum over the whole block, returned to every thread. `red` is a shared array of at least
// 32 floats; the leading barrier makes back-to-back calls with the same `red` safe.
__device__ __forceinline__ float sd_block_sum(float v, float* red) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned warps = (blockDim.x + 31) >> 5;
    v = sd_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : 0.0f;
    v = sd_warp_sum(v);
    return v;
}

// Maximum over the whole block, returned to every thread (same contract as sd_block_sum).
__device__ __forceinline__ float sd_block_max(float v, float* red) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned warps = (blockDim.x + 31) >> 5;
    v = sd_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : -INFINITY;
    v = sd_warp_max(v);
    return v;
}

// A candidate of the argmax-like reductions: a value and its index, SD_NO_INDEX for none.
// The better of two is the larger value, then the lower index; "none" loses to anything.
struct SdBest {
    float value;
    unsigned index;
};

__device__ __forceinline__ SdBest sd_better(SdBest a, SdBest b) {
    if (a.index == SD_NO_INDEX) return b;
    if (b.index == SD_NO_INDEX) return a;
    if (a.value > b.value) return a;
    if (b.value > a.value) return b;
    return a.index < b.index ? a : b;
}

__device__ __forceinline__ SdBest sd_warp_best(SdBest v) {
    for (int o = 16; o > 0; o >>= 1) {
        SdBest other;
        other.value = __shfl_xor_sync(SD_FULL_MASK, v.value, o);
        other.index = __shfl_xor_sync(SD_FULL_MASK, v.index, o);
        v = sd_better(v, other);
    }
    return v;
}

// The best over the whole block, returned to every thread. `red_value` and `red_index` are
// shared arrays of at least 32 entries; the leading barrier makes back-to-back calls safe.
__device__ __forceinline__ SdBest sd_block_best(SdBest v, float* red_value, unsigned* red_index) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned warps = (blockDim.x + 31) >> 5;
    v = sd_warp_best(v);
    __syncthreads();
    if (lane == 0) {
        red_value[warp] = v.value;
        red_index[warp] = v.index;
    }
    __syncthreads();
    v = lane < warps ? SdBest{red_value[lane], red_index[lane]} : SdBest{-INFINITY, SD_NO_INDEX};
    return sd_warp_best(v);
}
