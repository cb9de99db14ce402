//! The routed mixture-of-experts MLP (GLM-4.5+/DeepSeek-V3, Qwen3-MoE and Qwen3-Next
//! layers), with its shared experts where the family has them.
//!
//! Routing runs on the host from the router's f32 logits (one small download per forward):
//! - `Sigmoid` (DeepSeek-V3 / GLM, "noaux_tc"): `s = sigmoid(logits)`; experts are chosen by
//!   `s + e_score_correction_bias`, first keeping the `topk_group` best of `n_group` groups
//!   (a group scores the sum of its two best; the other groups' experts score -inf, as in
//!   DeepSeek-V3's reference inference and vLLM, where `transformers` fills 0, which differs
//!   only when a kept expert's biased score is negative), then the top `k`; the weights are
//!   the chosen `s`, divided by their sum when `norm_topk_prob`, times
//!   `routed_scaling_factor`.
//! - `Softmax` (Qwen3-MoE, Qwen3-Next): `p = softmax(logits)`, top `k`, renormalised when
//!   `norm_topk_prob`.
//!
//! The output is `shared(x) [* sigmoid(shared_expert_gate(x))] + sum_e w_e * expert_e(x)`
//! (without the first term where there is no shared expert, as in Qwen3-MoE),
//! accumulated in BF16 in the order: shared, then the experts in the order they were
//! chosen (by descending choice score, `p` or the biased `s`; ties: lower index). A weight multiplies an expert's output as a BF16 scalar through a 1x1 `linear`,
//! so no kernel beyond the typed set is needed. The layer computes the shared experts'
//! output into the accumulator (or zeroes it); [`MoeMlp::forward`] does the rest.

use super::expert_shard::ExpertShard;
use super::load::load_dense;
use super::names::LayerNames;
use super::project::{project_bf16, Projection};
use super::scratch::{LayerScratch, MoeScratch};
use super::weights::SwiGlu;
use crate::backend::{
    DevicePtr, Dtype, ElementwiseArgs, ElementwiseOp, GpuBackend, GpuBackendExt, LinearArgs,
    LinearWeight,
};
use crate::model::tensors::TensorSource;
use crate::model::{DenseWeight, DeviceAllocations, ModelConfig, ModelError};
use half::bf16;

/// How router logits become expert weights, and (with it, in every checkpoint family that
/// has it) how the shared experts are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeScoring {
    /// DeepSeek-V3 / GLM: sigmoid scores, correction bias, group-limited top-k; shared
    /// experts at `mlp.shared_experts.*`.
    Sigmoid,
    /// Qwen3-Next: softmax probabilities, top-k; the shared expert at `mlp.shared_expert.*`,
    /// scaled by `sigmoid(mlp.shared_expert_gate(x))`.
    Softmax,
}

impl MoeScoring {
    /// Where the shared experts' projections are, under the layer prefix.
    pub fn shared_expert_prefix(self) -> &'static str {
        match self {
            MoeScoring::Sigmoid => "mlp.shared_experts",
            MoeScoring::Softmax => "mlp.shared_expert",
        }
    }
}

/// A routed MoE MLP with its shared experts.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeMlp {
    /// The shared expert(s), run on every row; `None` in families without one (Qwen3-MoE).
    pub shared: Option<SwiGlu>,
    /// Router `[num_experts, hidden]`.
    pub router: DenseWeight,
    /// DeepSeek/GLM's `e_score_correction_bias`, used for choosing only.
    pub correction_bias: Option<Vec<f32>>,
    /// The routed experts this rank holds, in router order: experts
    /// `first_expert..first_expert + experts.len()` (all of them on one rank).
    pub experts: Vec<SwiGlu>,
    /// Router index of `experts[0]`.
    pub first_expert: usize,
    /// The expert-parallel group the routed outputs are exchanged over; `None` on one rank.
    pub shard: Option<ExpertShard>,
    /// Qwen3-Next's `shared_expert_gate` `[1, hidden]`.
    pub shared_gate: Option<DenseWeight>,
    /// How router logits become expert scores.
    pub scoring: MoeScoring,
    /// Experts each row is routed to.
    pub top_k: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Multiplier of the routed experts' summed output.
    pub routed_scaling_factor: f32,
    /// Groups the experts are split into for group-limited routing (1: none).
    pub n_group: usize,
    /// Groups kept before the top-k experts are chosen from them.
    pub topk_group: usize,
}

