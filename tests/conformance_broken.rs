//! `check_proposer` reports each kind of broken proposer with the right check and a fix,
//! and never panics, whatever the proposer does.

mod conformance_common;

use conformance_common::assert_reported;
use specdraft::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::model::ForwardContext;
use specdraft::speculative::conformance::{check_proposer, CheckOptions, ConformanceReport};
use specdraft::speculative::{DraftProposer, PromptLookup, ProposerError, ProposerState};
use specdraft::Result;

/// How a test proposer misbehaves; otherwise it behaves like PromptLookup.
#[derive(Clone, Copy, PartialEq)]
enum Flaw {
    TooMany,
    OutOfVocab,
    IgnoresMask,
    BatchDisagrees,
    Leaks,
    Errors,
    Panics,
    TakeNotFresh,
    /// `out_conf` one list short of the sequences.
    ConfShort,
    /// A non-empty `out_conf` list one short of its drafts.
    ConfWrongLength,
    /// A confidence above 1.
    ConfOutOfRange,
    /// Not a flaw: an empty `out_conf` list for the first sequence (nothing reported on it),
    /// one a draft for the others.
    ConfNoneForOne,
}

struct Broken {
    inner: PromptLookup,
    flaw: Flaw,
}

struct BrokenState {
    inner: Box<dyn ProposerState>,
    leaked: Option<DevicePtr>,
    rows: usize,
}
specdraft::impl_proposer_state!(BrokenState);

fn st(s: &mut dyn ProposerState) -> &mut BrokenState {
    s.as_any_mut().downcast_mut().expect("a BrokenState")
}

impl DraftProposer for Broken {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        let leaked = if self.flaw == Flaw::Leaks {
            Some(gpu.upload(&[0u8; 96], "broken:scratch")?)
        } else {
            None
        };
        Ok(Box::new(BrokenState {
            inner: self.inner.alloc_state(gpu)?,
            leaked,
            rows: 0,
        }))
    }

    fn propose(
        &self,
        last_token: u32,
        h: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        e: Option<DevicePtr>,
        mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let s = st(state);
        let passed_mask = if self.flaw == Flaw::IgnoresMask {
            None
        } else {
            mask
        };
        let mut drafts = self.inner.propose(
            last_token,
            h,
            position,
            num_drafts,
            &mut *s.inner,
            ctx,
            stream,
            e,
            passed_mask,
            stack,
        )?;
        match self.flaw {
            Flaw::TooMany => drafts.extend([1, 2, 3, 4, 5, 6, 7, 8, 9]),
            Flaw::OutOfVocab => drafts.insert(0, ctx.config.vocab_size as u32 + 3),
            Flaw::Errors if position > 20 => {
                return Err(ProposerError::Failed {
                    method: "propose".into(),
                    message: "synthetic failure".into(),
                }
                .into())
            }
            Flaw::Panics if position > 20 => panic!("synthetic panic in propose"),
            _ => {}
        }
        drafts.truncate(if self.flaw == Flaw::TooMany {
            usize::MAX
        } else {
            num_drafts
        });
        Ok(drafts)
    }

    fn after_verify(&self, n: usize, state: &mut dyn ProposerState, stream: u64) -> Result<()> {
        let s = st(state);
        // Drafts beyond the inner proposer's are not its own: clamp to what it proposed.
        let inner = s
            .inner
            .as_any()
            .downcast_ref::<specdraft::speculative::PromptLookupState>()
            .map_or(0, |i| i.pending.len());
        s.rows += n + 1;
        self.inner.after_verify(n.min(inner), &mut *s.inner, stream)
    }

    fn prefill_drafter(
        &self,
        p: &[u32],
        h: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        let s = st(state);
        s.rows = 0;
        self.inner.prefill_drafter(p, h, &mut *s.inner, ctx, stream)
    }

    fn propose_batch(
        &self,
        last: &[u32],
        hiddens: &[DevicePtr],
        positions: &[usize],
        n: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let mut out: Vec<Vec<u32>> = Vec::new();
        for i in 0..last.len() {
            let mut d = self.propose(
                last[i],
                hiddens[i],
                positions[i],
                n,
                &mut *states[i],
                ctx,
                stream,
                None,
                None,
                None,
            )?;
            if self.flaw == Flaw::BatchDisagrees && !d.is_empty() {
                d.pop();
            }
            out.push(d);
        }
        let per_draft = |v: f32| out.iter().map(|d| vec![v; d.len()]).collect::<Vec<_>>();
        let reported = match self.flaw {
            Flaw::ConfShort => {
                let mut c = per_draft(0.5);
                c.pop();
                Some(c)
            }
            Flaw::ConfWrongLength => Some(
                out.iter()
                    .map(|d| vec![0.5; d.len().saturating_sub(1)])
                    .collect(),
            ),
            Flaw::ConfOutOfRange => Some(per_draft(1.5)),
            Flaw::ConfNoneForOne => {
                let mut c = per_draft(0.5);
                c[0].clear();
                Some(c)
            }
            _ => None,
        };
        if let (Some(out), Some(c)) = (conf, reported) {
            *out = c;
        }
        Ok(Some(out))
    }

    fn propose_batch_max(
        &self,
        _buffers: &specdraft::memory::BufferArena,
        _config: &specdraft::model::ModelConfig,
    ) -> usize {
        // The confidence flaws need batches of several sequences to show.
        match self.flaw {
            Flaw::ConfShort
            | Flaw::ConfWrongLength
            | Flaw::ConfOutOfRange
            | Flaw::ConfNoneForOne => 4,
            _ => 1,
        }
    }

    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        let s = st(state);
        let rows = s.rows;
        if self.flaw != Flaw::TakeNotFresh {
            s.rows = 0;
        }
        Some((vec![], rows, None))
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        st(state).rows
    }

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        if self.flaw != Flaw::Leaks {
            if let Some(p) = st(state).leaked.take() {
                gpu.free(p)?;
            }
        }
        Ok(())
    }
}

