//! The legacy formats' dot on AMX-INT8 tiles, for calls of several rows (a verify step, a
//! batch of sequences, a prefill chunk).
//!
//! For each pair of eight-row groups (sixteen outputs) the records of every block are decoded
//! once into weight tiles, two blocks a tile: tile row `v` of a block is its group-vector `v`
//! of both groups, the low group's eight outputs then the high group's, which is the byte
//! order a tile multiply reads its second operand in. The input rows come laid out as
//! [`BlockPairs`] tiles (two blocks a tile, each row twice, zero-padded), so one multiply
//! and one tile store give the i32 sums of two blocks of up to eight rows, each block apart;
//! 512-bit registers then apply the scales block by block, as every other path does.
//! Q8_0's signed codes take the signed multiply (`tdpbssd`), the others `tdpbsud`.
//!
//! Where the time goes (`--kernel`, one thread, weights hot, Q4_1 1536x576): the multiplies
//! hide behind the rest (taking them out leaves 5 rows at 38 us); the decode into weight tiles
//! (about 14 us) and the scales (about 11 us at 5 rows, four vector operations per row and
//! block) are what is left. The decode does not shrink with the rows, so at 5 rows the tiles
//! (39 us) only match the 512-bit VNNI kernel (41 us), and at 16 rows they take 83 us against
//! 122, at 128 rows 559 against 1019. In a forward, whose weights stream from the last-level
//! cache, short calls lose outright (see [`AMX_MIN_ROWS`]).
//!
//! Invariants: the i32 sums are the same integers as every other path's, and each output
//! lane runs the same f32 operations in the same order as [`super::super::dot_portable`], so
//! results are bit-identical to the portable path. A task's odd last group goes to the
//! 256-bit VNNI build. The tiles are configured at the start of a task and released at its
//! end, on the thread that runs it.

use super::tiles::{self, TileConfig};
use super::zmm::{f16x16, halves, plane_vector};
use super::*;
use crate::backend::const_count::with_count;
use crate::backend::quant::block_pairs::{BlockPairs, AMX_MIN_ROWS, CHUNK_ROWS};
use std::cell::Cell;

/// Tile registers, every role in two so that consecutive block pairs never wait on each
/// other's registers (tiles are not renamed: a load into a tile waits for the multiply that
/// reads it): weight tiles `tmm0`, `tmm1`; for the first chunks (all of a call's rows up to
/// eight, else eight each) activation tiles `tmm2`, `tmm3` and sum tiles `tmm4`, `tmm5`; for
/// a shorter last chunk after them, one of each, `tmm6` and `tmm7`.
const WEIGHTS: [u8; 2] = [0, 1];
const MAIN: (u8, u8, u8, u8) = (2, 3, 4, 5);
const LAST: (u8, u8) = (6, 7);

/// A thread's decoded weight tiles and sum rows, kept between calls.
struct Buffers {
    /// Two pairs of groups' weight tiles (the one being multiplied, the next one being
    /// decoded), per block pair sixteen tile rows of 64 bytes.
    weights: Vec<__m512i>,
    /// Two tiles of sums, sixteen rows of sixteen i32 each.
    sums: [[__m512i; 16]; 2],
}

thread_local! {
    static BUFFERS: Cell<Option<Box<Buffers>>> = const { Cell::new(None) };
}

