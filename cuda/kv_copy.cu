// Copies rows between slots of a paged cache, in order: copy i moves slot src[i]'s key and
// value rows to slot dst[i]. A later copy may overwrite the row an earlier one read (a
// compacted path moves each node down onto the row its successor leaves), so one block runs
// them one after another, a barrier apart. The host checks the slots and that no copy reads a
// row an earlier copy wrote; the guard keeps a bad slot from writing outside the cache.
#include "common.cuh"

SD_KERNEL void sd_kv_copy(__nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const unsigned* src,
                          const unsigned* dst, int copies, int width, int num_slots) {
    for (int i = 0; i < copies; ++i) {
        const unsigned s = src[i], d = dst[i];
        if (s < (unsigned)num_slots && d < (unsigned)num_slots && s != d) {
            const size_t from = (size_t)s * width, to = (size_t)d * width;
            for (int e = threadIdx.x; e < width; e += blockDim.x) {
                k_cache[to + e] = k_cache[from + e];
                v_cache[to + e] = v_cache[from + e];
            }
        }
        __syncthreads();
    }
}
SD_REGISTER(sd_kv_copy)
