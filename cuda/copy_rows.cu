// Strided row copy: row r of src (rows src_stride elements apart) into row r of dst (rows
// dst_stride elements apart, dst already at the destination column). One block per row; the
// bits are copied unchanged. The host checks both spans against their allocations first.
#include "common.cuh"

SD_KERNEL void sd_copy_rows(__nv_bfloat16* dst, const __nv_bfloat16* src, int rows, int width,
                            int dst_stride, int src_stride) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const __nv_bfloat16* from = src + (size_t)r * src_stride;
    __nv_bfloat16* to = dst + (size_t)r * dst_stride;
    for (int i = threadIdx.x; i < width; i += blockDim.x) to[i] = from[i];
}
SD_REGISTER(sd_copy_rows)
