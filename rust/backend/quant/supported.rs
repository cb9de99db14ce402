//! Proofs that this CPU runs an instruction set, handed to the kernels that use one.
//!
//! Running an instruction the CPU lacks is undefined behaviour, not a clean fault, so no safe
//! function may run target-feature code on the word of a plain `bool` or [`Isa`]: a wrong
//! value, passed by any caller, would be enough. The kernels take these values instead, which
//! only run-time detection makes:
//! - [`SupportedIsa`]: an [`Isa`] level this CPU runs ([`Isa::supported`] said so), what a
//!   [`super::KernelPool`] holds and hands its kernels;
//! - [`Avx2Token`] (AVX2, FMA, F16C) and [`Avx512Token`] (those and AVX-512 F, BW, VL): made
//!   only from a `SupportedIsa` whose level includes those features, and passed by value to
//!   the code that runs them. They are zero-sized, so passing one costs nothing; they are
//!   asked for once per call or task, never in a hot loop.
//!
//! Invariant: no field is public and no constructor skips detection, so holding one of these
//! is the proof. An `unsafe` block that runs a set's instructions on a token's word says so.

use super::Isa;

/// An [`Isa`] level this CPU runs: every level's kernels may run with it (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SupportedIsa(Isa);

/// Proof that this CPU has AVX2, FMA and F16C ([`SupportedIsa::avx2`]).
#[derive(Clone, Copy, Debug)]
pub struct Avx2Token(());

/// Proof that this CPU has AVX-512 F, BW and VL, and everything [`Avx2Token`] proves
/// ([`SupportedIsa::avx512`]).
#[derive(Clone, Copy, Debug)]
pub struct Avx512Token(());

impl SupportedIsa {
    /// The portable level, which every CPU runs.
    pub const PORTABLE: SupportedIsa = SupportedIsa(Isa::Portable);

    /// The best level this CPU runs at or below `isa` ([`Isa::clamped`]).
    pub fn at_most(isa: Isa) -> SupportedIsa {
        SupportedIsa(isa.clamped())
    }

    /// The level itself.
    pub fn isa(self) -> Isa {
        self.0
    }

    /// The AVX2 proof, where the level includes AVX2 (every level from [`Isa::Avx2`] up
    /// requires AVX2, FMA and F16C of the CPU).
    #[inline(always)]
    pub fn avx2(self) -> Option<Avx2Token> {
        self.0.avx2().then_some(Avx2Token(()))
    }

    /// The AVX-512 proof, where the level includes AVX-512 (every level from
    /// [`Isa::Avx512Vnni`] up requires AVX-512 F, BW, VL and VNNI, and AVX2, of the CPU).
    #[inline(always)]
    pub fn avx512(self) -> Option<Avx512Token> {
        self.0.avx512().then_some(Avx512Token(()))
    }
}

impl Avx512Token {
    /// The AVX2 proof this one includes.
    #[inline(always)]
    pub fn avx2(self) -> Avx2Token {
        Avx2Token(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proof exists exactly where the CPU has the features it stands for, whatever level
    /// is asked for (read here from `is_x86_feature_detected!`, not from the levels' table).
    #[test]
    fn proofs_exist_exactly_where_the_cpu_has_their_features() {
        #[cfg(target_arch = "x86_64")]
        let (avx2, avx512) = {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            (
                avx2,
                avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl"),
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (avx2, avx512) = (false, false);
        // What a checker's run covered (scripts/unsafe-check.sh reads this line).
        let names: Vec<_> = Isa::available().iter().map(|i| i.name()).collect();
        eprintln!("instruction sets this CPU runs: {}", names.join(", "));
        for asked in Isa::ALL {
            let level = SupportedIsa::at_most(asked);
            assert!(level.isa() <= asked, "asked {asked:?}");
            assert!(level.isa().supported(), "asked {asked:?}");
            if level.avx2().is_some() {
                assert!(avx2, "an AVX2 proof without AVX2 (asked {asked:?})");
            }
            if level.avx512().is_some() {
                assert!(avx512, "an AVX-512 proof without AVX-512 (asked {asked:?})");
            }
        }
        assert!(SupportedIsa::PORTABLE.avx2().is_none());
        assert!(SupportedIsa::PORTABLE.avx512().is_none());
        // The best level gives every proof the CPU can back.
        let best = SupportedIsa::at_most(Isa::Amx);
        assert_eq!(best.avx2().is_some(), avx2);
        if avx512 && Isa::Avx512Vnni.supported() {
            assert!(best.avx512().is_some());
        }
    }
}
