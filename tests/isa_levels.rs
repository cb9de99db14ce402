//! Which instruction-set levels the CPU kernels take, against the CPU's features as the Linux
//! kernel lists them in `/proc/cpuinfo` (read here independently of the library's run-time
//! detection): AVX-VNNI (VEX) and AVX-512 VNNI are separate features, so a CPU with the
//! second alone (Zen 4, Ice Lake) runs the 512-bit kernels, and a pool held to a level it
//! lacks runs the best level below that it has.

#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use specdraft::backend::quant::{Isa, KernelPool};
use std::collections::HashSet;

fn cpu_flags() -> HashSet<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").expect("Linux lists CPU features");
    let line = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .expect("a flags line");
    line.split_once(':')
        .expect("flags: ...")
        .1
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Whether the flags give a level every feature its kernels use (AMX also needs the OS's
/// grant, which the flags do not show, so it is only bounded from above).
fn flags_allow(flags: &HashSet<String>, isa: Isa) -> bool {
    let has = |names: &[&str]| names.iter().all(|n| flags.contains(*n));
    let avx2 = has(&["avx2", "fma", "f16c"]);
    let avx512_vnni = avx2 && has(&["avx512f", "avx512bw", "avx512vl", "avx512_vnni"]);
    match isa {
        Isa::Portable => true,
        Isa::Avx2 => avx2,
        Isa::Avx2Vnni => avx2 && has(&["avx_vnni"]),
        Isa::Avx512Vnni => avx512_vnni,
        Isa::Amx => avx512_vnni && has(&["amx_tile", "amx_int8"]),
    }
}

#[test]
fn each_level_is_supported_exactly_when_the_cpu_has_its_features() {
    let flags = cpu_flags();
    for isa in Isa::ALL {
        if isa == Isa::Amx {
            assert!(!isa.supported() || flags_allow(&flags, isa), "{isa:?}");
        } else {
            assert_eq!(isa.supported(), flags_allow(&flags, isa), "{isa:?}");
        }
    }
    assert!(Isa::detect().supported());
    assert!(Isa::ALL
        .iter()
        .all(|&i| !i.supported() || i <= Isa::detect()));
}

#[test]
fn a_pool_held_to_a_level_runs_the_best_supported_level_at_or_below_it() {
    let flags = cpu_flags();
    for asked in Isa::ALL {
        let pool = KernelPool::with_options(1, asked, KernelPool::DEFAULT_SPIN);
        let ran = pool.isa();
        assert!(ran <= asked, "asked {asked:?}, ran {ran:?}");
        assert!(
            ran == Isa::Amx || flags_allow(&flags, ran),
            "asked {asked:?}, ran {ran:?}, which this CPU lacks"
        );
        let best_below = Isa::ALL
            .into_iter()
            .filter(|&i| i <= asked && i != Isa::Amx && flags_allow(&flags, i))
            .max()
            .unwrap();
        if asked != Isa::Amx {
            assert_eq!(ran, best_below, "asked {asked:?}");
        } else {
            assert!(ran >= best_below, "asked {asked:?}, ran {ran:?}");
        }
    }
    // The default is the 512-bit level wherever the CPU has it, AMX or not.
    let default = KernelPool::new(1).isa();
    let want = if flags_allow(&flags, Isa::Avx512Vnni) {
        Isa::Avx512Vnni
    } else {
        Isa::Avx2Vnni.clamped()
    };
    assert_eq!(default, want);
}
