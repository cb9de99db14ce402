//! Verification of drafts against the target's logits: greedy and lossless rejection
//! sampling. Pure functions on host f32 rows, so they are tested without any model.
//!
//! Invariants:
//! - Greedy: the emitted tokens are exactly what plain greedy decoding would pick: the
//!   longest prefix of drafts equal to the (masked) argmax of their rows, then the argmax of
//!   the first row that disagrees (or of the last row when all agree: the bonus token).
//! - Sampling (Leviathan et al. 2023, Chen et al. 2023): draft `x` at row `j` is accepted
//!   with probability `min(1, p(x) / q(x))`; on rejection the token is drawn from
//!   `norm(max(0, p - q))`; when every draft is accepted the bonus is drawn from the last
//!   row's `p`. `q` is the proposer's distribution, one-hot on the draft when it gives none.
//!   Every emitted token is therefore distributed exactly as plain sampling from `p`.
//! - With a grammar, `p` is masked before anything else and the matcher advances with every
//!   emitted token, so no emitted token is one the grammar forbade.

pub use crate::backend::argmax;

use super::draw::{sample_excluding, sample_from};
use super::target_probs;
use super::{EngineError, GrammarMatcher};
use crate::speculative::bitmask_words;
use crate::Result;
use rand::rngs::SmallRng;
use rand::Rng;

/// How the target's pick is made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability
    /// reaches `top_p` (`1` keeps all).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (`0` keeps all).
    pub top_k: usize,
    /// Seed of the sequence's random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }

    /// Sampling at `temperature` with `seed`, no truncation.
    pub fn sampled(temperature: f32, seed: u64) -> Self {
        SamplingParams {
            temperature,
            seed,
            ..SamplingParams::greedy()
        }
    }

    /// Whether the pick is the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks the ranges: temperature finite and `>= 0`, `0 < top_p <= 1`.
    pub fn validate(&self) -> std::result::Result<(), EngineError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(EngineError::InvalidArgument {
                what: "temperature",
                message: format!(
                    "{} (must be finite and >= 0; 0 means greedy)",
                    self.temperature
                ),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::InvalidArgument {
                what: "top_p",
                message: format!("{} (must be in (0, 1])", self.top_p),
            });
        }
        Ok(())
    }
}

/// The outcome of verifying one sequence's drafts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Drafts accepted (a prefix of the drafts).
    pub accepted: usize,
    /// Tokens to emit: the accepted drafts, then the target's own pick (the correction
    /// or the bonus token) unless the grammar allowed nothing at that point.
    pub tokens: Vec<u32>,
    /// The grammar allowed no token at the next position: the sequence cannot go on.
    pub grammar_exhausted: bool,
}

/// The mask `grammar` allows at its position, written into `mask` (cleared first); `None`
/// without a grammar.
pub(super) fn grammar_mask<'m>(
    grammar: Option<&mut (dyn GrammarMatcher + '_)>,
    mask: &'m mut [i32],
) -> Result<Option<&'m [i32]>> {
    let Some(g) = grammar else {
        return Ok(None);
    };
    mask.fill(0);
    g.fill_mask(mask)?;
    Ok(Some(mask))
}

