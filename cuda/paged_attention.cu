// Grouped-query attention over a paged KV cache, one pass with an online softmax.
//
// One block (SD_ATTN_WARPS warps) per (query head, row). Warp w visits the cached rows
// w, w + SD_ATTN_WARPS, ...; for each it forms q.k with one lane per 32nd element of the
// head, shuffles the sum to every lane, and folds the row into its running max, sum of
// exponentials and weighted V (the online softmax, so no score buffer of context length is
// needed). The warps then merge their partial results through shared memory. head_dim is
// at most SD_ATTN_MAX_DIM (the host checks), which bounds the registers a lane keeps.
//
// Under a tree mask (row_parent non-null), a row with a parent attends to the context of its
// first ancestor without one (the prefix) and to the own rows (row_ctx_len - 1) of that
// ancestor's descendants on its path and of itself, never to its siblings' branches; the
// warps share the branch rows as they share the prefix's.
#include "common.cuh"

#define SD_ATTN_WARPS 4
#define SD_ATTN_MAX_DIM 256
#define SD_ATTN_PER_LANE (SD_ATTN_MAX_DIM / 32)
#define SD_ATTN_NO_PARENT 0xFFFFFFFFu

SD_KERNEL void sd_paged_attention(__nv_bfloat16* out, const __nv_bfloat16* q,
                                  const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                                  const unsigned* block_table, const unsigned* row_seq,
                                  const unsigned* row_ctx_len, const unsigned* row_parent,
                                  int heads, int kv_heads, int head_dim, int block_size,
                                  int max_blocks_per_seq, float scale) {
    SD_SHARED(float, part_max, SD_ATTN_WARPS);
    SD_SHARED(float, part_sum, SD_ATTN_WARPS);
    SD_SHARED(float, part_acc, SD_ATTN_WARPS * SD_ATTN_MAX_DIM);
    const int h = blockIdx.x, r = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads);
    const unsigned seq = row_seq[r];
    const int n = (int)row_ctx_len[r];
    const __nv_bfloat16* qh = q + ((size_t)r * heads + h) * head_dim;
    const unsigned* table = block_table + (size_t)seq * max_blocks_per_seq;

    float qv[SD_ATTN_PER_LANE], acc[SD_ATTN_PER_LANE];
    for (int i = 0; i < SD_ATTN_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? sd_ld(qh + d) : 0.0f;
        acc[i] = 0.0f;
    }
    // The prefix every row of the branch sees: the whole context for a row without parent.
    const bool masked = row_parent != nullptr && row_parent[r] != SD_ATTN_NO_PARENT;
    int prefix = n;
    if (masked) {
        unsigned at = (unsigned)r;
        while (row_parent[at] != SD_ATTN_NO_PARENT) at = row_parent[at];
        prefix = (int)row_ctx_len[at];
    }
    float m = -INFINITY, l = 0.0f;
    // The prefix's rows in order, then the branch's own rows from this row up (branch index
    // 0 is this row's, 1 its parent's, ...), each index visited by warp index % WARPS. `up`
    // is the row at branch index `cur`, only ever walked upwards.
    unsigned up = (unsigned)r;
    int cur = 0;
    for (int idx = warp;; idx += SD_ATTN_WARPS) {
        int j = idx;
        if (idx >= prefix) {
            if (!masked) break;
            const int b = idx - prefix;
            while (cur < b && row_parent[up] != SD_ATTN_NO_PARENT) {
                up = row_parent[up];
                ++cur;
            }
            // Past the branch: the first ancestor without a parent is in the prefix.
            if (cur < b || row_parent[up] == SD_ATTN_NO_PARENT) break;
            j = (int)row_ctx_len[up] - 1;
        }
        const size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const size_t base = (slot * kv_heads + kvh) * head_dim;
        float dot = 0.0f;
        for (int i = 0; i < SD_ATTN_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) dot += qv[i] * sd_ld(k_cache + base + d);
        }
        const float score = sd_warp_sum(dot) * scale;
        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);
        const float p = expf(score - m_new);
        l = l * correction + p;
        for (int i = 0; i < SD_ATTN_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            const float vd = d < head_dim ? sd_ld(v_cache + base + d) : 0.0f;
            acc[i] = acc[i] * correction + p * vd;
        }
        m = m_new;
    }
    if (lane == 0) {
        part_max[warp] = m;
        part_sum[warp] = l;
    }
    for (int i = 0; i < SD_ATTN_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) part_acc[warp * SD_ATTN_MAX_DIM + d] = acc[i];
    }
    __syncthreads();
    float big = -INFINITY;
    for (int w = 0; w < SD_ATTN_WARPS; ++w) big = fmaxf(big, part_max[w]);
    float total = 0.0f, weight[SD_ATTN_WARPS];
    for (int w = 0; w < SD_ATTN_WARPS; ++w) {
        // A warp that saw no rows has max -inf and sum 0: its weight is 0, not NaN.
        weight[w] = part_sum[w] > 0.0f ? expf(part_max[w] - big) : 0.0f;
        total += part_sum[w] * weight[w];
    }
    __nv_bfloat16* oh = out + ((size_t)r * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < SD_ATTN_WARPS; ++w) {
            if (weight[w] > 0.0f) o += part_acc[w * SD_ATTN_MAX_DIM + d] * weight[w];
        }
        sd_st(oh + d, total > 0.0f ? o / total : 0.0f);
    }
}
SD_REGISTER(sd_paged_attention)
