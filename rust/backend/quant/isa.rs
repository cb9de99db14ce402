//! [`Isa`]: the instruction sets the CPU kernels can use, detected once at run time.
//!
//! The levels form a chain, each a superset of the one before it, so `min` of two is what
//! both can run and a pool can be held to any level at or below the CPU's. Every level gives
//! the same bits; a level only changes how fast.
//!
//! AMX is the one level the operating system must also grant: Linux leaves the 8 KiB tile
//! state off until a process asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and refuses
//! when it cannot (an old kernel, a signal stack too small for the larger state). The
//! request is made once, at the first detection, and a refusal leaves the CPU at the level
//! below: nothing else changes, and no tile instruction ever runs ungranted.

use std::sync::OnceLock;

/// Instruction sets the kernels can use, detected at run time, each a superset of the one
/// before it (so `min` of two is what both can run).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, every CPU: the definition the others match bit for bit.
    Portable,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// AVX2 plus AVX-VNNI: the legacy-format quantized dots use `vpdpbusd`.
    Avx2Vnni,
    /// AVX2, AVX-VNNI and AVX-512 (F, BW, VL, VNNI): the legacy-format quantized dots of a
    /// few rows take two eight-row groups per 512-bit register. (A CPU with AVX-512 VNNI but
    /// not AVX-VNNI, as before Sapphire Rapids, runs [`Isa::Avx2`].)
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

    /// The best this CPU supports (detected once; AMX also asks the OS for the tiles).
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(detect_once)
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
        Isa::detect().min(Isa::Avx512Vnni)
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
        Isa::ALL
            .into_iter()
            .filter(|&isa| isa <= Isa::detect())
            .collect()
    }
}

fn detect_once() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        if std::arch::is_x86_feature_detected!("avxvnni") {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                if amx_int8_granted() {
                    return Isa::Amx;
                }
                return Isa::Avx512Vnni;
            }
            return Isa::Avx2Vnni;
        }
        return Isa::Avx2;
    }
    Isa::Portable
}

/// Whether the CPU has AMX-TILE and AMX-INT8, the OS saves their state, and this process
/// may use it. `is_x86_feature_detected!` does not name the AMX features on stable Rust, so
/// CPUID and XCR0 are read directly.
#[cfg(target_arch = "x86_64")]
fn amx_int8_granted() -> bool {
    use std::arch::x86_64::__cpuid_count;
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