/// Output features of groups `groups`, every row of `act` (Q8 blocks laid out as
/// [`BlockPairs`]), into `out`.
///
/// # Safety
/// The CPU must support [`Isa::Amx`] (granted by the OS); `w` is of format `F`; `act` has
/// pairs for its rows ([`QuantizedRows::has_pairs`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn run<F: Fmt>(
    w: &PackedView<'_>,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
) {
    // Once a task: the tile shapes below, and so every tile load's rows, follow from it.
    assert!(
        act.has_pairs() && act.rows >= AMX_MIN_ROWS,
        "the AMX kernel needs the input laid out as tiles, {AMX_MIN_ROWS} rows or more"
    );
    let pairs_end = groups.start + groups.len() / 2 * 2;
    let layout = RecordLayout::of(w.format());
    let ws = Workspace::take(act);
    let mut buf = BUFFERS.take().unwrap_or_else(|| {
        Box::new(Buffers {
            weights: Vec::new(),
            // SAFETY: all-zero bytes are valid integer vectors.
            sums: unsafe { std::mem::zeroed() },
        })
    });
    let block_pairs = w.blocks().div_ceil(2);
    let tiles_len = block_pairs * 16;
    buf.weights.resize(2 * tiles_len, _mm512_setzero_si512());
    // `main`: the rows of each chunk the `MAIN` tiles serve (the one chunk of a call of up to
    // eight rows, else eight); `last`: the rows of a shorter last chunk (0: there is none).
    let (main, last) = if act.rows <= CHUNK_ROWS {
        (act.rows, 0)
    } else {
        (CHUNK_ROWS, act.rows % CHUNK_ROWS)
    };
    let w64 = (16, 64);
    let (m, l) = ((2 * main, 64), (2 * last, 64));
    // An unused tile must be all zero: a configuration with rows but no bytes (or the other
    // way round) faults.
    let l = if last > 0 { l } else { (0, 0) };
    // SAFETY: the tiles are granted (this function's contract); each shape fits a tile.
    unsafe { TileConfig::new(&[w64, w64, m, m, m, m, l, l]).load() };
    let Buffers { weights, sums } = &mut *buf;
    let (mut current, mut next) = weights.split_at_mut(tiles_len);
    if groups.start < pairs_end {
        for b in 0..w.blocks() {
            // SAFETY: groups `start` and `start + 1` are whole groups of `w`.
            unsafe { decode_block::<F>(w, &layout, groups.start, b, current) };
        }
    }
    for g in (groups.start..pairs_end).step_by(2) {
        let (lo, hi) = (w.group_records(g), w.group_records(g + 1));
        let pair = Pair {
            w,
            layout: &layout,
            pairs: &act.pairs,
            weights: current,
            g,
            records: [lo.as_ptr(), hi.as_ptr()],
            record_bytes: lo.len() / w.blocks(),
            out,
        };
        // The next pair's records are decoded while this pair's tiles multiply, a block pair
        // at a time, so the weight stream keeps pace with the arithmetic instead of arriving
        // in bursts between pairs.
        let mut ahead = (g + 2 < pairs_end).then_some((g + 2, &mut *next));
        for c in 0..act.rows.div_ceil(CHUNK_ROWS) - (last > 0) as usize {
            let first = c * CHUNK_ROWS;
            with_count!(main, "a chunk of rows", |R| {
                let rows: [Act; R] = std::array::from_fn(|i| ws.acts[first + i]);
                // SAFETY: chunk `c` has `main` rows, as `MAIN`'s tiles are configured for.
                unsafe {
                    pair.chunk::<F, R, { MAIN.0 }, { MAIN.1 }, { MAIN.2 }, { MAIN.3 }>(
                        c,
                        &rows,
                        sums,
                        ahead.take(),
                    )
                }
            });
        }
        if last > 0 {
            let c = act.rows / CHUNK_ROWS;
            with_count!(last, "a chunk of rows", |R| {
                let rows: [Act; R] = std::array::from_fn(|i| ws.acts[c * CHUNK_ROWS + i]);
                // SAFETY: the last chunk has `last` rows, as `LAST`'s tiles are configured for.
                unsafe {
                    pair.chunk::<F, R, { LAST.0 }, { LAST.0 }, { LAST.1 }, { LAST.1 }>(
                        c,
                        &rows,
                        sums,
                        ahead.take(),
                    )
                }
            });
        }
        std::mem::swap(&mut current, &mut next);
    }
    // SAFETY: as above.
    unsafe { tiles::release() };
    BUFFERS.set(Some(buf));
    ws.give_back();
    if pairs_end < groups.end {
        // SAFETY: as above, for the last group.
        unsafe { legacy::run_with::<F, { legacy::EVEX_VNNI }>(w, act, pairs_end..groups.end, out) };
    }
}

/// Decodes block `b` of groups `g` and `g + 1` into their weight tiles: group-vector `v` is
/// row `8 * (b % 2) + v` of tile `b / 2`; an odd count's missing last block is zeros.
#[inline(always)]
unsafe fn decode_block<F: Fmt>(
    w: &PackedView<'_>,
    layout: &RecordLayout,
    g: usize,
    b: usize,
    weights: &mut [__m512i],
) {
    let nb = w.blocks();
    let (lo, hi) = (w.group_records(g), w.group_records(g + 1));
    let record_bytes = lo.len() / nb;
    let rec = [lo.as_ptr(), hi.as_ptr()].map(|p| p.add(b * record_bytes));
    prefetch_ahead(rec[0], record_bytes);
    prefetch_ahead(rec[1], record_bytes);
    let rows = &mut weights[16 * (b / 2) + 8 * (b % 2)..][..8];
    for (v, row) in rows.iter_mut().enumerate() {
        *row = if F::Q8 {
            let at = layout.planes[0].0 + 32 * v;
            halves(rec[0].add(at), rec[1].add(at))
        } else {
            let x = plane_vector(&rec, layout.planes[0].0, F::W1, 0, v);
            if F::W2 == 0 {
                x
            } else {
                _mm512_or_si512(x, plane_vector(&rec, layout.planes[1].0, F::W2, F::D2, v))
            }
        };
    }
    if b + 1 == nb && nb % 2 == 1 {
        weights[16 * (nb / 2) + 8..][..8].fill(_mm512_setzero_si512());
    }
}

