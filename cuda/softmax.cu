// Softmax of each row of logits / temperature, f32. One block per row, three passes: the
// row max, the sum of exponentials, then the normalised write. `out` may alias `logits`:
// the last pass reads each element just before the same thread overwrites it, and the
// earlier passes end in block-wide barriers.
#include "common.cuh"

SD_KERNEL void sd_softmax(float* out, const float* logits, int rows, int vocab, float temperature) {
    SD_SHARED(float, red, 32);
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* row = logits + (size_t)r * vocab;
    float* orow = out + (size_t)r * vocab;
    float m = -INFINITY;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) m = fmaxf(m, row[t]);
    m = sd_block_max(m, red);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) sum += expf((row[t] - m) / temperature);
    sum = sd_block_sum(sum, red);
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) orow[t] = expf((row[t] - m) / temperature) / sum;
}
SD_REGISTER(sd_softmax)
