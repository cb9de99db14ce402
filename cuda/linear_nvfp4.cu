// NVFP4 (ModelOpt layout) linear layer, W4A16: the weight is dequantized on the fly and
// never materialised. W[o, c] = e2m1(code) * fp8_e4m3(weight_scale[o, c / 16]) * global,
// with two codes a byte, low nibble first; the optional bias is added in f32 before the
// output is stored. Same warp-per-feature layout as linear.cu: each
// lane takes whole 16-element scale groups, so one scale byte serves 8 code bytes.
#include "common.cuh"

#define SD_NVFP4_ROWS 4

// E2M1: bit 3 sign, bits 1-2 exponent (bias 1), bit 0 mantissa: 0, .5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float sd_e2m1(unsigned code) {
    const unsigned e = (code >> 1) & 3u, m = code & 1u;
    const float mag = e == 0 ? 0.5f * (float)m : ldexpf(1.0f + 0.5f * (float)m, (int)e - 1);
    return (code & 8u) ? -mag : mag;
}

SD_KERNEL void sd_linear_nvfp4(void* out, int out_f32, const __nv_bfloat16* x,
                               const unsigned char* weight, const unsigned char* weight_scale,
                               float global_scale, const __nv_bfloat16* bias, int rows,
                               int in_features, int out_features) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int r0 = blockIdx.y * SD_NVFP4_ROWS;
    if (o >= out_features) return;
    const int nr = min(SD_NVFP4_ROWS, rows - r0);
    const int groups = in_features / 16;
    const unsigned char* codes = weight + (size_t)o * (in_features / 2);
    const unsigned char* scales = weight_scale + (size_t)o * groups;
    float acc[SD_NVFP4_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int g = lane; g < groups; g += 32) {
        const float s = sd_fp8_e4m3(scales[g]);
        float wf[16];
        for (int b = 0; b < 8; ++b) {
            const unsigned byte = codes[(size_t)g * 8 + b];
            wf[2 * b] = sd_e2m1(byte & 15u) * s * global_scale;
            wf[2 * b + 1] = sd_e2m1(byte >> 4) * s * global_scale;
        }
        for (int rr = 0; rr < SD_NVFP4_ROWS; ++rr) {
            if (rr >= nr) break;
            const __nv_bfloat16* xr = x + (size_t)(r0 + rr) * in_features + (size_t)g * 16;
            float sum = 0.0f;
            for (int k = 0; k < 16; ++k) sum += wf[k] * sd_ld(xr + k);
            acc[rr] += sum;
        }
    }
    const float b = bias ? sd_ld(bias + o) : 0.0f;
    for (int rr = 0; rr < SD_NVFP4_ROWS; ++rr) {
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
SD_REGISTER(sd_linear_nvfp4)
