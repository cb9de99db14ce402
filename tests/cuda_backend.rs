//! `CudaBackend` (feature `cuda`). Without a driver or device, `new` must return the
//! documented error and never panic (plain tests, run everywhere); with a GPU, every op must
//! match the CPU reference (the cases and tolerances of `kernel_cases/mod.rs`). The GPU
//! tests are ignored in a plain `cargo test` (reported as ignored, never as passed);
//! `tests/gpu/run.sh` runs them with `--ignored`, where a missing device is a failure.

#[path = "kernel_cases/mod.rs"]
mod kernel_cases;

use kernel_cases as k;
use specdraft::backend::{
    default_backend, BackendError, CudaBackend, Dtype, GpuBackend, GpuBackendExt, RopeStyle,
};

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| {
        panic!("this test needs a CUDA GPU (tests/gpu/run.sh runs it on one): {e}")
    })
}

fn check(dut: &CudaBackend, result: Result<(), String>) {
    if let Err(e) = result {
        panic!("{e}");
    }
    assert_eq!(
        dut.ledger().live_count(),
        0,
        "leaked: {:?}",
        dut.ledger().live_report()
    );
}

#[test]
fn new_without_a_device_is_a_clear_error() {
    let result = std::panic::catch_unwind(|| CudaBackend::new(0).map(|_| ()));
    let result = result.expect("CudaBackend::new panicked");
    match result {
        Ok(()) => eprintln!("a CUDA device is present; the error path is checked by device 4096"),
        Err(BackendError::CudaUnavailable(msg)) => {
            assert!(
                msg.contains("no CUDA driver (libcuda) found") || msg.contains("no CUDA device 0"),
                "{msg}"
            );
        }
        Err(other) => panic!("expected CudaUnavailable, got {other}"),
    }
    match CudaBackend::new(4096) {
        Err(BackendError::CudaUnavailable(msg)) => {
            assert!(
                msg.contains("libcuda") || msg.contains("no CUDA device 4096"),
                "{msg}"
            )
        }
        Err(other) => panic!("expected CudaUnavailable, got {other}"),
        Ok(_) => panic!("device 4096 does not exist"),
    }
}

#[test]
fn default_backend_always_works() {
    let b = default_backend();
    let p = b.upload(&[1u32, 2, 3], "t").unwrap();
    assert_eq!(b.download::<u32>(p, 3).unwrap(), vec![1, 2, 3]);
    b.free(p).unwrap();
    assert_eq!(b.ledger().live_count(), 0);
    assert_eq!(b.name().starts_with("cuda:"), CudaBackend::new(0).is_ok());
}

#[test]
#[ignore = "needs a CUDA GPU; tests/gpu/run.sh runs it"]
fn gpu_memory_copies_and_ledger() {
    let g = gpu();
    let p = g.upload(&[1u8, 2, 3, 4, 5, 6, 7, 8], "t").unwrap();
    g.memset(p.offset(2), 9, 3, 0).unwrap();
    assert_eq!(
        g.download::<u8>(p, 8).unwrap(),
        vec![1, 2, 9, 9, 9, 6, 7, 8]
    );
    assert!(matches!(
        g.memset(p, 0, 9, 0),
        Err(BackendError::OutOfBounds { .. })
    ));
    let s = g.create_stream().unwrap();
    g.copy_dtod(p.offset(4), p, 4, s).unwrap();
    g.synchronize(s).unwrap();
    assert_eq!(
        g.download::<u8>(p, 8).unwrap(),
        vec![1, 2, 9, 9, 1, 2, 9, 9]
    );
    g.destroy_stream(s).unwrap();
    assert!(matches!(
        g.synchronize(s),
        Err(BackendError::UnknownStream(_))
    ));
    g.free(p).unwrap();
    assert!(matches!(g.free(p), Err(BackendError::DoubleFree { .. })));
    assert_eq!(g.ledger().live_count(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU; tests/gpu/run.sh runs it"]
fn gpu_ops_match_reference() {
    let g = gpu();
    check(&g, k::embedding(&g, 7, 577, 50, 11));
    check(&g, k::rms_norm(&g, 7, 577, 21, false));
    check(&g, k::rms_norm(&g, 3, 4096, 22, true));
    check(&g, k::add_silu(&g, 100_000, 31));
    for (rows, inf, outf) in [(1, 4096, 1000), (3, 577, 17), (7, 576, 300)] {
        check(&g, k::linear(&g, rows, inf, outf, Dtype::Bf16, true, 41));
        check(&g, k::linear(&g, rows, inf, outf, Dtype::F32, false, 42));
        check(
            &g,
            k::linear_nvfp4(&g, rows, inf / 16 * 16, outf, Dtype::Bf16, true, 51),
        );
        check(&g, k::linear_fp8(&g, rows, inf, outf, Dtype::F32, true, 55));
    }
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        check(&g, k::rope(&g, 7, 9, 64, 64, style, 61));
    }
    check(&g, k::kv_write(&g, 7, 3, 64, 100, 71));
    check(&g, k::kv_copy(&g, 3, 64, 16, 13, &[1, 4, 5, 9], 73));
    check(
        &g,
        k::paged_attention(&g, &[1, 17, 300], 1, 9, 3, 64, 16, 81),
    );
    check(&g, k::paged_attention(&g, &[5, 33], 5, 4, 2, 128, 8, 82));
    check(&g, k::paged_attention_tree(&g, 85));
    check(
        &g,
        k::mla_attention(&g, &[1, 17, 300], 3, (3, 10, 6, 4, 5, 4), 91),
    );
    check(
        &g,
        k::mla_attention(&g, &[33, 200], 4, (16, 512, 128, 64, 128, 16), 92),
    );
    check(&g, k::argmax(&g, 3, 49152, false, 91));
    check(&g, k::argmax(&g, 3, 49152, true, 92));
    check(&g, k::softmax(&g, 3, 49152, 0.7, false, 101));
    check(&g, k::softmax(&g, 2, 577, 1.0, true, 102));
    check(&g, k::pick(&g, 300, 7, 121));
    check(&g, k::pick(&g, 4, 49152, 122));
    check(&g, k::top_k(&g, 6, 8192, 4, true, 131));
    check(&g, k::top_k(&g, 6, 49152, 8, false, 132));
    check(&g, k::copy_rows(&g, 7, 577, 600, 3, 2, 111));
}

#[test]
#[ignore = "needs a CUDA GPU; tests/gpu/run.sh runs it"]
fn gpu_rejects_what_the_reference_rejects() {
    let g = gpu();
    check(&g, k::same_errors(&g));
}
