//! PromptLookup's drafts computed the slow way, by scanning the whole history: the
//! reference its index is tested against, and the baseline its benchmark measures.

/// The drafts by the definition, with nothing shared with the index: scan every earlier
/// position for the longest suffix (newest occurrence first), count how far back that
/// occurrence matches, draft that many of its followers (at most `num_drafts`, not past the
/// history's end), and stop at the first forbidden token.
pub fn linear_scan(
    min: usize,
    max: usize,
    history: &[u32],
    num_drafts: usize,
    mask: Option<&[i32]>,
) -> Vec<u32> {
    let len = history.len();
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let suffix = &history[len - n..];
        for start in (0..len - n).rev() {
            if &history[start..start + n] != suffix {
                continue;
            }
            // Past num_drafts a longer match changes nothing.
            let mut matched = n;
            while matched < num_drafts
                && matched < start + n
                && history[start + n - 1 - matched] == history[len - 1 - matched]
            {
                matched += 1;
            }
            let from = start + n;
            let to = (from + matched.min(num_drafts)).min(len);
            return history[from..to]
                .iter()
                .copied()
                .take_while(|&t| mask.is_none_or(|m| m[t as usize / 32] >> (t % 32) & 1 == 1))
                .collect();
        }
    }
    Vec::new()
}
