//! Layer capture: the target's hidden state after chosen decoder layers, for every row of a
//! forward, gathered into one BF16 `[rows, n * hidden]` buffer (row `r` holds `[layer
//! ids[0]'s hidden | ids[1]'s | ...]`, in the order asked), for drafters that fuse several
//! target layers (EAGLE-3, DFlash).
//!
//! Layer id `i` names the residual stream after decoder layer `i` (0-based), before any final
//! norm: the output of layer `i`. EAGLE-3's convention, "the hidden entering layer `k`", is
//! id `k - 1`.
//!
//! Invariants:
//! - Ids are below the model's layer count and distinct ([`check_layer_ids`]).
//! - The buffer is allocated by the first forward that asks for layers and grown when a
//!   forward asks for more; a forward that asks for none allocates, reads and writes nothing
//!   for capture.

use super::weights::DeviceAllocations;
use crate::backend::{BackendError, CopyRowsArgs, DevicePtr, Dtype, GpuBackend};

/// Checks capture layer ids against a model of `num_layers` decoder layers: each must be
/// below it, and none named twice. The message names the offending id and the layer count.
pub fn check_layer_ids(ids: &[usize], num_layers: usize) -> Result<(), String> {
    for (k, &id) in ids.iter().enumerate() {
        if id >= num_layers {
            return Err(format!(
                "layer id {id} is out of range: the model has {num_layers} decoder layers (ids 0..{num_layers})"
            ));
        }
        if ids[..k].contains(&id) {
            return Err(format!(
                "layer id {id} is named twice (the model has {num_layers} decoder layers)"
            ));
        }
    }
    Ok(())
}

/// The model-owned capture buffer: room for `max_rows` rows of `layers` hiddens.
#[derive(Debug)]
pub(super) struct CaptureBuffer {
    ptr: DevicePtr,
    layers: usize,
}

impl CaptureBuffer {
    /// No buffer yet.
    pub fn empty() -> Self {
        CaptureBuffer {
            ptr: DevicePtr::NULL,
            layers: 0,
        }
    }

    /// The buffer, with room for `max_rows` rows of `layers` hiddens of `hidden` elements:
    /// allocated in `allocs` on first use, and replaced by a larger one when more layers are
    /// asked than it holds.
    pub fn with_room(
        &mut self,
        allocs: &DeviceAllocations,
        layers: usize,
        max_rows: usize,
        hidden: usize,
    ) -> Result<DevicePtr, BackendError> {
        if layers > self.layers {
            let nbytes = max_rows * layers * hidden * Dtype::Bf16.size();
            let fresh = allocs.alloc(nbytes, "target_hidden_stack")?;
            if !self.ptr.is_null() {
                allocs.free(self.ptr)?;
            }
            self.ptr = fresh;
            self.layers = layers;
        }
        Ok(self.ptr)
    }
}

/// Where one forward writes its capture: the buffer and the layer ids, in column order.
#[derive(Clone, Copy)]
pub(super) struct Capture<'a> {
    pub buffer: DevicePtr,
    pub ids: &'a [usize],
}

impl Capture<'_> {
    /// Copies `rows` rows of the residual stream `hidden_rows` (`hidden` wide), as it stands
    /// after decoder layer `layer`, into the columns of every id naming that layer.
    pub fn after_layer(
        &self,
        gpu: &dyn GpuBackend,
        layer: usize,
        hidden_rows: DevicePtr,
        rows: usize,
        hidden: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        for (j, _) in self.ids.iter().enumerate().filter(|(_, &id)| id == layer) {
            gpu.copy_rows(CopyRowsArgs {
                dst: self.buffer,
                src: hidden_rows,
                rows,
                width: hidden,
                col: j * hidden,
                dst_stride: self.ids.len() * hidden,
                src_stride: hidden,
                stream,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::check_layer_ids;

    #[test]
    fn ids_must_be_in_range_and_distinct() {
        assert_eq!(check_layer_ids(&[], 2), Ok(()));
        assert_eq!(check_layer_ids(&[1, 0], 2), Ok(()));
        let e = check_layer_ids(&[0, 2], 2).unwrap_err();
        assert!(
            e.contains("layer id 2 is out of range") && e.contains("2 decoder layers"),
            "{e}"
        );
        let e = check_layer_ids(&[1, 0, 1], 3).unwrap_err();
        assert!(
            e.contains("layer id 1 is named twice") && e.contains("3 decoder layers"),
            "{e}"
        );
    }
}
