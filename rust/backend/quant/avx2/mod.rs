//! The AVX2 quantized dot: eight output features per register, read from packed records.
//!
//! Design (after llama.cpp's repacked AVX2 GEMV/GEMM, written independently): a record of
//! eight rows is decoded once into an L1 scratch of *group-vectors* (32 unsigned codes: four
//! consecutive elements of each of the eight rows), then every input row of the call reads
//! it: per group-vector, the row's four matching activation codes are broadcast, `maddubs`
//! multiplies and adds pairs (unsigned weight code x signed activation, never saturating:
//! see the bounds below), a few products are summed in i16, and `madd` with the sub-block
//! scale (or with ones) pairs them into i32 lane `l` = output `8 g + l`. Offsets (Q4_0's 8,
//! Q6_K's 32, ...) and K-quant mins come from the activation block sums. So each weight byte
//! is loaded from memory once per call whatever the number of rows, rows are taken four at a
//! time to share each loaded group-vector, and no horizontal sum is ever needed.
//!
//! The i32 sums equal the portable path's exactly (integers), and the float epilogue runs the
//! same f32 operations (fused multiply-adds included) in the same order
//! ([`super::dot_portable`]), so results are bit-identical. i16 bounds (`|qa| <= 127`): 4-bit codes 8 products of `2 * 15 * 127`
//! (30480), 5-bit 4 of `2 * 31 * 127` (31496), 6-bit 2 of `2 * 63 * 127` (32004), 3-bit 4 of
//! `2 * 7 * 127`; Q8_0 uses `|w| x sign(qa, w)`, at most `2 * 128 * 127` (32512) per pair.

use super::activation::QuantizedRows;
use super::linear::OutMatrix;
use super::packed::{RecordLayout, GROUP_ROWS};
use super::{BlockFormat, Isa, PackedView, SupportedIsa};
use std::arch::x86_64::*;
use std::ops::Range;

mod amx;
mod kquant;
mod kquant_zmm;
mod legacy;
mod tiles;
mod zmm;

/// One decoded chunk of a group: a K-quant super-block, or up to 8 legacy blocks (4 for Q8_0).
#[repr(C)]
struct Scratch {
    /// Group-vectors of unsigned codes (Q8_0: |w| in 0..32, w in 32..64).
    codes: [__m256i; 64],
    /// K-quants, AVX2 build: per sub-block, lane `l` = `(sc_j[l], sc_j[l])` as i16.
    scale_pairs: [__m256i; 16],
    /// K-quants, VNNI builds: per sub-block, lane `l` = `sc_j[l]` as i32.
    scale_words: [__m256i; 16],
    /// K-quants: lane `l` = `(x_{2i}[l], x_{2i+1}[l])`, x = mins (KMin) or scales (KSym).
    off_pairs: [__m256i; 8],
    /// Per block of the chunk: the eight rows' `d` and `m`/`dmin`.
    d: [__m256; 8],
    d2: [__m256; 8],
}

impl Scratch {
    fn new() -> Box<Scratch> {
        // SAFETY: all-zero bytes are valid SIMD values.
        Box::new(unsafe { std::mem::zeroed() })
    }
}

/// A thread's decode scratch, running sums and row pointers, kept between kernel calls so a
/// call allocates nothing (a decode step makes hundreds of them, each tens of microseconds).
/// Every field is overwritten before it is read, so nothing carries over between calls.
struct Workspace {
    scratch: Box<Scratch>,
    accs: Accumulators,
    acts: Vec<Act>,
}

thread_local! {
    /// Taken out for the length of a call (so a nested call simply gets a fresh one).
    static WORKSPACE: std::cell::Cell<Option<Box<Workspace>>> = const { std::cell::Cell::new(None) };
}

impl Workspace {
    /// The thread's workspace (or a new one), ready for every row of `act`.
    fn take(act: &QuantizedRows) -> Box<Workspace> {
        let mut ws = WORKSPACE.take().unwrap_or_else(|| {
            Box::new(Workspace {
                scratch: Scratch::new(),
                accs: Accumulators { sums: Vec::new() },
                acts: Vec::new(),
            })
        });
        ws.accs
            .sums
            .resize(act.rows.min(ROW_TILE), [0.0; GROUP_ROWS]);
        Act::fill(&mut ws.acts, act);
        ws
    }

    /// Hands the workspace back to the thread for its next call.
    fn give_back(self: Box<Self>) {
        WORKSPACE.set(Some(self));
    }
}

mod formats;
use formats::Fmt;

