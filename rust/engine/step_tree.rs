//! Draft trees in the decode step: asking a proposer for a tree, the verify forward with
//! the tree mask, acceptance of one path, and compacting that path.
//!
//! When the engine drafts trees ([`DraftShape::Tree`], a target that takes them), the
//! sequences are grouped as for `propose_batch` and each group asked `propose_tree_batch`
//! with its draft count as the node budget (a tree gets the rows a chain would); a
//! sequence under a grammar, and each member of a group the proposer does not batch, is
//! asked `propose_tree` on its own, with the grammar's mask for the next position when it
//! has one. Greedy sequences without a grammar verify their tree with
//! [`verify_tree_picks`] (the longest accepted path, from each row's argmax made on the
//! device when the target has room for it, else [`verify_tree_greedy`] on the downloaded
//! logits); sampled ones, and greedy ones under a grammar, walk it with
//! [`verify_tree_sampled`](fn@super::verify_tree_sampled) (lossless recursive rejection
//! sampling, the sequence's own random stream, the grammar advanced along the walked path).
//!
//! Under the adaptive policy a tree whose nodes carry probabilities is cut before its
//! verify, as a chain's doubted tail is: nodes whose calibrated chance of being reached and
//! accepted would not pay for their rows go, with everything under them
//! (`DraftPolicy::trim_tree`).
//!
//! Invariants:
//! - A tree that is a chain (node `i`'s parent node `i - 1`) is verified as one, exactly as
//!   `propose`'s drafts are; only a branching tree takes the tree path, and keeps it when
//!   the policy cuts it to a chain.
//! - `after_verify_tree` gets the accepted path in the proposer's own node indices, the
//!   nodes the policy cut counted.
//! - A malformed tree (see [`DraftTree::fault`]) ends its sequence with a contract error
//!   naming `propose_tree` and the fault; it is never verified.
//! - After a tree's verification, the target KV, `hidden_rows` and the captured stack rows
//!   hold the accepted path as a chain would: the KV the prefix then the path (moved down
//!   in order, the other nodes dropped), hidden row `k` the row whose logits picked the
//!   path's token `k` (row `a` the one that picked the emitted bonus token), and `drafts`
//!   the path's tokens, so `after_verify`, the catch-up and the next propose see exactly
//!   what they would after a chain that drafted that path, whichever verifier chose it.
//! - A grammar that allows nothing after the emitted tokens ends the sequence
//!   ([`FinishReason::Grammar`]), as after a chain.

use super::error::Stage;
use super::sequence::grammar_of;
use super::sequence::EngineSequence;
use super::step::verifies_from_picks;
use super::{
    verify_tree_greedy, verify_tree_picks, verify_tree_sampled, EngineError, FinishReason,
    SpecEngine, Target, TargetOutput, TreeVerdict,
};
use crate::backend::{DevicePtr, GpuBackend, GpuBackendExt, DEFAULT_STREAM};
use crate::model::ForwardContext;
use crate::speculative::{DraftProposer, DraftTree};
use crate::Result;
use std::time::{Duration, Instant};

/// What shape of drafts the engine asks of a proposer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftShape {
    /// `propose_tree` where the step allows it (a target that verifies trees, a sequence
    /// proposing on its own); a proposer that grows no tree returns its chain, verified as
    /// before.
    #[default]
    Tree,
    /// `propose` always: one chain per sequence.
    Chain,
}

impl DraftShape {
    /// The shape named `"tree"` or `"chain"`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "tree" => Some(DraftShape::Tree),
            "chain" => Some(DraftShape::Chain),
            _ => None,
        }
    }

    /// Its name, as [`DraftShape::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            DraftShape::Tree => "tree",
            DraftShape::Chain => "chain",
        }
    }
}

impl<T: Target> SpecEngine<T> {
    /// `propose_tree` for `seq` with a budget of `budget` nodes; its tree (or chain) becomes
    /// the sequence's drafts.
    pub(super) fn propose_tree_one(
        &self,
        prop: &dyn DraftProposer,
        seq: &mut EngineSequence<T::KvSequence>,
        budget: usize,
        ctx: &ForwardContext<'_>,
    ) {
        let tree = self.run_lone(seq, ctx, |x, state| {
            prop.propose_tree(
                x.last,
                x.hidden,
                x.position,
                budget,
                state,
                ctx,
                DEFAULT_STREAM,
                None,
                x.mask,
                x.stack,
            )
        });
        if let Some(tree) = tree {
            self.take_tree(seq, tree, budget, "propose_tree");
        }
    }

