// Rotary position embedding, in place. One block per row; thread t handles pairs
// t, t + blockDim.x, ... over every head, so each pair is read and written by one thread.
// style 0: rotate-half (i with i + rotary_dim / 2); style 1: interleaved (2i with 2i + 1).
#include "common.cuh"

SD_KERNEL void sd_rope(__nv_bfloat16* x, const unsigned* positions, const float* inv_freq,
                       int rows, int heads, int head_dim, int rotary_dim, int style) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int half = rotary_dim / 2;
    const float pos = (float)positions[r];
    for (int p = threadIdx.x; p < heads * half; p += blockDim.x) {
        const int h = p / half, i = p % half;
        __nv_bfloat16* head = x + ((size_t)r * heads + h) * head_dim;
        const float angle = pos * inv_freq[i];
        const float s = sinf(angle), c = cosf(angle);
        const int a = style == 0 ? i : 2 * i;
        const int b = style == 0 ? i + half : 2 * i + 1;
        const float xa = sd_ld(head + a), xb = sd_ld(head + b);
        sd_st(head + a, xa * c - xb * s);
        sd_st(head + b, xb * c + xa * s);
    }
}
SD_REGISTER(sd_rope)
