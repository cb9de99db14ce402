//! Draft trees through the engine (greedy): a tree proposer's output equals plain greedy
//! decoding token for token, on the table target and on the real model; a tree whose
//! second branch is right is accepted through that branch (where its chain accepts
//! nothing) and the proposer is told that path; after a tree step the target's KV holds
//! the accepted path exactly as a plain forward of it would, row by row; a malformed tree
//! ends only its own sequence; and nothing leaks.

mod engine_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use engine_common::{cpu, prompts, requests, table};
use model_util::*;
use specdraft::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::engine::testing::decode_hidden;
use specdraft::engine::{
    DraftPolicyKind, DraftShape, GenerateRequest, SamplingParams, SpecEngine, Target,
};
use specdraft::model::{ForwardContext, LoadOptions, LogitRows, TargetModel};
use specdraft::speculative::{DraftProposer, DraftTree, PromptLookup, ProposerState};
use specdraft::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Knows each prompt's plain greedy continuation and drafts a tree whose first branch is a
/// wrong token and whose second branch is the truth, as deep as the budget allows:
/// `[wrong, t0, t1, ..]`, node 0 and node 1 children of the last token, node `k + 1` a
/// child of node `k` from there. Its chain (`propose`) is the first branch: one wrong draft
/// and the truth after it, so a chain accepts nothing. With `bad_tree_for`, the sequence
/// whose prompt starts with that token gets a tree whose second node names itself as
/// parent.
struct SecondBranch {
    /// Prompt followed by its plain greedy output, keyed by the prompt.
    truth: HashMap<Vec<u32>, Vec<u32>>,
    vocab: u32,
    bad_tree_for: Option<u32>,
    /// Every path `after_verify_tree` was told.
    paths: Mutex<Vec<Vec<usize>>>,
    /// Whether to check each propose's hidden against the table target's encoding: the row
    /// of the token before `last_token`, at its position.
    check_hidden: bool,
    /// The hiddens that were not that row.
    wrong_hidden: Mutex<Vec<String>>,
    /// Target layers to capture, and for each prompt the rows a plain forward of its whole
    /// greedy text gives (BF16 bits: the final hiddens, then the captured layers' rows), to
    /// check each propose's `target_hidden` and `target_hidden_stack` against.
    capture: Option<(Vec<usize>, ReferenceRows)>,
}

/// Each prompt's reference rows as BF16 bits: the final hiddens, then the captured layers'.
type ReferenceRows = HashMap<Vec<u32>, (Vec<u16>, Vec<u16>)>;

#[derive(Default)]
struct Seen {
    full: Vec<u32>,
    bad: bool,
    prompt: Vec<u32>,
    /// The position of the last propose (the last prompt row's after the prefill).
    last: usize,
}
specdraft::impl_proposer_state!(Seen);

fn seen(state: &mut dyn ProposerState) -> &mut Seen {
    state.as_any_mut().downcast_mut::<Seen>().unwrap()
}

impl SecondBranch {
    fn new(prompts: &[Vec<u32>], outputs: &[Vec<u32>], vocab: u32) -> Self {
        let truth = prompts
            .iter()
            .zip(outputs)
            .map(|(p, o)| (p.clone(), [&p[..], &o[..]].concat()))
            .collect();
        SecondBranch {
            truth,
            vocab,
            bad_tree_for: None,
            paths: Mutex::new(Vec::new()),
            check_hidden: false,
            wrong_hidden: Mutex::new(Vec::new()),
            capture: None,
        }
    }

    /// The tree for a sequence whose last token sits at `position`.
    fn tree(&self, st: &Seen, position: usize, budget: usize) -> DraftTree {
        let next = |k: usize| st.full.get(position + 1 + k).copied().unwrap_or(0);
        let mut tree = DraftTree::default();
        if budget == 0 {
            return tree;
        }
        tree.tokens.push((next(0) + 1) % self.vocab);
        tree.parents.push(None);
        for k in 0..budget - 1 {
            tree.tokens.push(next(k));
            tree.parents.push(k.checked_sub(1).map(|_| k));
        }
        if st.bad && tree.len() > 1 {
            tree.parents[1] = Some(1);
        }
        tree
    }
}

