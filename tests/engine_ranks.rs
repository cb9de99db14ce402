//! Expert parallelism and the rank-0/worker protocol, with two ranks as threads of this
//! process (`ranks_common::thread_group`): each rank loads its half of the routed experts
//! of a tiny GLM-4.5, Qwen3-MoE or DeepSeek-V3 (latent attention) checkpoint (written by
//! `tests/python/moe_target_reference.py` or `mla_target_reference.py`, which need `python3`
//! with numpy); rank 0 runs the engine and rank 1 `run_worker`, or `run_worker_with` and
//! its share of an MTP head: a GLM-4.5 one, or DeepSeek-V3's own MTP layer (latent
//! attention and routed experts) from the target's folder.
//!
//! What it proves: two ranks give token-identical output to one rank, greedy and sampled,
//! with and without drafts, with the MTP head's experts split too; each rank holds exactly half the experts' bytes; the worker
//! frees every sequence rank 0 frees, and ends cleanly at the shutdown; a checkpoint whose
//! expert count the ranks do not divide is refused at load.

#[allow(dead_code)]
#[path = "../benches/common/default_model.rs"]
mod default_model;
#[allow(unused_imports)]
mod model_util;
mod mtp_common;
mod ranks_common;

use default_model::python;
use model_util::temp_dir;
use ranks_common::thread_group;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::distributed::Communicator;
use specdraft::engine::ranks::{run_worker, run_worker_with, shutdown_workers, WorkerReport};
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SamplingParams, SpecEngine};
use specdraft::model::layers::ExpertShard;
use specdraft::model::{LoadOptions, ModelLevers, TargetModel};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, PromptLookup};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// Routed experts in the reference's checkpoints.
const EXPERTS: usize = 8;

fn opts() -> LoadOptions {
    LoadOptions {
        max_rows: 32,
        max_seq_len: Some(64),
        kv_blocks: Some(16),
    }
}

/// Writes `family`'s tiny checkpoint with `seed` into a fresh folder of its own (`test`
/// names it: tests run in parallel, and one must never rewrite a file another has mapped).
fn checkpoint(test: &str, family: &str, seed: u64) -> PathBuf {
    checkpoint_with_gguf(test, family, seed, None)
}

/// [`checkpoint`], also writing the same weights to `dir/model.gguf` with its stacked
/// experts in the block format `gguf` (`f32` or `q8_0`).
fn checkpoint_with_gguf(test: &str, family: &str, seed: u64, gguf: Option<&str>) -> PathBuf {
    let dir = temp_dir(&format!("ranks_{test}_{family}"));
    // DeepSeek-V3 (MLA attention, its "q_lora" variant; "mtp" adds its MTP layer) has a
    // reference of its own.
    let (script, arg) = match family {
        "deepseek_v3" => ("mla_target_reference.py", "q_lora"),
        "deepseek_v3_mtp" => ("mla_target_reference.py", "mtp"),
        _ => ("moe_target_reference.py", family),
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let gguf_path = dir.join("model.gguf");
    let out = Command::new(python())
        .arg(&script)
        .args([arg, dir.to_str().unwrap(), &seed.to_string(), "1,2,3"])
        .args(gguf.map(|_| gguf_path.to_str().unwrap()))
        .args(gguf)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "the checkpoint writer failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 5, 17, 33, 4, 90, 12, 12, 7, 64],
        vec![11, 12, 13, 11, 12, 13, 11, 12],
        vec![3, 22, 45, 8, 8, 61],
    ]
}

