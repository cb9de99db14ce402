//! The grammar bitmask format of the protocol: one bit per token id in `i32` words, token
//! `t` allowed when bit `t % 32` of word `t / 32` is set (llguidance's format).

/// Words a mask over `vocab_size` tokens needs.
pub fn bitmask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// Whether `mask` allows `token`; a token beyond the mask is not allowed.
pub fn bitmask_allows(mask: &[i32], token: u32) -> bool {
    mask.get(token as usize / 32)
        .is_some_and(|&w| (w as u32 >> (token % 32)) & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_order_matches_llguidance() {
        let mut mask = vec![0i32; bitmask_words(70)];
        assert_eq!(mask.len(), 3);
        mask[0] |= 1 << 5;
        mask[1] |= 1 << 31;
        mask[2] |= 1 << 1;
        let allowed: Vec<u32> = (0..100).filter(|&t| bitmask_allows(&mask, t)).collect();
        assert_eq!(allowed, vec![5, 63, 65]);
    }
}