impl DraftProposer for SecondBranch {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(Seen::default()))
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        _h: DevicePtr,
        state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        let st = seen(state);
        st.full = self.truth.get(prompt).cloned().unwrap_or_default();
        st.prompt = prompt.to_vec();
        st.last = prompt.len() - 1;
        st.bad = self.bad_tree_for.is_some() && prompt.first() == self.bad_tree_for.as_ref();
        Ok(0)
    }
    fn propose(
        &self,
        _last: u32,
        _h: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        _mask: Option<&[i32]>,
        _stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        Ok(self.tree(seen(state), position, n).tokens)
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _stream: u64) -> Result<()> {
        Ok(())
    }
    fn grows_trees(&self) -> bool {
        true
    }
    fn target_layer_ids(&self) -> Vec<usize> {
        self.capture.as_ref().map_or(Vec::new(), |(l, _)| l.clone())
    }
    fn propose_tree(
        &self,
        _last: u32,
        h: DevicePtr,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        _mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        let st = seen(state);
        let hidden = ctx.config.hidden_size;
        let mut wrong = self.wrong_hidden.lock().unwrap();
        if self.check_hidden {
            let row = ctx.gpu.download_bf16(h, hidden)?;
            let want = (st.full[position - 1], position - 1);
            if decode_hidden(&row) != want {
                wrong.push(format!(
                    "at {position}: {:?}, want {want:?}",
                    decode_hidden(&row)
                ));
            }
        }
        if let Some((layers, reference)) = &self.capture {
            // The rows of the tokens since the last propose: positions `last..position`.
            let (hiddens, stacks) = &reference[&st.prompt];
            let (sw, k) = (layers.len() * hidden, position - st.last);
            let row = ctx.gpu.download::<u16>(h, hidden)?;
            if row[..] != hiddens[(position - 1) * hidden..position * hidden] {
                wrong.push(format!("target_hidden at {position}"));
            }
            let rows = ctx
                .gpu
                .download::<u16>(stack.expect("rows captured"), k * sw)?;
            if rows[..] != stacks[(position - k) * sw..position * sw] {
                wrong.push(format!("{k} stack rows at {position}"));
            }
        }
        st.last = position;
        Ok(self.tree(st, position, budget))
    }
    fn after_verify_tree(
        &self,
        path: &[usize],
        _state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        self.paths.lock().unwrap().push(path.to_vec());
        Ok(())
    }
}

const MAX_TOKENS: usize = 24;

fn run<T: Target + 'static>(
    target: &Arc<T>,
    proposer: Option<Arc<dyn DraftProposer>>,
    shape: DraftShape,
    prompts: &[Vec<u32>],
) -> (Vec<Vec<u32>>, u64, Vec<Option<String>>) {
    let engine = SpecEngine::new(target.clone(), proposer, 4)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_draft_shape(shape);
    let reqs: Vec<GenerateRequest> = requests(prompts, MAX_TOKENS)
        .into_iter()
        .map(|r| r.ignore_eos().with_sampling(SamplingParams::greedy()))
        .collect();
    let g = engine.generate(reqs);
    let errors = g
        .results
        .iter()
        .map(|r| r.error.as_ref().map(|e| format!("{e:#}")))
        .collect();
    let tokens = g.results.into_iter().map(|r| r.tokens).collect();
    (tokens, g.metrics.accepted, errors)
}

fn plain<T: Target + 'static>(target: &Arc<T>, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let (tokens, _, errors) = run(target, None, DraftShape::Tree, prompts);
    assert!(errors.iter().all(Option::is_none), "{errors:?}");
    tokens
}

