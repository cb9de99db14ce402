//! Cost of one `propose` call through `dyn DraftProposer` for PromptLookup and
//! SuffixDecoding at several history lengths, against the linear scan PromptLookup used
//! before its index, printed as JSON.
//!
//! Run: `cargo bench --bench protocol`. Two cases per length: `no-match` (the last token
//! breaks the history's pattern, so nothing is drafted and a scan reads the whole history)
//! and `match` (the history repeats with period 1000 and the last token continues it, so
//! every proposer drafts). `suffix-decoding+shared` also holds the history as an earlier
//! output in the shared tree. The Python-side figures (a trivial Python proposer called
//! from Rust) come from `specdraft bench --protocol`.

#[path = "../tests/reference/ngram_scan.rs"]
mod ngram_scan;

use specdraft::backend::{CpuBackend, DevicePtr};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::{
    DraftProposer, PromptLookup, ProposerState, SuffixDecoding, SuffixState, DEFAULT_MAX_NGRAM,
    DEFAULT_MIN_NGRAM,
};
use std::sync::Arc;
use std::time::Instant;

const NUM_DRAFTS: usize = 4;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median microseconds per call of `f`, over 31 rounds of about 20 ms each.
fn time_us(mut f: impl FnMut() -> usize) -> f64 {
    let start = Instant::now();
    std::hint::black_box(f());
    let once = start.elapsed().as_secs_f64().max(1e-8);
    let per_round = ((0.02 / once) as usize).clamp(3, 5000);
    let samples = (0..31)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..per_round {
                std::hint::black_box(f());
            }
            start.elapsed().as_secs_f64() * 1e6 / per_round as f64
        })
        .collect();
    median(samples)
}

/// Microseconds per `propose` of `last` at the end of `history`; each call truncates back to
/// the same position and re-drafts, so the history length stays fixed. Also the drafts.
fn time_propose(
    proposer: &dyn DraftProposer,
    state: &mut dyn ProposerState,
    ctx: &ForwardContext<'_>,
    history: &[u32],
    last: u32,
) -> (f64, usize) {
    proposer
        .prefill_drafter(history, DevicePtr::NULL, state, ctx, 0)
        .expect("prefill");
    let mut propose = || {
        proposer
            .propose(
                last,
                DevicePtr::NULL,
                history.len(),
                NUM_DRAFTS,
                state,
                ctx,
                0,
                None,
                None,
                None,
            )
            .expect("propose")
            .len()
    };
    let drafted = propose();
    (time_us(&mut propose), drafted)
}

fn main() {
    let gpu = Arc::new(CpuBackend::new());
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(1)),
        Arc::new(ModelConfig::tiny(49152)),
        ModelLevers::default(),
    );
    let mut json = Vec::new();
    for history_len in [256usize, 4096, 65536] {
        let history: Vec<u32> = (0..history_len as u32).map(|i| (i * 7919) % 1000).collect();
        let cases = [
            ("no-match", history[history_len / 2]),
            ("match", (history_len as u32 * 7919) % 1000),
        ];
        for (case, last) in cases {
            let mut full = history.clone();
            full.push(last);
            let scan = time_us(|| {
                ngram_scan::linear_scan(
                    DEFAULT_MIN_NGRAM,
                    DEFAULT_MAX_NGRAM,
                    &full,
                    NUM_DRAFTS,
                    None,
                )
                .len()
            });
            let row = |name: &str, us: f64, drafted: usize, extra: String| {
                format!(
                    "{{\"proposer\": \"{name}\", \"case\": \"{case}\", \"history_tokens\": {history_len}, \"us_per_propose\": {us:.3}, \"linear_scan_us\": {scan:.3}, \"speedup_vs_linear_scan\": {:.1}, \"drafted\": {drafted}{extra}}}",
                    scan / us
                )
            };
            let lookup = PromptLookup::default();
            let mut state = lookup.alloc_state(&*gpu).expect("state");
            let (us, drafted) = time_propose(&lookup, &mut *state, &ctx, &history, last);
            json.push(row("prompt-lookup", us, drafted, String::new()));
            for shared in [false, true] {
                let suffix = SuffixDecoding::default();
                if shared {
                    suffix.remember_output(&history).expect("remember");
                }
                let mut state = suffix.alloc_state(&*gpu).expect("state");
                let (us, drafted) = time_propose(&suffix, &mut *state, &ctx, &history, last);
                let st = state.as_any().downcast_ref::<SuffixState>().expect("state");
                let tree = suffix.shared_tree().expect("shared tree");
                let extra = format!(
                    ", \"tree_nodes\": {}, \"tree_bytes\": {}, \"shared_nodes\": {}, \"shared_bytes\": {}",
                    st.tree_nodes(),
                    st.tree_bytes(),
                    tree.nodes,
                    tree.bytes
                );
                let name = if shared {
                    "suffix-decoding+shared"
                } else {
                    "suffix-decoding"
                };
                json.push(row(name, us, drafted, extra));
            }
        }
    }
    // Memory of a tree over text that never repeats (every suffix its own path).
    let random: Vec<u32> = (0..65536u64)
        .map(|i| ((i * 2654435761) >> 7) as u32 % 49152)
        .collect();
    let suffix = SuffixDecoding::default();
    let mut state = suffix.alloc_state(&*gpu).expect("state");
    let start = Instant::now();
    suffix
        .prefill_drafter(&random, DevicePtr::NULL, &mut *state, &ctx, 0)
        .expect("prefill");
    let build_ms = start.elapsed().as_secs_f64() * 1e3;
    let st = state.as_any().downcast_ref::<SuffixState>().expect("state");
    json.push(format!(
        "{{\"proposer\": \"suffix-decoding\", \"case\": \"tree over 65536 non-repeating tokens\", \"tree_nodes\": {}, \"tree_bytes\": {}, \"bytes_per_node\": {:.1}, \"build_ms\": {build_ms:.1}}}",
        st.tree_nodes(),
        st.tree_bytes(),
        st.tree_bytes() as f64 / st.tree_nodes() as f64
    ));
    println!("[\n  {}\n]", json.join(",\n  "));
}
