//! The `Communicator` contract on one process: `LocalCommunicator` is rank 0 of 1 whose
//! collectives are the identity, BF16 sums round once, and commands survive their byte form
//! while bad bytes are refused by name.

use half::bf16;
use specdraft::distributed::{
    Command, Communicator, Counted, DistributedError, LocalCommunicator, SeqTokens,
};

/// Rank 0 of a world whose other ranks hold `others`: the f32 sum adds them in.
struct WithOthers {
    others: Vec<Vec<f32>>,
}

impl Communicator for WithOthers {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        self.others.len() + 1
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistributedError> {
        for other in &self.others {
            for (v, o) in buf.iter_mut().zip(other) {
                *v += o;
            }
        }
        Ok(())
    }
    fn broadcast_bytes(&self, _root: usize, _buf: &mut Vec<u8>) -> Result<(), DistributedError> {
        Ok(())
    }
    fn barrier(&self) -> Result<(), DistributedError> {
        Ok(())
    }
}

#[test]
fn local_is_rank_0_of_1_and_its_collectives_are_the_identity() {
    let comm = LocalCommunicator;
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let mut f = vec![1.5f32, -2.25, 1e-30, 3.0e38];
    comm.all_reduce_sum_f32(&mut f).unwrap();
    assert_eq!(f, vec![1.5f32, -2.25, 1e-30, 3.0e38]);
    let mut h: Vec<bf16> = [0.1f32, -7.0, 65280.0].map(bf16::from_f32).to_vec();
    let before = h.clone();
    comm.all_reduce_sum_bf16(&mut h).unwrap();
    assert_eq!(h, before);
    let mut bytes = vec![9u8, 8, 7];
    comm.broadcast_bytes(0, &mut bytes).unwrap();
    assert_eq!(bytes, vec![9, 8, 7]);
    comm.barrier().unwrap();
    comm.send_command(&Command::Shutdown).unwrap();
}

#[test]
fn local_refuses_a_root_outside_the_world_and_receiving_on_rank_0() {
    let comm = LocalCommunicator;
    let err = comm.broadcast_bytes(1, &mut Vec::new()).unwrap_err();
    assert!(
        matches!(
            err,
            DistributedError::InvalidArgument {
                op: "broadcast_bytes",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("root 1 is not a rank"), "{err}");
    let err = comm.recv_command().unwrap_err();
    assert!(
        err.to_string().starts_with("rank 0 of 1: recv_command"),
        "{err}"
    );
}

#[test]
fn bf16_sums_are_taken_in_f32_and_rounded_once_to_nearest() {
    // BF16 steps by 2^-7 in [1, 2). Element 0: 1 + 2^-8 + 2^-8 = 1 + 2^-7 exactly, while
    // rounding each partial sum would give 1 (1 + 2^-8 is a tie, to even: 1). Element 1:
    // 1 + 3 * 2^-9 lies 3/4 of a step above 1, so nearest is 1 + 2^-7 (truncating gives 1).
    let comm = WithOthers {
        others: vec![
            vec![2f32.powi(-8), 3.0 * 2f32.powi(-9)],
            vec![2f32.powi(-8), 0.0],
        ],
    };
    let mut buf = vec![bf16::ONE, bf16::ONE];
    comm.all_reduce_sum_bf16(&mut buf).unwrap();
    assert_eq!(buf, vec![bf16::from_f32(1.0078125); 2]);
    assert_eq!(bf16::from_f32(1.0078125).to_f32(), 1.0078125);
}

fn every_command() -> Vec<Command> {
    let seq = |seq: u64, tokens: Vec<u32>| SeqTokens { seq, tokens };
    vec![
        Command::Prefill {
            batch: vec![seq(7, vec![1, 2, 49151, u32::MAX]), seq(8, vec![3])],
            layers: vec![2, 0],
        },
        Command::Prefill {
            batch: vec![seq(0, vec![])],
            layers: vec![],
        },
        Command::Verify {
            batch: vec![seq(u64::MAX, vec![5, 6, 7])],
            layers: vec![],
            trees: vec![],
        },
        Command::Verify {
            batch: vec![seq(1, vec![5, 6, 7]), seq(2, vec![9, 9])],
            layers: vec![1],
            trees: vec![Some(vec![0, 0]), None],
        },
        Command::MtpPropose {
            state: 3,
            last_token: 49151,
            position: 17,
            num_drafts: 4,
            hidden: vec![1, 2, 3, 4],
            grammar: Some(vec![-1, 0, i32::MIN]),
        },
        Command::MtpPropose {
            state: u64::MAX,
            last_token: 0,
            position: 0,
            num_drafts: 0,
            hidden: vec![],
            grammar: None,
        },
        Command::MtpProposeBatch {
            states: vec![3, u64::MAX],
            last_tokens: vec![7, 49151],
            positions: vec![12, 40],
            num_drafts: 3,
            hidden: vec![5; 8],
            confidences: true,
        },
        Command::MtpProposeBatch {
            states: vec![],
            last_tokens: vec![],
            positions: vec![],
            num_drafts: 0,
            hidden: vec![],
            confidences: false,
        },
        Command::ProposerAlloc {
            state: 8,
            budget: u64::MAX,
        },
        Command::ProposerPrefill {
            state: 8,
            tokens: vec![1, 2],
            hidden: vec![9; 7],
        },
        Command::ProposerAfterVerify {
            state: 8,
            accepted: 2,
        },
        Command::ProposerCatchup {
            state: 8,
            tokens: vec![4],
            hidden: vec![0, 255],
            row_base: 3,
            pos_base: 11,
        },
        Command::ProposerFree { state: 8 },
        Command::Trim { seq: 4, len: 17 },
        Command::Compact {
            seq: 5,
            start: 9,
            rows: vec![10, 12],
        },
        Command::Free { seq: 12 },
        Command::Shutdown,
    ]
}

#[test]
fn every_command_decodes_to_itself() {
    for cmd in every_command() {
        let bytes = cmd.encode();
        assert_eq!(Command::decode(&bytes, 1).unwrap(), cmd, "{bytes:?}");
    }
    // The byte form is fixed: a worker built from another commit reads the same bytes.
    assert_eq!(
        Command::MtpPropose {
            state: 3,
            last_token: 9,
            position: 2,
            num_drafts: 4,
            hidden: vec![0xab],
            grammar: None,
        }
        .encode(),
        [
            vec![3],
            3u64.to_le_bytes().to_vec(),
            9u32.to_le_bytes().to_vec(),
            2u64.to_le_bytes().to_vec(),
            4u32.to_le_bytes().to_vec(),
            vec![1, 0, 0, 0, 0xab, 0],
        ]
        .concat()
    );
    assert_eq!(Command::Shutdown.encode(), vec![5]);
}

#[test]
fn bad_command_bytes_are_refused_by_name() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "empty: no tag byte"),
        (vec![42], "unknown command tag 42"),
        (vec![4, 1, 2, 3], "truncated sequence id"),
        (vec![3, 0, 0, 0, 0, 0, 0, 0, 0, 4], "truncated last token"),
        (
            [
                vec![3],
                vec![0; 8],
                vec![0; 4],
                vec![0; 8],
                vec![0; 4],
                vec![0; 4],
                vec![2],
            ]
            .concat(),
            "grammar flag 2 is not 0 or 1",
        ),
        (
            vec![
                1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0,
            ],
            "2 tokens need at least 8 bytes, 4 are left",
        ),
        (
            vec![1, 255, 255, 255, 255],
            "4294967295 sequences need at least 51539607540 bytes, 0 are left",
        ),
        (
            vec![2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 7],
            "tree flag 7 is not 0 or 1",
        ),
        (vec![5, 0], "1 trailing bytes after a shutdown command"),
        (
            [vec![13], vec![2, 0, 0, 0], vec![0; 12]].concat(),
            "2 states need at least 16 bytes, 12 are left",
        ),
        (
            [
                vec![13],
                vec![0; 4],
                vec![0; 4],
                vec![0; 4],
                vec![0; 4],
                vec![0; 4],
                vec![9],
            ]
            .concat(),
            "confidence flag 9 is not 0 or 1",
        ),
    ];
    for (bytes, reason) in cases {
        let err = Command::decode(&bytes, 2).unwrap_err();
        assert_eq!(
            err,
            DistributedError::BadCommand {
                rank: 2,
                len: bytes.len(),
                reason: reason.into()
            },
            "{bytes:?}"
        );
        assert!(
            err.to_string().starts_with("rank 2: bad command bytes"),
            "{err}"
        );
    }
    // Every prefix of a valid command is refused, never read as another command.
    for cmd in every_command() {
        let bytes = cmd.encode();
        for cut in 0..bytes.len() {
            assert!(
                Command::decode(&bytes[..cut], 1).is_err(),
                "{cmd:?} cut at {cut}"
            );
        }
    }
}

