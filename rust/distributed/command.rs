//! The commands rank 0 sends its workers, and their byte form on the broadcast channel.
//!
//! Layout: one tag byte, then the variant's fields in order, little-endian (`u64` sequence
//! ids and lengths, `u32` counts, token ids and rows; a list as its `u32` length then its
//! items; a flag as one byte, 0 or 1; a batch as its length then each sequence's id and token list; an optional tree
//! as a 0/1 flag then its parent list). A
//! decode consumes exactly every byte or fails naming what was wrong: a worker that
//! misreads a command would run a different forward from rank 0, so nothing is guessed.

use super::error::DistributedError;
use super::wire::{Reader, Writer};

/// One sequence's new tokens in a batched forward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqTokens {
    /// The sequence (rank 0's id for it).
    pub seq: u64,
    /// The tokens appended to it.
    pub tokens: Vec<u32>,
}

/// One step rank 0 asks every worker to run with it, so all ranks join the same
/// collectives in the same order and keep the same KV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// The target's prefill forward over `batch` (logits for each sequence's last row
    /// only), capturing `layers`.
    Prefill {
        /// Each sequence's tokens, in the forward's order.
        batch: Vec<SeqTokens>,
        /// Decoder layers whose hiddens the forward captures.
        layers: Vec<u32>,
    },
    /// The target's verify forward over `batch` (logits for every row), capturing `layers`;
    /// `trees[i] = Some(parents)` makes sequence `i`'s rows a draft tree (empty `trees`:
    /// every sequence a chain).
    Verify {
        /// Each sequence's tokens, in the forward's order.
        batch: Vec<SeqTokens>,
        /// Decoder layers whose hiddens the forward captures.
        layers: Vec<u32>,
        /// Per sequence, the tree's parent list, or `None` for a chain.
        trees: Vec<Option<Vec<u32>>>,
    },
    /// One propose of a proposer whose block is sharded (the seed's `EP_CMD_MTP_PROPOSE`),
    /// with everything the call reads.
    MtpPropose {
        /// The proposer state (rank 0's id for it).
        state: u64,
        /// The last verified token.
        last_token: u32,
        /// Its position.
        position: u64,
        /// Draft tokens asked for.
        num_drafts: u32,
        /// The target's hidden row for the last token (BF16 bytes).
        hidden: Vec<u8>,
        /// The grammar's mask for the first draft, when there is one.
        grammar: Option<Vec<i32>>,
    },
    /// One `propose_batch` of a proposer whose block is sharded: every sequence of the
    /// call, in its order.
    MtpProposeBatch {
        /// Each sequence's proposer state.
        states: Vec<u64>,
        /// Each sequence's last verified token.
        last_tokens: Vec<u32>,
        /// Their positions.
        positions: Vec<u64>,
        /// Draft tokens asked of every sequence.
        num_drafts: u32,
        /// The target's hidden row of each last token, one after another (BF16 bytes).
        hidden: Vec<u8>,
        /// Whether the call reports its confidence in each draft.
        confidences: bool,
    },
    /// A sharded proposer allocates state `state` for a sequence of `budget` tokens.
    ProposerAlloc {
        /// The new state's id.
        state: u64,
        /// Tokens the sequence may reach (`u64::MAX`: unbounded).
        budget: u64,
    },
    /// A sharded proposer's `prefill_drafter` over the prompt.
    ProposerPrefill {
        /// The state.
        state: u64,
        /// The prompt's tokens.
        tokens: Vec<u32>,
        /// The target's hidden rows paired with them (BF16 bytes).
        hidden: Vec<u8>,
    },
    /// A sharded proposer's `after_verify`.
    ProposerAfterVerify {
        /// The state.
        state: u64,
        /// Drafts accepted.
        accepted: u32,
    },
    /// A sharded proposer's `catchup_drafter`.
    ProposerCatchup {
        /// The state.
        state: u64,
        /// The tokens caught up.
        tokens: Vec<u32>,
        /// The hidden rows paired with them (BF16 bytes).
        hidden: Vec<u8>,
        /// The drafter row the rows start at.
        row_base: u64,
        /// The position of the first token.
        pos_base: u64,
    },
    /// A sharded proposer frees state `state`.
    ProposerFree {
        /// The state.
        state: u64,
    },
    /// Sequence `seq` keeps its first `len` tokens (rejected drafts dropped).
    Trim {
        /// The sequence.
        seq: u64,
        /// Tokens kept.
        len: u64,
    },
    /// Sequence `seq`'s KV rows `rows` move to `start..` and the rest is dropped (a draft
    /// tree's accepted path).
    Compact {
        /// The sequence.
        seq: u64,
        /// First row the path moves to.
        start: u64,
        /// The path's rows, increasing.
        rows: Vec<u32>,
    },
    /// Sequence `seq` ended or was preempted: free its KV and state.
    Free {
        /// The sequence.
        seq: u64,
    },
    /// Rank 0 is closing: workers return from their loop.
    Shutdown,
}

