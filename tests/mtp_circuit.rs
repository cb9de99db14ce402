//! The circuit binding (`circuit_draft` / `set_circuit_draft`) checked with a runner that
//! shares no code with the head's forward: [`HostRunner`] reads the binding's slots by
//! their documented names, decodes them on the host (BF16, FP8 E4M3 with block scales,
//! NVFP4, each decoder written here from the format's definition) and runs the head's
//! equations in plain Rust loops, reading and writing the binding's KV caches itself.
//!
//! So a slot under the wrong name, a missing or swapped weight, a wrong flag in `kind`, or a
//! head that ignores its runner, makes it draft something else than the head's own forward.
//! It rounds to BF16 where the kernels store BF16, so its logits match the kernels' to
//! within f32 summation order, far below the margins between the top tokens here.
//!
//! Also: grammar masks reach the runner, and a run that a mask ends early leaves the rows
//! the head's own forward leaves.

mod mtp_common;

use half::bf16;
use mtp_common::{Fixture, VOCAB};
use specdraft::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use specdraft::model::{ForwardContext, ModelLevers};
use specdraft::speculative::mtp::ReferenceDraftRunner;
use specdraft::speculative::{
    DraftBinding, DraftProposer, DraftRunner, MtpQuantization, MtpState, ProposerState,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn r(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0,
/// `S.1111.111` NaN.
fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    match (e, m) {
        (15, 7.0) => f32::NAN,
        (0, _) => sign * m / 8.0 * 2f32.powi(-6),
        _ => sign * (1.0 + m / 8.0) * 2f32.powi(e - 7),
    }
}

/// E2M1: sign (bit 3), 2 exponent bits (bias 1), 1 mantissa bit.
fn e2m1(c: u8) -> f32 {
    let sign = if c & 8 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((c >> 1) & 3), f32::from(c & 1));
    sign * if e == 0 {
        m / 2.0
    } else {
        (1.0 + m / 2.0) * 2f32.powi(e - 1)
    }
}

/// Every slot of a binding, decoded to f32 on the host.
struct Slots(HashMap<String, (Vec<f32>, Vec<usize>)>);

impl Slots {
    fn read(gpu: &dyn GpuBackend, b: &DraftBinding) -> Slots {
        let mut map = HashMap::new();
        for s in &b.weights {
            let n: usize = s.shape.iter().product();
            let values = match s.dtype {
                Dtype::Bf16 => gpu.download_bf16(s.ptr, n).unwrap(),
                Dtype::F32 => gpu.download::<f32>(s.ptr, n).unwrap(),
                Dtype::F8E4M3 => {
                    let (o, i) = (s.shape[0], s.shape[1]);
                    let codes = gpu.download::<u8>(s.ptr, n).unwrap();
                    let cols = i.div_ceil(128);
                    let scales = gpu
                        .download::<f32>(s.block_scale.unwrap(), o.div_ceil(128) * cols)
                        .unwrap();
                    (0..n)
                        .map(|k| e4m3(codes[k]) * scales[(k / i) / 128 * cols + (k % i) / 128])
                        .collect()
                }
                Dtype::U8 => {
                    let codes = gpu.download::<u8>(s.ptr, n / 2).unwrap();
                    let scales = gpu.download::<u8>(s.block_scale.unwrap(), n / 16).unwrap();
                    let g = s.global_scale.unwrap();
                    (0..n)
                        .map(|k| {
                            let c = codes[k / 2] >> (4 * (k % 2)) & 0xf;
                            e2m1(c) * e4m3(scales[k / 16]) * g
                        })
                        .collect()
                }
                other => panic!("slot {} has dtype {other:?}", s.name),
            };
            map.insert(s.name.clone(), (values, s.shape.clone()));
        }
        Slots(map)
    }

    fn get(&self, name: &str) -> &[f32] {
        &self
            .0
            .get(name)
            .unwrap_or_else(|| panic!("no slot {name}"))
            .0
    }

    fn opt(&self, name: &str) -> Option<&[f32]> {
        self.0.get(name).map(|s| s.0.as_slice())
    }

