//! `TableTarget`'s forward: checks a call as strictly as the real model does, grows the
//! sequences' KV (and blocks), and writes each row's logits and hidden from the table (a
//! tree row's from its own path).
//!
//! Invariant: a forward that its checks or the block grant refuse changes no sequence
//! (both come before any token is appended).

use super::super::TargetOutput;
use super::{contract_broken, TableKv, TableTarget};
use crate::backend::{GpuBackendExt, DEFAULT_STREAM};
use crate::Result;
use half::bf16;
use std::sync::atomic::Ordering;

impl TableTarget {
    /// A forward; with `last_only` the logits hold each sequence's last row only (as a
    /// target that skips the LM head on prefill rows does).
    pub(super) fn run(
        &self,
        seqs: &mut [&mut TableKv],
        tokens: &[&[u32]],
        last_only: bool,
        trees: Option<&[Option<&[usize]>]>,
    ) -> Result<TargetOutput> {
        if seqs.len() != tokens.len() {
            return Err(contract_broken(
                "table_target.forward",
                format!("{} sequences but {} token lists", seqs.len(), tokens.len()),
            ));
        }
        let rows: usize = tokens.iter().map(|t| t.len()).sum();
        if rows == 0 || rows > self.buffers.max_rows() {
            return Err(contract_broken(
                "table_target.forward",
                format!(
                    "forward of {rows} rows (1 to {} allowed)",
                    self.buffers.max_rows()
                ),
            ));
        }
        let v = self.config.vocab_size;
        let hidden = self.config.hidden_size;
        for (seq, toks) in seqs.iter().zip(tokens) {
            self.check_input(seq, toks)?;
        }
        self.grow_blocks(seqs, tokens)?;
        let mut logits = Vec::with_capacity(rows * v);
        let mut hiddens = Vec::with_capacity(rows * hidden);
        let mut row_offsets = Vec::with_capacity(seqs.len());
        for (i, (seq, toks)) in seqs.iter_mut().zip(tokens).enumerate() {
            row_offsets.push(hiddens.len() / hidden);
            let prefix = seq.tokens.len();
            let parents = trees.and_then(|t| t[i]);
            for (k, &t) in toks.iter().enumerate() {
                seq.tokens.push(t);
                // The row's own path: the prefix, then its ancestors' tokens and its own.
                let on_path: Vec<u32>;
                let context: &[u32] = match parents {
                    Some(parents) if k > 0 => {
                        let mut path = vec![t];
                        let mut at = parents[k - 1];
                        while at > 0 {
                            path.push(toks[at]);
                            at = parents[at - 1];
                        }
                        path.push(toks[0]);
                        path.reverse();
                        on_path = [&seq.tokens[..prefix], &path[..]].concat();
                        &on_path
                    }
                    _ => &seq.tokens,
                };
                if !last_only || k + 1 == toks.len() {
                    logits.extend(self.logits_for(context));
                }
                hiddens.extend(
                    self.hidden_for(t, context.len() - 1)
                        .into_iter()
                        .map(bf16::from_f32),
                );
            }
        }
        self.gpu.write(self.logits, &logits, DEFAULT_STREAM)?;
        self.gpu.write(self.hiddens, &hiddens, DEFAULT_STREAM)?;
        self.forwards.fetch_add(1, Ordering::Relaxed);
        self.peak_rows.fetch_max(rows, Ordering::Relaxed);
        Ok(TargetOutput {
            rows,
            row_offsets,
            logits: self.logits,
            last_logits_only: last_only,
            hiddens: self.hiddens,
            hidden_stack: None,
            picks: self.picks,
        })
    }

    /// Refuses a forward input that breaks the target contract.
    fn check_input(&self, seq: &TableKv, toks: &[u32]) -> Result<()> {
        let v = self.config.vocab_size;
        if seq.freed {
            return Err(contract_broken(
                "table_target.forward",
                "forward on a freed sequence".into(),
            ));
        }
        if seq.tokens.len() + toks.len() > self.max_seq_len {
            return Err(contract_broken(
                "table_target.forward",
                format!(
                    "sequence of {} tokens plus {} exceeds max_seq_len {}",
                    seq.tokens.len(),
                    toks.len(),
                    self.max_seq_len
                ),
            ));
        }
        if let Some(&t) = toks.iter().find(|&&t| t as usize >= v) {
            return Err(contract_broken(
                "table_target.forward",
                format!("token {t} outside the vocabulary of {v}"),
            ));
        }
        Ok(())
    }
}