fn check(flaw: Flaw) -> ConformanceReport {
    let p = Broken {
        inner: PromptLookup::default(),
        flaw,
    };
    check_proposer(
        &p,
        &CheckOptions {
            label: "broken".into(),
            ..CheckOptions::default()
        },
    )
}

#[test]
fn too_many_drafts() {
    assert_reported(&check(Flaw::TooMany), "propose", "but num_drafts is 4");
}

#[test]
fn ids_outside_the_vocabulary() {
    assert_reported(
        &check(Flaw::OutOfVocab),
        "propose",
        "outside the vocabulary of 64",
    );
}

#[test]
fn grammar_mask_ignored() {
    assert_reported(&check(Flaw::IgnoresMask), "grammar mask", "forbids");
}

#[test]
fn batch_disagrees_with_per_sequence() {
    assert_reported(
        &check(Flaw::BatchDisagrees),
        "propose_batch vs propose",
        "propose_batch drafted",
    );
}

#[test]
fn device_memory_leaked() {
    let report = check(Flaw::Leaks);
    assert_reported(&report, "free_state: leaks", "broken:scratch");
}

#[test]
fn errors_and_panics_are_reported_not_propagated() {
    assert_reported(&check(Flaw::Errors), "propose", "synthetic failure");
    assert_reported(&check(Flaw::Panics), "propose", "synthetic panic");
}

#[test]
fn state_not_fresh_after_take() {
    assert_reported(
        &check(Flaw::TakeNotFresh),
        "take_drafter_kv: fresh state",
        "drafter_rows is",
    );
}

#[test]
fn bad_options_are_reported() {
    let report = check_proposer(
        &PromptLookup::default(),
        &CheckOptions {
            hidden_size: 30,
            ..CheckOptions::default()
        },
    );
    assert_reported(&report, "options", "multiple of 16");
}

#[test]
fn confidences_not_one_a_draft_or_out_of_range() {
    for flaw in [Flaw::ConfShort, Flaw::ConfWrongLength, Flaw::ConfOutOfRange] {
        assert_reported(
            &check(flaw),
            "propose_batch: out_conf",
            "one probability in [0, 1] per draft or an empty list",
        );
    }
}

#[test]
fn an_empty_confidence_list_reports_nothing_on_its_sequence() {
    let report = check(Flaw::ConfNoneForOne);
    assert!(
        report.checks_run.iter().any(|c| c == "propose_batch"),
        "{report}"
    );
    let conf = report
        .violations
        .iter()
        .find(|v| v.check.contains("out_conf"));
    assert!(conf.is_none(), "{report}");
}