    /// `W x (+ bias)` for the `[out, in]` slot `name`, in f32.
    fn linear(&self, name: &str, x: &[f32]) -> Vec<f32> {
        let (w, shape) = &self.0[name];
        let bias = self.opt(&format!("{name}.bias"));
        (0..shape[0])
            .map(|o| {
                let row = &w[o * shape[1]..(o + 1) * shape[1]];
                let s: f32 = row.iter().zip(x).map(|(w, x)| w * x).sum();
                s + bias.map_or(0.0, |b| b[o])
            })
            .collect()
    }

    /// BF16-rounded [`Slots::linear`], as a projection stores it.
    fn proj(&self, name: &str, x: &[f32]) -> Vec<f32> {
        self.linear(name, x).into_iter().map(r).collect()
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| r(v * inv * w)).collect()
}

/// Rotate-half RoPE of every `head_dim`-wide head in `x`, over the first `2 * freq.len()`
/// elements of each.
fn rope(x: &mut [f32], head_dim: usize, pos: usize, freq: &[f32]) {
    let half = freq.len();
    for head in x.chunks_mut(head_dim) {
        for (i, f) in freq.iter().enumerate() {
            let (sin, cos) = (pos as f32 * f).sin_cos();
            let (a, b) = (head[i], head[i + half]);
            head[i] = r(a * cos - b * sin);
            head[i + half] = r(b * cos + a * sin);
        }
    }
}

/// The MTP head on the host, from a binding alone.
#[derive(Default)]
struct HostRunner {
    calls: AtomicUsize,
}

