//! SuffixDecoding's drafts and tree size computed by brute force over the stored token
//! streams: the reference its trees are tested against.

use specdraft::speculative::SuffixDecodingOptions;
use std::collections::{HashMap, HashSet};

/// The definition, counted by brute force over the streams: for each suffix of the history
/// of `L` tokens (`L < max_depth`), follow the most frequent continuation (ties to the
/// smaller token) while the product of `count(w t) / count(w)` stays at least the threshold,
/// drafting at most `floor(L * factor)` and `num_drafts` tokens within `max_depth`; keep the
/// chain with the highest sum of those products, the longest match on a tie.
pub struct Reference {
    max_depth: usize,
    min_prob: f64,
    factor: f64,
}

/// A chain: tokens, each one's step probability, and the score.
type RefChain = (Vec<u32>, Vec<f64>, f64);

fn occurrences(streams: &[Vec<u32>], w: &[u32]) -> usize {
    streams
        .iter()
        .map(|s| s.windows(w.len()).filter(|x| *x == w).count())
        .sum()
}

impl Reference {
    pub fn of(o: &SuffixDecodingOptions) -> Self {
        Reference {
            max_depth: o.max_depth,
            min_prob: f64::from(o.min_token_prob),
            factor: f64::from(o.max_spec_factor),
        }
    }

    fn follow(&self, streams: &[Vec<u32>], start: &[u32], num_drafts: usize) -> RefChain {
        let allowed = ((start.len() as f64 * self.factor).floor() as usize).min(num_drafts);
        let mut w = start.to_vec();
        let (mut tokens, mut probs, mut score, mut reach) = (Vec::new(), Vec::new(), 0.0, 1.0);
        while tokens.len() < allowed && w.len() < self.max_depth {
            let mut next: HashMap<u32, usize> = HashMap::new();
            for s in streams {
                for i in 0..s.len().saturating_sub(w.len()) {
                    if s[i..i + w.len()] == w[..] {
                        *next.entry(s[i + w.len()]).or_default() += 1;
                    }
                }
            }
            let Some((&t, &c)) = next.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))) else {
                break;
            };
            let step = c as f64 / occurrences(streams, &w) as f64;
            reach *= step;
            if reach < self.min_prob {
                break;
            }
            tokens.push(t);
            probs.push(step);
            score += reach;
            w.push(t);
        }
        (tokens, probs, score)
    }

    fn best(&self, streams: &[Vec<u32>], history: &[u32], num_drafts: usize) -> RefChain {
        let mut best: RefChain = (Vec::new(), Vec::new(), 0.0);
        for l in (1..=history.len().min(self.max_depth - 1)).rev() {
            let chain = self.follow(streams, &history[history.len() - l..], num_drafts);
            if chain.2 > best.2 {
                best = chain;
            }
        }
        best
    }

    /// The sequence's own history first; the stored outputs only when strictly better.
    pub fn drafts(
        &self,
        outputs: &[Vec<u32>],
        history: &[u32],
        num_drafts: usize,
        mask: Option<&[i32]>,
    ) -> (Vec<u32>, Vec<f64>) {
        if num_drafts == 0 {
            return (Vec::new(), Vec::new());
        }
        let own = self.best(&[history.to_vec()], history, num_drafts);
        let theirs = self.best(outputs, history, num_drafts);
        let (mut tokens, mut probs, _) = if theirs.2 > own.2 { theirs } else { own };
        let keep = tokens
            .iter()
            .take_while(|&&t| mask.is_none_or(|m| m[t as usize / 32] >> (t % 32) & 1 == 1))
            .count();
        tokens.truncate(keep);
        probs.truncate(keep);
        (tokens, probs)
    }
}

/// Distinct strings of `1..=max_depth` tokens in the streams: the nodes a trie over them
/// holds.
pub fn distinct_strings(streams: &[Vec<u32>], max_depth: usize) -> usize {
    let mut seen: HashSet<&[u32]> = HashSet::new();
    for s in streams {
        for i in 0..s.len() {
            for l in 1..=max_depth.min(s.len() - i) {
                seen.insert(&s[i..i + l]);
            }
        }
    }
    seen.len()
}
