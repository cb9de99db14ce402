//! [`Isa`]: the instruction sets the CPU kernels can use, detected once at run time.
//!
//! The levels are ordered by what their kernels need, and each level's kernels use only its
//! own features: every level from AVX2 up includes AVX2, FMA and F16C, [`Isa::Amx`] includes
//! [`Isa::Avx512Vnni`], but [`Isa::Avx2Vnni`] (the VEX-encoded AVX-VNNI) and
//! [`Isa::Avx512Vnni`] are separate CPU features: Alder Lake has the first only, Ice Lake,
//! Cascade Lake and Zen 4 the second only, Sapphire Rapids and Zen 5 both. So a CPU supports
//! a set of levels, not every level below its best; [`Isa::supported`] says which, and a pool
//! asked for a level runs the best supported one at or below it. Every level gives the same
//! bits; a level only changes how fast.
//!
//! AMX is the one level the operating system must also grant: Linux leaves the 8 KiB tile
//! state off until a process asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and refuses
//! when it cannot (an old kernel, a signal stack too small for the larger state). The
//! request is made once, at the first detection, and a refusal leaves the CPU at the level
//! below: nothing else changes, and no tile instruction ever runs ungranted.

use std::sync::OnceLock;

/// Instruction sets the kernels can use, detected at run time, ordered by what their kernels
/// need (see the module doc for which a CPU supports).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, every CPU: the definition the others match bit for bit.
    Portable,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// AVX2 plus AVX-VNNI: the legacy-format quantized dots use `vpdpbusd`.
    Avx2Vnni,
    /// AVX2 and AVX-512 (F, BW, VL, VNNI), with or without AVX-VNNI: the legacy-format
    /// quantized dots of a few rows take two eight-row groups per 512-bit register.
    Avx512Vnni,
    /// [`Isa::Avx512Vnni`] plus AMX-INT8 tile multiplies (Sapphire Rapids and later), granted
    /// by the operating system: the legacy-format quantized dots of calls of several rows
    /// (a verify step, a batch, a prefill chunk) run on the tiles.
    Amx,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 5] = [
        Isa::Portable,
        Isa::Avx2,
        Isa::Avx2Vnni,
        Isa::Avx512Vnni,
        Isa::Amx,
    ];

    /// Its name as the command line and the Python API spell it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx2Vnni => "avx2-vnni",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Amx => "amx",
        }
    }

    /// The best this CPU supports (detected once; AMX also asks the OS for the tiles): the
    /// highest level, clamped.
    pub fn detect() -> Isa {
        Isa::Amx.clamped()
    }

    /// Whether this CPU runs this level's kernels (detected once; AMX also asks the OS for
    /// the tiles).
    pub fn supported(self) -> bool {
        static SUPPORTED: OnceLock<[bool; Isa::ALL.len()]> = OnceLock::new();
        let table = SUPPORTED.get_or_init(|| Isa::ALL.map(detect_level));
        table[self as usize]
    }

    /// The best level this CPU supports at or below `self`: what a pool asked for `self`
    /// runs.
    pub fn clamped(self) -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|&isa| isa <= self && isa.supported())
            .unwrap_or(Isa::Portable)
    }

    /// The level a pool runs unless told otherwise ([`super::KernelPool::new`]): the best this
    /// CPU supports, except that AMX tiles run only where asked for
    /// ([`super::KernelPool::with_options`]). On a Sapphire Rapids class machine the 512-bit
    /// VNNI kernel is faster than the tiles at every row count a forward makes (SmolLM2's
    /// linears on two threads, `quant_linear -- --step`: 16 rows 11.2-12.0 ms against
    /// 14.0-14.4, 64 rows 35.6-37.0 against 38.0-39.4, 128 rows 67-68 against 77-81; its
    /// 384-token prompt 1364-1427 tokens/s against 1297-1319): the tiles' per-block scale
    /// pass and tile stores cost more than the multiplies they save.
    pub fn preferred() -> Isa {
        Isa::Avx512Vnni.clamped()
    }

    /// Whether the AVX2 kernels run (every op but the legacy quantized dots reads no more).
    pub fn avx2(self) -> bool {
        self >= Isa::Avx2
    }

    /// Whether AVX-512 (F, BW, VL) may be used: the kernels compiled for 512-bit registers.
    pub fn avx512(self) -> bool {
        self >= Isa::Avx512Vnni
    }

    /// The SIMD instruction sets this CPU runs (every one from AVX2 up), lowest first: the
    /// levels a comparison of kernels forces in turn.
    pub fn available_simd() -> Vec<Isa> {
        Self::available().into_iter().filter(|i| i.avx2()).collect()
    }

    /// Every instruction set this CPU runs, the portable one first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.supported()).collect()
    }
}

/// Whether the CPU (and, for AMX, the OS) gives `isa` every feature its kernels use.
fn detect_level(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
        let avx512_vnni = avx512 && has!("avx512vnni");
        match isa {
            Isa::Portable => true,
            Isa::Avx2 => avx2,
            Isa::Avx2Vnni => avx2 && has!("avxvnni"),
            Isa::Avx512Vnni => avx512_vnni,
            Isa::Amx => avx512_vnni && amx_int8_granted(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        isa == Isa::Portable
    }
}

#[cfg(target_arch = "x86_64")]
fn amx_int8_granted() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // Miri (scripts/unsafe-check.sh) runs no inline assembly, `cpuid` or the tiles' alike.
    if cfg!(miri) {
        return false;
    }
    let (leaf1, leaf7) = (__cpuid_count(1, 0), __cpuid_count(7, 0));
    let osxsave = leaf1.ecx & (1 << 27) != 0;
    let (tile, int8) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 25) != 0);
    if !(osxsave && tile && int8) {
        return false;
    }
    // XCR0 bits 17 and 18: the OS manages the tile configuration and the tile data.
    // SAFETY: OSXSAVE is set, so XGETBV is enabled.
    let xcr0 = unsafe { read_xcr0() };
    if xcr0 & (0b11 << 17) != 0b11 << 17 {
        return false;
    }
    request_tile_data()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn read_xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

/// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`); a
/// refusal is an answer, not an error.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this arch_prctl reads and writes no memory of ours; it only changes which
    // state components the kernel lets this process use.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// Other systems: the tiles are not used (their grant differs, and nothing here tests it).
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_data() -> bool {
    false
}
