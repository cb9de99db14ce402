//! The routed mixture-of-experts MLP of GLM-4.5+/DeepSeek-V3 and Qwen3-Next MTP layers.
//!
//! Routing runs on the host from the router's f32 logits (one small download per forward):
//! - `Sigmoid` (DeepSeek-V3 / GLM, "noaux_tc"): `s = sigmoid(logits)`; experts are chosen by
//!   `s + e_score_correction_bias`, first keeping the `topk_group` best of `n_group` groups
//!   (a group scores the sum of its two best), then the top `k`; the weights are the chosen
//!   `s`, divided by their sum when `norm_topk_prob`, times `routed_scaling_factor`.
//! - `Softmax` (Qwen3-Next): `p = softmax(logits)`, top `k`, renormalised when
//!   `norm_topk_prob`.
//!
//! The output is `shared(x) [* sigmoid(shared_expert_gate(x))] + sum_e w_e * expert_e(x)`,
//! accumulated in BF16 in the order: shared, then experts by descending weight (ties: lower
//! index). A weight multiplies an expert's output as a BF16 scalar through a 1x1 `linear`,
//! so no kernel beyond the typed set is needed.

use super::forward::Scratch;
use crate::backend::{Dtype, GpuBackend, GpuBackendExt};
use crate::model::layers::{load_dense, load_linear};
use crate::model::tensors::TensorSource;
use crate::model::{DenseWeight, DeviceAllocations, Linear, ModelConfig, ModelError};
use half::bf16;

/// How router logits become expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeScoring {
    /// DeepSeek-V3 / GLM: sigmoid scores, correction bias, group-limited top-k.
    Sigmoid,
    /// Qwen3-Next: softmax probabilities, top-k.
    Softmax,
}

/// One expert's SwiGLU projections.
#[derive(Clone, Debug, PartialEq)]
pub struct Expert {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// A routed MoE MLP (the layer's `gate`/`up`/`down` are then its shared expert).
#[derive(Clone, Debug, PartialEq)]
pub struct MtpMoe {
    /// Router `[num_experts, hidden]`.
    pub router: DenseWeight,
    /// DeepSeek/GLM's `e_score_correction_bias`, used for choosing only.
    pub correction_bias: Option<Vec<f32>>,
    pub experts: Vec<Expert>,
    /// Qwen3-Next's `shared_expert_gate` `[1, hidden]`.
    pub shared_gate: Option<DenseWeight>,
    pub scoring: MoeScoring,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub n_group: usize,
    pub topk_group: usize,
}

impl MtpMoe {
    /// Width of one expert's MLP.
    pub fn expert_ffn(&self) -> usize {
        self.experts.first().map_or(0, |e| e.gate.dims().0)
    }

    /// Bytes one row reads: the router and `top_k` experts.
    pub fn nbytes_per_row(&self) -> usize {
        let e = self
            .experts
            .first()
            .map_or(0, |e| e.gate.nbytes() + e.up.nbytes() + e.down.nbytes());
        self.router.nbytes()
            + self.top_k * e
            + self.shared_gate.as_ref().map_or(0, DenseWeight::nbytes)
    }

    /// `(expert, weight)` for one row's router logits, by descending weight.
    pub fn route(&self, logits: &[f32]) -> Vec<(usize, f32)> {
        let n = logits.len();
        let k = self.top_k.min(n);
        let by_desc = |v: &[f32], idx: &mut Vec<usize>| {
            idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        };
        let mut chosen: Vec<(usize, f32)> = match self.scoring {
            MoeScoring::Softmax => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f32 = e.iter().sum();
                let p: Vec<f32> = e.iter().map(|x| x / total).collect();
                let mut idx: Vec<usize> = (0..n).collect();
                by_desc(&p, &mut idx);
                idx[..k].iter().map(|&i| (i, p[i])).collect()
            }
            MoeScoring::Sigmoid => {
                let s: Vec<f32> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
                let mut choice = s.clone();
                if let Some(b) = &self.correction_bias {
                    for (c, b) in choice.iter_mut().zip(b) {
                        *c += b;
                    }
                }
                let groups = self.n_group.max(1);
                if groups > 1 && n % groups == 0 && self.topk_group < groups {
                    let per = n / groups;
                    let mut gscore: Vec<(usize, f32)> = (0..groups)
                        .map(|g| {
                            let mut v: Vec<f32> = choice[g * per..(g + 1) * per].to_vec();
                            v.sort_by(|a, b| b.total_cmp(a));
                            (g, v.iter().take(2).sum())
                        })
                        .collect();
                    gscore.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    let keep: Vec<usize> = gscore[..self.topk_group].iter().map(|g| g.0).collect();
                    for (i, c) in choice.iter_mut().enumerate() {
                        if !keep.contains(&(i / per)) {
                            *c = f32::NEG_INFINITY;
                        }
                    }
                }
                let mut idx: Vec<usize> = (0..n).collect();
                by_desc(&choice, &mut idx);
                idx[..k].iter().map(|&i| (i, s[i])).collect()
            }
        };
        if self.norm_topk_prob {
            let total: f32 = chosen.iter().map(|c| c.1).sum::<f32>() + 1e-20;
            chosen.iter_mut().for_each(|c| c.1 /= total);
        }
        chosen
            .iter_mut()
            .for_each(|c| c.1 *= self.routed_scaling_factor);
        chosen
    }

