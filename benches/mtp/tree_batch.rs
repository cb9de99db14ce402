//! What growing trees together saves: `BATCH` sequences at the same point of the real
//! default model's context, each growing an EAGLE-2 tree of `BUDGET` nodes with the shipped
//! head, one by one (`propose_tree` each) against one `propose_tree_batch`, and, for
//! reference, one `propose_batch` of `BUDGET` chained drafts each; timed interleaved in the
//! same rounds (medians and minimums), every call settled by a verify that accepts nothing,
//! so each round starts from the same state. One JSON line, `mtp_tree_batch`.

use super::step_cost::{stats, timed, Cycle};
use specdraft::speculative::{DraftProposer, MtpHead, ProposerState};

const BATCH: usize = 4;
const BUDGET: usize = 8;

/// Runs the comparison for `head` over `c`'s context and prints its line.
pub fn run(head: &MtpHead, c: &Cycle<'_>, target_step: f64, rounds: usize) {
    let gpu = c.ctx.gpu.as_ref();
    let row_bytes = c.ctx.config.hidden_size * 2;
    let pos = c.tokens.len() - 1;
    let (token, hidden) = (c.tokens[pos], c.hiddens.offset((pos - 1) * row_bytes));
    let mut states: Vec<_> = (0..BATCH)
        .map(|_| head.alloc_state_for(gpu, 512).expect("state"))
        .collect();
    for st in states.iter_mut() {
        head.prefill_drafter(&c.tokens[..pos], c.hiddens, &mut **st, c.ctx, 0)
            .expect("drafter prefill");
    }
    let mut nodes = 0;
    let (mut alone, mut together, mut chains) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        alone.push(timed(|| {
            for st in states.iter_mut() {
                let tree = head
                    .propose_tree(
                        token, hidden, pos, BUDGET, &mut **st, c.ctx, 0, None, None, None,
                    )
                    .expect("propose_tree");
                nodes = tree.len();
                head.after_verify_tree(&[], &mut **st, 0)
                    .expect("after_verify_tree");
            }
        }));
        let mut batch: Vec<&mut dyn ProposerState> = states
            .iter_mut()
            .map(|s| -> &mut dyn ProposerState { &mut **s })
            .collect();
        together.push(timed(|| {
            head.propose_tree_batch(
                &[token; BATCH],
                &[hidden; BATCH],
                &[pos; BATCH],
                BUDGET,
                &mut batch,
                c.ctx,
                0,
            )
            .expect("propose_tree_batch")
            .expect("the head batches trees");
            for st in batch.iter_mut() {
                head.after_verify_tree(&[], &mut **st, 0)
                    .expect("after_verify_tree");
            }
        }));
        chains.push(timed(|| {
            head.propose_batch(
                &[token; BATCH],
                &[hidden; BATCH],
                &[pos; BATCH],
                BUDGET,
                &mut batch,
                c.ctx,
                0,
                None,
            )
            .expect("propose_batch");
            for st in batch.iter_mut() {
                head.after_verify(0, &mut **st, 0).expect("after_verify");
            }
        }));
    }
    let wall =
        |v: &[super::step_cost::Sample]| stats(&mut v.iter().map(|s| s.wall).collect::<Vec<_>>());
    let (a, t, ch) = (wall(&alone), wall(&together), wall(&chains));
    println!(
        "{}",
        serde_json::json!({
            "bench": "mtp_tree_batch", "backend": gpu.name(), "batch": BATCH,
            "budget": BUDGET, "nodes_per_tree": nodes, "rounds": rounds,
            "target_step_ms": target_step * 1e3,
            "trees_one_by_one_ms": a.0 * 1e3, "tree_batch_ms": t.0 * 1e3,
            "chain_batch_ms": ch.0 * 1e3,
            "tree_batch_vs_one_by_one": t.0 / a.0,
            "min_tree_batch_vs_one_by_one": t.1 / a.1,
            "tree_batch_vs_chain_batch": t.0 / ch.0,
            "tree_batch_vs_target_step": t.0 / target_step,
        })
    );
    for mut st in states {
        head.free_state(gpu, &mut *st).expect("free state");
    }
}