/// `dest` := the sums of activation tile `A` (loaded from `act`) against weight tile `B`
/// (loaded from `weights`), through sum tile `C`; Q8_0's signed codes take the signed
/// multiply.
#[inline(always)]
unsafe fn tile_product<const A: u8, const B: u8, const C: u8>(
    act: *const u8,
    weights: *const u8,
    dest: *mut u8,
    signed: bool,
) {
    tiles::load::<B>(weights, 64);
    tiles::load::<A>(act, 64);
    tiles::zero::<C>();
    if signed {
        tiles::dot::<C, A, B, true>();
    } else {
        tiles::dot::<C, A, B, false>();
    }
    tiles::store::<C>(dest, 64);
}

/// One pair of groups, its weight tiles decoded.
struct Pair<'a> {
    w: &'a PackedView<'a>,
    layout: &'a RecordLayout,
    pairs: &'a BlockPairs,
    weights: &'a [__m512i],
    g: usize,
    /// The first records of groups `g` and `g + 1`, and the bytes of one record.
    records: [*const u8; 2],
    record_bytes: usize,
    out: OutMatrix,
}

impl Pair<'_> {
    /// The sixteen outputs of chunk `c`'s `R` rows (`rows`, from their first block), with
    /// activation tiles `A0`, `A1` and sum tiles `C0`, `C1` (even and odd block pairs),
    /// configured for `2 * R` rows; `ahead`: a pair of groups to decode meanwhile.
    #[inline(always)]
    unsafe fn chunk<
        F: Fmt,
        const R: usize,
        const A0: u8,
        const A1: u8,
        const C0: u8,
        const C1: u8,
    >(
        &self,
        c: usize,
        rows: &[Act; R],
        sums: &mut [[__m512i; 16]; 2],
        mut ahead: Option<(usize, &mut [__m512i])>,
    ) {
        let nb = self.w.blocks();
        let block_pairs = nb.div_ceil(2);
        let mut acc = [_mm512_setzero_ps(); R];
        let chunk_tiles = self.pairs.chunk(c).as_ptr();
        for j in 0..block_pairs {
            // Tile `j` of the chunk: `2 * R` rows of 64 bytes.
            let act = chunk_tiles.add(j * 2 * R * 64).cast();
            let weights = self.weights[16 * j..].as_ptr().cast();
            // Block pair `j` multiplies into one sum tile while the other's sums (pair
            // `j - 1`) are scaled.
            let dest = sums[j % 2].as_mut_ptr().cast();
            if j % 2 == 0 {
                tile_product::<A0, { WEIGHTS[0] }, C0>(act, weights, dest, F::Q8);
            } else {
                tile_product::<A1, { WEIGHTS[1] }, C1>(act, weights, dest, F::Q8);
            }
            if let Some((g, weights)) = ahead.as_mut() {
                for b in 2 * j..nb.min(2 * j + 2) {
                    decode_block::<F>(self.w, self.layout, *g, b, weights);
                }
            }
            if j > 0 {
                self.scale::<F, R>(j - 1, &sums[(j - 1) % 2], rows, &mut acc);
            }
        }
        self.scale::<F, R>(
            block_pairs - 1,
            &sums[(block_pairs - 1) % 2],
            rows,
            &mut acc,
        );
        for (r, &sum) in acc.iter().enumerate() {
            // SAFETY: the caller owns these sixteen outputs of every row of the chunk.
            _mm512_storeu_ps(self.out.at(c * CHUNK_ROWS + r, self.g * GROUP_ROWS), sum);
        }
    }

    /// Adds block pair `j`'s contribution (its i32 sums in `sums`: row `r` for block `2j`,
    /// row `R + r` for block `2j + 1`) to the rows' sums, block by block, as every path does.
    #[inline(always)]
    unsafe fn scale<F: Fmt, const R: usize>(
        &self,
        j: usize,
        sums: &[__m512i; 16],
        rows: &[Act; R],
        acc: &mut [__m512; R],
    ) {
        let nb = self.w.blocks();
        for half in 0..2 {
            let b = 2 * j + half;
            if b >= nb {
                break;
            }
            let rec = self.records.map(|p| p.add(b * self.record_bytes));
            let d = f16x16(rec[0], rec[1]);
            let d2 = match self.layout.d2 {
                Some(at) => f16x16(rec[0].add(at), rec[1].add(at)),
                None => _mm512_setzero_ps(),
            };
            for r in 0..R {
                let mut isum = sums[half * R + r];
                // The code offsets of Q4_0 and Q5_0 (`2^OFFSET`); Q8_0's signed multiply
                // needs none.
                if F::OFFSET != 0 {
                    let o = _mm512_set1_epi32(*rows[r].bsum.add(b) << F::OFFSET);
                    isum = _mm512_sub_epi32(isum, o);
                }
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(*rows[r].d.add(b)));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[r]);
                if F::AFFINE {
                    acc[r] = _mm512_fmadd_ps(d2, _mm512_set1_ps(*rows[r].sum.add(b)), acc[r]);
                }
            }
        }
    }
}