/// Verifies `drafts` against `rows` (one f32 logits row per input token: the row of the
/// last verified token, then one per draft, so `rows.len() == drafts.len() + 1`).
///
/// `draft_probs[j]`, when given, is the proposer's distribution over the vocabulary at
/// draft `j` (`q`); without it `q` is one-hot on the draft. `grammar` is advanced with
/// every token in the verdict. Greedy parameters ignore `rng` and `draft_probs`.
pub fn verify(
    rows: &[&[f32]],
    drafts: &[u32],
    draft_probs: Option<&[Vec<f32>]>,
    params: &SamplingParams,
    rng: &mut SmallRng,
    mut grammar: Option<&mut dyn GrammarMatcher>,
) -> Result<Verdict> {
    if rows.len() != drafts.len() + 1 {
        return Err(EngineError::InvalidArgument {
            what: "verify rows",
            message: format!(
                "{} logits rows for {} drafts (need drafts + 1)",
                rows.len(),
                drafts.len()
            ),
        }
        .into());
    }
    let vocab = rows[0].len();
    if let Some(q) = draft_probs {
        if q.len() != drafts.len() || q.iter().any(|d| d.len() != vocab) {
            return Err(EngineError::InvalidArgument {
                what: "draft_probs",
                message: format!("need {} rows of {vocab} probabilities", drafts.len()),
            }
            .into());
        }
    }
    let mut mask = vec![0i32; bitmask_words(vocab)];
    let mut verdict = Verdict {
        accepted: 0,
        tokens: Vec::with_capacity(drafts.len() + 1),
        grammar_exhausted: false,
    };
    for (j, row) in rows.iter().enumerate() {
        if row.len() != vocab {
            return Err(EngineError::InvalidArgument {
                what: "verify rows",
                message: format!("row {j} has {} logits, row 0 has {vocab}", row.len()),
            }
            .into());
        }
        let row_mask = grammar_mask(grammar.as_deref_mut(), &mut mask)?;
        let draft = drafts.get(j).copied();
        let (token, accepted) = if params.is_greedy() {
            let Some(pick) = argmax(row, row_mask) else {
                verdict.grammar_exhausted = true;
                return Ok(verdict);
            };
            (pick, draft == Some(pick))
        } else {
            let Some(p) = target_probs(row, params, row_mask) else {
                verdict.grammar_exhausted = true;
                return Ok(verdict);
            };
            match draft {
                None => (sample_from(&p, rng), false),
                Some(x) => {
                    let px = p.get(x as usize).copied().unwrap_or(0.0);
                    let q = draft_probs.map(|q| q[j].as_slice());
                    let qx = q.map_or(1.0, |q| q.get(x as usize).copied().unwrap_or(0.0));
                    // Always draw, so the random stream does not depend on the branch taken.
                    let u = rng.random::<f32>();
                    let accept = if qx <= 0.0 { px > 0.0 } else { u < px / qx };
                    if accept {
                        (x, true)
                    } else if let Some(q) = q {
                        let residual: Vec<f32> =
                            p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect();
                        let weights = if residual.iter().any(|&w| w > 0.0) {
                            &residual
                        } else {
                            &p
                        };
                        (sample_from(weights, rng), false)
                    } else {
                        // A one-hot `q`: the residual is `p` without the draft.
                        (sample_excluding(&p, &[x], rng), false)
                    }
                }
            }
        };
        if let Some(g) = grammar.as_deref_mut() {
            g.advance(token)?;
        }
        verdict.tokens.push(token);
        if !accepted {
            return Ok(verdict);
        }
        verdict.accepted += 1;
    }
    unreachable_last_row()
}

/// Greedy verification from each row's pick instead of its logits: `picks[j]` is the
/// argmax of row `j` ([`argmax`]), `u32::MAX` where the row has none (as the `argmax` kernel
/// writes), so `picks.len() == drafts.len() + 1`. The verdict is the one [`verify`] gives
/// greedy parameters without a grammar.
pub fn verify_picks(picks: &[u32], drafts: &[u32]) -> Result<Verdict> {
    if picks.len() != drafts.len() + 1 {
        return Err(EngineError::InvalidArgument {
            what: "verify picks",
            message: format!(
                "{} picks for {} drafts (need drafts + 1)",
                picks.len(),
                drafts.len()
            ),
        }
        .into());
    }
    let mut verdict = Verdict {
        accepted: 0,
        tokens: Vec::with_capacity(picks.len()),
        grammar_exhausted: false,
    };
    for (j, &pick) in picks.iter().enumerate() {
        if pick == u32::MAX {
            verdict.grammar_exhausted = true;
            break;
        }
        verdict.tokens.push(pick);
        if drafts.get(j) != Some(&pick) {
            break;
        }
        verdict.accepted += 1;
    }
    Ok(verdict)
}

