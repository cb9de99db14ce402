// RMSNorm of each row: out = x / sqrt(mean(x^2) + eps) * weight, accumulated in f32. One
// block per row. `out` may alias `x`: every element is read and written by the same thread,
// and all reads of the sum happen before the barrier inside the block reduction.
#include "common.cuh"

SD_KERNEL void sd_rms_norm(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                           int rows, int dim, float eps) {
    SD_SHARED(float, red, 32);
    const int r = blockIdx.x;
    if (r >= rows) return;
    const __nv_bfloat16* xr = x + (size_t)r * dim;
    __nv_bfloat16* orow = out + (size_t)r * dim;
    float sq = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = sd_ld(xr + i);
        sq += v * v;
    }
    sq = sd_block_sum(sq, red);
    const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        sd_st(orow + i, sd_ld(xr + i) * inv * sd_ld(weight + i));
    }
}
SD_REGISTER(sd_rms_norm)
