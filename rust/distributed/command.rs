//! The commands rank 0 sends its workers, and their byte form on the broadcast channel.
//!
//! Layout: one tag byte, then the variant's fields in order, little-endian (`u64` sequence
//! ids, `u32` counts and token ids, a token list as its `u32` length then its ids). A
//! decode consumes exactly every byte or fails naming what was wrong: a worker that
//! misreads a command would run a different forward from rank 0, so nothing is guessed.

use super::error::DistributedError;

/// One step rank 0 asks every worker to run with it, so all ranks join the same
/// collectives in the same order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// The target's prefill of `tokens` for sequence `seq`.
    Prefill {
        /// The sequence.
        seq: u64,
        /// The prompt tokens to prefill.
        tokens: Vec<u32>,
    },
    /// The target's verify forward over `tokens` (the last token then the drafts).
    Verify {
        /// The sequence.
        seq: u64,
        /// The tokens the forward runs over.
        tokens: Vec<u32>,
    },
    /// One propose of a proposer whose block is sharded (the seed's `EP_CMD_MTP_PROPOSE`).
    MtpPropose {
        /// The sequence.
        seq: u64,
        /// Draft tokens asked for.
        num_drafts: u32,
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

impl Command {
    /// The command's name, as messages and the Python dict form use it.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Prefill { .. } => "prefill",
            Command::Verify { .. } => "verify",
            Command::MtpPropose { .. } => "mtp_propose",
            Command::Free { .. } => "free",
            Command::Shutdown => "shutdown",
        }
    }

    /// The byte form sent over the broadcast channel.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Command::Prefill { seq, tokens } | Command::Verify { seq, tokens } => {
                let tag = if matches!(self, Command::Prefill { .. }) {
                    TAG_PREFILL
                } else {
                    TAG_VERIFY
                };
                out.push(tag);
                out.extend_from_slice(&seq.to_le_bytes());
                // A token list longer than u32::MAX ids cannot exist in a context window.
                out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                for t in tokens {
                    out.extend_from_slice(&t.to_le_bytes());
                }
            }
            Command::MtpPropose { seq, num_drafts } => {
                out.push(TAG_MTP_PROPOSE);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&num_drafts.to_le_bytes());
            }
            Command::Free { seq } => {
                out.push(TAG_FREE);
                out.extend_from_slice(&seq.to_le_bytes());
            }
            Command::Shutdown => out.push(TAG_SHUTDOWN),
        }
        out
    }

    /// The command `bytes` encode; `rank` is the decoding rank, named in the error.
    pub fn decode(bytes: &[u8], rank: usize) -> Result<Command, DistributedError> {
        let bad = |reason: String| DistributedError::BadCommand {
            rank,
            len: bytes.len(),
            reason,
        };
        let mut r = Reader { bytes, at: 0 };
        let tag = r.u8().ok_or_else(|| bad("empty: no tag byte".into()))?;
        let cmd = match tag {
            TAG_PREFILL | TAG_VERIFY => {
                let seq = r.u64().ok_or_else(|| bad("truncated sequence id".into()))?;
                let n = r.u32().ok_or_else(|| bad("truncated token count".into()))? as usize;
                if r.left() != n.saturating_mul(4) {
                    return Err(bad(format!(
                        "{n} tokens need {} bytes after the count, {} are there",
                        n.saturating_mul(4),
                        r.left()
                    )));
                }
                let tokens = (0..n).filter_map(|_| r.u32()).collect();
                if tag == TAG_PREFILL {
                    Command::Prefill { seq, tokens }
                } else {
                    Command::Verify { seq, tokens }
                }
            }
            TAG_MTP_PROPOSE => {
                let seq = r.u64().ok_or_else(|| bad("truncated sequence id".into()))?;
                let num_drafts = r.u32().ok_or_else(|| bad("truncated draft count".into()))?;
                Command::MtpPropose { seq, num_drafts }
            }
            TAG_FREE => Command::Free {
                seq: r.u64().ok_or_else(|| bad("truncated sequence id".into()))?,
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

/// A cursor over command bytes; each read is `None` past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let end = self.at.checked_add(N)?;
        let out = self.bytes.get(self.at..end)?.try_into().ok()?;
        self.at = end;
        Some(out)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }
}
