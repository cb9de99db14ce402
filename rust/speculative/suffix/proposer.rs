//! `SuffixDecoding` and its per-sequence state: the `DraftProposer` methods.

use super::draft::{best_chain, Chain, ChainLimits};
use super::shared::{SharedOutputs, SharedTreeStats};
use super::trie::{Cursor, SuffixTrie, MAX_NODES};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::speculative::{bitmask_allows, DraftProposer, ProposerError, ProposerState};
use crate::Result;
use std::sync::{Mutex, MutexGuard};

/// Strings of up to 24 tokens: vLLM's default tree depth for suffix decoding. The depth
/// bounds the matched suffix plus the drafts after it, and this trie spends up to one node
/// per stored token and depth, so a deeper tree costs memory for matches rarely that long:
/// over 65536 tokens that never repeat, a sequence's own tree holds 1.55M nodes, 90 MB
/// (`cargo bench --bench protocol`); text that repeats costs far less.
pub const DEFAULT_MAX_DEPTH: usize = 24;
/// Stop a chain before a draft reached with probability under 0.1 (vLLM's default).
pub const DEFAULT_MIN_TOKEN_PROB: f32 = 0.1;
/// A match of `L` tokens drafts at most `L` tokens (vLLM's default factor).
pub const DEFAULT_MAX_SPEC_FACTOR: f32 = 1.0;
/// About a million nodes in the shared tree: about 60 MB at the 58 bytes a node that
/// `cargo bench --bench protocol` measures, or some 50,000 output tokens of text that
/// repeats little.
pub const DEFAULT_MAX_TREE_NODES: usize = 1 << 20;

/// The knobs of [`SuffixDecoding`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SuffixDecodingOptions {
    /// Longest string the trees keep (2..=4096): the matched suffix plus its drafts.
    pub max_depth: usize,
    /// A draft is proposed only while the estimated probability of reaching it (the product
    /// of its continuation frequencies so far) is at least this (0..=1).
    pub min_token_prob: f32,
    /// A match of `L` tokens drafts at most `floor(L * max_spec_factor)` tokens (>= 0).
    pub max_spec_factor: f32,
    /// The shared tree's bound, in nodes and in stored output tokens; the oldest outputs are
    /// evicted beyond it. 0 keeps no outputs (each sequence drafts from its own history).
    pub max_tree_nodes: usize,
}

impl Default for SuffixDecodingOptions {
    fn default() -> Self {
        SuffixDecodingOptions {
            max_depth: DEFAULT_MAX_DEPTH,
            min_token_prob: DEFAULT_MIN_TOKEN_PROB,
            max_spec_factor: DEFAULT_MAX_SPEC_FACTOR,
            max_tree_nodes: DEFAULT_MAX_TREE_NODES,
        }
    }
}

/// Drafting from suffix trees over the sequence's own prompt and output and over the
/// outputs of earlier sequences (see the module documentation).
#[derive(Debug)]
pub struct SuffixDecoding {
    options: SuffixDecodingOptions,
    shared: Mutex<SharedOutputs>,
}

impl Default for SuffixDecoding {
    fn default() -> Self {
        let options = SuffixDecodingOptions::default();
        SuffixDecoding {
            shared: Mutex::new(SharedOutputs::new(
                options.max_depth,
                options.max_tree_nodes,
            )),
            options,
        }
    }
}

/// Per-sequence state of [`SuffixDecoding`]: the history and its own suffix tree.
#[derive(Debug, Clone)]
pub struct SuffixState {
    tokens: Vec<u32>,
    /// Tokens of `tokens` that came with the prompt; the rest is the sequence's output.
    prompt_len: usize,
    trie: SuffixTrie,
    /// `cursors[i]`: the cursor of the first `i` tokens, so taking a token back needs no
    /// search.
    cursors: Vec<Cursor>,
    pending: Vec<u32>,
}

crate::impl_proposer_state!(SuffixState);

impl SuffixState {
    /// Prompt and verified tokens, in sequence order.
    pub fn history(&self) -> &[u32] {
        &self.tokens
    }

    /// Nodes of this sequence's own suffix tree.
    pub fn tree_nodes(&self) -> usize {
        self.trie.live_nodes()
    }

    /// Bytes held by this sequence's tree and history (capacities).
    pub fn tree_bytes(&self) -> usize {
        self.trie.memory_bytes()
            + self.tokens.capacity() * 4
            + self.cursors.capacity() * std::mem::size_of::<Cursor>()
    }

    /// The drafts of the last propose, until `after_verify` says how many were kept.
    pub fn pending(&self) -> &[u32] {
        &self.pending
    }

    fn cursor(&self) -> Cursor {
        self.cursors.last().copied().unwrap_or(Cursor::START)
    }

    fn push(&mut self, token: u32) {
        let next = self.trie.append(self.cursor(), token);
        self.cursors.push(next);
        self.tokens.push(token);
    }

