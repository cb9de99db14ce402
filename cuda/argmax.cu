// Argmax of each row of f32 logits, optionally restricted by a grammar bitmask (token t
// allowed when bit t % 32 of word t / 32 is set). One block per row. Ties go to the lowest
// index: each thread scans its tokens in increasing order keeping the first maximum, and
// every merge prefers the lower index on equal values. A row with nothing allowed gets
// SD_NO_INDEX (u32::MAX).
#include "common.cuh"

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

SD_KERNEL void sd_argmax(unsigned* out, const float* logits, const int* bitmask, int rows,
                         int vocab) {
    SD_SHARED(float, red_value, 32);
    SD_SHARED(unsigned, red_index, 32);
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* row = logits + (size_t)r * vocab;
    const int words = (vocab + 31) / 32;
    const int* mask = bitmask ? bitmask + (size_t)r * words : nullptr;
    SdBest best = {-INFINITY, SD_NO_INDEX};
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        if (mask && ((((unsigned)mask[t >> 5]) >> (t & 31)) & 1u) == 0) continue;
        const float v = row[t];
        if (best.index == SD_NO_INDEX || v > best.value) best = SdBest{v, (unsigned)t};
    }
    best = sd_warp_best(best);
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        red_value[warp] = best.value;
        red_index[warp] = best.index;
    }
    __syncthreads();
    if (warp == 0) {
        SdBest v = {-INFINITY, SD_NO_INDEX};
        if (lane < warps) v = SdBest{red_value[lane], red_index[lane]};
        v = sd_warp_best(v);
        if (lane == 0) out[r] = v.index;
    }
}
SD_REGISTER(sd_argmax)
