//! Test support, not part of the engine proper: `TableTarget`, a small deterministic target
//! model for tests, examples and benchmarks of the engine without model weights.
//!
//! The logits of the row for token `t` at position `p` (with `t1` the token before it) are
//! `table[t][v] + noise * h(t1, t, p, v)` for a fixed random table and a fixed hash `h`, so
//! they depend only on the sequence's own tokens (the target is causal and batch
//! independent, as a real model is up to rounding). A mostly table-driven argmax makes
//! greedy output repetitive enough for n-gram drafters to be accepted sometimes.
//!
//! Its hidden rows encode the row's token and position exactly (BF16 holds integers below
//! 256 exactly): see [`decode_hidden`]. Tests use this to check which hidden the engine
//! hands a proposer. It enforces the target contract strictly: a forward of more rows than
//! its arena's `max_rows`, past `max_seq_len`, with an id outside the vocabulary, or on a
//! freed sequence is an error (the same `ModelError::InvalidInput` the real model returns).
//!
//! It verifies draft trees as the real model does: a tree row's logits and hidden are those
//! of its own path (the prefix, its ancestors, itself) at its depth's position, its token
//! goes to the next KV row in row order, and `compact` moves the kept path's tokens down.
//!
//! With [`TableTarget::with_kv_blocks`] its sequences take blocks from a paged pool as the
//! real model's do (`ceil(len / block_size)` each, all or nothing per forward), so tests can
//! run the scheduler's admission and preemption against a pool they size.

mod forward;

use super::{EngineError, KvPoolStatus, Target, TargetOutput};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::{BlockAllocator, BufferArena};
use crate::model::ModelConfig;
use crate::model::ModelError;
use crate::Result;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One sequence of a [`TableTarget`]: the tokens in its "KV".
#[derive(Debug, Default)]
pub struct TableKv {
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    freed: bool,
}

impl TableKv {
    /// Tokens held.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// A deterministic table-driven target (see the module documentation).
pub struct TableTarget {
    config: Arc<ModelConfig>,
    gpu: Arc<dyn GpuBackend>,
    buffers: Arc<BufferArena>,
    max_seq_len: usize,
    table: Vec<f32>,
    noise: f32,
    seed: u64,
    logits: DevicePtr,
    hiddens: DevicePtr,
    /// Room for a pick a row ([`TargetOutput::picks`]), unless made without.
    picks: Option<DevicePtr>,
    /// Whether `forward_last` computes every row's logits, as a target without it does.
    all_logits: bool,
    forwards: AtomicUsize,
    live: AtomicUsize,
    peak: AtomicUsize,
    peak_rows: AtomicUsize,
    pool: Option<BlockAllocator>,
    /// The forward (counted by `forward_count`) whose KV blocks are refused, for tests.
    fail_blocks_at: AtomicUsize,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser: a cheap, well-spread hash.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}

/// A call that breaks the [`Target`] contract.
fn contract_broken(op: &'static str, message: String) -> crate::Error {
    ModelError::InvalidInput { op, message }.into()
}

/// The `(token, position)` a [`TableTarget`] hidden row encodes.
pub fn decode_hidden(row: &[f32]) -> (u32, usize) {
    let at = |i: usize| row.get(i).copied().unwrap_or(0.0) as usize;
    ((at(0) + 256 * at(1)) as u32, at(2) + 256 * at(3))
}

impl TableTarget {
    /// A target over `vocab_size` tokens holding `max_seq_len` tokens a sequence and at most
    /// `max_rows` rows a forward, with logits drawn from `seed`. `noise` (0 to 1) is how much
    /// the context beyond the current token moves the logits.
    pub fn new(
        gpu: Arc<dyn GpuBackend>,
        vocab_size: usize,
        max_seq_len: usize,
        max_rows: usize,
        seed: u64,
        noise: f32,
    ) -> Result<Self> {
        if vocab_size < 2 || max_seq_len < 2 || max_rows == 0 {
            return Err(EngineError::InvalidArgument {
                what: "TableTarget",
                message: format!("vocab_size {vocab_size} and max_seq_len {max_seq_len} must be at least 2, max_rows {max_rows} at least 1"),
            }
            .into());
        }
        let config = ModelConfig::tiny(vocab_size);
        let mut rng = SmallRng::seed_from_u64(seed);
        let table = (0..vocab_size * vocab_size)
            .map(|_| rng.random::<f32>() * 4.0)
            .collect();
        let logits = gpu.alloc(max_rows * vocab_size * 4, "table_target:logits")?;
        let rest = gpu
            .alloc(max_rows * config.hidden_size * 2, "table_target:hiddens")
            .and_then(|h| match gpu.alloc(max_rows * 4, "table_target:picks") {
                Ok(p) => Ok((h, p)),
                Err(e) => {
                    let _ = gpu.free(h);
                    Err(e)
                }
            });
        let (hiddens, picks) = match rest {
            Ok(both) => both,
            Err(e) => {
                let _ = gpu.free(logits);
                return Err(e.into());
            }
        };
        Ok(TableTarget {
            config: Arc::new(config),
            gpu,
            buffers: Arc::new(BufferArena::empty(max_rows)),
            max_seq_len,
            table,
            noise,
            seed,
            logits,
            hiddens,
            picks: Some(picks),
            all_logits: false,
            forwards: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            peak_rows: AtomicUsize::new(0),
            pool: None,
            fail_blocks_at: AtomicUsize::new(usize::MAX),
        })
    }

