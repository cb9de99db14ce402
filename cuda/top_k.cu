// Each row's k largest finite logits among the allowed ids (grammar bitmask as argmax's),
// highest first with ties to the lower id, each with its softmax probability over every
// finite logit of the row; places past the allowed finite logits, or whose probability
// rounds to 0, get SD_NO_INDEX and 0. One block per row, three passes over the row: its
// finite max, the sum of exp(l - max), then each thread's own top k kept in registers
// (it scans its ids in increasing order and lets a value in only when strictly greater
// than the one it would pass, so equal values stay in id order). Then k rounds: every
// thread offers its best remaining candidate, the block takes the best (sd_block_best),
// and the thread that offered it moves on. Each id is scanned by one thread, so only that
// thread can hold the winner.
#include "common.cuh"

#define SD_TOP_K_MAX 8

SD_KERNEL void sd_top_k(unsigned* ids, float* probs, const float* logits, const int* bitmask,
                        int rows, int width, int k) {
    SD_SHARED(float, red, 32);
    SD_SHARED(float, red_value, 32);
    SD_SHARED(unsigned, red_index, 32);
    const int r = blockIdx.x;
    if (r >= rows || k < 1 || k > SD_TOP_K_MAX) return;
    const float* row = logits + (size_t)r * width;
    const int words = (width + 31) / 32;
    const int* mask = bitmask ? bitmask + (size_t)r * words : nullptr;
    float m = -INFINITY;
    for (int t = threadIdx.x; t < width; t += blockDim.x) {
        const float v = row[t];
        if (isfinite(v)) m = fmaxf(m, v);
    }
    m = sd_block_max(m, red);
    float sum = 0.0f;
    SdBest mine[SD_TOP_K_MAX];
    int have = 0;
    for (int t = threadIdx.x; t < width; t += blockDim.x) {
        const float v = row[t];
        if (!isfinite(v)) continue;
        sum += expf(v - m);
        if (mask && ((((unsigned)mask[t >> 5]) >> (t & 31)) & 1u) == 0) continue;
        if (have == k && !(v > mine[k - 1].value)) continue;
        int at = have < k ? have++ : k - 1;
        while (at > 0 && mine[at - 1].value < v) {
            mine[at] = mine[at - 1];
            --at;
        }
        mine[at] = SdBest{v, (unsigned)t};
    }
    sum = sd_block_sum(sum, red);
    int next = 0;
    for (int j = 0; j < k; ++j) {
        const SdBest offer = next < have ? mine[next] : SdBest{-INFINITY, SD_NO_INDEX};
        const SdBest best = sd_block_best(offer, red_value, red_index);
        if (best.index != SD_NO_INDEX && next < have && mine[next].index == best.index) ++next;
        if (threadIdx.x == 0) {
            const float p = best.index == SD_NO_INDEX ? 0.0f : expf(best.value - m) / sum;
            const size_t at = (size_t)r * k + j;
            ids[at] = p > 0.0f ? best.index : SD_NO_INDEX;
            probs[at] = p > 0.0f ? p : 0.0f;
        }
    }
}
SD_REGISTER(sd_top_k)
