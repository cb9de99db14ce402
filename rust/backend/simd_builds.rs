//! [`simd_builds!`] and [`dispatch!`]: one kernel source compiled for AVX2 and for AVX-512
//! beside its portable build, and the pick of the widest build a pool may use.
//!
//! A kernel written as plain loops over fixed blocks, which the compiler vectorises, gives
//! the same bits in every build (lane-wise operations, no fused multiply-add unless the
//! source asks for one, no reassociation), so a caller may pick any build the CPU runs.
//!
//! The builds are safe functions that take the proof of their instruction set
//! ([`crate::backend::quant::Avx2Token`], [`crate::backend::quant::Avx512Token`]) as their
//! first argument, and [`dispatch!`] takes a [`crate::backend::quant::SupportedIsa`]: no
//! flag can make them run instructions the CPU lacks.

/// Defines `$avx2` and `$avx512`: `$portable` compiled with AVX2 enabled, and with AVX-512
/// (F, BW, VL) as well, the same source (so the same bits) in 256- and 512-bit registers,
/// each callable with the proof that the CPU runs it.
macro_rules! simd_builds {
    ($portable:ident => $avx2:ident, $avx512:ident ($($arg:ident: $ty:ty),* $(,)?)) => {
        #[cfg(target_arch = "x86_64")]
        #[inline]
        fn $avx2(_: $crate::backend::quant::Avx2Token, $($arg: $ty),*) {
            #[target_feature(enable = "avx2")]
            unsafe fn build($($arg: $ty),*) {
                $portable($($arg),*)
            }
            // SAFETY: the token proves that this CPU runs AVX2.
            unsafe { build($($arg),*) }
        }

        #[cfg(target_arch = "x86_64")]
        #[inline]
        fn $avx512(_: $crate::backend::quant::Avx512Token, $($arg: $ty),*) {
            #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
            unsafe fn build($($arg: $ty),*) {
                $portable($($arg),*)
            }
            // SAFETY: the token proves that this CPU runs AVX2 and AVX-512 F, BW and VL.
            unsafe { build($($arg),*) }
        }
    };
}

/// Runs the widest build of a kernel ([`simd_builds`]) that `$level` (a
/// [`crate::backend::quant::SupportedIsa`], such as a pool's) proves this CPU runs.
macro_rules! dispatch {
    ($level:expr, $portable:ident, $avx2:ident, $avx512:ident ( $($arg:expr),* )) => {{
        let level: $crate::backend::quant::SupportedIsa = $level;
        match (level.avx512(), level.avx2()) {
            #[cfg(target_arch = "x86_64")]
            (Some(proof), _) => $avx512(proof, $($arg),*),
            #[cfg(target_arch = "x86_64")]
            (None, Some(proof)) => $avx2(proof, $($arg),*),
            _ => $portable($($arg),*),
        }
    }};
}
pub(crate) use {dispatch, simd_builds};
