// One value of each row: out[r] = values[r * width + index[r]], or 0 where index[r] is not
// below width (argmax's "nothing allowed", u32::MAX). One thread per row (grid-stride, so any
// grid size is correct); the host checks every span against its allocation first.
#include "common.cuh"

SD_KERNEL void sd_pick(float* out, const float* values, const unsigned* index, int rows,
                       int width) {
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t r = (size_t)blockIdx.x * blockDim.x + threadIdx.x; r < (size_t)rows; r += stride) {
        const unsigned i = index[r];
        out[r] = i < (unsigned)width ? values[r * (size_t)width + i] : 0.0f;
    }
}
SD_REGISTER(sd_pick)