/// Output features of groups `groups`, every row of `act`, into `out` (no bias). With
/// AVX-VNNI the legacy formats' dots run on `vpdpbusd` (the same integers: see [`legacy`]),
/// with AVX-512 VNNI too, on 512-bit registers ([`zmm`]), and with AMX, in tile multiplies
/// where the call's input was laid out as tiles ([`amx`]); the K-quants' sub-block dots run on
/// `vpdpbusd` with either VNNI, each scaled by a 32-bit multiply ([`kquant`]), with AVX-512
/// two groups to a 512-bit register ([`kquant_zmm`]).
///
/// # Safety
/// `isa` includes AVX2 (`isa.avx2()` is `Some`; every higher level it names, this CPU runs,
/// being a [`SupportedIsa`]); `act` must hold the blocks `w` reads (Q8 for legacy formats,
/// Q8K for K-quants) of `w.in_features()` columns.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quant_groups(
    w: &PackedView<'_>,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
    isa: SupportedIsa,
) {
    use formats::*;
    use BlockFormat as F;
    macro_rules! legacy {
        ($f:ty) => {
            match isa.isa() {
                Isa::Amx if act.has_pairs() => amx::run::<$f>(w, act, groups, out),
                Isa::Avx512Vnni | Isa::Amx => zmm::run::<$f>(w, act, groups, out),
                Isa::Avx2Vnni => legacy::run_vnni::<$f>(w, act, groups, out),
                _ => legacy::run::<$f>(w, act, groups, out),
            }
        };
    }
    macro_rules! kquant {
        ($f:ty) => {
            match isa.isa() {
                Isa::Avx512Vnni | Isa::Amx => kquant_zmm::run::<$f>(w, act, groups, out),
                Isa::Avx2Vnni => kquant::run_vnni::<$f>(w, act, groups, out),
                _ => kquant::run::<$f>(w, act, groups, out),
            }
        };
    }
    // SAFETY (all calls below): forwarded from this function's contract.
    unsafe {
        match w.format() {
            F::Q4_0 => legacy!(Q4_0),
            F::Q4_1 => legacy!(Q4_1),
            F::Q5_0 => legacy!(Q5_0),
            F::Q5_1 => legacy!(Q5_1),
            F::Q8_0 => legacy!(Q8_0),
            F::Q2_K => kquant!(Q2_K),
            F::Q3_K => kquant!(Q3_K),
            F::Q4_K => kquant!(Q4_K),
            F::Q5_K => kquant!(Q5_K),
            F::Q6_K => kquant!(Q6_K),
            F::F32 | F::F16 | F::BF16 => unreachable!("float formats use the float dot"),
        }
    }
}

/// Row `r`'s activation blocks from block `b` on.
#[derive(Clone, Copy)]
struct Act {
    qa: *const i8,
    d: *const f32,
    sum: *const f32,
    bsum: *const i32,
    bsum16: *const i16,
    bsum32: *const i16,
}

impl Act {
    /// `out` := every row of `act` from its first block (bounds checked here; kernels stay in
    /// a row).
    fn fill(out: &mut Vec<Act>, act: &QuantizedRows) {
        let nb = act.blocks();
        let k = !act.bsum16.is_empty();
        out.clear();
        out.extend((0..act.rows).map(|r| {
            let i = r * nb;
            Act {
                qa: act.qs[i * (act.cols / nb)..].as_ptr(),
                d: act.d[i..].as_ptr(),
                sum: act.sum[i..].as_ptr(),
                bsum: act.bsum[i..].as_ptr(),
                bsum16: if k {
                    act.bsum16[i * 16..].as_ptr()
                } else {
                    std::ptr::null()
                },
                bsum32: if k {
                    act.bsum32[i * 8..].as_ptr()
                } else {
                    std::ptr::null()
                },
            }
        }));
    }

    /// The same row from block `b` (blocks of `n` codes).
    #[inline(always)]
    fn at_block(self, b: usize, n: usize) -> Act {
        Act {
            qa: self.qa.wrapping_add(b * n),
            d: self.d.wrapping_add(b),
            sum: self.sum.wrapping_add(b),
            bsum: self.bsum.wrapping_add(b),
            bsum16: self.bsum16.wrapping_add(16 * b),
            bsum32: self.bsum32.wrapping_add(8 * b),
        }
    }
}

/// Four activation codes broadcast to every lane.
#[inline(always)]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// The eight f16 at `p` as f32.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// How far ahead of the record being read the kernels ask for weight bytes.
const PREFETCH_BYTES: usize = 16384;