    /// The same target without room for picks ([`TargetOutput::picks`] is `None`), so the
    /// engine verifies greedy steps from downloaded logits, as for a target that has none.
    pub fn without_picks(mut self) -> Self {
        if let Some(p) = self.picks.take() {
            // Ours since `new`; freeing it only fails on a bug.
            let _ = self.gpu.free(p);
        }
        self
    }

    /// The same target with every row's logits from [`Target::forward_last`] too
    /// ([`TargetOutput::last_logits_only`] never set), as a target that keeps the default.
    pub fn with_all_logits(mut self) -> Self {
        self.all_logits = true;
        self
    }

    /// The same target with its KV in a pool of `num_blocks` blocks of `block_size` rows.
    pub fn with_kv_blocks(mut self, num_blocks: usize, block_size: usize) -> Result<Self> {
        self.pool = Some(BlockAllocator::new(num_blocks, block_size)?);
        Ok(self)
    }

    /// Makes the KV pool refuse, once, the blocks of forward number `forward` (as counted by
    /// [`TableTarget::forward_count`]; `usize::MAX`: none), as an exhausted pool would.
    pub fn fail_kv_blocks_at(&self, forward: usize) {
        self.fail_blocks_at.store(forward, Ordering::Relaxed);
    }

    /// Returns the blocks `seq` no longer needs for `len` tokens.
    fn shrink_blocks(&self, seq: &mut TableKv, len: usize) -> Result<()> {
        if let Some(pool) = &self.pool {
            let keep = pool.blocks_for(len);
            if seq.blocks.len() > keep {
                pool.free(&seq.blocks[keep..])?;
                seq.blocks.truncate(keep);
            }
        }
        Ok(())
    }

    /// Takes the blocks every sequence needs for its new tokens, all or nothing.
    fn grow_blocks(&self, seqs: &mut [&mut TableKv], tokens: &[&[u32]]) -> Result<()> {
        let Some(pool) = &self.pool else {
            return Ok(());
        };
        let need: Vec<usize> = seqs
            .iter()
            .zip(tokens)
            .map(|(s, t)| pool.blocks_for(s.tokens.len() + t.len()) - s.blocks.len())
            .collect();
        let total: usize = need.iter().sum();
        let now = self.forwards.load(Ordering::Relaxed);
        // One refusal: a failed forward does not count, so the next one has the same number.
        if self
            .fail_blocks_at
            .compare_exchange(now, usize::MAX, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            return Err(crate::memory::MemoryError::Exhausted {
                requested: total,
                free: 0,
                total: pool.num_blocks(),
            }
            .into());
        }
        let mut fresh = pool.alloc(total)?;
        for (seq, n) in seqs.iter_mut().zip(need) {
            seq.blocks.extend(fresh.drain(..n));
        }
        Ok(())
    }

    /// The same target with `eos` as its EOS ids.
    pub fn with_eos(mut self, eos: Vec<u32>) -> Self {
        let mut config = (*self.config).clone();
        config.eos_token_ids = eos;
        self.config = Arc::new(config);
        self
    }

