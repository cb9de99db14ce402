// Scatter of key/value rows into the paged cache: row r goes to slot slots[r]. One block
// per row. The host rejects out-of-range slots first; the guard keeps a bad one from
// writing outside the cache.
#include "common.cuh"

SD_KERNEL void sd_kv_write(__nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const __nv_bfloat16* k,
                           const __nv_bfloat16* v, const unsigned* slots, int rows, int width,
                           int num_slots) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const unsigned slot = slots[r];
    if (slot >= (unsigned)num_slots) return;
    const size_t src = (size_t)r * width, dst = (size_t)slot * width;
    for (int e = threadIdx.x; e < width; e += blockDim.x) {
        k_cache[dst + e] = k[src + e];
        v_cache[dst + e] = v[src + e];
    }
}
SD_REGISTER(sd_kv_write)
