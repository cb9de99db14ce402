//! Reads one KV head of one sequence's paged BF16 cache for the attention: key blocks
//! widened and transposed for the score pass, value blocks widened, prefetches ahead of both.
//!
//! Invariant: widening is exact and every path (scalar, AVX2, AVX-512 transposes) writes the
//! same bits; positions past the context read as zero keys and are never read as values.

use super::math::{to_f32, widen};
use super::{AttentionInputs, AttentionShape, KEYS};
use crate::backend::quant::{Avx2Token, SupportedIsa};
use half::bf16;

/// Reads one KV head of one sequence's cache, up to context `ctx`, a block at a time.
pub(super) struct CacheReader<'a> {
    pub shape: &'a AttentionShape,
    pub inputs: &'a AttentionInputs<'a>,
    pub seq: usize,
    pub ctx: usize,
    pub kv_head: usize,
    /// The pool's instruction set (the keys are transposed with its widest registers).
    pub isa: SupportedIsa,
}

impl CacheReader<'_> {
    /// [`Self::load_block`] compiled with AVX2, which the proof says this CPU runs.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn load_block_avx2(
        &self,
        _: Avx2Token,
        j0: usize,
        keys: &mut [f32],
        values: &mut [f32],
    ) {
        #[target_feature(enable = "avx2")]
        unsafe fn build(reader: &CacheReader, j0: usize, keys: &mut [f32], values: &mut [f32]) {
            reader.load_block(j0, keys, values)
        }
        // SAFETY: the proof says this CPU runs AVX2.
        unsafe { build(self, j0, keys, values) }
    }

    #[inline(always)]
    pub(super) fn load_block(&self, j0: usize, keys: &mut [f32], values: &mut [f32]) {
        self.load_keys(j0, keys);
        self.load_values(j0, values);
    }

    /// The cache offset of position `j` of the sequence, the reader's KV head.
    #[inline(always)]
    fn cache_at(&self, j: usize) -> usize {
        let sh = self.shape;
        let block = self.inputs.block_table[self.seq * sh.max_blocks_per_seq + j / sh.block_size];
        let slot = block as usize * sh.block_size + j % sh.block_size;
        (slot * sh.kv_heads + self.kv_head) * sh.head_dim
    }

    /// Asks the CPU to bring the keys and values of positions `j0 .. j0 + KEYS` (those within
    /// the context) into the cache. The weights a forward streams between two steps evict
    /// the cache, and a KV head's rows lie a slot apart, too scattered for the hardware
    /// prefetcher: without this every row is a cache miss the kernel waits for. The values
    /// are fetched during the score pass, which runs long before the value pass reads them.
    /// The lines go to the L2 (`T1`), whose requests do not hold the L1's few miss buffers
    /// against the kernel's loads (`step_profile`, attention of a forward on a 2-core Zen 4:
    /// one row 0.70-0.77 ms with `T0`, 0.46-0.54 with `T1`; 9 rows 1.44-1.45 against
    /// 1.23-1.24). Fetching 4 blocks ahead instead of 2 was slower.
    #[inline(always)]
    pub(super) fn prefetch_block(&self, j0: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            let hd = self.shape.head_dim;
            let lines = (hd * std::mem::size_of::<bf16>()).div_ceil(64);
            for j in j0..(j0 + KEYS).min(self.ctx) {
                let at = self.cache_at(j);
                for cache in [self.inputs.k_cache, self.inputs.v_cache] {
                    if let Some(row) = cache.get(at..at + hd) {
                        let base = row.as_ptr().cast::<i8>();
                        for line in 0..lines {
                            // SAFETY: a prefetch never faults, and `line * 64` is less than
                            // the byte length of `row`, so the address lies inside it.
                            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.add(line * 64)) };
                        }
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = j0;
    }

    /// Keys `j0 .. j0 + KEYS` widened and transposed to `[head_dim, KEYS]` (zero past the
    /// context), so that one query's scores of a block are lane-wise.
    #[inline(always)]
    pub(super) fn load_keys(&self, j0: usize, keys: &mut [f32]) {
        let hd = self.shape.head_dim;
        #[cfg(target_arch = "x86_64")]
        if let Some(avx2) = self.isa.avx2() {
            if hd.is_multiple_of(8) && j0 + KEYS <= self.ctx {
                let rows: [&[bf16]; KEYS] = std::array::from_fn(|jj| {
                    let at = self.cache_at(j0 + jj);
                    &self.inputs.k_cache[at..at + hd]
                });
                match self.isa.avx512() {
                    Some(proof) if hd.is_multiple_of(16) => {
                        super::transpose::keys_avx512(proof, &rows, keys)
                    }
                    _ => super::transpose::keys_avx2(avx2, &rows, keys),
                }
                return;
            }
        }
        for jj in 0..KEYS {
            let j = j0 + jj;
            if j < self.ctx {
                let at = self.cache_at(j);
                for (d, k) in self.inputs.k_cache[at..at + hd].iter().enumerate() {
                    keys[d * KEYS + jj] = to_f32(*k);
                }
            } else {
                for d in 0..hd {
                    keys[d * KEYS + jj] = 0.0;
                }
            }
        }
    }

    /// Values `j0 .. j0 + KEYS` (those within the context) widened, `[KEYS, head_dim]`.
    #[inline(always)]
    pub(super) fn load_values(&self, j0: usize, values: &mut [f32]) {
        let hd = self.shape.head_dim;
        for (jj, v) in values.chunks_exact_mut(hd).enumerate() {
            if j0 + jj >= self.ctx {
                break;
            }
            let at = self.cache_at(j0 + jj);
            widen(&self.inputs.v_cache[at..at + hd], v);
        }
    }
}