/// Asks for the `bytes` of cache lines [`PREFETCH_BYTES`] past `at` (later records of the
/// group, or the next group's, which follow in memory): a call spends much of its time
/// waiting for weight bytes, and this keeps more reads in flight than the hardware
/// prefetcher alone. A prefetch past the end of the weight is harmless: it never faults.
///
/// The lines go to the L2 (`T1`), not the L1: requests for the L1 hold its few miss
/// buffers, which the kernel's own loads then wait behind, and 16 KiB ahead of two record
/// streams is half an L1. Measured on a 2-core Zen 4 share (`model_decode`, interleaved
/// runs): a decode step 5.6-5.7 ms with `T0` 8 KiB ahead, 3.5-4.2 with `T1` 16 KiB ahead
/// (8 KiB: 3.6-4.4, 4 KiB: 5.0, 32 KiB: 3.7-4.2); the step's weights moved at 0.62 of a
/// memcpy, now 0.88-0.94. One thread, Q4_1 576x576 at one row, weights streamed
/// (`quant_linear --kernel`): 17.6 us -> 8.4.
///
/// Non-temporal prefetches (`NTA`) were tried so that a step's weight stream would not
/// evict what the next step reads again (an MTP head's weights, the KV cache). On Zen 4 they
/// fill the L1 as `T0` does and cost as much: decode 5.8-6.1 ms a token against 3.5-4.3,
/// and the head's first draft step after a target step got slower too (0.53-0.61 ms against
/// 0.29-0.31, `mtp --step-cost`), so they kept nothing warm.
#[inline(always)]
unsafe fn prefetch_ahead(at: *const u8, bytes: usize) {
    let ahead = at.wrapping_add(PREFETCH_BYTES);
    for line in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line).cast());
    }
}

/// Decodes one plane of `w`-bit fields at `p` into `vectors` group-vectors at `codes`, at bit
/// `dest` of each code; the first plane stores, later ones OR into what is there. Always
/// inlined with constant widths, so the shifts and loops resolve at compile time.
#[inline(always)]
unsafe fn decode_plane(
    p: *const u8,
    w: u32,
    dest: u32,
    first: bool,
    vectors: usize,
    codes: *mut __m256i,
) {
    let per_slot = vectors / (8 / w) as usize;
    for c in 0..per_slot {
        let v = _mm256_loadu_si256(p.add(32 * c).cast());
        for s in 0..(8 / w) as usize {
            let (_, by, mask) = plane_field(w, dest, per_slot, s * per_slot + c);
            let x = place_field(v, by, _mm256_set1_epi8(mask));
            let slot = codes.add(s * per_slot + c);
            *slot = if first { x } else { _mm256_or_si256(*slot, x) };
        }
    }
}

/// Where group-vector `v` of a `w`-bit plane lies, the plane holding `per_slot` group-vectors
/// in each of its `8 / w` bit slots: its 32-byte chunk, the shift that brings its slot to bit
/// `dest` of the code (negative: to the right), and the mask byte of the field's bits there.
#[inline(always)]
fn plane_field(w: u32, dest: u32, per_slot: usize, v: usize) -> (usize, i32, i8) {
    let (c, s) = (v % per_slot, v / per_slot);
    let by = dest as i32 - (s as u32 * w) as i32;
    (c, by, (((1u16 << w) - 1) << dest) as u8 as i8)
}

/// `x` shifted by `by` bits (left if positive) in 16-bit lanes and masked: one field of every
/// byte at its place in the code. The 16-bit shift leaks bits across a byte boundary only
/// outside the field, which the mask drops.
#[inline(always)]
unsafe fn place_field(x: __m256i, by: i32, mask: __m256i) -> __m256i {
    let x = if by >= 0 {
        _mm256_sll_epi16(x, _mm_cvtsi32_si128(by))
    } else {
        _mm256_srl_epi16(x, _mm_cvtsi32_si128(-by))
    };
    _mm256_and_si256(x, mask)
}

/// Decodes a record's codes (`vectors` group-vectors) into `codes`.
#[inline(always)]
unsafe fn decode_codes<F: Fmt>(
    rec: *const u8,
    layout: &RecordLayout,
    vectors: usize,
    codes: *mut __m256i,
) {
    decode_plane(rec.add(layout.planes[0].0), F::W1, 0, true, vectors, codes);
    if F::W2 > 0 {
        decode_plane(
            rec.add(layout.planes[1].0),
            F::W2,
            F::D2,
            false,
            vectors,
            codes,
        );
    }
}

/// Input rows per tile: their activations (up to 32 x in_features bytes) stay in L1/L2 while
/// the task's groups pass, and the weights are decoded once per tile.
const ROW_TILE: usize = 32;

