//! [`Observed`]: a backend that passes every call on to an inner backend, each one handed to
//! an [`Observer`] on the way, to time it, count it or log it. Profilers and tests that
//! assert what an engine asks of the device wrap a backend in one instead of forwarding
//! every method themselves; a new kernel is one line of `observed_calls!` here, and an
//! observer that does not care about it needs no change.
//!
//! Invariants:
//! - Every call is handed to the observer once, and reaches the inner backend, with the
//!   arguments it was given, each time the observer runs it (the default observer: once);
//!   the call returns what the observer returns (the default: the inner backend's result,
//!   unchanged).
//! - Allocation, freeing, streams, the ledger and `as_any` are the inner backend's, not
//!   observed: a model that downcasts its backend to the CPU backend finds it through the
//!   wrapper.

use super::kernels::*;
use super::{AllocationLedger, BackendError, DevicePtr, GpuBackend};
use std::any::Any;

/// Sees each call an [`Observed`] backend passes on, and makes it by calling `run`.
pub trait Observer: Send + Sync {
    /// Called for each call, which `run` makes on the inner backend; returns its result.
    /// The default only runs it.
    fn observe(
        &self,
        call: Call,
        run: &mut dyn FnMut() -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let _ = call;
        run()
    }
}

/// A backend whose calls go to `inner` through `observer` (see the module doc).
pub struct Observed<B, O> {
    /// The backend that does the work.
    pub inner: B,
    /// What sees each call.
    pub observer: O,
}

impl<B: GpuBackend, O: Observer> Observed<B, O> {
    /// `inner`, its calls handed to `observer`.
    pub fn new(inner: B, observer: O) -> Self {
        Observed { inner, observer }
    }
}

/// Writes [`Call`] (one variant a kernel, then the copies), its `name`, and the forwarding
/// [`Kernels`] implementation, from one list of `method(Args) => Variant`.
macro_rules! observed_calls {
    ($($method:ident($args:ty) => $variant:ident),+ $(,)?) => {
        /// One call an [`Observed`] backend passes on, with its arguments.
        #[derive(Clone, Copy, Debug)]
        #[non_exhaustive]
        pub enum Call {
            $(
                #[doc = concat!("[`Kernels::", stringify!($method), "`].")]
                $variant($args),
            )+
            /// [`GpuBackend::copy_htod`] of this many bytes.
            Upload {
                /// The bytes the call moves or sets.
                bytes: usize,
            },
            /// [`GpuBackend::copy_dtoh`] of this many bytes.
            Download {
                /// The bytes the call moves or sets.
                bytes: usize,
            },
            /// [`GpuBackend::copy_dtod`] of this many bytes.
            CopyDtod {
                /// The bytes the call moves or sets.
                bytes: usize,
            },
            /// [`GpuBackend::memset`] of this many bytes.
            Memset {
                /// The bytes the call moves or sets.
                bytes: usize,
            },
        }

        impl Call {
            /// The name of the backend method the call is.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Call::$variant(_) => stringify!($method),)+
                    Call::Upload { .. } => "copy_htod",
                    Call::Download { .. } => "copy_dtoh",
                    Call::CopyDtod { .. } => "copy_dtod",
                    Call::Memset { .. } => "memset",
                }
            }
        }

        impl<B: GpuBackend, O: Observer> Kernels for Observed<B, O> {
            $(
                fn $method(&self, args: $args) -> Result<(), BackendError> {
                    self.observer.observe(Call::$variant(args), &mut || self.inner.$method(args))
                }
            )+
        }
    };
}

observed_calls! {
    embedding(EmbeddingArgs) => Embedding,
    rms_norm(RmsNormArgs) => RmsNorm,
    elementwise(ElementwiseArgs) => Elementwise,
    linear(LinearArgs) => Linear,
    grouped_linear(GroupedLinearArgs) => GroupedLinear,
    rope(RopeArgs) => Rope,
    kv_write(KvWriteArgs) => KvWrite,
    paged_attention(PagedAttentionArgs) => PagedAttention,
    argmax(ArgmaxArgs) => Argmax,
    softmax(SoftmaxArgs) => Softmax,
    pick(PickArgs) => Pick,
    top_k(TopKArgs) => TopK,
    copy_rows(CopyRowsArgs) => CopyRows,
    kv_copy(KvCopyArgs) => KvCopy,
    mla_attention(MlaAttentionArgs) => MlaAttention,
}