impl MoeMlp {
    /// Routed experts in the whole layer (the router's rows), on every rank.
    pub fn num_experts(&self) -> usize {
        self.router.shape.first().copied().unwrap_or(0)
    }

    /// Width of one routed expert's MLP.
    pub fn expert_width(&self) -> usize {
        self.experts.first().map_or(0, SwiGlu::width)
    }

    /// Bytes one row reads beyond the shared experts: the router and `top_k` experts.
    pub fn nbytes_per_row(&self) -> usize {
        let e = self.experts.first().map_or(0, SwiGlu::nbytes);
        self.router.nbytes()
            + self.top_k * e
            + self.shared_gate.as_ref().map_or(0, DenseWeight::nbytes)
    }

    /// `(expert, weight)` for one row's router logits, by descending choice score (the
    /// softmax `p`, or the biased sigmoid score: not always the weight's order).
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
                if groups > 1 && n.is_multiple_of(groups) && self.topk_group < groups {
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

    /// Loads the routed part of the MoE MLP under `names` (router `mlp.gate`, experts
    /// `mlp.experts.{e}.*`, Qwen3-Next's `mlp.shared_expert_gate`, or their GGUF names: see
    /// [`LayerNames::moe`]), around `shared`, with
    /// the config's group-limited routing. With a `shard`, only this rank's experts are
    /// loaded; an expert count the ranks do not divide is refused.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        names: &LayerNames,
        scoring: MoeScoring,
        shared: Option<SwiGlu>,
        shard: Option<&ExpertShard>,
    ) -> crate::Result<MoeMlp> {
        let router_name = format!("{}.weight", names.moe("mlp.gate"));
        let r = src.require(&router_name)?;
        let h = config.hidden_size;
        let num_experts = r.shape.first().copied().unwrap_or(0);
        let moe = config.moe.as_ref().ok_or_else(|| ModelError::Format {
            path: src.path().to_string(),
            format: "checkpoint",
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
        let width = moe.expert_intermediate_size;
        let router = load_dense(allocs, src, &router_name, &[num_experts, h])?;
        let bias_name = names.moe("mlp.gate.e_score_correction_bias");
        let correction_bias = match src.tensor(&bias_name)? {
            Some(_) => Some(
                src.read_bf16(&bias_name, &[num_experts])?
                    .into_iter()
                    .map(f32::from)
                    .collect(),
            ),
            None => None,
        };
        let local = match shard {
            Some(s) => s.range(num_experts).map_err(|message| ModelError::Format {
                path: src.path().to_string(),
                format: "checkpoint",
                message: format!("{router_name}: {message}"),
            })?,
            None => 0..num_experts,
        };
        let mut experts = Vec::with_capacity(local.len());
        for e in local.clone() {
            let parts = ["gate_proj", "up_proj", "down_proj"]
                .map(|p| names.moe(&format!("mlp.experts.{e}.{p}")));
            experts.push(SwiGlu::load(allocs, src, parts, width, h)?);
        }
        let gate_name = format!("{}.weight", names.moe("mlp.shared_expert_gate"));
        let shared_gate = match src.tensor(&gate_name)? {
            Some(_) => Some(load_dense(allocs, src, &gate_name, &[1, h])?),
            None => None,
        };
        Ok(MoeMlp {
            shared,
            router,
            correction_bias,
            experts,
            first_expert: local.start,
            shard: shard.cloned(),
            shared_gate,
            scoring,
            top_k: moe.experts_per_token,
            norm_topk_prob: moe.norm_topk_prob,
            routed_scaling_factor: moe.routed_scaling_factor,
            n_group: moe.n_group,
            topk_group: moe.topk_group,
        })
    }

    /// `Err(message)` unless the router and every routed expert fit `hidden` and `top_k`.
    pub(super) fn check(&self, hidden: usize) -> Result<(), String> {
        let e = self.num_experts();
        let held = self.first_expert + self.experts.len();
        if self.experts.is_empty() || held > e {
            return Err(format!(
                "experts {}..{held} are held of a router for {e}",
                self.first_expert
            ));
        }
        if self.router.shape != [e, hidden] || self.top_k == 0 || self.top_k > e {
            return Err(format!(
                "the MoE router is {:?} for {e} experts (top-{}); expected [{e}, {hidden}] and 1 <= top_k <= {e}",
                self.router.shape, self.top_k
            ));
        }
        let f = self.expert_width();
        for (i, x) in self.experts.iter().enumerate() {
            if x.gate.dims() != (f, hidden)
                || x.up.dims() != (f, hidden)
                || x.down.dims() != (hidden, f)
            {
                return Err(format!(
                    "expert {i}'s projections are not [{f}, {hidden}] / [{hidden}, {f}]"
                ));
            }
        }
        Ok(())
    }

    /// `acc[r] += sum_e w_e * expert_e(normed[r])` for `rows` rows, after scaling the shared
    /// experts' output already in `ms.acc` by their gate. `sc.gate` / `sc.up` serve each
    /// expert in turn; `sc.normed` is read, never written.
    pub(crate) fn forward(
        &self,
        gpu: &dyn GpuBackend,
        sc: &LayerScratch,
        ms: &MoeScratch,
        rows: usize,
        hidden: usize,
        stream: u64,
    ) -> crate::Result<()> {
        let row_bytes = hidden * 2;
        let e = self.num_experts();
        let scale_into_acc = |row: usize, src: DevicePtr, w: f32, add: bool| -> crate::Result<()> {
            self.scale(gpu, ms, src, w, hidden, stream)?;
            let acc = ms.acc.offset(row * row_bytes);
            if add {
                add_into(gpu, acc, ms.scaled, hidden, stream)
            } else {
                Ok(gpu.copy_dtod(acc, ms.scaled, row_bytes, stream)?)
            }
        };
        if let Some(g) = &self.shared_gate {
            gpu.linear(LinearArgs {
                out: ms.gate_logit,
                out_dtype: Dtype::Bf16,
                x: sc.normed,
                weight: LinearWeight::Bf16 { weight: g.ptr },
                bias: None,
                rows,
                in_features: hidden,
                out_features: 1,
                stream,
            })?;
            let logits = gpu.download_bf16(ms.gate_logit, rows)?;
            for (r, l) in logits.iter().enumerate() {
                let s = bf16::from_f32(1.0 / (1.0 + (-l).exp())).to_f32();
                scale_into_acc(r, ms.acc.offset(r * row_bytes), s, false)?;
            }
        }
        gpu.linear(LinearArgs {
            out: ms.router_logits,
            out_dtype: Dtype::F32,
            x: sc.normed,
            weight: LinearWeight::Bf16 {
                weight: self.router.ptr,
            },
            bias: None,
            rows,
            in_features: hidden,
            out_features: e,
            stream,
        })?;
        let logits: Vec<f32> = gpu.download(ms.router_logits, rows * e)?;
        let routes: Vec<Vec<(usize, f32)>> = (0..rows)
            .map(|r| self.route(&logits[r * e..(r + 1) * e]))
            .collect();
        let Some(shard) = &self.shard else {
            for (r, chosen) in routes.iter().enumerate() {
                for &(idx, w) in chosen {
                    self.run_expert(gpu, sc, ms, idx, r, hidden, stream)?;
                    scale_into_acc(r, ms.expert_out, w, true)?;
                }
            }
            return Ok(());
        };
        // Each rank fills the slots of the choices its experts answer; the all-reduce then
        // hands every rank every slot exactly (see `expert_shard`), and all accumulate them
        // in choice order as one rank does.
        let k = self.top_k;
        let mut slots = vec![bf16::ZERO; rows * k * hidden];
        for (r, chosen) in routes.iter().enumerate() {
            for (j, &(idx, w)) in chosen.iter().enumerate() {
                if !self.holds(idx) {
                    continue;
                }
                self.run_expert(gpu, sc, ms, idx, r, hidden, stream)?;
                self.scale(gpu, ms, ms.expert_out, w, hidden, stream)?;
                let slot = (r * k + j) * hidden;
                let scaled: Vec<bf16> = gpu.download(ms.scaled, hidden)?;
                slots[slot..slot + hidden].copy_from_slice(&scaled);
            }
        }
        shard.comm().all_reduce_sum_bf16(&mut slots)?;
        for (r, chosen) in routes.iter().enumerate() {
            for j in 0..chosen.len() {
                let slot = (r * k + j) * hidden;
                gpu.write(ms.scaled, &slots[slot..slot + hidden], stream)?;
                add_into(gpu, ms.acc.offset(r * row_bytes), ms.scaled, hidden, stream)?;
            }
        }
        Ok(())
    }

    /// Whether this rank holds router expert `idx`.
    fn holds(&self, idx: usize) -> bool {
        (self.first_expert..self.first_expert + self.experts.len()).contains(&idx)
    }

    /// `ms.expert_out = expert_idx(sc.normed[row])`; `idx` is a router index this rank holds.
    #[allow(clippy::too_many_arguments)]
    fn run_expert(
        &self,
        gpu: &dyn GpuBackend,
        sc: &LayerScratch,
        ms: &MoeScratch,
        idx: usize,
        row: usize,
        hidden: usize,
        stream: u64,
    ) -> crate::Result<()> {
        let x = &self.experts[idx - self.first_expert];
        let input = sc.normed.offset(row * hidden * 2);
        let gate_up = [(&x.gate, sc.gate), (&x.up, sc.up)].map(|(weight, out)| Projection {
            weight,
            bias: None,
            out,
        });
        project_bf16(gpu, input, 1, stream, &gate_up)?;
        gpu.elementwise(ElementwiseArgs {
            op: ElementwiseOp::SiluMul,
            out: sc.gate,
            a: sc.gate,
            b: sc.up,
            n: self.expert_width(),
            stream,
        })?;
        x.down
            .forward(gpu, ms.expert_out, Dtype::Bf16, sc.gate, None, 1, stream)?;
        Ok(())
    }

    /// `ms.scaled = bf16(w) * src` over `hidden` values.
    fn scale(
        &self,
        gpu: &dyn GpuBackend,
        ms: &MoeScratch,
        src: DevicePtr,
        w: f32,
        hidden: usize,
        stream: u64,
    ) -> crate::Result<()> {
        gpu.write(ms.weight, &[bf16::from_f32(w)], stream)?;
        // [hidden, 1] x [1, 1]^T: a BF16 scalar times a vector.
        gpu.linear(LinearArgs {
            out: ms.scaled,
            out_dtype: Dtype::Bf16,
            x: src,
            weight: LinearWeight::Bf16 { weight: ms.weight },
            bias: None,
            rows: hidden,
            in_features: 1,
            out_features: 1,
            stream,
        })?;
        Ok(())
    }
}

/// `acc += b` over `n` BF16 values.
fn add_into(
    gpu: &dyn GpuBackend,
    acc: DevicePtr,
    b: DevicePtr,
    n: usize,
    stream: u64,
) -> crate::Result<()> {
    gpu.elementwise(ElementwiseArgs {
        op: ElementwiseOp::Add,
        out: acc,
        a: acc,
        b,
        n,
        stream,
    })?;
    Ok(())
}
