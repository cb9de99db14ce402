// Multi-head latent attention (DeepSeek-V3's MLA) over a paged latent cache, in the absorbed
// form, one pass with an online softmax (see MlaAttentionArgs for the definition).
//
// One block (SD_MLA_WARPS warps) per (query head, row). The block first absorbs the head's
// no-RoPE query through kv_b's key rows into the latent space (q_lat, in shared memory, one
// thread per latent element), next to its RoPE query. Warp w then visits the attended cached
// rows w, w + SD_MLA_WARPS, ... as paged attention does (the same tree mask): for each it
// forms [q_lat | q_rope] . [c_kv | k_rope] with one lane per 32nd element of the latent row
// (the row's halves read from lo_cache and hi_cache), shuffles the sum to every lane, and
// folds c_kv into its running max, sum of exponentials and weighted latent. The warps merge
// through shared memory, and each thread up-projects the merged latent through kv_b's value
// rows for its output elements. kv_lora_rank is at most SD_MLA_MAX_RANK and the latent row at
// most SD_MLA_MAX_LATENT (the host checks), which bound the registers a lane keeps.
#include "common.cuh"

#define SD_MLA_WARPS 4
#define SD_MLA_MAX_RANK 512
#define SD_MLA_MAX_LATENT 640
#define SD_MLA_PER_LANE (SD_MLA_MAX_LATENT / 32)
#define SD_MLA_NO_PARENT 0xFFFFFFFFu

SD_KERNEL void sd_mla_attention(__nv_bfloat16* out, const __nv_bfloat16* q,
                                const __nv_bfloat16* kv_b, const __nv_bfloat16* lo_cache,
                                const __nv_bfloat16* hi_cache, const unsigned* block_table,
                                const unsigned* row_seq, const unsigned* row_ctx_len,
                                const unsigned* row_parent, int heads, int rank, int nope,
                                int rope, int v_dim, int block_size, int max_blocks_per_seq,
                                float scale) {
    SD_SHARED(float, q_full, SD_MLA_MAX_LATENT);
    SD_SHARED(float, part_max, SD_MLA_WARPS);
    SD_SHARED(float, part_sum, SD_MLA_WARPS);
    SD_SHARED(float, part_acc, SD_MLA_WARPS * SD_MLA_MAX_RANK);
    SD_SHARED(float, lat, SD_MLA_MAX_RANK);
    const int h = blockIdx.x, r = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int latent = rank + rope, half = latent / 2;
    const unsigned seq = row_seq[r];
    const int n = (int)row_ctx_len[r];
    const __nv_bfloat16* qh = q + ((size_t)r * heads + h) * (nope + rope);
    const __nv_bfloat16* head_rows = kv_b + (size_t)h * (nope + v_dim) * rank;
    const unsigned* table = block_table + (size_t)seq * max_blocks_per_seq;

    // q_lat = q_nope . kv_b's key rows (one latent element a thread), then q_rope.
    for (int c = threadIdx.x; c < rank; c += blockDim.x) {
        float s = 0.0f;
        for (int d = 0; d < nope; ++d) s += sd_ld(qh + d) * sd_ld(head_rows + (size_t)d * rank + c);
        q_full[c] = s;
    }
    for (int e = threadIdx.x; e < rope; e += blockDim.x) q_full[rank + e] = sd_ld(qh + nope + e);
    __syncthreads();
    float qv[SD_MLA_PER_LANE], acc[SD_MLA_PER_LANE];
    for (int i = 0; i < SD_MLA_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < latent ? q_full[d] : 0.0f;
        acc[i] = 0.0f;
    }
    // The prefix every row of the branch sees: the whole context for a row without parent.
    const bool masked = row_parent != nullptr && row_parent[r] != SD_MLA_NO_PARENT;
    int prefix = n;
    if (masked) {
        unsigned at = (unsigned)r;
        while (row_parent[at] != SD_MLA_NO_PARENT) at = row_parent[at];
        prefix = (int)row_ctx_len[at];
    }
    float m = -INFINITY, l = 0.0f;
    // As in paged attention: the prefix's rows in order, then the branch's own rows from
    // this row up, each index visited by warp index % WARPS.
    unsigned up = (unsigned)r;
    int cur = 0;
    for (int idx = warp;; idx += SD_MLA_WARPS) {
        int j = idx;
        if (idx >= prefix) {
            if (!masked) break;
            const int b = idx - prefix;
            while (cur < b && row_parent[up] != SD_MLA_NO_PARENT) {
                up = row_parent[up];
                ++cur;
            }
            if (cur < b || row_parent[up] == SD_MLA_NO_PARENT) break;
            j = (int)row_ctx_len[up] - 1;
        }
        const size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const __nv_bfloat16* lo = lo_cache + slot * half;
        const __nv_bfloat16* hi = hi_cache + slot * half;
        float x[SD_MLA_PER_LANE];
        float dot = 0.0f;
        for (int i = 0; i < SD_MLA_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            x[i] = d < half ? sd_ld(lo + d) : (d < latent ? sd_ld(hi + d - half) : 0.0f);
            dot += qv[i] * x[i];
        }
        const float score = sd_warp_sum(dot) * scale;
        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);
        const float p = expf(score - m_new);
        l = l * correction + p;
        for (int i = 0; i < SD_MLA_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            acc[i] = acc[i] * correction + (d < rank ? p * x[i] : 0.0f);
        }
        m = m_new;
    }
    if (lane == 0) {
        part_max[warp] = m;
        part_sum[warp] = l;
    }
    for (int i = 0; i < SD_MLA_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < rank) part_acc[warp * SD_MLA_MAX_RANK + d] = acc[i];
    }
    __syncthreads();
    float big = -INFINITY;
    for (int w = 0; w < SD_MLA_WARPS; ++w) big = fmaxf(big, part_max[w]);
    float total = 0.0f, weight[SD_MLA_WARPS];
    for (int w = 0; w < SD_MLA_WARPS; ++w) {
        // A warp that saw no rows has max -inf and sum 0: its weight is 0, not NaN.
        weight[w] = part_sum[w] > 0.0f ? expf(part_max[w] - big) : 0.0f;
        total += part_sum[w] * weight[w];
    }
    for (int c = threadIdx.x; c < rank; c += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < SD_MLA_WARPS; ++w) {
            if (weight[w] > 0.0f) o += part_acc[w * SD_MLA_MAX_RANK + c] * weight[w];
        }
        lat[c] = total > 0.0f ? o / total : 0.0f;
    }
    __syncthreads();
    // out = kv_b's value rows . the merged latent (zero for a row attending to nothing).
    __nv_bfloat16* oh = out + ((size_t)r * heads + h) * v_dim;
    for (int e = threadIdx.x; e < v_dim; e += blockDim.x) {
        const __nv_bfloat16* row = head_rows + (size_t)(nope + e) * rank;
        float o = 0.0f;
        for (int c = 0; c < rank; ++c) o += sd_ld(row + c) * lat[c];
        sd_st(oh + e, o);
    }
}
SD_REGISTER(sd_mla_attention)
