// BF16 linear layer, out = x @ weight^T (+ bias), f32 accumulation.
//
// Layout: a block is 8 warps; warp w of block (bx, by) computes output feature bx * 8 + w
// for the SD_LINEAR_ROWS input rows starting at by * SD_LINEAR_ROWS, so each weight row is
// streamed once per row tile (decode, rows = 1, reads the weight exactly once). Lanes
// stride over the input features, 8 at a time with 16-byte loads when the rows are
// 16-byte aligned, and the warp sums its lanes with shuffles. There is no barrier, so a
// warp past the last feature simply returns.
#include "common.cuh"

#define SD_LINEAR_ROWS 4

__device__ __forceinline__ void sd_linear_store(void* out, int out_f32, size_t index, float v) {
    if (out_f32) {
        static_cast<float*>(out)[index] = v;
    } else {
        sd_st(static_cast<__nv_bfloat16*>(out) + index, v);
    }
}

SD_KERNEL void sd_linear_bf16(void* out, int out_f32, const __nv_bfloat16* x,
                              const __nv_bfloat16* weight, const __nv_bfloat16* bias, int rows,
                              int in_features, int out_features) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int r0 = blockIdx.y * SD_LINEAR_ROWS;
    if (o >= out_features) return;
    const int nr = min(SD_LINEAR_ROWS, rows - r0);
    const __nv_bfloat16* w = weight + (size_t)o * in_features;
    float acc[SD_LINEAR_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bool vec = (in_features % 8 == 0) &&
                     ((((uintptr_t)x) | ((uintptr_t)weight)) & 15) == 0;
    if (vec) {
        const int groups = in_features / 8;
        for (int g = lane; g < groups; g += 32) {
            const uint4 wv = reinterpret_cast<const uint4*>(w)[g];
            const float wf[8] = {sd_bf16_lo(wv.x), sd_bf16_hi(wv.x), sd_bf16_lo(wv.y), sd_bf16_hi(wv.y),
                                 sd_bf16_lo(wv.z), sd_bf16_hi(wv.z), sd_bf16_lo(wv.w), sd_bf16_hi(wv.w)};
            for (int rr = 0; rr < SD_LINEAR_ROWS; ++rr) {
                if (rr >= nr) break;
                const uint4 xv =
                    reinterpret_cast<const uint4*>(x + (size_t)(r0 + rr) * in_features)[g];
                acc[rr] += wf[0] * sd_bf16_lo(xv.x) + wf[1] * sd_bf16_hi(xv.x) +
                           wf[2] * sd_bf16_lo(xv.y) + wf[3] * sd_bf16_hi(xv.y) +
                           wf[4] * sd_bf16_lo(xv.z) + wf[5] * sd_bf16_hi(xv.z) +
                           wf[6] * sd_bf16_lo(xv.w) + wf[7] * sd_bf16_hi(xv.w);
            }
        }
    } else {
        for (int k = lane; k < in_features; k += 32) {
            const float wk = sd_ld(w + k);
            for (int rr = 0; rr < SD_LINEAR_ROWS; ++rr) {
                if (rr >= nr) break;
                acc[rr] += wk * sd_ld(x + (size_t)(r0 + rr) * in_features + k);
            }
        }
    }
    const float b = bias ? sd_ld(bias + o) : 0.0f;
    for (int rr = 0; rr < SD_LINEAR_ROWS; ++rr) {
        // Every lane takes part in every shuffle, so the loop bound is warp-uniform.
        const float s = sd_warp_sum(acc[rr]);
        if (lane == 0 && rr < nr) sd_linear_store(out, out_f32, (size_t)(r0 + rr) * out_features + o, s + b);
    }
}
SD_REGISTER(sd_linear_bf16)
