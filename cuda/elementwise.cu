// Element-wise ops over BF16 vectors, f32 in between. One thread per element (grid-stride,
// so any grid size is correct); outputs may alias inputs since each element is read and
// written by one thread.
#include "common.cuh"

SD_KERNEL void sd_add(__nv_bfloat16* out, const __nv_bfloat16* a, const __nv_bfloat16* b, int n) {
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)n; i += stride) {
        sd_st(out + i, sd_ld(a + i) + sd_ld(b + i));
    }
}
SD_REGISTER(sd_add)

SD_KERNEL void sd_silu_mul(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* up,
                           int n) {
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)n; i += stride) {
        const float g = sd_ld(gate + i);
        sd_st(out + i, g / (1.0f + expf(-g)) * sd_ld(up + i));
    }
}
SD_REGISTER(sd_silu_mul)

// The output gate of Qwen3-Next's attention: out = x * sigmoid(gate), written as
// x / (1 + exp(-gate)) like the reference.
SD_KERNEL void sd_sigmoid_mul(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* x,
                              int n) {
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)n; i += stride) {
        sd_st(out + i, sd_ld(x + i) / (1.0f + expf(-sd_ld(gate + i))));
    }
}
SD_REGISTER(sd_sigmoid_mul)