    fn truncate(&mut self, len: usize) {
        while self.tokens.len() > len {
            let (Some(t), Some(_)) = (self.tokens.pop(), self.cursors.pop()) else {
                break;
            };
            self.trie.pop(self.cursor(), t);
        }
        self.prompt_len = self.prompt_len.min(len);
    }

    fn clear(&mut self) {
        self.tokens.clear();
        self.prompt_len = 0;
        self.trie.clear();
        self.cursors.clear();
        self.pending.clear();
    }
}

fn state_of<'s>(
    state: &'s mut dyn ProposerState,
    method: &'static str,
) -> Result<&'s mut SuffixState> {
    state
        .as_any_mut()
        .downcast_mut::<SuffixState>()
        .ok_or_else(|| {
            ProposerError::WrongState {
                method,
                expected: "SuffixState",
            }
            .into()
        })
}

fn invalid(method: &'static str, message: String) -> ProposerError {
    ProposerError::InvalidArgument { method, message }
}

impl SuffixDecoding {
    /// A proposer with `options`, checked: each out-of-range option is an error naming it.
    pub fn new(options: SuffixDecodingOptions) -> std::result::Result<Self, ProposerError> {
        const M: &str = "SuffixDecoding::new";
        let o = options;
        if !(2..=4096).contains(&o.max_depth) {
            return Err(invalid(
                M,
                format!("max_depth must be in 2..=4096, got {}", o.max_depth),
            ));
        }
        if !(0.0..=1.0).contains(&o.min_token_prob) {
            return Err(invalid(
                M,
                format!("min_token_prob must be in [0, 1], got {}", o.min_token_prob),
            ));
        }
        if !(o.max_spec_factor.is_finite() && o.max_spec_factor >= 0.0) {
            return Err(invalid(
                M,
                format!(
                    "max_spec_factor must be finite and >= 0, got {}",
                    o.max_spec_factor
                ),
            ));
        }
        let most = MAX_NODES - o.max_depth;
        if o.max_tree_nodes > most {
            return Err(invalid(
                M,
                format!(
                    "max_tree_nodes must be at most {most}, got {}",
                    o.max_tree_nodes
                ),
            ));
        }
        Ok(SuffixDecoding {
            shared: Mutex::new(SharedOutputs::new(o.max_depth, o.max_tree_nodes)),
            options,
        })
    }

    /// The options it was built with.
    pub fn options(&self) -> SuffixDecodingOptions {
        self.options
    }

    /// What the shared tree of earlier outputs holds now.
    pub fn shared_tree(&self) -> Result<SharedTreeStats> {
        Ok(self.lock("shared_tree")?.stats())
    }

    /// Adds `output` to the shared tree as if a sequence had just produced it (to seed the
    /// tree with text expected again). Evicts the oldest outputs beyond the bound.
    pub fn remember_output(&self, output: &[u32]) -> Result<()> {
        self.lock("remember_output")?.insert(output);
        Ok(())
    }