#[test]
fn the_second_branch_is_accepted_where_the_chain_accepts_nothing() {
    let gpu = cpu();
    let target = table(&gpu);
    let base = plain(&target, &prompts());
    let mut tree = SecondBranch::new(&prompts(), &base, 48);
    tree.check_hidden = true;
    let tree = Arc::new(tree);
    let (out, accepted, errors) = run(&target, Some(tree.clone()), DraftShape::Tree, &prompts());
    assert!(errors.iter().all(Option::is_none), "{errors:?}");
    assert_eq!(out, base, "greedy output with trees differs from plain");
    let (chain_out, chain_accepted, _) =
        run(&target, Some(tree.clone()), DraftShape::Chain, &prompts());
    assert_eq!(chain_out, base);
    assert_eq!(chain_accepted, 0, "the chain's first draft is always wrong");
    // Each full step accepts the second branch's three nodes.
    assert!(accepted >= 3 * 4, "tree accepted {accepted}");
    // The hidden handed to each propose is the accepted path's last node's row.
    let wrong = tree.wrong_hidden.lock().unwrap();
    assert!(wrong.is_empty(), "wrong hiddens: {wrong:?}");
    let paths = tree.paths.lock().unwrap();
    assert!(!paths.is_empty());
    for p in paths.iter() {
        let want: Vec<usize> = (1..=p.len()).collect();
        assert_eq!(p, &want, "the path runs down the second branch");
    }
    drop(target);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn a_malformed_tree_ends_its_sequence_and_the_others_go_on() {
    let gpu = cpu();
    let target = table(&gpu);
    let base = plain(&target, &prompts());
    let mut p = SecondBranch::new(&prompts(), &base, 48);
    p.bad_tree_for = Some(9);
    let (out, _, errors) = run(&target, Some(Arc::new(p)), DraftShape::Tree, &prompts());
    for (i, prompt) in prompts().iter().enumerate() {
        if prompt[0] == 9 {
            let e = errors[i].as_deref().expect("the bad tree's sequence fails");
            assert!(
                e.contains("propose_tree")
                    && e.contains("node 1's parent 1, which does not come before it"),
                "{e}"
            );
        } else {
            assert_eq!(errors[i], None);
            assert_eq!(out[i], base[i]);
        }
    }
    drop(target);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

fn load(gpu: &Arc<dyn GpuBackend>, tag: &str) -> Arc<TargetModel> {
    let dir = temp_dir(&format!("engine_tree_{tag}"));
    let tiny = Tiny::default();
    write_hf(&dir, &tiny, &tiny.tensors(5));
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(128),
        kv_blocks: Some(64),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap())
}

fn model_prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33],
        vec![3, 22, 45, 8, 8, 61, 70, 9, 95, 40],
        vec![11, 12, 13, 11, 12, 13, 11, 12],
    ]
}