    /// One `propose_tree_batch` call for `group` (equal budgets); false when the caller
    /// should propose per sequence instead (see [`SpecEngine::run_group`]).
    pub(super) fn propose_tree_group(
        &self,
        prop: &dyn DraftProposer,
        group: &[usize],
        budgets: &[usize],
        seqs: &mut [EngineSequence<T::KvSequence>],
        ctx: &ForwardContext<'_>,
    ) -> bool {
        let budget = group.iter().map(|&i| budgets[i]).max().unwrap_or(0);
        let answers = self.run_group(group, seqs, ctx, |x, states, ctx| {
            prop.propose_tree_batch(
                &x.last,
                &x.hiddens,
                &x.positions,
                budget,
                states,
                ctx,
                DEFAULT_STREAM,
            )
        });
        let Some(trees) = answers else {
            return false;
        };
        for (&i, tree) in group.iter().zip(trees) {
            self.take_tree(&mut seqs[i], tree, budgets[i], "propose_tree_batch");
        }
        true
    }

    /// Checks a proposer's tree against the protocol (a fault ends the sequence) and makes
    /// it the sequence's drafts: its nodes, and the tree itself where it branches.
    fn take_tree(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        tree: DraftTree,
        budget: usize,
        method: &'static str,
    ) {
        if let Some(fault) = tree.fault(budget, self.target.config().vocab_size) {
            return seq.fail(
                EngineError::ProposerContract {
                    method,
                    message: format!("returned a tree with {fault}"),
                }
                .into(),
            );
        }
        // A branching tree stays a tree to the proposer even when the policy cuts it to a
        // chain: its state (the MTP head's branch KV) is indexed by its own nodes.
        let branched = !tree.is_chain();
        let (tree, nodes) = self.draft_policy.trim_tree(&mut seq.draft_stats, tree);
        seq.drafts = tree.tokens.clone();
        if branched {
            seq.tree = Some(tree);
            seq.tree_nodes = nodes;
        }
    }

    /// Each sequence of `chunk`'s row parents for [`Target::forward_tree`]: row `k + 1` is
    /// node `k`, whose parent row is its parent node's, or row 0; `None` for a chain.
    pub(super) fn tree_parents(
        &self,
        chunk: &[usize],
        seqs: &[EngineSequence<T::KvSequence>],
    ) -> Vec<Option<Vec<usize>>> {
        chunk
            .iter()
            .map(|&i| {
                seqs[i]
                    .tree
                    .as_ref()
                    .map(|t| t.parents.iter().map(|p| p.map_or(0, |p| p + 1)).collect())
            })
            .collect()
    }

    /// The verify forward of `kvs` over `tokens`, with the tree mask where `parents` (see
    /// [`SpecEngine::tree_parents`]) names a tree.
    pub(super) fn forward_trees(
        &self,
        parents: &[Option<Vec<usize>>],
        kvs: &mut [&mut T::KvSequence],
        tokens: &[&[u32]],
    ) -> Result<TargetOutput> {
        let trees: Vec<Option<&[usize]>> = parents.iter().map(|p| p.as_deref()).collect();
        let out = self
            .target
            .forward_tree(kvs, tokens, &trees, &self.capture_layers)?;
        if self.captures() && out.hidden_stack.is_none() {
            return Err(EngineError::TargetOutput(format!(
                "no hidden stack for the {} capture layers asked",
                self.capture_layers.len()
            ))
            .into());
        }
        Ok(out)
    }

    /// Verification of `seq`'s tree against its verify rows `offset..offset + rows` of
    /// `out` (the verdict `ready` when the host made it already), then the path's compaction
    /// and bookkeeping. Returns the time spent in the proposer.
    pub(super) fn verify_tree_one(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        out: &TargetOutput,
        offset: usize,
        rows: usize,
        picks: Option<&[u32]>,
        ready: Option<TreeVerdict>,
    ) -> Result<Duration> {
        let gpu = self.target.gpu();
        let vocab = self.target.config().vocab_size;
        let hb = self.row_bytes();
        let Some(tree) = seq.tree.take() else {
            return Err(EngineError::TargetOutput("no draft tree to verify".into()).into());
        };
        let t = Instant::now();
        if !seq.hidden_rows.is_null() {
            gpu.copy_dtod(
                seq.hidden_rows,
                out.hiddens.offset(offset * hb),
                rows * hb,
                DEFAULT_STREAM,
            )?;
        }
        let stack_base = self.keep_stack_rows(seq, out, offset, rows)?;
        let verdict = match (ready, picks) {
            (Some(verdict), _) => verdict,
            (None, Some(picks)) => verify_tree_picks(picks, &tree, vocab)?,
            (None, None) => {
                let logits =
                    gpu.download::<f32>(out.logits.offset(offset * vocab * 4), rows * vocab)?;
                let row_refs: Vec<&[f32]> = logits.chunks(vocab).collect();
                if verifies_from_picks(seq) {
                    verify_tree_greedy(&row_refs, &tree)?
                } else {
                    verify_tree_sampled(
                        &row_refs,
                        &tree,
                        &seq.sampling,
                        &mut seq.rng,
                        grammar_of(&mut seq.grammar),
                    )?
                }
            }
        };
        seq.metrics.verify_time += t.elapsed();
        self.apply_tree(seq, &tree, verdict, stack_base)
    }

