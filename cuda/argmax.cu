// Argmax of each row of f32 logits, optionally restricted by a grammar bitmask (token t
// allowed when bit t % 32 of word t / 32 is set). One block per row. Ties go to the lowest
// index: each thread scans its tokens in increasing order keeping the first maximum, and
// every merge prefers the lower index on equal values. NaN logits never count (as in the
// Rust `backend::argmax`, which the host's greedy verification uses); a row with nothing
// allowed, or only NaN, gets SD_NO_INDEX (u32::MAX).
#include "common.cuh"

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
        if (isnan(v)) continue;
        if (best.index == SD_NO_INDEX || v > best.value) best = SdBest{v, (unsigned)t};
    }
    best = sd_block_best(best, red_value, red_index);
    if (threadIdx.x == 0) out[r] = best.index;
}
SD_REGISTER(sd_argmax)
