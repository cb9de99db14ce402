//! `MtpHead` on the CUDA kernels, run on the CPU through the device emulation (feature
//! `cuda-emu`), against the same head on the CPU reference: dense heads with NVFP4 and FP8
//! projections and a MoE head (Qwen3-Next: gated attention, q/k norms, partial RoPE, routed
//! and shared experts), logits of every step, single and chained drafts, trees grown in
//! batches through the engine, nothing leaked.
//! Tolerances and why are in `mtp_backends/mod.rs`; the device script runs every layout.
//!
//! `cargo test --features cuda-emu --test mtp_emulated`

mod mtp_backends;
mod mtp_common;

use specdraft::backend::EmuBackend;
use specdraft::speculative::MtpQuantization;
use std::sync::Arc;

#[test]
fn emulated_kernels_run_a_dense_nvfp4_head_like_the_cpu() {
    let emu = Arc::new(EmuBackend::new());
    mtp_backends::compare_with_cpu(
        emu,
        "deepseek_v3",
        false,
        MtpQuantization::Nvfp4,
        mtp_backends::EMU_LOGIT_RTOL,
    );
}

#[test]
fn emulated_kernels_run_a_moe_head_like_the_cpu() {
    let emu = Arc::new(EmuBackend::new());
    mtp_backends::compare_with_cpu(
        emu,
        "qwen3_next",
        true,
        MtpQuantization::Bf16,
        mtp_backends::EMU_LOGIT_RTOL,
    );
}

#[test]
fn emulated_kernels_grow_batched_trees_in_the_engine_like_the_cpu() {
    let emu = Arc::new(EmuBackend::new());
    mtp_backends::engine_keeps_greedy_output(emu, "deepseek_v3", false, true);
}

#[test]
fn emulated_kernels_run_an_fp8_head_like_the_cpu() {
    // MiMo: q/k/v biases added inside the FP8 kernel.
    let emu = Arc::new(EmuBackend::new());
    mtp_backends::compare_with_cpu(
        emu,
        "mimo",
        false,
        MtpQuantization::Fp8,
        mtp_backends::EMU_LOGIT_RTOL,
    );
}
