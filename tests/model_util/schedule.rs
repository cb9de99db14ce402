//! The fixed schedule of forwards the backend tests compare on: two sequences through a
//! batched prefill, a batched decode, a trim of the first and a replay, freed at the end
//! with the ledger checked empty.

use specdraft::backend::{GpuBackend, GpuBackendExt};
use specdraft::model::{ForwardOutput, LoadOptions, LogitRows, TargetModel};
use std::path::Path;
use std::sync::Arc;

/// The tokens of each forward of the schedule, one list per sequence.
pub struct Schedule<'a> {
    pub prefill: [&'a [u32]; 2],
    pub decode: [&'a [u32]; 2],
    /// The first sequence's length after the trim.
    pub trim_to: usize,
    /// The forward after the trim, keeping the last row per sequence.
    pub replay: [&'a [u32]; 2],
}

/// The logits of every forward of `schedule` on the model at `path`.
pub fn schedule_logits(
    path: &Path,
    gpu: Arc<dyn GpuBackend>,
    opts: LoadOptions,
    schedule: &Schedule<'_>,
) -> Vec<Vec<f32>> {
    let model = TargetModel::load(path, gpu.clone(), opts).unwrap();
    let v = model.config().vocab_size;
    let logits = |out: &ForwardOutput| -> Vec<f32> {
        gpu.download(out.logits, out.logits_rows * v).unwrap()
    };
    let (mut a, mut b) = (model.new_sequence(), model.new_sequence());
    let mut rows = Vec::new();
    for step in [schedule.prefill, schedule.decode] {
        rows.push(logits(
            &model.forward(&mut [&mut a, &mut b], &step).unwrap(),
        ));
    }
    model.trim(&mut a, schedule.trim_to).unwrap();
    let out = model
        .forward_with(
            &mut [&mut a, &mut b],
            &schedule.replay,
            LogitRows::LastPerSequence,
        )
        .unwrap();
    rows.push(logits(&out));
    model.free_sequence(&mut a).unwrap();
    model.free_sequence(&mut b).unwrap();
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
    rows
}