impl<B: GpuBackend, O: Observer> GpuBackend for Observed<B, O> {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn ledger(&self) -> &AllocationLedger {
        self.inner.ledger()
    }
    fn alloc(&self, nbytes: usize, tag: &str) -> Result<DevicePtr, BackendError> {
        self.inner.alloc(nbytes, tag)
    }
    fn free(&self, ptr: DevicePtr) -> Result<(), BackendError> {
        self.inner.free(ptr)
    }
    fn copy_htod(&self, dst: DevicePtr, src: &[u8], stream: u64) -> Result<(), BackendError> {
        let call = Call::Upload { bytes: src.len() };
        self.observer
            .observe(call, &mut || self.inner.copy_htod(dst, src, stream))
    }
    fn copy_dtoh(&self, dst: &mut [u8], src: DevicePtr, stream: u64) -> Result<(), BackendError> {
        let call = Call::Download { bytes: dst.len() };
        self.observer
            .observe(call, &mut || self.inner.copy_dtoh(dst, src, stream))
    }
    fn copy_dtod(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let call = Call::CopyDtod { bytes: nbytes };
        self.observer
            .observe(call, &mut || self.inner.copy_dtod(dst, src, nbytes, stream))
    }
    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let call = Call::Memset { bytes: nbytes };
        self.observer
            .observe(call, &mut || self.inner.memset(dst, value, nbytes, stream))
    }
    fn create_stream(&self) -> Result<u64, BackendError> {
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: u64) -> Result<(), BackendError> {
        self.inner.destroy_stream(stream)
    }
    fn synchronize(&self, stream: u64) -> Result<(), BackendError> {
        self.inner.synchronize(stream)
    }
    fn as_any(&self) -> &dyn Any {
        self.inner.as_any()
    }
}

#[cfg(test)]
mod tests {
    use super::{Call, Observed, Observer};
    use crate::backend::{
        ArgmaxArgs, BackendError, CpuBackend, GpuBackend, GpuBackendExt, Kernels, DEFAULT_STREAM,
    };
    use std::sync::Mutex;

    /// Records each call's name and size, and refuses memsets.
    #[derive(Default)]
    struct Log(Mutex<Vec<(&'static str, usize)>>);

    impl Observer for Log {
        fn observe(
            &self,
            call: Call,
            run: &mut dyn FnMut() -> Result<(), BackendError>,
        ) -> Result<(), BackendError> {
            let size = match call {
                Call::Upload { bytes } | Call::Download { bytes } | Call::CopyDtod { bytes } => {
                    bytes
                }
                Call::Argmax(a) => a.rows,
                _ => 0,
            };
            self.0.lock().unwrap().push((call.name(), size));
            if let Call::Memset { .. } = call {
                return Err(BackendError::InvalidArgument {
                    op: "memset",
                    message: "refused".into(),
                });
            }
            run()
        }
    }

    #[test]
    fn every_call_reaches_the_inner_backend_once_through_the_observer() {
        let gpu = Observed::new(CpuBackend::new(), Log::default());
        let logits = gpu
            .upload(&[0.5f32, 3.0, -1.0, 2.0, 9.0, 1.0], "logits")
            .unwrap();
        let out = gpu.alloc(8, "picks").unwrap();
        let args = ArgmaxArgs {
            out,
            logits,
            bitmask: None,
            rows: 2,
            vocab: 3,
            stream: DEFAULT_STREAM,
        };
        gpu.argmax(args).unwrap();
        assert_eq!(gpu.download::<u32>(out, 2).unwrap(), vec![1, 1]);
        // An argument error is the inner backend's, word for word.
        let wrong = ArgmaxArgs { rows: 3, ..args };
        let ours = gpu.argmax(wrong).unwrap_err().to_string();
        assert_eq!(ours, gpu.inner.argmax(wrong).unwrap_err().to_string());
        let refused = gpu.memset(out, 0, 8, DEFAULT_STREAM).unwrap_err();
        assert_eq!(refused.to_string(), "memset: refused");
        assert_eq!(
            gpu.download::<u32>(out, 2).unwrap(),
            vec![1, 1],
            "a refused call ran"
        );
        assert_eq!(
            *gpu.observer.0.lock().unwrap(),
            vec![
                ("copy_htod", 24),
                ("argmax", 2),
                ("copy_dtoh", 8),
                ("argmax", 3),
                ("memset", 0),
                ("copy_dtoh", 8),
            ]
        );
        gpu.free(logits).unwrap();
        gpu.free(out).unwrap();
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}