    /// The logits row for the last token of `context` (at position `context.len() - 1`).
    pub fn logits_for(&self, context: &[u32]) -> Vec<f32> {
        let v = self.config.vocab_size;
        let Some(&t) = context.last() else {
            return vec![0.0; v];
        };
        let p = context.len() - 1;
        let t1 = if p > 0 { context[p - 1] as u64 + 1 } else { 0 };
        let base = mix(self.seed ^ mix(t1 << 40 ^ (t as u64) << 20 ^ p as u64));
        let row = &self.table[t as usize * v..(t as usize + 1) * v];
        row.iter()
            .enumerate()
            .map(|(i, &x)| {
                let h = (mix(base ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32;
                x + self.noise * 4.0 * h
            })
            .collect()
    }

    /// The hidden row for `token` at `position`, as f32.
    pub fn hidden_for(&self, token: u32, position: usize) -> Vec<f32> {
        let mut h: Vec<f32> = (0..self.config.hidden_size)
            .map(|i| ((token as usize * 31 + position * 7 + i) % 17) as f32 / 4.0)
            .collect();
        h[0] = (token % 256) as f32;
        h[1] = (token / 256) as f32;
        h[2] = (position % 256) as f32;
        h[3] = (position / 256) as f32;
        h
    }

    /// Forwards run so far.
    pub fn forward_count(&self) -> usize {
        self.forwards.load(Ordering::Relaxed)
    }

    /// The most sequences that were alive at once.
    pub fn peak_sequences(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// The most rows one forward carried.
    pub fn peak_forward_rows(&self) -> usize {
        self.peak_rows.load(Ordering::Relaxed)
    }

    /// The KV pool's blocks and how many are free, when it has one.
    pub fn kv_blocks(&self) -> Option<(usize, usize)> {
        self.pool.as_ref().map(|p| (p.num_blocks(), p.num_free()))
    }

    /// Sequences created and not yet freed.
    pub fn live_sequences(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

impl Drop for TableTarget {
    fn drop(&mut self) {
        // Drop cannot report; the buffers are ours, so freeing them only fails on a bug.
        let _ = self.gpu.free(self.logits);
        let _ = self.gpu.free(self.hiddens);
        if let Some(p) = self.picks {
            let _ = self.gpu.free(p);
        }
    }
}

impl Target for TableTarget {
    type KvSequence = TableKv;

    fn config(&self) -> &Arc<ModelConfig> {
        &self.config
    }

    fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    fn new_sequence(&self) -> TableKv {
        let now = self.live.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(now, Ordering::Relaxed);
        TableKv::default()
    }

    fn seq_len(&self, seq: &TableKv) -> usize {
        seq.tokens.len()
    }

    fn forward(&self, seqs: &mut [&mut TableKv], tokens: &[&[u32]]) -> Result<TargetOutput> {
        self.run(seqs, tokens, false, None)
    }

    fn forward_last(&self, seqs: &mut [&mut TableKv], tokens: &[&[u32]]) -> Result<TargetOutput> {
        self.run(seqs, tokens, !self.all_logits, None)
    }

    fn supports_trees(&self) -> bool {
        true
    }

    fn forward_tree(
        &self,
        seqs: &mut [&mut TableKv],
        tokens: &[&[u32]],
        trees: &[Option<&[usize]>],
        layers: &[usize],
    ) -> Result<TargetOutput> {
        if !layers.is_empty() {
            return self.forward_capturing(seqs, tokens, false, layers);
        }
        if trees.len() != tokens.len() {
            return Err(contract_broken(
                "table_target.forward_tree",
                format!("{} trees for {} token lists", trees.len(), tokens.len()),
            ));
        }
        for (tree, toks) in trees.iter().zip(tokens) {
            let Some(parents) = tree else { continue };
            if parents.len() + 1 != toks.len() || parents.iter().enumerate().any(|(k, &p)| p > k) {
                return Err(contract_broken(
                    "table_target.forward_tree",
                    format!("parents {parents:?} for {} rows", toks.len()),
                ));
            }
        }
        self.run(seqs, tokens, false, Some(trees))
    }

    fn compact(&self, seq: &mut TableKv, start: usize, rows: &[usize]) -> Result<()> {
        let ok = rows
            .iter()
            .enumerate()
            .all(|(k, &r)| r >= start + k && r < seq.tokens.len() && (k == 0 || r > rows[k - 1]));
        if !ok {
            return Err(contract_broken(
                "table_target.compact",
                format!(
                    "rows {rows:?} to {start}.. of a sequence of {}",
                    seq.tokens.len()
                ),
            ));
        }
        for (k, &r) in rows.iter().enumerate() {
            seq.tokens[start + k] = seq.tokens[r];
        }
        self.trim(seq, start + rows.len())
    }

    fn trim(&self, seq: &mut TableKv, new_len: usize) -> Result<()> {
        if new_len > seq.tokens.len() {
            return Err(contract_broken(
                "table_target.trim",
                format!("trim to {new_len} of a sequence of {}", seq.tokens.len()),
            ));
        }
        seq.tokens.truncate(new_len);
        self.shrink_blocks(seq, new_len)
    }

    fn free_sequence(&self, seq: &mut TableKv) -> Result<()> {
        if seq.freed {
            return Err(contract_broken(
                "table_target.free_sequence",
                "sequence freed twice".into(),
            ));
        }
        seq.freed = true;
        seq.tokens.clear();
        self.live.fetch_sub(1, Ordering::Relaxed);
        self.shrink_blocks(seq, 0)
    }

    fn buffers(&self) -> &Arc<BufferArena> {
        &self.buffers
    }

    fn kv_pool(&self) -> Option<KvPoolStatus> {
        self.pool.as_ref().map(|p| KvPoolStatus {
            block_size: p.block_size(),
            num_blocks: p.num_blocks(),
            num_free: p.num_free(),
        })
    }
}