    fn lock(&self, method: &'static str) -> Result<MutexGuard<'_, SharedOutputs>> {
        self.shared.lock().map_err(|_| {
            ProposerError::Failed {
                method: method.into(),
                message: "the shared suffix tree is unusable: a thread panicked while updating it"
                    .into(),
            }
            .into()
        })
    }

    /// Prompt tokens stored before each output in the shared tree: half the tree's depth,
    /// so a match that long still leaves room for as many drafts.
    pub fn prompt_context(&self) -> usize {
        self.options.max_depth / 2
    }

    /// Longest history a sequence may have: its tree's node ids must stay below the limit.
    fn max_history(&self) -> usize {
        MAX_NODES / self.options.max_depth
    }

    fn check_room(&self, method: &'static str, len: usize) -> Result<()> {
        if len > self.max_history() {
            return Err(invalid(
                method,
                format!("a history of {len} tokens is longer than the {} a suffix tree of depth {} indexes", self.max_history(), self.options.max_depth),
            )
            .into());
        }
        Ok(())
    }

    fn limits(&self, num_drafts: usize) -> ChainLimits {
        ChainLimits {
            num_drafts,
            max_spec_factor: f64::from(self.options.max_spec_factor),
            min_token_prob: f64::from(self.options.min_token_prob),
        }
    }

    fn new_state(&self) -> SuffixState {
        SuffixState {
            tokens: Vec::new(),
            prompt_len: 0,
            trie: SuffixTrie::new(self.options.max_depth),
            cursors: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// Records `last_token` at `position` and drafts from the better of the sequence's own
    /// tree and the shared one (the shared one only when strictly better). Returns the drafts
    /// and each one's probability given those before it.
    #[allow(clippy::too_many_arguments)]
    fn propose_one(
        &self,
        last_token: u32,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        vocab_size: usize,
        mask: Option<&[i32]>,
        shared: &mut SharedOutputs,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        if last_token as usize >= vocab_size {
            return Err(ProposerError::TokenOutOfVocab {
                method: "propose",
                token: u64::from(last_token),
                vocab_size,
            }
            .into());
        }
        let st = state_of(state, "propose")?;
        // `position` is where `last_token` sits: anything at or after it is a leftover of an
        // earlier propose from this point.
        st.truncate(position);
        self.check_room("propose", st.tokens.len() + 1)?;
        st.push(last_token);
        st.pending.clear();
        if num_drafts == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let limits = self.limits(num_drafts);
        let cursor = st.cursor();
        let own = best_chain(&mut st.trie, cursor, &limits);
        let theirs = if shared.trie.live_nodes() == 0 {
            Chain::default()
        } else {
            let tail = st.tokens.len().saturating_sub(self.options.max_depth - 1);
            let at = shared.trie.longest_suffix(&st.tokens[tail..]);
            best_chain(&mut shared.trie, at, &limits)
        };
        let chain: Chain = if theirs.score > own.score {
            theirs
        } else {
            own
        };
        // Outputs stored by a sequence of another model may hold ids beyond this vocabulary.
        let keep = chain
            .tokens
            .iter()
            .take_while(|&&t| {
                (t as usize) < vocab_size && mask.is_none_or(|m| bitmask_allows(m, t))
            })
            .count();
        st.pending = chain.tokens[..keep].to_vec();
        let probs = chain.step_probs[..keep].iter().map(|&p| p as f32).collect();
        Ok((st.pending.clone(), probs))
    }
}

impl DraftProposer for SuffixDecoding {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(self.new_state()))
    }

    fn propose(
        &self,
        last_token: u32,
        _target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let mut shared = self.lock("propose")?;
        let (drafts, _) = self.propose_one(
            last_token,
            position,
            num_drafts,
            state,
            ctx.config.vocab_size,
            grammar_bitmask,
            &mut shared,
        )?;
        Ok(drafts)
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        let st = state_of(state, "after_verify")?;
        if num_accepted > st.pending.len() {
            return Err(invalid(
                "after_verify",
                format!(
                    "{num_accepted} accepted, but only {} drafts were proposed",
                    st.pending.len()
                ),
            )
            .into());
        }
        self.check_room("after_verify", st.tokens.len() + num_accepted)?;
        for t in std::mem::take(&mut st.pending)
            .into_iter()
            .take(num_accepted)
        {
            st.push(t);
        }
        Ok(())
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        _hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        let vocab_size = ctx.config.vocab_size;
        if let Some(&t) = prompt_tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ProposerError::TokenOutOfVocab {
                method: "prefill_drafter",
                token: u64::from(t),
                vocab_size,
            }
            .into());
        }
        self.check_room("prefill_drafter", prompt_tokens.len())?;
        let st = state_of(state, "prefill_drafter")?;
        st.clear();
        for &t in prompt_tokens {
            st.push(t);
        }
        st.prompt_len = prompt_tokens.len();
        // Host-side trees only: no drafter KV rows are written.
        Ok(0)
    }

    fn free_state(&self, _gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        let st = state_of(state, "free_state")?;
        // The sequence's output joins the shared tree only now, when it is final: while a
        // sequence runs, the drafts of every other sequence depend on nothing but finished
        // ones, so proposing twice from the same point gives the same drafts. The prompt's
        // last tokens go in before it, so the same prompt again matches at length from its
        // first generated token instead of from a one-token match.
        if st.tokens.len() > st.prompt_len {
            let from = st.prompt_len.saturating_sub(self.prompt_context());
            self.lock("free_state")?.insert(&st.tokens[from..]);
        }
        st.clear();
        Ok(())
    }

    fn propose_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        num_drafts: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        _stream: u64,
        out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let n = last_tokens.len();
        if target_hiddens.len() != n || positions.len() != n || states.len() != n {
            return Err(invalid(
                "propose_batch",
                format!(
                    "slices differ in length: {n} last_tokens, {} target_hiddens, {} positions, {} states",
                    target_hiddens.len(),
                    positions.len(),
                    states.len()
                ),
            )
            .into());
        }
        let mut shared = self.lock("propose_batch")?;
        let mut drafts = Vec::with_capacity(n);
        let mut confs = Vec::with_capacity(n);
        for i in 0..n {
            let (d, c) = self.propose_one(
                last_tokens[i],
                positions[i],
                num_drafts,
                &mut *states[i],
                ctx.config.vocab_size,
                None,
                &mut shared,
            )?;
            drafts.push(d);
            confs.push(c);
        }
        if let Some(out) = out_conf {
            *out = confs;
        }
        Ok(Some(drafts))
    }

    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        // Host-only work per sequence: no scratch limits the width.
        usize::MAX
    }
}
