//! [`BlockPairs`]: a call's Q8 input rows laid out as the AMX kernel's activation tiles.
//!
//! A tile multiply sums 64 bytes per output: two 32-element blocks. Each block's sum must
//! come out on its own (its scales differ), so a tile holds every row twice: in a chunk of
//! `m` rows, tile row `x` is row `x`'s block `2j` followed by 32 zero bytes, and tile row
//! `m + x` is 32 zero bytes followed by its block `2j + 1`. Against a weight tile of both
//! blocks, output row `x` is then block `2j`'s sum and output row `m + x` block `2j + 1`'s:
//! one multiply and one tile store for two blocks of up to [`CHUNK_ROWS`] rows.
//!
//! Layout: chunks of [`CHUNK_ROWS`] input rows, the last one shorter; chunk `c` starts at
//! byte `c * CHUNK_ROWS * pairs * 128`, and its tile of block pair `j` at `j * 2m * 64` after
//! that, tile rows 64 bytes apart. The missing second block of an odd block count is zeros.
//!
//! Invariant: filled from Q8 codes, it holds exactly those codes and zeros, so sums over it
//! are the same integers as over the rows themselves.

/// Calls of fewer rows keep to the VNNI kernels: the weight decode's stores and a tile store
/// per two blocks cost more than the `vpdpbusd` they save (`cargo bench --bench quant_linear
/// -- --step`, two threads, Sapphire Rapids class: 9 rows 12.3 ms on the tiles against 9.5,
/// 16 rows 13.5 against 14.5).
pub const AMX_MIN_ROWS: usize = 16;

/// Input rows per chunk: two copies of each fill a tile's 16 rows.
pub(crate) const CHUNK_ROWS: usize = 8;

/// The tiles of one call's input rows (see the module doc); buffers reused between calls.
#[derive(Debug, Default)]
pub(crate) struct BlockPairs {
    rows: usize,
    pairs: usize,
    bytes: Vec<i8>,
}

impl BlockPairs {
    /// Lays out `rows` rows of `cols` Q8 codes (`qs`, `[rows, cols]`, `cols` a multiple of
    /// 32).
    pub(crate) fn fill(&mut self, qs: &[i8], rows: usize, cols: usize) {
        let blocks = cols / 32;
        let pairs = blocks.div_ceil(2);
        self.rows = rows;
        self.pairs = pairs;
        self.bytes.clear();
        self.bytes.resize(rows * pairs * 128, 0);
        for (r, row) in qs.chunks_exact(cols).take(rows).enumerate() {
            let (c, x) = (r / CHUNK_ROWS, r % CHUNK_ROWS);
            let m = self.chunk_rows(c);
            let chunk = c * CHUNK_ROWS * pairs * 128;
            for (b, block) in row.chunks_exact(32).enumerate() {
                let (j, half) = (b / 2, b % 2);
                let at = chunk + j * 2 * m * 64 + (half * m + x) * 64 + half * 32;
                self.bytes[at..at + 32].copy_from_slice(block);
            }
        }
    }

    /// Forgets the rows laid out (keeping the buffer for the next call).
    pub(crate) fn clear(&mut self) {
        self.rows = 0;
        self.bytes.clear();
    }

    /// Input rows laid out.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Rows of chunk `c`.
    pub(crate) fn chunk_rows(&self, c: usize) -> usize {
        (self.rows - c * CHUNK_ROWS).min(CHUNK_ROWS)
    }

    /// The tile of chunk `c`, block pair `j`: `2 * chunk_rows(c)` rows of 64 bytes.
    #[cfg(test)]
    fn tile(&self, c: usize, j: usize) -> &[i8] {
        let m = self.chunk_rows(c);
        &self.chunk(c)[j * 2 * m * 64..][..2 * m * 64]
    }

    /// Every tile of chunk `c`, block pair after block pair.
    pub(crate) fn chunk(&self, c: usize) -> &[i8] {
        let at = c * CHUNK_ROWS * self.pairs * 128;
        &self.bytes[at..at + self.chunk_rows(c) * self.pairs * 128]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (row, block) comes out of the tile product's definition exactly once: the sum
    /// of tile row `x` (or `m + x`) against a weight tile of two blocks of ones is the sum of
    /// that row's block `2j` (or `2j + 1`), zero for the missing block of an odd count.
    #[test]
    fn each_tile_row_sums_one_block_of_one_row() {
        for (rows, blocks) in [(1, 1), (5, 3), (8, 2), (9, 5), (17, 4)] {
            let cols = 32 * blocks;
            let qs: Vec<i8> = (0..rows * cols).map(|i| (i * 37 % 255) as i8).collect();
            let mut p = BlockPairs::default();
            p.fill(&qs, rows, cols);
            let block_sum = |r: usize, b: usize| -> i32 {
                if b >= blocks {
                    return 0;
                }
                qs[r * cols + b * 32..][..32]
                    .iter()
                    .map(|&v| v as i32)
                    .sum()
            };
            for r in 0..rows {
                let (c, x) = (r / CHUNK_ROWS, r % CHUNK_ROWS);
                let m = p.chunk_rows(c);
                for j in 0..blocks.div_ceil(2) {
                    let tile = p.tile(c, j);
                    let row = |t: usize| -> (i32, i32) {
                        let bytes = &tile[t * 64..(t + 1) * 64];
                        let lo = bytes[..32].iter().map(|&v| v as i32).sum();
                        let hi = bytes[32..].iter().map(|&v| v as i32).sum();
                        (lo, hi)
                    };
                    assert_eq!(
                        row(x),
                        (block_sum(r, 2 * j), 0),
                        "{rows}x{blocks} r{r} j{j}"
                    );
                    assert_eq!(row(m + x), (0, block_sum(r, 2 * j + 1)), "r{r} j{j}");
                }
            }
        }
    }
}