/// The running sums of one group for one tile of rows, contiguous (the output's rows are
/// `out_features` floats apart, which would put every row's sums in the same few L1 sets).
struct Accumulators {
    sums: Vec<[f32; GROUP_ROWS]>,
}

/// Every (row tile, group) pair, row tiles outermost.
fn tiles(rows: usize, groups: Range<usize>) -> impl Iterator<Item = (Range<usize>, usize)> {
    (0..rows).step_by(ROW_TILE).flat_map(move |r0| {
        let tile = r0..rows.min(r0 + ROW_TILE);
        groups.clone().map(move |g| (tile.clone(), g))
    })
}

impl Accumulators {
    /// Zeroes the sums before a (row tile, group) pair.
    #[inline(always)]
    fn zero(&mut self) {
        self.sums.fill([0.0; GROUP_ROWS]);
    }

    #[inline(always)]
    fn at(&mut self, r: usize) -> *mut f32 {
        self.sums[r].as_mut_ptr()
    }

    /// Copies the tile's sums to group `g`'s outputs.
    #[inline(always)]
    unsafe fn store(&self, out: OutMatrix, tile: Range<usize>, g: usize) {
        for (i, r) in tile.enumerate() {
            // SAFETY: the caller owns these eight outputs of row `r`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.sums[i].as_ptr(),
                    out.at(r, g * GROUP_ROWS),
                    GROUP_ROWS,
                )
            };
        }
    }
}

/// Writes a module's two 256-bit builds of its kernel body `run_with::<F, DOT>`: `run`, on
/// AVX2's `maddubs` ([`legacy::MADDUBS`]), and `run_vnni`, on AVX-VNNI's `vpdpbusd`
/// ([`legacy::VEX_VNNI`]: one instruction where AVX2 takes a `maddubs`, an i16 add and a share
/// of a `madd`, the same integers). Each is its own function so that every intrinsic of the
/// inlined body is compiled with that build's features.
macro_rules! dot_builds {
    () => {
        /// Output features of groups `groups`, every row of `act` (the 8-bit blocks this
        /// module's formats read), into `out`.
        ///
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C; `w` is of format `F`.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn run<F: Fmt>(
            w: &PackedView<'_>,
            act: &QuantizedRows,
            groups: Range<usize>,
            out: OutMatrix,
        ) {
            // SAFETY: forwarded.
            unsafe { run_with::<F, { super::legacy::MADDUBS }>(w, act, groups, out) }
        }

        /// [`run`] with the dots on AVX-VNNI's `vpdpbusd`.
        ///
        /// # Safety
        /// As [`run`], and the CPU must support AVX-VNNI.
        #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
        pub(super) unsafe fn run_vnni<F: Fmt>(
            w: &PackedView<'_>,
            act: &QuantizedRows,
            groups: Range<usize>,
            out: OutMatrix,
        ) {
            // SAFETY: forwarded.
            unsafe { run_with::<F, { super::legacy::VEX_VNNI }>(w, act, groups, out) }
        }
    };
}
use dot_builds;

/// Runs `$body` with const `$R` over the rows four at a time (4, then the 1..3 left over).
macro_rules! row_tiles {
    ($rows:expr, |$r0:ident, $R:ident| $body:expr) => {{
        let rows = $rows;
        let mut $r0 = 0;
        while $r0 + 4 <= rows {
            const $R: usize = 4;
            $body;
            $r0 += 4;
        }
        match rows - $r0 {
            3 => {
                const $R: usize = 3;
                $body
            }
            2 => {
                const $R: usize = 2;
                $body
            }
            1 => {
                const $R: usize = 1;
                $body
            }
            _ => {}
        }
    }};
}
use row_tiles;

/// Runs `$body` over the rows of the range `$rows` in as few tiles of at most `$max` rows as
/// there can be, as even as they can be (seven rows at most four: four and three), with `$r0`
/// the tile's first row and `$R` its length as a constant, one of the literals listed (the
/// lengths `$max` allows): a group's records, decoded once per tile, stay in L1 between its
/// tiles, and even tiles keep every tile near the register limit.
macro_rules! even_tiles {
    ($rows:expr, $max:expr, [$($n:literal),+], |$r0:ident, $R:ident| $body:expr) => {{
        let rows = $rows;
        let mut $r0 = rows.start;
        while $r0 < rows.end {
            let left = rows.end - $r0;
            let take = left.div_ceil(left.div_ceil($max));
            match take {
                $($n => {
                    const $R: usize = $n;
                    $body
                })+
                _ => unreachable!("a tile longer than its kernel allows"),
            }
            $r0 += take;
        }
    }};
}
use even_tiles;