/// The engine's outputs for [`prompts`] on `model`, greedy or sampled, with or without
/// prompt-lookup drafts.
fn generate(model: &Arc<TargetModel>, drafts: bool, sampled: bool) -> Vec<Vec<u32>> {
    let proposer: Option<Arc<dyn DraftProposer>> =
        drafts.then(|| Arc::new(PromptLookup::default()) as Arc<dyn DraftProposer>);
    let engine = SpecEngine::new(model.clone(), proposer, 4)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_max_batch(2);
    let reqs = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let sampling = match sampled {
                true => SamplingParams::sampled(0.9, 7 + i as u64),
                false => SamplingParams::greedy(),
            };
            GenerateRequest::new(p, 14)
                .ignore_eos()
                .with_sampling(sampling)
        })
        .collect();
    engine
        .generate(reqs)
        .results
        .into_iter()
        .map(|r| {
            assert!(r.error.is_none(), "{:?}", r.error);
            r.tokens
        })
        .collect()
}

/// Loads `dir` on one rank: its outputs (greedy plain, greedy with drafts, sampled with
/// drafts) and its live weight bytes.
fn one_rank(dir: &Path) -> (Vec<Vec<Vec<u32>>>, usize) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = Arc::new(TargetModel::load(dir, gpu.clone(), opts()).unwrap());
    let bytes = gpu.ledger().live_bytes();
    let outs = [(false, false), (true, false), (true, true)]
        .map(|(d, s)| generate(&model, d, s))
        .to_vec();
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "one rank: the ledger after the drop"
    );
    (outs, bytes)
}

/// What each rank of a two-rank run saw.
struct TwoRanks {
    outputs: Vec<Vec<Vec<u32>>>,
    bytes: [usize; 2],
    report: WorkerReport,
}

/// Loads `dir` on two thread ranks; rank 0 runs the same generations as [`one_rank`].
fn two_ranks(dir: &Path) -> TwoRanks {
    let comms = thread_group(2, Duration::from_secs(60));
    let load = |comm: &Arc<dyn Communicator>| {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let shard = ExpertShard::new(comm.clone());
        let model = TargetModel::load_sharded(dir, gpu.clone(), opts(), None, shard).unwrap();
        (gpu, Arc::new(model))
    };
    let worker_comm = comms[1].clone();
    let worker = std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let (gpu, model) = load(&worker_comm);
            let bytes = gpu.ledger().live_bytes();
            let report = run_worker(&model).unwrap();
            drop(model);
            assert_eq!(
                gpu.ledger().live_count(),
                0,
                "rank 1: the ledger after the drop"
            );
            (bytes, report)
        });
        let (gpu, model) = load(&comms[0]);
        let bytes = gpu.ledger().live_bytes();
        let outputs = [(false, false), (true, false), (true, true)]
            .map(|(d, s)| generate(&model, d, s))
            .to_vec();
        shutdown_workers(&model).unwrap();
        drop(model);
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "rank 0: the ledger after the drop"
        );
        let (worker_bytes, report) = worker.join().unwrap();
        TwoRanks {
            outputs,
            bytes: [bytes, worker_bytes],
            report,
        }
    });
    worker
}

/// Bytes of every routed expert of `dir`'s checkpoint (BF16), from its safetensors header.
fn routed_expert_bytes(dir: &Path) -> usize {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .iter()
        .filter(|(name, _)| name.contains(".mlp.experts."))
        .map(|(_, t)| {
            let shape = t["shape"].as_array().unwrap();
            2 * shape
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .product::<usize>()
        })
        .sum()
}

fn check_family(family: &str, seed: u64) {
    let dir = checkpoint("match", family, seed);
    let (want, one_rank_bytes) = one_rank(&dir);
    let got = two_ranks(&dir);
    for (what, (w, g)) in ["greedy", "greedy with drafts", "sampled with drafts"]
        .iter()
        .zip(want.iter().zip(&got.outputs))
    {
        assert_eq!(g, w, "{family}, {what}: two ranks against one");
    }
    let experts = routed_expert_bytes(&dir);
    assert!(experts > 0);
    for (rank, bytes) in got.bytes.iter().enumerate() {
        assert_eq!(
            one_rank_bytes - bytes,
            experts / 2,
            "{family}: rank {rank} holds half the routed experts' bytes less than one rank"
        );
    }
    let report = got.report;
    assert_eq!(report.failed, 0, "{family}: {:?}", report.last_error);
    assert_eq!(
        report.leftover_sequences, 0,
        "{family}: the worker still held sequences rank 0 had freed"
    );
    // Three generations of three prompts: at least a prefill, a free and the shutdown each.
    assert!(report.commands > 3 * 3 * 2, "{report:?}");
}

