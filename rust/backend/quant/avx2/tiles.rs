//! AMX tile instructions as inline assembly: stable Rust has no intrinsics for them.
//!
//! Tile registers are named by const generics (`tmm0`..`tmm7`); the compiler never
//! allocates them, so every use is explicit here. A thread loads a [`TileConfig`] before its
//! first tile instruction and releases the tiles when its task ends, so the 8 KiB tile state
//! is not carried through context switches while unused.
//!
//! Invariant: every function here is `unsafe` with one contract: the CPU has AMX-TILE and
//! AMX-INT8, the OS granted them ([`super::Isa::Amx`]), a configuration is loaded on this
//! thread whose shapes fit the operands, and every pointer covers the rows it names.

use std::arch::asm;

/// The 64-byte operand of `ldtilecfg` (palette 1): each tile's rows and bytes per row.
#[repr(C, align(64))]
pub(super) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Tiles `shapes[t] = (rows, bytes per row)` for `tmm0..`, the others unused. Panics on
    /// a shape larger than a tile (16 rows of 64 bytes), in every build: the tile loads and
    /// stores read and write the configured rows, so a configuration is what keeps them in
    /// their buffers, and it is made once a task, far from any hot loop.
    pub(super) fn new(shapes: &[(usize, usize)]) -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for (t, &(rows, bytes)) in shapes.iter().enumerate().take(8) {
            assert!(
                rows <= 16 && bytes <= 64,
                "tile {t}: {rows} rows of {bytes} bytes do not fit a tile of 16 rows of 64"
            );
            c.rows[t] = rows as u8;
            c.bytes_per_row[t] = bytes as u16;
        }
        c
    }

    /// Loads this configuration on the calling thread (zeroing every tile).
    #[inline(always)]
    pub(super) unsafe fn load(&self) {
        asm!("ldtilecfg [{}]", in(reg) self, options(nostack, readonly, preserves_flags));
    }
}

/// Returns the tiles to their initial state (no configuration, no data to save).
#[inline(always)]
pub(super) unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem, preserves_flags));
}

/// Tile `T` := its configured rows from `base`, `stride` bytes apart.
#[inline(always)]
pub(super) unsafe fn load<const T: u8>(base: *const u8, stride: usize) {
    asm!(
        "tileloadd tmm{t}, [{base} + {stride} * 1]",
        t = const T,
        base = in(reg) base,
        stride = in(reg) stride,
        options(nostack, readonly, preserves_flags)
    );
}

/// Tile `T`'s configured rows to `base`, `stride` bytes apart.
#[inline(always)]
pub(super) unsafe fn store<const T: u8>(base: *mut u8, stride: usize) {
    asm!(
        "tilestored [{base} + {stride} * 1], tmm{t}",
        t = const T,
        base = in(reg) base,
        stride = in(reg) stride,
        options(nostack, preserves_flags)
    );
}

/// Tile `T` := 0.
#[inline(always)]
pub(super) unsafe fn zero<const T: u8>() {
    asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags));
}

/// `C[m][n] += sum_k A[m][k] * B[k / 4][4 n + k % 4]` in exact i32, `A` signed bytes and `B`
/// unsigned (`tdpbsud`), or both signed when `SIGNED_B` (`tdpbssd`).
#[inline(always)]
pub(super) unsafe fn dot<const C: u8, const A: u8, const B: u8, const SIGNED_B: bool>() {
    if SIGNED_B {
        asm!(
            "tdpbssd tmm{c}, tmm{a}, tmm{b}",
            c = const C, a = const A, b = const B,
            options(nostack, nomem, preserves_flags)
        );
    } else {
        asm!(
            "tdpbsud tmm{c}, tmm{a}, tmm{b}",
            c = const C, a = const A, b = const B,
            options(nostack, nomem, preserves_flags)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape check holds in release builds too (it needs no AMX: nothing is loaded).
    #[test]
    fn a_shape_larger_than_a_tile_is_refused() {
        let c = TileConfig::new(&[(16, 64), (2, 64), (0, 0)]);
        assert_eq!(
            (c.rows[..3].to_vec(), c.bytes_per_row[..3].to_vec()),
            (vec![16, 2, 0], vec![64, 64, 0])
        );
        for (shape, what) in [
            ((17, 64), "17 rows of 64 bytes"),
            ((16, 65), "16 rows of 65 bytes"),
        ] {
            let caught = std::panic::catch_unwind(|| {
                TileConfig::new(&[(16, 64), shape]);
            });
            let payload = caught.expect_err(what);
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default();
            assert_eq!(
                message,
                format!("tile 1: {what} do not fit a tile of 16 rows of 64")
            );
        }
    }
}