#[test]
fn greedy_with_trees_equals_plain_greedy_on_the_real_model() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    let model = load(&gpu, "greedy");
    let prompts = model_prompts();
    let base = plain(&model, &prompts);
    let tree = Arc::new(SecondBranch::new(&prompts, &base, 96));
    let (out, accepted, errors) = run(&model, Some(tree.clone()), DraftShape::Tree, &prompts);
    assert!(errors.iter().all(Option::is_none), "{errors:?}");
    assert_eq!(out, base, "greedy output with trees differs from plain");
    assert!(accepted >= 3 * 3, "tree accepted {accepted}");
    let lookup: Arc<dyn DraftProposer> = Arc::new(PromptLookup::default().with_trees(true));
    let (out, _, errors) = run(&model, Some(lookup), DraftShape::Tree, &prompts);
    assert!(errors.iter().all(Option::is_none), "{errors:?}");
    assert_eq!(
        out, base,
        "greedy output with prompt-lookup trees differs from plain"
    );
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn a_compacted_path_holds_the_kv_and_logits_of_a_plain_forward_of_it() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    let model = load(&gpu, "compact");
    let vocab = model.config().vocab_size;
    // 14 prompt tokens, so the tree's rows cross a 16-row block boundary.
    let prompt: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % 96).collect();
    let last = 42;
    // Nodes: 0 and 1 under the root, 2 under 0, 3 and 4 under 1, 5 under 4. The path kept
    // is 1 -> 4 -> 5 (rows 2, 5, 6), which must land on rows 1, 2, 3 after the root.
    let tokens = [last, 10, 11, 12, 13, 14, 15];
    let parents = [0, 0, 1, 2, 2, 5];
    let path = [1usize, 4, 5];
    let (mut a, mut b) = (model.new_sequence(), model.new_sequence());
    model
        .forward(&mut [&mut a, &mut b], &[&prompt, &prompt])
        .unwrap();
    let out = model
        .forward_tree(&mut [&mut a], &[&tokens], &[Some(&parents)], &[])
        .unwrap();
    let tree_logits = gpu_f32(&gpu, out.logits, tokens.len() * vocab);
    let start = prompt.len() + 1;
    let rows: Vec<usize> = path.iter().map(|&i| start + i).collect();
    model.compact(&mut a, start, &rows).unwrap();
    // The same tokens as a chain, in a plain forward.
    let chain: Vec<u32> = [last]
        .into_iter()
        .chain(path.iter().map(|&i| tokens[1 + i]))
        .collect();
    let out = model.forward(&mut [&mut b], &[&chain]).unwrap();
    let chain_logits = gpu_f32(&gpu, out.logits, chain.len() * vocab);
    // The root's and each path node's logits in the tree forward are the chain's rows, bit
    // for bit.
    let tree_rows: Vec<usize> = std::iter::once(0)
        .chain(path.iter().map(|i| i + 1))
        .collect();
    for (k, &i) in tree_rows.iter().enumerate() {
        let tree_row = &tree_logits[i * vocab..(i + 1) * vocab];
        let chain_row = &chain_logits[k * vocab..(k + 1) * vocab];
        assert!(
            tree_row
                .iter()
                .zip(chain_row)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "logits of tree row {i} differ from chain row {k}"
        );
    }
    assert_eq!(a.len(), b.len());
    for layer in 0..model.config().num_hidden_layers {
        let (ka, va) = model.read_kv(&a, layer).unwrap();
        let (kb, vb) = model.read_kv(&b, layer).unwrap();
        let width = ka.len() / a.len();
        for row in 0..a.len() {
            let r = row * width..(row + 1) * width;
            assert_eq!(ka[r.clone()], kb[r.clone()], "layer {layer} key row {row}");
            assert_eq!(va[r.clone()], vb[r], "layer {layer} value row {row}");
        }
    }
    // And the next token's logits, which read every row, agree.
    let out = model.forward(&mut [&mut a, &mut b], &[&[7], &[7]]).unwrap();
    let next = gpu_f32(&gpu, out.logits, 2 * vocab);
    assert!(
        next[..vocab]
            .iter()
            .zip(&next[vocab..])
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "the next token's logits differ after compaction"
    );
    model.free_sequence(&mut a).unwrap();
    model.free_sequence(&mut b).unwrap();
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn the_hidden_and_captured_rows_follow_the_accepted_path_on_the_real_model() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    let model = load(&gpu, "capture");
    let prompts = model_prompts();
    let base = plain(&model, &prompts);
    let layers = vec![0, 1];
    let mut reference = HashMap::new();
    let h = model.config().hidden_size;
    for (p, b) in prompts.iter().zip(&base) {
        let full = [&p[..], &b[..]].concat();
        let mut s = model.new_sequence();
        let out = model
            .forward_capturing(&mut [&mut s], &[&full], LogitRows::All, &layers)
            .unwrap();
        let n = full.len();
        let hiddens = gpu.download::<u16>(out.hiddens, n * h).unwrap();
        let stacks = gpu
            .download::<u16>(out.hidden_stack.unwrap(), n * layers.len() * h)
            .unwrap();
        model.free_sequence(&mut s).unwrap();
        reference.insert(p.clone(), (hiddens, stacks));
    }
    let mut tree = SecondBranch::new(&prompts, &base, 96);
    tree.capture = Some((layers, reference));
    let tree = Arc::new(tree);
    let (out, accepted, errors) = run(&model, Some(tree.clone()), DraftShape::Tree, &prompts);
    assert!(errors.iter().all(Option::is_none), "{errors:?}");
    assert_eq!(out, base);
    assert!(accepted >= 3 * 3, "tree accepted {accepted}");
    let wrong = tree.wrong_hidden.lock().unwrap();
    assert!(wrong.is_empty(), "rows off the accepted path: {wrong:?}");
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

fn gpu_f32(gpu: &Arc<dyn GpuBackend>, ptr: DevicePtr, n: usize) -> Vec<f32> {
    gpu.download::<f32>(ptr, n).unwrap()
}