impl DraftRunner for HostRunner {
    fn run(
        &self,
        b: &DraftBinding,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        grammar_bitmask: Option<&[i32]>,
    ) -> specdraft::Result<Vec<u32>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let gpu = ctx.gpu.as_ref();
        let st = state.as_any_mut().downcast_mut::<MtpState>().unwrap();
        let w = Slots::read(gpu, b);
        let mut flags = b.kind.split('+');
        let layout = flags
            .next()
            .unwrap()
            .strip_prefix("mtp:")
            .unwrap()
            .to_string();
        let flags: Vec<&str> = flags.collect();
        let (h, eps) = (b.hidden_size, b.rms_norm_eps);
        let (heads, kvh, hd) = (b.num_attention_heads, b.num_key_value_heads, b.head_dim);
        let gated = layout == "qwen3_next";
        let freq = w.get("rope_inv_freq");
        let row_elems = kvh * hd;
        let mut drafts = Vec::new();
        let mut token = last_token;
        let mut hidden = gpu.download_bf16(target_hidden, h)?;
        for step in 0..num_drafts {
            let row = st.rows() + step;
            let t = token as usize;
            let emb = rms_norm(
                &w.get("embed_tokens")[t * h..(t + 1) * h],
                w.get("enorm"),
                eps,
            );
            if step == 0 && flags.contains(&"target_postnorm") {
                hidden = rms_norm(&hidden, w.get("target_final_norm"), eps);
            }
            let hid = rms_norm(&hidden, w.get("hnorm"), eps);
            let concat = if layout == "mimo" {
                [hid, emb].concat()
            } else {
                [emb, hid].concat()
            };
            let mut x = w.proj("eh_proj", &concat);

            let n = rms_norm(&x, w.get("layer.input_layernorm"), eps);
            let q_full = w.proj("layer.self_attn.q_proj", &n);
            let (mut q, gate): (Vec<f32>, Vec<f32>) = if gated {
                let per = q_full.chunks(hd);
                let q = per.clone().step_by(2).flatten().copied().collect();
                (q, per.skip(1).step_by(2).flatten().copied().collect())
            } else {
                (q_full, Vec::new())
            };
            let mut k = w.proj("layer.self_attn.k_proj", &n);
            let v = w.proj("layer.self_attn.v_proj", &n);
            if let Some(qn) = w.opt("layer.self_attn.q_norm") {
                q = q.chunks(hd).flat_map(|c| rms_norm(c, qn, eps)).collect();
                let kn = w.get("layer.self_attn.k_norm");
                k = k.chunks(hd).flat_map(|c| rms_norm(c, kn, eps)).collect();
            }
            rope(&mut q, hd, position + step, freq);
            rope(&mut k, hd, position + step, freq);
            let slot = st.slot(row).expect("the head reserved the row") as usize;
            let bits = |v: &[f32]| {
                v.iter()
                    .map(|x| bf16::from_f32(*x).to_bits())
                    .collect::<Vec<u16>>()
            };
            gpu.write(b.k_cache.offset(slot * row_elems * 2), &bits(&k), 0)?;
            gpu.write(b.v_cache.offset(slot * row_elems * 2), &bits(&v), 0)?;
            let cache_len = b.kv_num_blocks * b.kv_block_size * row_elems;
            let (kc, vc) = (
                gpu.download_bf16(b.k_cache, cache_len)?,
                gpu.download_bf16(b.v_cache, cache_len)?,
            );
            let ctx_slots: Vec<usize> = (0..=row).map(|j| st.slot(j).unwrap() as usize).collect();
            let mut attn = vec![0f32; heads * hd];
            for hh in 0..heads {
                let g = hh / (heads / kvh);
                let qh = &q[hh * hd..(hh + 1) * hd];
                let at = |c: &[f32], s: usize| c[s * row_elems + g * hd..][..hd].to_vec();
                let scores: Vec<f32> = ctx_slots
                    .iter()
                    .map(|&s| {
                        let kj = at(&kc, s);
                        qh.iter().zip(&kj).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = e.iter().sum();
                for (p, &s) in e.iter().zip(&ctx_slots) {
                    for (d, vv) in at(&vc, s).iter().enumerate() {
                        attn[hh * hd + d] += p / total * vv;
                    }
                }
            }
            let mut attn: Vec<f32> = attn.into_iter().map(r).collect();
            if gated {
                for (a, g) in attn.iter_mut().zip(&gate) {
                    *a = r(*a / (1.0 + (-g).exp()));
                }
            }
            let o = w.proj("layer.self_attn.o_proj", &attn);
            x = x.iter().zip(&o).map(|(a, b)| r(a + b)).collect();

            let n = rms_norm(&x, w.get("layer.post_attention_layernorm"), eps);
            let g = w.proj("layer.mlp.gate_proj", &n);
            let u = w.proj("layer.mlp.up_proj", &n);
            let a: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| r(g / (1.0 + (-g).exp()) * u))
                .collect();
            let d = w.proj("layer.mlp.down_proj", &a);
            x = x.iter().zip(&d).map(|(a, b)| r(a + b)).collect();
            let normed = rms_norm(&x, w.get("final_norm"), eps);
            let logits = w.linear("lm_head", &normed);

            let allowed =
                |t: usize| grammar_bitmask.is_none_or(|m| (m[t / 32] as u32 >> (t % 32)) & 1 == 1);
            let pick = (0..b.draft_vocab_size).filter(|&t| allowed(t)).fold(
                None,
                |best: Option<usize>, t| match best {
                    Some(bt) if logits[bt] >= logits[t] => Some(bt),
                    _ => Some(t),
                },
            );
            let Some(pick) = pick else {
                break;
            };
            drafts.push(pick as u32);
            token = pick as u32;
            hidden = if flags.contains(&"chain_postnorm") {
                normed
            } else {
                x
            };
        }
        Ok(drafts)
    }
}

type Trace = Vec<(Vec<u32>, usize, Option<usize>)>;

/// Prefill, then four rounds of propose and after_verify, with `runner` set (or not).
fn trace(f: &Fixture, runner: Option<Arc<dyn DraftRunner>>, mask: Option<&[i32]>) -> Trace {
    let h = f.head();
    h.set_circuit_draft(runner);
    let mut st = f.state();
    let mut pos = 14;
    f.prefill(&mut *st, pos);
    let mut all = Vec::new();
    for round in 0..4 {
        let d = h
            .propose(
                f.tokens[pos],
                f.hidden(pos - 1),
                pos,
                3,
                &mut *st,
                &f.ctx,
                0,
                None,
                mask,
                None,
            )
            .unwrap();
        let k = (round % 3).min(d.len());
        h.after_verify(k, &mut *st, 0).unwrap();
        all.push((d, h.drafter_rows(&mut *st), h.last_pair_key(&mut *st)));
        pos += k + 1;
    }
    h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    h.set_circuit_draft(None);
    all
}

