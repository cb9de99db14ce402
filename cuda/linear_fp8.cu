// FP8 E4M3 linear layer, W8A16, in DeepSeek-V3's block-scaled layout: one E4M3 byte per
// weight element, row-major [out, in], and an f32 scale per 128 x 128 block,
// W[o, c] = e4m3(weight[o, c]) * block_scales[o / 128, c / 128]. The weight is decoded on the
// fly; the optional bias is added in f32 before the output is stored. Same warp-per-feature
// layout as linear.cu: the lanes of a warp read 32 consecutive bytes of the feature's row,
// and each block of 4 input rows reuses every decoded weight.
#include "common.cuh"

#define SD_FP8_ROWS 4
#define SD_FP8_BLOCK 128

SD_KERNEL void sd_linear_fp8(void* out, int out_f32, const __nv_bfloat16* x,
                             const unsigned char* weight, const float* block_scales,
                             const __nv_bfloat16* bias, int rows, int in_features,
                             int out_features) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int r0 = blockIdx.y * SD_FP8_ROWS;
    // A whole warp shares `o`, so it leaves together and the shuffles below stay full.
    if (o >= out_features) return;
    const int nr = min(SD_FP8_ROWS, rows - r0);
    const int blocks = (in_features + SD_FP8_BLOCK - 1) / SD_FP8_BLOCK;
    const unsigned char* w = weight + (size_t)o * in_features;
    const float* scales = block_scales + (size_t)(o / SD_FP8_BLOCK) * blocks;
    float acc[SD_FP8_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = lane; c < in_features; c += 32) {
        const float wv = sd_fp8_e4m3(w[c]) * scales[c / SD_FP8_BLOCK];
        for (int rr = 0; rr < SD_FP8_ROWS; ++rr) {
            if (rr >= nr) break;
            acc[rr] += wv * sd_ld(x + (size_t)(r0 + rr) * in_features + c);
        }
    }
    const float b = bias ? sd_ld(bias + o) : 0.0f;
    for (int rr = 0; rr < SD_FP8_ROWS; ++rr) {
        const float s = sd_warp_sum(acc[rr]);
        if (lane == 0 && rr < nr) {
            const size_t index = (size_t)(r0 + rr) * out_features + o;
            if (out_f32) {
                static_cast<float*>(out)[index] = s + b;
            } else {
                sd_st(static_cast<__nv_bfloat16*>(out) + index, s + b);
            }
        }
    }
}
SD_REGISTER(sd_linear_fp8)