#[test]
fn two_ranks_match_one_rank_on_glm4_moe() {
    check_family("glm4_moe", 12);
}

#[test]
fn two_ranks_match_one_rank_on_qwen3_moe() {
    check_family("qwen3_moe", 56);
}

#[test]
fn two_ranks_match_one_rank_on_deepseek_v3_with_latent_attention() {
    check_family("deepseek_v3", 6);
}

#[test]
fn two_ranks_match_one_rank_on_a_gguf_with_q8_0_experts() {
    let dir = checkpoint_with_gguf("gguf", "glm4_moe", 12, Some("q8_0"));
    let gguf = dir.join("model.gguf");
    let (want, one_rank_bytes) = one_rank(&gguf);
    let got = two_ranks(&gguf);
    assert_eq!(got.outputs, want, "GGUF: two ranks against one");
    // Each rank holds less than the whole model: its half of the stacked Q8_0 experts.
    assert!(
        got.bytes.iter().all(|&b| b < one_rank_bytes),
        "{:?} vs {one_rank_bytes}",
        got.bytes
    );
    assert_eq!(got.bytes[0], got.bytes[1], "both ranks hold the same share");
    assert_eq!((got.report.failed, got.report.leftover_sequences), (0, 0));
}

#[test]
fn an_expert_count_the_ranks_do_not_divide_is_refused_at_load() {
    let dir = checkpoint("indivisible", "glm4_moe", 12);
    let comms = thread_group(3, Duration::from_secs(5));
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let err = TargetModel::load_sharded(
        &dir,
        gpu.clone(),
        opts(),
        None,
        ExpertShard::new(comms[1].clone()),
    )
    .err()
    .expect("8 experts on 3 ranks loaded")
    .to_string();
    assert!(
        err.contains(&format!("{EXPERTS} routed experts")) && err.contains("3 ranks"),
        "{err}"
    );
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "nothing left after the refusal"
    );
}

#[test]
fn run_worker_is_refused_on_a_model_loaded_on_one_rank() {
    let dir = checkpoint("one_rank_worker", "qwen3_moe", 56);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = TargetModel::load(&dir, gpu, opts()).unwrap();
    let err = run_worker(&model).unwrap_err().to_string();
    assert!(err.contains("one rank"), "{err}");
}