    /// Loads the MoE MLP at `{layer}mlp.` when it has a router (`mlp.gate.weight`).
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        layer: &str,
        scoring: MoeScoring,
    ) -> crate::Result<Option<MtpMoe>> {
        let router_name = format!("{layer}mlp.gate.weight");
        let Some(r) = src.tensor(&router_name)? else {
            return Ok(None);
        };
        let h = config.hidden_size;
        let num_experts = r.shape.first().copied().unwrap_or(0);
        let moe = config.moe.as_ref().ok_or_else(|| ModelError::Format {
            path: src.path().to_string(),
            format: "MTP checkpoint",
            message: format!("{router_name} is a router but config.json declares no experts (n_routed_experts / num_experts)"),
        })?;
        if moe.num_experts != num_experts {
            return Err(ModelError::ShapeMismatch {
                path: src.path().to_string(),
                tensor: router_name,
                expected: vec![moe.num_experts, h],
                found: r.shape.clone(),
            }
            .into());
        }
        let ffn = moe.expert_intermediate_size;
        let router = load_dense(allocs, src, &router_name, &[num_experts, h])?;
        let bias_name = format!("{layer}mlp.gate.e_score_correction_bias");
        let correction_bias = match src.tensor(&bias_name)? {
            Some(_) => Some(
                src.read_bf16(&bias_name, &[num_experts])?
                    .into_iter()
                    .map(f32::from)
                    .collect(),
            ),
            None => None,
        };
        let mut experts = Vec::with_capacity(num_experts);
        for e in 0..num_experts {
            let p = |part: &str| format!("{layer}mlp.experts.{e}.{part}");
            experts.push(Expert {
                gate: load_linear(allocs, src, &p("gate_proj"), ffn, h)?,
                up: load_linear(allocs, src, &p("up_proj"), ffn, h)?,
                down: load_linear(allocs, src, &p("down_proj"), h, ffn)?,
            });
        }
        let gate_name = format!("{layer}mlp.shared_expert_gate.weight");
        let shared_gate = match src.tensor(&gate_name)? {
            Some(_) => Some(load_dense(allocs, src, &gate_name, &[1, h])?),
            None => None,
        };
        Ok(Some(MtpMoe {
            router,
            correction_bias,
            experts,
            shared_gate,
            scoring,
            top_k: moe.experts_per_token,
            norm_topk_prob: moe.norm_topk_prob,
            routed_scaling_factor: moe.routed_scaling_factor,
            n_group: 1,
            topk_group: 1,
        }))
    }

    /// `acc[r] += sum_e w_e * expert_e(normed[r])` for `rows` rows, after scaling the shared
    /// expert's output already in `acc` by its gate. Uses the scratch's MoE buffers.
    pub(crate) fn forward(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        rows: usize,
        hidden: usize,
        stream: u64,
    ) -> crate::Result<()> {
        let hb = hidden * 2;
        let e = self.experts.len();
        let scale_into_acc =
            |row: usize, src: crate::backend::DevicePtr, w: f32, add: bool| -> crate::Result<()> {
                gpu.write(sc.moe_w, &[bf16::from_f32(w)], stream)?;
                // [hidden, 1] x [1, 1]^T: a BF16 scalar times a vector.
                gpu.linear(
                    sc.moe_tmp,
                    Dtype::Bf16,
                    src,
                    sc.moe_w,
                    None,
                    hidden,
                    1,
                    1,
                    stream,
                )?;
                let acc = sc.moe_acc.offset(row * hb);
                if add {
                    gpu.add(acc, acc, sc.moe_tmp, hidden, stream)?;
                } else {
                    gpu.copy_dtod(acc, sc.moe_tmp, hb, stream)?;
                }
                Ok(())
            };
        if let Some(g) = &self.shared_gate {
            gpu.linear(
                sc.moe_gate_logit,
                Dtype::Bf16,
                sc.normed,
                g.ptr,
                None,
                rows,
                hidden,
                1,
                stream,
            )?;
            let logits = gpu.download_bf16(sc.moe_gate_logit, rows)?;
            for (r, l) in logits.iter().enumerate() {
                let s = bf16::from_f32(1.0 / (1.0 + (-l).exp())).to_f32();
                scale_into_acc(r, sc.moe_acc.offset(r * hb), s, false)?;
            }
        }
        gpu.linear(
            sc.router,
            Dtype::F32,
            sc.normed,
            self.router.ptr,
            None,
            rows,
            hidden,
            e,
            stream,
        )?;
        let logits: Vec<f32> = gpu.download(sc.router, rows * e)?;
        let ffn = self.expert_ffn();
        for r in 0..rows {
            let input = sc.normed.offset(r * hb);
            for (idx, w) in self.route(&logits[r * e..(r + 1) * e]) {
                let x = &self.experts[idx];
                x.gate
                    .forward(gpu, sc.mlp_gate, Dtype::Bf16, input, None, 1, stream)?;
                x.up.forward(gpu, sc.mlp_up, Dtype::Bf16, input, None, 1, stream)?;
                gpu.silu_mul(sc.mlp_gate, sc.mlp_gate, sc.mlp_up, ffn, stream)?;
                x.down
                    .forward(gpu, sc.moe_out, Dtype::Bf16, sc.mlp_gate, None, 1, stream)?;
                scale_into_acc(r, sc.moe_out, w, true)?;
            }
        }
        Ok(())
    }
}
