//! The CPU multi-head latent attention (see `MlaAttentionArgs`): for each (row, head), the
//! query absorbed into the latent space, the scores over the attended latent rows, their
//! softmax, the weighted latent sum and its up-projection through `kv_b`'s value rows.
//!
//! Every sum is f32 in a fixed order (over `d`, then over `j`, then over `c`), and a (row,
//! head) reads only its own query, its attended rows and `kv_b`, so its output is the same
//! bits whatever else is in the batch and whichever thread computes it. (Row, head) pairs
//! are split over rayon's pool.

use super::HostView;
use crate::backend::kernels::{attended_rows, CheckedMla};
use half::bf16;
use rayon::prelude::*;

/// Runs a validated call.
///
/// # Safety
/// `c`'s ranges were validated for this call: `out` is apart from every input, and each
/// cache range covers every slot the block table names.
pub(super) unsafe fn mla_attention(c: &CheckedMla<HostView>) {
    let a = &c.args;
    let (heads, rank, nope, rope, vd) = (a.heads, a.kv_lora_rank, a.nope_dim, a.rope_dim, a.v_dim);
    let (qk, half) = (nope + rope, (rank + rope) / 2);
    // SAFETY (caller): validated ranges; `out` is written only here and is apart from the rest.
    let (q, kv_b, lo, hi) = unsafe {
        (
            a.q.typed::<bf16>(),
            a.kv_b.typed::<bf16>(),
            a.lo_cache.typed::<bf16>(),
            a.hi_cache.typed::<bf16>(),
        )
    };
    let out = unsafe { a.out.typed_mut::<bf16>() };
    let widen = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let kv_b = widen(kv_b);
    // Each token's latent row, widened once: `[c_kv | k_rope]`.
    let latent_row = |seq: usize, j: usize| -> Vec<f32> {
        let block = c.block_table[seq * a.max_blocks_per_seq + j / a.block_size] as usize;
        let slot = block * a.block_size + j % a.block_size;
        let mut row = widen(&lo[slot * half..(slot + 1) * half]);
        row.extend(
            hi[slot * half..(slot + 1) * half]
                .iter()
                .map(|v| v.to_f32()),
        );
        row
    };
    out.par_chunks_mut(vd).enumerate().for_each(|(unit, out)| {
        let (r, h) = (unit / heads, unit % heads);
        let query = widen(&q[(r * heads + h) * qk..(r * heads + h + 1) * qk]);
        let head_rows = &kv_b[h * (nope + vd) * rank..(h + 1) * (nope + vd) * rank];
        // q_lat = q_nope . kv_b's key rows of this head.
        let mut q_lat = vec![0f32; rank];
        for (d, &qd) in query[..nope].iter().enumerate() {
            for (acc, &w) in q_lat.iter_mut().zip(&head_rows[d * rank..(d + 1) * rank]) {
                *acc += qd * w;
            }
        }
        let rows = attended_rows(r, &c.row_ctx_len, c.row_parent.as_deref());
        if rows.is_empty() {
            out.fill(bf16::ZERO);
            return;
        }
        let seq = c.row_seq[r] as usize;
        let latents: Vec<Vec<f32>> = rows.iter().map(|&j| latent_row(seq, j)).collect();
        let scores: Vec<f32> = latents
            .iter()
            .map(|l| {
                let nope_part: f32 = q_lat.iter().zip(&l[..rank]).map(|(x, y)| x * y).sum();
                let rope_part: f32 = query[nope..]
                    .iter()
                    .zip(&l[rank..])
                    .map(|(x, y)| x * y)
                    .sum();
                (nope_part + rope_part) * a.scale
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        let mut lat = vec![0f32; rank];
        for (w, l) in weights.iter().zip(&latents) {
            for (acc, &x) in lat.iter_mut().zip(&l[..rank]) {
                *acc += w * x;
            }
        }
        for (e, o) in out.iter_mut().enumerate() {
            let row = &head_rows[(nope + e) * rank..(nope + e + 1) * rank];
            let v: f32 = row.iter().zip(&lat).map(|(w, x)| w * x).sum();
            *o = bf16::from_f32(v / total);
        }
    });
}