    /// Emits a tree verdict's tokens, keeps the accepted path (see the module invariants)
    /// and tells the proposer how many of its nodes entered the sequence.
    fn apply_tree(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        tree: &DraftTree,
        verdict: TreeVerdict,
        stack_base: usize,
    ) -> Result<Duration> {
        let last_pos = seq.last_pos();
        let eos = &self.target.config().eos_token_ids;
        let kept = seq.emit(&verdict.tokens, eos, self.target.max_seq_len());
        // As for a chain: nodes accepted past EOS or the length limit never enter.
        let a = verdict.path.len().min(kept);
        let path = &verdict.path[..a];
        let request = seq.request;
        let kv_rows: Vec<usize> = path.iter().map(|&i| last_pos + 1 + i).collect();
        self.target
            .compact(seq.kv_mut()?, last_pos + 1, &kv_rows)
            .map_err(|e| EngineError::at(request, Stage::Trim, e))?;
        let gpu = self.target.gpu().as_ref();
        if !seq.hidden_rows.is_null() {
            compact_rows(gpu, seq.hidden_rows, self.row_bytes(), path)?;
        }
        if !seq.stack.ptr.is_null() {
            let sb = self.stack_row_bytes();
            compact_rows(gpu, seq.stack.ptr.offset(stack_base * sb), sb, path)?;
        }
        let mut proposer_time = Duration::ZERO;
        if let (true, Some(prop), Some(state)) =
            (seq.proposed, &self.proposer, seq.state.as_deref_mut())
        {
            // In the proposer's own node indices, where the policy cut nodes.
            let own: Vec<usize> = match seq.tree_nodes.take() {
                Some(nodes) => path.iter().map(|&i| nodes[i]).collect(),
                None => path.to_vec(),
            };
            let t = Instant::now();
            let r = prop.after_verify_tree(&own, state, DEFAULT_STREAM);
            proposer_time = t.elapsed();
            seq.metrics.draft_time += proposer_time;
            r.map_err(|e| EngineError::at(request, Stage::AfterVerify, e))?;
        }
        seq.drafts = path.iter().map(|&i| tree.tokens[i]).collect();
        seq.draft_stats.tree_path = Some(path.to_vec());
        seq.catchup_pos = last_pos + 1;
        seq.metrics
            .record_step(tree.len(), verdict.path.len(), kept);
        if verdict.grammar_exhausted && seq.active() {
            seq.finish = Some(FinishReason::Grammar);
        }
        seq.hidden_row = a;
        seq.stack.len = stack_base + a + 1;
        Ok(proposer_time)
    }
}

/// Moves rows `1 + path[k]` of `base` (rows `row_bytes` apart) to rows `1 + k`, in order:
/// `path` increases and `path[k] >= k`, so no row is overwritten before it is read.
fn compact_rows(
    gpu: &dyn GpuBackend,
    base: DevicePtr,
    row_bytes: usize,
    path: &[usize],
) -> Result<()> {
    for (k, &node) in path.iter().enumerate().filter(|(k, &n)| n != *k) {
        gpu.copy_dtod(
            base.offset((1 + k) * row_bytes),
            base.offset((1 + node) * row_bytes),
            row_bytes,
            DEFAULT_STREAM,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::DraftShape;
    use crate::speculative::DraftTree;

    #[test]
    fn a_chain_is_told_from_a_tree_and_shapes_parse() {
        assert!(DraftTree::chain(vec![4, 5, 6]).is_chain());
        assert!(DraftTree::default().is_chain());
        let fork = DraftTree {
            tokens: vec![4, 5],
            parents: vec![None, None],
            probs: None,
        };
        assert!(!fork.is_chain());
        assert_eq!(fork.accepted_path(&[5, 1]), [1]);
        assert_eq!(DraftShape::parse("tree"), Some(DraftShape::Tree));
        assert_eq!(
            DraftShape::parse(DraftShape::Chain.name()),
            Some(DraftShape::Chain)
        );
        assert_eq!(DraftShape::parse("bush"), None);
    }
}
