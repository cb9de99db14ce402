//! [`simd_builds!`] and [`dispatch!`]: one kernel source compiled for AVX2 and for AVX-512
//! beside its portable build, and the pick of the widest build a pool may use.
//!
//! A kernel written as plain loops over fixed blocks, which the compiler vectorises, gives
//! the same bits in every build (lane-wise operations, no fused multiply-add unless the
//! source asks for one, no reassociation), so a caller may pick any build the CPU runs.

/// Defines `$avx2` and `$avx512`: `$portable` compiled with AVX2 enabled, and with AVX-512
/// (F, BW, VL) as well, the same source (so the same bits) in 256- and 512-bit registers.
macro_rules! simd_builds {
    ($portable:ident => $avx2:ident, $avx512:ident ($($arg:ident: $ty:ty),* $(,)?)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn $avx2($($arg: $ty),*) {
            $portable($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
        unsafe fn $avx512($($arg: $ty),*) {
            $portable($($arg),*)
        }
    };
}

/// Picks the widest build of a kernel ([`simd_builds`]) the pool may use.
macro_rules! dispatch {
    ($isa:expr, $portable:ident, $avx2:ident, $avx512:ident ( $($arg:expr),* )) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the pool reports AVX-512 only where the CPU has it.
            isa if isa.avx512() => unsafe { $avx512($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the pool reports AVX2 only where the CPU has it.
            isa if isa.avx2() => unsafe { $avx2($($arg),*) },
            _ => $portable($($arg),*),
        }
    };
}
pub(crate) use {dispatch, simd_builds};