#[test]
fn a_runner_written_from_the_binding_alone_drafts_what_the_head_drafts() {
    let cases = [
        ("deepseek_v3", ModelLevers::default(), MtpQuantization::Bf16),
        (
            "mimo",
            ModelLevers {
                mtp_chain_postnorm: true,
                ..Default::default()
            },
            MtpQuantization::Bf16,
        ),
        (
            "qwen3_next",
            ModelLevers {
                mtp_target_postnorm: true,
                ..Default::default()
            },
            MtpQuantization::Bf16,
        ),
        ("deepseek_v3", ModelLevers::default(), MtpQuantization::Fp8),
        ("qwen3_next", ModelLevers::default(), MtpQuantization::Nvfp4),
    ];
    for (layout, levers, quant) in cases {
        let f = Fixture::new(
            &format!("host_runner_{layout}_{quant:?}"),
            layout,
            levers,
            quant,
        );
        let own = trace(&f, None, None);
        let runner = Arc::new(HostRunner::default());
        let host = trace(&f, Some(runner.clone()), None);
        assert_eq!(
            runner.calls.load(Ordering::Relaxed),
            4,
            "{layout} {quant:?}"
        );
        assert!(own.iter().all(|(d, ..)| d.len() == 3), "{layout} {quant:?}");
        assert_eq!(own, host, "{layout} {quant:?}");
        f.finish();
    }
}

#[test]
fn grammar_masks_reach_the_runner_and_an_empty_one_keeps_the_rows_the_head_keeps() {
    let f = Fixture::new(
        "runner_mask",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let words = VOCAB.div_ceil(32);
    // Even token ids only.
    let even = vec![0x5555_5555i32; words];
    // Nothing in the draft vocabulary.
    let none = vec![0i32; words];
    for mask in [&even, &none] {
        let own = trace(&f, None, Some(mask));
        let reference = trace(&f, Some(Arc::new(ReferenceDraftRunner)), Some(mask));
        let runner = Arc::new(HostRunner::default());
        let host = trace(&f, Some(runner.clone()), Some(mask));
        assert_eq!(
            runner.calls.load(Ordering::Relaxed),
            4,
            "the mask bypassed the runner"
        );
        assert_eq!(own, reference);
        assert_eq!(own, host);
        let drafted: Vec<u32> = own.iter().flat_map(|(d, ..)| d.clone()).collect();
        assert!(drafted.iter().all(|t| t % 2 == 0));
        if mask == &even {
            assert_eq!(drafted.len(), 12);
        } else {
            assert!(drafted.is_empty());
            // Prefill wrote rows for positions 1..=13; each round's verified token keeps its
            // row even though nothing was drafted.
            let rows: Vec<usize> = own.iter().map(|&(_, rows, _)| rows).collect();
            assert_eq!(rows, vec![14, 15, 16, 17]);
        }
    }
    // A mask too short for the draft vocabulary is refused before the runner runs.
    let runner = Arc::new(HostRunner::default());
    f.head().set_circuit_draft(Some(runner.clone()));
    let mut st = f.state();
    f.prefill(&mut *st, 14);
    let err = f
        .head()
        .propose(
            f.tokens[14],
            f.hidden(13),
            14,
            3,
            &mut *st,
            &f.ctx,
            0,
            None,
            Some(&even[..words - 1]),
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("grammar_bitmask"), "{err}");
    assert_eq!(runner.calls.load(Ordering::Relaxed), 0);
    f.head().free_state(f.gpu.as_ref(), &mut *st).unwrap();
    f.head().set_circuit_draft(None);
    f.finish();
}