/// A GLM-4.5 MTP head (8 routed experts, top-2, shared experts) for the tiny GLM target:
/// `mtp_common`'s checkpoint with the target's vocabulary.
fn glm_head_dir(test: &str) -> PathBuf {
    let dir = mtp_common::scratch_dir(&format!("ranks_head_{test}_{}", std::process::id()));
    mtp_common::write_checkpoint_with(&dir, "glm4_moe", 5, true);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["vocab_size"] = serde_json::json!(96);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

fn head_for(model: &Arc<TargetModel>, dir: &Path) -> Arc<MtpHead> {
    let levers = ModelLevers::default();
    let head = MtpHead::from_checkpoint_for_target(
        dir,
        model.clone(),
        MtpQuantization::Bf16,
        0,
        64,
        16,
        &levers,
    )
    .unwrap();
    Arc::new(head)
}

/// Greedy and sampled outputs of [`prompts`] with the MTP head drafting 3 a step.
fn generate_with_head(model: &Arc<TargetModel>, head: Arc<MtpHead>) -> Vec<Vec<Vec<u32>>> {
    let engine = SpecEngine::new(model.clone(), Some(head as Arc<dyn DraftProposer>), 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_max_batch(2);
    [false, true]
        .map(|sampled| {
            let reqs = prompts()
                .into_iter()
                .enumerate()
                .map(|(i, p)| {
                    let sampling = match sampled {
                        true => SamplingParams::sampled(0.9, 3 + i as u64),
                        false => SamplingParams::greedy(),
                    };
                    GenerateRequest::new(p, 12)
                        .ignore_eos()
                        .with_sampling(sampling)
                })
                .collect();
            let out = engine.generate(reqs);
            assert!(out.metrics.drafted > 0, "the head drafted nothing");
            out.results
                .into_iter()
                .map(|r| {
                    assert!(r.error.is_none(), "{:?}", r.error);
                    r.tokens
                })
                .collect()
        })
        .to_vec()
}

#[test]
fn a_sharded_mtp_head_drafts_on_two_ranks_what_it_drafts_on_one() {
    let dir = checkpoint("mtp", "glm4_moe", 12);
    check_sharded_head(&dir, &glm_head_dir("mtp"));
}

#[test]
fn deepseek_v3s_own_mtp_layer_sharded_drafts_on_two_ranks_what_it_drafts_on_one() {
    // Target and MTP layer (latent attention, routed and shared experts) in one folder.
    let dir = checkpoint("mtp", "deepseek_v3_mtp", 6);
    check_sharded_head(&dir, &dir);
}

/// One rank with the whole target and head against two with half the routed experts of
/// each: greedy and sampled outputs with the head drafting, and the worker's report.
fn check_sharded_head(dir: &Path, head_dir: &Path) {
    // One rank: the whole target and the whole head.
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = Arc::new(TargetModel::load(dir, gpu.clone(), opts()).unwrap());
    let head = head_for(&model, head_dir);
    assert!(
        !head.needs_comm(),
        "a head on one rank needs no communicator"
    );
    let want = generate_with_head(&model, head);
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);

    let comms = thread_group(2, Duration::from_secs(60));
    let load = |comm: &Arc<dyn Communicator>| {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let shard = ExpertShard::new(comm.clone());
        let model = TargetModel::load_sharded(dir, gpu.clone(), opts(), None, shard).unwrap();
        let model = Arc::new(model);
        let head = head_for(&model, head_dir);
        (gpu, model, head)
    };
    let worker_comm = comms[1].clone();
    let (got, report) = std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let (gpu, model, head) = load(&worker_comm);
            assert!(head.needs_comm(), "rank 1's head holds half its experts");
            let report =
                run_worker_with(&model, Some(head.as_ref()), ModelLevers::default()).unwrap();
            drop(head);
            drop(model);
            assert_eq!(
                gpu.ledger().live_count(),
                0,
                "rank 1: the ledger after the drop"
            );
            report
        });
        let (gpu, model, head) = load(&comms[0]);
        assert!(head.needs_comm(), "rank 0's head holds half its experts");
        let got = generate_with_head(&model, head);
        shutdown_workers(&model).unwrap();
        drop(model);
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "rank 0: the ledger after the drop"
        );
        (got, worker.join().unwrap())
    });
    assert_eq!(
        got[0], want[0],
        "greedy with the MTP head: two ranks against one"
    );
    assert_eq!(
        got[1], want[1],
        "sampled with the MTP head: two ranks against one"
    );
    assert_eq!(report.failed, 0, "{:?}", report.last_error);
    assert_eq!(
        report.leftover_sequences, 0,
        "the worker kept sequences or states rank 0 freed"
    );
    // Two sequences run at once, and the head drafts them in one announced propose_batch:
    // one command a draft step for the pair, not one a sequence.
    let batched = report
        .by_kind
        .get("mtp_propose_batch")
        .copied()
        .unwrap_or(0);
    assert!(
        batched > 0,
        "no batched propose reached the worker: {report:?}"
    );
}
