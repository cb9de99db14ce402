//! `DevicePtr`: an address in a backend's memory.
//!
//! It is a bare `u64` on purpose: it crosses the FFI boundary and the protocol by value,
//! has no `Drop`, and is only meaningful together with the backend that produced it.

use std::fmt;

/// An address in device memory (or, on the CPU backend, in its host-memory arena).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null address; never returned by a successful allocation.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// Whether this is [`DevicePtr::NULL`].
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address `bytes` further on (no bounds check: the ledger checks on use).
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }

    /// The raw address.
    pub fn addr(self) -> u64 {
        self.0
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_and_offset() {
        assert!(DevicePtr::NULL.is_null());
        let p = DevicePtr(0x1000);
        assert!(!p.is_null());
        assert_eq!(p.offset(16), DevicePtr(0x1010));
        assert_eq!(p.offset(0), p);
        assert_eq!(format!("{p:?}"), "DevicePtr(0x1000)");
    }
}
