//! The allocation ledger under random alloc/free sequences, and its error cases.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{BackendError, CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};

#[test]
fn counts_are_exact_after_random_alloc_free() {
    let gpu = CpuBackend::new();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut live: Vec<(DevicePtr, usize)> = Vec::new();
    for step in 0..5000 {
        if live.is_empty() || rng.random_bool(0.55) {
            let n = rng.random_range(1..4096);
            let p = gpu.alloc(n, &format!("step{step}")).unwrap();
            assert!(!p.is_null());
            live.push((p, n));
        } else {
            let (p, _) = live.swap_remove(rng.random_range(0..live.len()));
            gpu.free(p).unwrap();
        }
        assert_eq!(gpu.ledger().live_count(), live.len());
        assert_eq!(
            gpu.ledger().live_bytes(),
            live.iter().map(|(_, n)| n).sum::<usize>()
        );
    }
    let report = gpu.ledger().live_report();
    assert_eq!(report.len(), live.len());
    for (p, n) in &live {
        assert!(report.iter().any(|a| a.ptr == *p && a.nbytes == *n));
    }
    for (p, _) in live {
        gpu.free(p).unwrap();
    }
    assert_eq!(gpu.ledger().live_count(), 0);
    assert_eq!(gpu.ledger().live_bytes(), 0);
}

#[test]
fn double_free_unknown_pointer_and_zero_size_are_errors() {
    let gpu = CpuBackend::new();
    let p = gpu.alloc(16, "once").unwrap();
    gpu.free(p).unwrap();
    match gpu.free(p) {
        Err(BackendError::DoubleFree { tag, .. }) => assert_eq!(tag, "once"),
        other => panic!("expected a double free error, got {other:?}"),
    }
    let q = gpu.alloc(16, "inner").unwrap();
    assert!(matches!(
        gpu.free(q.offset(4)),
        Err(BackendError::UnknownPointer { .. })
    ));
    assert!(matches!(
        gpu.free(DevicePtr(12345)),
        Err(BackendError::UnknownPointer { .. })
    ));
    assert!(matches!(
        gpu.alloc(0, "empty"),
        Err(BackendError::ZeroSizedAlloc { .. })
    ));
    gpu.free(q).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn copies_past_the_end_are_errors_and_touch_nothing() {
    let gpu = CpuBackend::new();
    let a = gpu.upload(&[1u32, 2, 3, 4], "a").unwrap();
    let b = gpu.upload(&[9u32; 4], "b").unwrap();
    let err = gpu.copy_htod(a.offset(8), &[0u8; 9], 0).unwrap_err();
    assert!(matches!(err, BackendError::OutOfBounds { .. }), "{err}");
    assert!(err.to_string().contains("\"a\""), "{err}");
    let mut host = [0u8; 17];
    assert!(gpu.copy_dtoh(&mut host, a, 0).is_err());
    assert!(gpu.copy_dtod(b, a.offset(4), 16, 0).is_err());
    assert!(gpu.memset(a, 0, 17, 0).is_err());
    assert_eq!(gpu.download::<u32>(a, 4).unwrap(), vec![1, 2, 3, 4]);
    assert_eq!(gpu.download::<u32>(b, 4).unwrap(), vec![9; 4]);
    // In-bounds copies work, overlapping included.
    gpu.copy_dtod(a.offset(4), a, 8, 0).unwrap();
    assert_eq!(gpu.download::<u32>(a, 4).unwrap(), vec![1, 1, 2, 4]);
    gpu.free(a).unwrap();
    assert!(
        gpu.download::<u32>(a, 1).is_err(),
        "reading a freed buffer must fail"
    );
    gpu.free(b).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn streams_are_checked_and_memory_limit_is_an_error() {
    let gpu = CpuBackend::with_memory_limit(1000);
    let s = gpu.create_stream().unwrap();
    assert_ne!(s, 0);
    gpu.synchronize(s).unwrap();
    gpu.destroy_stream(s).unwrap();
    assert!(matches!(
        gpu.synchronize(s),
        Err(BackendError::UnknownStream(_))
    ));
    let p = gpu.alloc(600, "big").unwrap();
    let err = gpu.alloc(600, "too much").unwrap_err();
    assert!(
        matches!(err, BackendError::OutOfMemory { requested: 600, .. }),
        "{err}"
    );
    gpu.free(p).unwrap();
    let bf = gpu.upload_bf16(&[1.0, -2.5, 0.1], "bf16").unwrap();
    let back = gpu.download_bf16(bf, 3).unwrap();
    assert_eq!(&back[..2], &[1.0, -2.5]);
    assert!((back[2] - 0.1).abs() < 1e-3);
    gpu.free(bf).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
}