const TAG_PREFILL: u8 = 1;
const TAG_VERIFY: u8 = 2;
const TAG_MTP_PROPOSE: u8 = 3;
const TAG_FREE: u8 = 4;
const TAG_SHUTDOWN: u8 = 5;
const TAG_TRIM: u8 = 6;
const TAG_COMPACT: u8 = 7;
const TAG_PROPOSER_ALLOC: u8 = 8;
const TAG_PROPOSER_PREFILL: u8 = 9;
const TAG_PROPOSER_AFTER_VERIFY: u8 = 10;
const TAG_PROPOSER_CATCHUP: u8 = 11;
const TAG_PROPOSER_FREE: u8 = 12;
const TAG_MTP_PROPOSE_BATCH: u8 = 13;

impl Command {
    /// The command's name, as messages and the Python dict form use it.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Prefill { .. } => "prefill",
            Command::Verify { .. } => "verify",
            Command::MtpPropose { .. } => "mtp_propose",
            Command::MtpProposeBatch { .. } => "mtp_propose_batch",
            Command::ProposerAlloc { .. } => "proposer_alloc",
            Command::ProposerPrefill { .. } => "proposer_prefill",
            Command::ProposerAfterVerify { .. } => "proposer_after_verify",
            Command::ProposerCatchup { .. } => "proposer_catchup",
            Command::ProposerFree { .. } => "proposer_free",
            Command::Trim { .. } => "trim",
            Command::Compact { .. } => "compact",
            Command::Free { .. } => "free",
            Command::Shutdown => "shutdown",
        }
    }

    /// The byte form sent over the broadcast channel.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::new());
        match self {
            Command::Prefill { batch, layers } => {
                w.u8(TAG_PREFILL);
                w.batch(batch);
                w.list(layers);
            }
            Command::Verify {
                batch,
                layers,
                trees,
            } => {
                w.u8(TAG_VERIFY);
                w.batch(batch);
                w.list(layers);
                w.len(trees.len());
                for tree in trees {
                    match tree {
                        None => w.u8(0),
                        Some(parents) => {
                            w.u8(1);
                            w.list(parents);
                        }
                    }
                }
            }
            Command::MtpPropose {
                state,
                last_token,
                position,
                num_drafts,
                hidden,
                grammar,
            } => {
                w.u8(TAG_MTP_PROPOSE);
                w.u64(*state);
                w.u32(*last_token);
                w.u64(*position);
                w.u32(*num_drafts);
                w.bytes(hidden);
                match grammar {
                    None => w.u8(0),
                    Some(mask) => {
                        w.u8(1);
                        w.len(mask.len());
                        mask.iter().for_each(|&m| w.u32(m as u32));
                    }
                }
            }
            Command::MtpProposeBatch {
                states,
                last_tokens,
                positions,
                num_drafts,
                hidden,
                confidences,
            } => {
                w.u8(TAG_MTP_PROPOSE_BATCH);
                w.list64(states);
                w.list(last_tokens);
                w.list64(positions);
                w.u32(*num_drafts);
                w.bytes(hidden);
                w.u8(u8::from(*confidences));
            }
            Command::ProposerAlloc { state, budget } => {
                w.u8(TAG_PROPOSER_ALLOC);
                w.u64(*state);
                w.u64(*budget);
            }
            Command::ProposerPrefill {
                state,
                tokens,
                hidden,
            } => {
                w.u8(TAG_PROPOSER_PREFILL);
                w.u64(*state);
                w.list(tokens);
                w.bytes(hidden);
            }
            Command::ProposerAfterVerify { state, accepted } => {
                w.u8(TAG_PROPOSER_AFTER_VERIFY);
                w.u64(*state);
                w.u32(*accepted);
            }
            Command::ProposerCatchup {
                state,
                tokens,
                hidden,
                row_base,
                pos_base,
            } => {
                w.u8(TAG_PROPOSER_CATCHUP);
                w.u64(*state);
                w.list(tokens);
                w.bytes(hidden);
                w.u64(*row_base);
                w.u64(*pos_base);
            }
            Command::ProposerFree { state } => {
                w.u8(TAG_PROPOSER_FREE);
                w.u64(*state);
            }
            Command::Trim { seq, len } => {
                w.u8(TAG_TRIM);
                w.u64(*seq);
                w.u64(*len);
            }
            Command::Compact { seq, start, rows } => {
                w.u8(TAG_COMPACT);
                w.u64(*seq);
                w.u64(*start);
                w.list(rows);
            }
            Command::Free { seq } => {
                w.u8(TAG_FREE);
                w.u64(*seq);
            }
            Command::Shutdown => w.u8(TAG_SHUTDOWN),
        }
        w.0
    }

    /// The command `bytes` encode; `rank` is the decoding rank, named in the error.
    pub fn decode(bytes: &[u8], rank: usize) -> Result<Command, DistributedError> {
        let bad = |reason: String| DistributedError::BadCommand {
            rank,
            len: bytes.len(),
            reason,
        };
        let mut r = Reader::new(bytes);
        let tag = r.u8().ok_or_else(|| bad("empty: no tag byte".into()))?;
        let cmd = match tag {
            TAG_PREFILL => Command::Prefill {
                batch: r.batch().map_err(bad)?,
                layers: r.list("layer").map_err(bad)?,
            },
            TAG_VERIFY => {
                let batch = r.batch().map_err(bad)?;
                let layers = r.list("layer").map_err(bad)?;
                let n = r.count("tree", 1).map_err(bad)?;
                let mut trees = Vec::with_capacity(n);
                for _ in 0..n {
                    trees.push(match r.u8() {
                        Some(0) => None,
                        Some(1) => Some(r.list("parent").map_err(bad)?),
                        Some(other) => return Err(bad(format!("tree flag {other} is not 0 or 1"))),
                        None => return Err(bad("truncated tree flag".into())),
                    });
                }
                Command::Verify {
                    batch,
                    layers,
                    trees,
                }
            }
            TAG_MTP_PROPOSE => Command::MtpPropose {
                state: r.seq().map_err(bad)?,
                last_token: r.u32().ok_or_else(|| bad("truncated last token".into()))?,
                position: r.u64().ok_or_else(|| bad("truncated position".into()))?,
                num_drafts: r.u32().ok_or_else(|| bad("truncated draft count".into()))?,
                hidden: r.bytes("hidden").map_err(bad)?,
                grammar: match r.u8() {
                    Some(0) => None,
                    Some(1) => Some(
                        r.list("mask word")
                            .map_err(bad)?
                            .into_iter()
                            .map(|m| m as i32)
                            .collect(),
                    ),
                    Some(other) => return Err(bad(format!("grammar flag {other} is not 0 or 1"))),
                    None => return Err(bad("truncated grammar flag".into())),
                },
            },
            TAG_MTP_PROPOSE_BATCH => Command::MtpProposeBatch {
                states: r.list64("state").map_err(bad)?,
                last_tokens: r.list("last token").map_err(bad)?,
                positions: r.list64("position").map_err(bad)?,
                num_drafts: r.u32().ok_or_else(|| bad("truncated draft count".into()))?,
                hidden: r.bytes("hidden").map_err(bad)?,
                confidences: match r.u8() {
                    Some(0) => false,
                    Some(1) => true,
                    Some(other) => {
                        return Err(bad(format!("confidence flag {other} is not 0 or 1")))
                    }
                    None => return Err(bad("truncated confidence flag".into())),
                },
            },
            TAG_PROPOSER_ALLOC => Command::ProposerAlloc {
                state: r.seq().map_err(bad)?,
                budget: r.u64().ok_or_else(|| bad("truncated budget".into()))?,
            },
            TAG_PROPOSER_PREFILL => Command::ProposerPrefill {
                state: r.seq().map_err(bad)?,
                tokens: r.list("token").map_err(bad)?,
                hidden: r.bytes("hidden").map_err(bad)?,
            },
            TAG_PROPOSER_AFTER_VERIFY => Command::ProposerAfterVerify {
                state: r.seq().map_err(bad)?,
                accepted: r
                    .u32()
                    .ok_or_else(|| bad("truncated accepted count".into()))?,
            },
            TAG_PROPOSER_CATCHUP => Command::ProposerCatchup {
                state: r.seq().map_err(bad)?,
                tokens: r.list("token").map_err(bad)?,
                hidden: r.bytes("hidden").map_err(bad)?,
                row_base: r.u64().ok_or_else(|| bad("truncated row base".into()))?,
                pos_base: r
                    .u64()
                    .ok_or_else(|| bad("truncated position base".into()))?,
            },
            TAG_PROPOSER_FREE => Command::ProposerFree {
                state: r.seq().map_err(bad)?,
            },
            TAG_TRIM => Command::Trim {
                seq: r.seq().map_err(bad)?,
                len: r.u64().ok_or_else(|| bad("truncated length".into()))?,
            },
            TAG_COMPACT => Command::Compact {
                seq: r.seq().map_err(bad)?,
                start: r.u64().ok_or_else(|| bad("truncated start row".into()))?,
                rows: r.list("row").map_err(bad)?,
            },
            TAG_FREE => Command::Free {
                seq: r.seq().map_err(bad)?,
            },
            TAG_SHUTDOWN => Command::Shutdown,
            other => return Err(bad(format!("unknown command tag {other}"))),
        };
        if r.left() != 0 {
            return Err(bad(format!(
                "{} trailing bytes after a {} command",
                r.left(),
                cmd.kind()
            )));
        }
        Ok(cmd)
    }
}
