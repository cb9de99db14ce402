//! The allocation ledger every backend shares.
//!
//! Invariants:
//! - `live_count` / `live_bytes` equal exactly the allocations recorded and not yet freed.
//! - Every recorded allocation has a tag, so a leak report says who allocated what.
//! - A free of a freed or unknown pointer, and a range that does not lie in one live
//!   allocation, are errors; the ledger is never left half-updated by a failed call.

use super::{BackendError, DevicePtr};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

/// How many freed allocations are remembered to tell a double free from an unknown pointer.
const FREED_MEMORY: usize = 4096;

/// One allocation that is still live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveAllocation {
    /// Its first byte.
    pub ptr: DevicePtr,
    /// Its size in bytes.
    pub nbytes: usize,
    /// What the allocator said it is for.
    pub tag: String,
}

#[derive(Default)]
struct LedgerInner {
    live: BTreeMap<u64, (usize, String)>,
    live_bytes: usize,
    freed: HashMap<u64, String>,
    freed_order: VecDeque<u64>,
}

/// Counts and tags of live device allocations; shared by every backend.
#[derive(Default)]
pub struct AllocationLedger {
    inner: Mutex<LedgerInner>,
}

impl AllocationLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LedgerInner> {
        // A panic while holding the lock cannot leave the maps inconsistent (every update
        // is a single insert/remove), so a poisoned lock is still safe to use.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a new allocation at `ptr`.
    pub fn record_alloc(&self, ptr: DevicePtr, nbytes: usize, tag: &str) {
        let mut inner = self.lock();
        inner.freed.remove(&ptr.0);
        inner.live.insert(ptr.0, (nbytes, tag.to_string()));
        inner.live_bytes += nbytes;
    }

    /// Checks that `ptr` may be freed and returns its size and tag, without forgetting it.
    pub fn check_free(&self, ptr: DevicePtr) -> Result<(usize, String), BackendError> {
        let inner = self.lock();
        match inner.live.get(&ptr.0) {
            Some((n, tag)) => Ok((*n, tag.clone())),
            None => Err(match inner.freed.get(&ptr.0) {
                Some(tag) => BackendError::DoubleFree {
                    ptr,
                    tag: tag.clone(),
                },
                None => BackendError::UnknownPointer { ptr },
            }),
        }
    }

    /// Forgets the allocation at `ptr`; errors on a double free or an unknown pointer.
    pub fn record_free(&self, ptr: DevicePtr) -> Result<LiveAllocation, BackendError> {
        let mut inner = self.lock();
        let Some((nbytes, tag)) = inner.live.remove(&ptr.0) else {
            return Err(match inner.freed.get(&ptr.0) {
                Some(tag) => BackendError::DoubleFree {
                    ptr,
                    tag: tag.clone(),
                },
                None => BackendError::UnknownPointer { ptr },
            });
        };
        inner.live_bytes -= nbytes;
        inner.freed.insert(ptr.0, tag.clone());
        inner.freed_order.push_back(ptr.0);
        if inner.freed_order.len() > FREED_MEMORY {
            if let Some(old) = inner.freed_order.pop_front() {
                // Only forget it if it was not reallocated and freed again since.
                if !inner.freed_order.contains(&old) {
                    inner.freed.remove(&old);
                }
            }
        }
        Ok(LiveAllocation { ptr, nbytes, tag })
    }

    /// Checks that `[ptr, ptr + nbytes)` lies inside one live allocation and returns that
    /// allocation's start and the offset of `ptr` in it. `what` names the caller in errors.
    pub fn check_range(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<(DevicePtr, usize), BackendError> {
        let inner = self.lock();
        let out_of_bounds = |detail: String| BackendError::OutOfBounds {
            what: what.to_string(),
            ptr,
            nbytes,
            detail,
        };
        if ptr.is_null() {
            return Err(out_of_bounds(" (null pointer)".into()));
        }
        let Some((&base, (size, tag))) = inner.live.range(..=ptr.0).next_back() else {
            return Err(out_of_bounds(String::new()));
        };
        let offset = (ptr.0 - base) as usize;
        let end = offset.checked_add(nbytes);
        match end {
            Some(end) if offset <= *size && end <= *size => Ok((DevicePtr(base), offset)),
            _ if offset > *size => Err(out_of_bounds(String::new())),
            _ => Err(out_of_bounds(format!(
                " (allocation {tag:?} at {} has {size} bytes; the range ends {} bytes past it)",
                DevicePtr(base),
                offset.saturating_add(nbytes) - size
            ))),
        }
    }

    /// Number of live allocations.
    pub fn live_count(&self) -> usize {
        self.lock().live.len()
    }

    /// Bytes in live allocations.
    pub fn live_bytes(&self) -> usize {
        self.lock().live_bytes
    }

    /// Every live allocation, in address order.
    pub fn live_report(&self) -> Vec<LiveAllocation> {
        self.lock()
            .live
            .iter()
            .map(|(&p, (n, tag))| LiveAllocation {
                ptr: DevicePtr(p),
                nbytes: *n,
                tag: tag.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_checks() {
        let l = AllocationLedger::new();
        l.record_alloc(DevicePtr(0x1000), 64, "a");
        assert_eq!(
            l.check_range(DevicePtr(0x1000), 64, "t").unwrap(),
            (DevicePtr(0x1000), 0)
        );
        assert_eq!(
            l.check_range(DevicePtr(0x1010), 48, "t").unwrap(),
            (DevicePtr(0x1000), 16)
        );
        assert!(l.check_range(DevicePtr(0x1010), 49, "t").is_err());
        assert!(l.check_range(DevicePtr(0x0fff), 1, "t").is_err());
        assert!(l.check_range(DevicePtr(0x1041), 0, "t").is_err());
        assert!(l.check_range(DevicePtr::NULL, 0, "t").is_err());
        let err = l.check_range(DevicePtr(0x1020), 64, "copy").unwrap_err();
        assert!(err.to_string().contains("\"a\""), "{err}");
    }

    #[test]
    fn double_free_and_unknown() {
        let l = AllocationLedger::new();
        l.record_alloc(DevicePtr(0x2000), 8, "x");
        assert_eq!(l.live_count(), 1);
        assert_eq!(l.live_bytes(), 8);
        l.record_free(DevicePtr(0x2000)).unwrap();
        assert!(matches!(
            l.record_free(DevicePtr(0x2000)),
            Err(BackendError::DoubleFree { .. })
        ));
        assert!(matches!(
            l.record_free(DevicePtr(0x3000)),
            Err(BackendError::UnknownPointer { .. })
        ));
        assert_eq!(l.live_count(), 0);
        assert_eq!(l.live_bytes(), 0);
    }
}
