// Embedding lookup: out[r, :] = table[ids[r], :]. One block per row; the bits are copied
// unchanged. The host checks every id against the vocabulary first; the guard here only
// keeps a bad id from reading outside the table.
#include "common.cuh"

SD_KERNEL void sd_embedding(__nv_bfloat16* out, const __nv_bfloat16* table, const unsigned* ids,
                            int rows, int hidden, int vocab) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const unsigned id = ids[r];
    if (id >= (unsigned)vocab) return;
    const __nv_bfloat16* src = table + (size_t)id * hidden;
    __nv_bfloat16* dst = out + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}
SD_REGISTER(sd_embedding)