#[test]
fn a_distributed_error_is_a_crate_error_with_the_same_message() {
    let err = DistributedError::Timeout {
        rank: 0,
        size: 2,
        op: "all_reduce_sum_f32",
        timeout_s: 3.0,
        missing: "rank 1".into(),
    };
    let crate_err: specdraft::Error = err.clone().into();
    assert_eq!(crate_err.to_string(), err.to_string());
    assert!(
        err.to_string().starts_with(
            "rank 0 of 2: all_reduce_sum_f32 timed out after 3.0 s waiting for rank 1"
        ),
        "{err}"
    );
}

#[test]
fn counted_forwards_every_call_and_counts_calls_and_payload_bytes() {
    let comm = Counted::new(Box::new(LocalCommunicator));
    let mut f = vec![1.5f32, -2.0, 3.0];
    comm.all_reduce_sum_f32(&mut f).unwrap();
    assert_eq!(
        f,
        vec![1.5, -2.0, 3.0],
        "the inner call's result comes back"
    );
    let mut h = vec![bf16::ONE; 5];
    comm.all_reduce_sum_bf16(&mut h).unwrap();
    let mut bytes = b"twelve bytes".to_vec();
    comm.broadcast_bytes(0, &mut bytes).unwrap();
    comm.broadcast_bytes(0, &mut bytes).unwrap();
    comm.barrier().unwrap();
    let cmd = Command::Free { seq: 9 };
    comm.send_command(&cmd).unwrap();
    // An error still counts, and comes back unchanged.
    let err = comm.recv_command().unwrap_err();
    assert!(matches!(
        err,
        DistributedError::InvalidArgument {
            op: "recv_command",
            ..
        }
    ));
    let costs = comm.costs();
    let got: Vec<(&str, u64, u64)> = costs
        .iter()
        .map(|(op, c)| (*op, c.calls, c.bytes))
        .collect();
    assert_eq!(
        got,
        vec![
            ("all_reduce_bf16", 1, 10),
            ("all_reduce_f32", 1, 12),
            ("barrier", 1, 0),
            ("broadcast", 2, 24),
            ("recv_command", 1, 0),
            ("send_command", 1, cmd.encode().len() as u64),
        ]
    );
    comm.reset();
    assert!(comm.costs().is_empty());
}