// The last row has no draft, so the loop always returns from it; this keeps the compiler
// satisfied without a panic path.
fn unreachable_last_row() -> Result<Verdict> {
    Err(EngineError::InvalidArgument {
        what: "verify rows",
        message: "no logits rows".into(),
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rng() -> SmallRng {
        SmallRng::seed_from_u64(7)
    }

    #[test]
    fn greedy_accepts_longest_matching_prefix_then_corrects() {
        let rows: Vec<Vec<f32>> = vec![
            vec![0.0, 5.0, 0.0, 0.0], // picks 1
            vec![0.0, 0.0, 5.0, 0.0], // picks 2
            vec![5.0, 0.0, 0.0, 0.0], // picks 0
            vec![0.0, 0.0, 0.0, 5.0], // picks 3
        ];
        let r: Vec<&[f32]> = rows.iter().map(|v| v.as_slice()).collect();
        let g = SamplingParams::greedy();
        let v = verify(&r, &[1, 2, 3], None, &g, &mut rng(), None).unwrap();
        assert_eq!((v.accepted, v.tokens.clone()), (2, vec![1, 2, 0]));
        let v = verify(&r, &[1, 2, 0], None, &g, &mut rng(), None).unwrap();
        assert_eq!((v.accepted, v.tokens.clone()), (3, vec![1, 2, 0, 3]));
        let v = verify(&r, &[2, 2, 0], None, &g, &mut rng(), None).unwrap();
        assert_eq!((v.accepted, v.tokens.clone()), (0, vec![1]));
        let v = verify(&r[..1], &[], None, &g, &mut rng(), None).unwrap();
        assert_eq!(v.tokens, vec![1]);
        assert!(verify(&r, &[1], None, &g, &mut rng(), None).is_err());
    }

    #[test]
    fn verifying_from_picks_gives_the_greedy_verdict_of_the_logits() {
        let mut r = rng();
        let params = SamplingParams::greedy();
        for case in 0..300 {
            let drafts_len = case % 5;
            // Few distinct values, so that ties are common; one case in ten has a NaN row.
            let mut rows: Vec<Vec<f32>> = (0..=drafts_len)
                .map(|_| (0..9).map(|_| r.random_range(0..4) as f32).collect())
                .collect();
            if case % 10 == 3 {
                let j = r.random_range(0..rows.len());
                rows[j].fill(f32::NAN);
            }
            // Drafts that follow the rows' argmax for a while, then guess.
            let follow = r.random_range(0..=drafts_len);
            let drafts: Vec<u32> = (0..drafts_len)
                .map(|j| match argmax(&rows[j], None) {
                    Some(t) if j < follow => t,
                    _ => r.random_range(0..9),
                })
                .collect();
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let want = verify(&refs, &drafts, None, &params, &mut rng(), None).unwrap();
            let picks: Vec<u32> = rows
                .iter()
                .map(|row| argmax(row, None).unwrap_or(u32::MAX))
                .collect();
            assert_eq!(verify_picks(&picks, &drafts).unwrap(), want, "case {case}");
        }
        let err = verify_picks(&[1, 2], &[1, 2]).unwrap_err().to_string();
        assert!(err.contains("2 picks for 2 drafts"), "{err}");
    }

    #[test]
    fn target_probs_truncates_and_normalises() {
        let logits = [2.0f32.ln(), 4.0f32.ln(), 1.0f32.ln(), 3.0f32.ln()];
        let p = target_probs(&logits, &SamplingParams::sampled(1.0, 0), None).unwrap();
        for (a, b) in p.iter().zip([0.2, 0.4, 0.1, 0.3]) {
            assert!((a - b).abs() < 1e-6, "{p:?}");
        }
        let mut top2 = SamplingParams::sampled(1.0, 0);
        top2.top_k = 2;
        let p = target_probs(&logits, &top2, None).unwrap();
        assert!((p[1] - 4.0 / 7.0).abs() < 1e-6 && (p[3] - 3.0 / 7.0).abs() < 1e-6);
        assert_eq!((p[0], p[2]), (0.0, 0.0));
        let mut nucleus = SamplingParams::sampled(1.0, 0);
        nucleus.top_p = 0.65; // 0.4 + 0.3 reaches it
        let p = target_probs(&logits, &nucleus, None).unwrap();
        assert_eq!(p.iter().filter(|&&x| x > 0.0).count(), 2);
        let masked =
            target_probs(&logits, &SamplingParams::sampled(1.0, 0), Some(&[0b0101])).unwrap();
        assert!((masked[0] - 2.0 / 3.0).abs() < 1e-6 && masked[1] == 0.0);
        assert!(target_probs(&logits, &SamplingParams::sampled(1.0, 0), Some(&[0])).is_none());
    }

    #[test]
    fn sampling_rejects_a_draft_the_target_gives_no_mass() {
        // p puts all mass on token 0 (top_k 1): draft 2 must be rejected and 0 emitted.
        let rows: Vec<Vec<f32>> = vec![vec![9.0, 1.0, 1.0], vec![1.0, 1.0, 1.0]];
        let r: Vec<&[f32]> = rows.iter().map(|v| v.as_slice()).collect();
        let mut params = SamplingParams::sampled(1.0, 0);
        params.top_k = 1;
        for seed in 0..20 {
            let v = verify(
                &r,
                &[2],
                None,
                &params,
                &mut SmallRng::seed_from_u64(seed),
                None,
            )
            .unwrap();
            assert_eq!((v.accepted, v.tokens), (0, vec![0]));
        }
    }

    #[test]
    fn invalid_params_are_named() {
        let mut p = SamplingParams::sampled(-1.0, 0);
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        p.temperature = 1.0;
        p.top_p = 0.0;
        assert!(p.validate().unwrap_err().to_string().contains("top_p"));
    }
}
