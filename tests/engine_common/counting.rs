//! A backend for the engine tests that must see what the engine asks of the device: the
//! CPU backend, observed, counting chosen kernel calls and the bytes downloaded.

use specdraft::backend::{BackendError, Call, CpuBackend, Observed, Observer};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The counts the engine tests ask about.
#[derive(Default)]
pub struct Counts {
    /// `copy_rows` calls (the capture kernel).
    pub copy_rows: AtomicUsize,
    /// `argmax` calls.
    pub argmax: AtomicUsize,
    /// Bytes downloaded (`copy_dtoh`).
    pub dtoh_bytes: AtomicUsize,
}

impl Counts {
    pub fn reset(&self) {
        for c in [&self.copy_rows, &self.argmax, &self.dtoh_bytes] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

impl Observer for Counts {
    fn observe(
        &self,
        call: Call,
        run: &mut dyn FnMut() -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        match call {
            Call::CopyRows(_) => self.copy_rows.fetch_add(1, Ordering::Relaxed),
            Call::Argmax(_) => self.argmax.fetch_add(1, Ordering::Relaxed),
            Call::Download { bytes } => self.dtoh_bytes.fetch_add(bytes, Ordering::Relaxed),
            _ => 0,
        };
        run()
    }
}

/// The CPU backend, counting the calls and bytes the engine tests ask about.
pub type Counting = Observed<CpuBackend, Counts>;

/// A fresh counting CPU backend.
pub fn counting() -> Counting {
    Observed::new(CpuBackend::new(), Counts::default())
}
