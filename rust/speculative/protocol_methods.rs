//! The one list of the [`DraftProposer`] protocol's methods ([`with_protocol_methods`]) and
//! the [`ProtocolMethod`] enum written from it.
//!
//! Every place that must name each method (the Python bindings' base class and adapter,
//! `specdraft.PROTOCOL_METHODS`, the engine's panic guard, the ranks' announcer,
//! `DelegatingProposer`) is written from this list. Invariants: each name is checked at
//! compile time to be a method of the trait, the list is in the trait's order with the
//! required methods first, and a test checks that the trait has no method the list lacks.

use super::protocol::DraftProposer;

/// Hands the protocol's method list to the macro `$callback`: one entry per method, in the
/// specification's order (the three required methods first), as
/// `Variant => fn name(argument: Type, ...) -> Return, answer;`.
///
/// `answer` is `fallible` for a method that reports failure through its `Result`, and
/// `default(VALUE)` for one without an error channel: `VALUE` is what the protocol's default
/// returns, the answer when the method cannot run. Every place that must name each method
/// ([`ProtocolMethod`], the engine's panic guard, the adapter for Python proposers) is
/// written from this list, so a new method is one entry here and one in the trait. A
/// signature that differs from the trait's does not compile where it implements the trait.
macro_rules! with_protocol_methods {
    ($callback:ident) => {
        $callback! {
            AllocState => fn alloc_state(
                gpu: &dyn $crate::backend::GpuBackend,
            ) -> $crate::Result<Box<dyn $crate::speculative::ProposerState>>, fallible;
            Propose => fn propose(
                last_token: u32,
                target_hidden: $crate::backend::DevicePtr,
                position: usize,
                num_drafts: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
                draft_embed_target: Option<$crate::backend::DevicePtr>,
                grammar_bitmask: Option<&[i32]>,
                target_hidden_stack: Option<$crate::backend::DevicePtr>,
            ) -> $crate::Result<Vec<u32>>, fallible;
            AfterVerify => fn after_verify(
                num_accepted: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                stream: u64,
            ) -> $crate::Result<()>, fallible;
            AllocStateFor => fn alloc_state_for(
                gpu: &dyn $crate::backend::GpuBackend,
                budget_tokens: usize,
            ) -> $crate::Result<Box<dyn $crate::speculative::ProposerState>>, fallible;
            BlockGamma => fn block_gamma() -> Option<usize>, default(None);
            TargetLayerIds => fn target_layer_ids() -> Vec<usize>, default(Vec::new());
            PrefillHiddenRows => fn prefill_hidden_rows(max_seq_len: usize) -> usize,
                default(max_seq_len);
            NeedsComm => fn needs_comm() -> bool, default(false);
            PrefillUsesSharedBuffers => fn prefill_uses_shared_buffers() -> bool, default(false);
            DrafterRows => fn drafter_rows(
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> usize, default(0);
            LastPairKey => fn last_pair_key(
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> Option<usize>, default(None);
            TakeDrafterKv => fn take_drafter_kv(
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> Option<(Vec<u32>, usize, Option<usize>)>, default(None);
            InstallDrafterKv => fn install_drafter_kv(
                state: &mut dyn $crate::speculative::ProposerState,
                blocks: Vec<u32>,
                rows: usize,
                last_pair_key: Option<usize>,
            ) -> bool, default(false);
            FreeDrafterKv => fn free_drafter_kv(blocks: &[u32]) -> (), default(());
            CatchupDrafter => fn catchup_drafter(
                tokens: &[u32],
                hiddens: $crate::backend::DevicePtr,
                row_base: usize,
                pos_base: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<usize>, fallible;
            ProposeBatch => fn propose_batch(
                last_tokens: &[u32],
                target_hiddens: &[$crate::backend::DevicePtr],
                positions: &[usize],
                num_drafts: usize,
                states: &mut [&mut dyn $crate::speculative::ProposerState],
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
                out_conf: Option<&mut Vec<Vec<f32>>>,
            ) -> $crate::Result<Option<Vec<Vec<u32>>>>, fallible;
            ProposeBatchMax => fn propose_batch_max(
                buffers: &$crate::memory::BufferArena,
                config: &$crate::model::ModelConfig,
            ) -> usize, default(1);
            ProposeTree => fn propose_tree(
                last_token: u32,
                target_hidden: $crate::backend::DevicePtr,
                position: usize,
                budget: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
                draft_embed_target: Option<$crate::backend::DevicePtr>,
                grammar_bitmask: Option<&[i32]>,
                target_hidden_stack: Option<$crate::backend::DevicePtr>,
            ) -> $crate::Result<$crate::speculative::DraftTree>, fallible;
            ProposeTreeBatch => fn propose_tree_batch(
                last_tokens: &[u32],
                target_hiddens: &[$crate::backend::DevicePtr],
                positions: &[usize],
                budget: usize,
                states: &mut [&mut dyn $crate::speculative::ProposerState],
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<Option<Vec<$crate::speculative::DraftTree>>>, fallible;
            GrowsTrees => fn grows_trees() -> bool, default(false);
            AfterVerifyTree => fn after_verify_tree(
                path: &[usize],
                state: &mut dyn $crate::speculative::ProposerState,
                stream: u64,
            ) -> $crate::Result<()>, fallible;
            CatchupBatch => fn catchup_batch(
                tokens: &[Vec<u32>],
                hiddens: &[Vec<$crate::backend::DevicePtr>],
                first_pos: &[usize],
                states: &mut [&mut dyn $crate::speculative::ProposerState],
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<usize>, fallible;
            PrefillDrafter => fn prefill_drafter(
                prompt_tokens: &[u32],
                hiddens: $crate::backend::DevicePtr,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<usize>, fallible;
            ReadDeferredDraftToken => fn read_deferred_draft_token(
                gpu: &dyn $crate::backend::GpuBackend,
            ) -> $crate::Result<u32>, fallible;
            FreeState => fn free_state(
                gpu: &dyn $crate::backend::GpuBackend,
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> $crate::Result<()>, fallible;
            CircuitDraft => fn circuit_draft(
                config: &$crate::model::ModelConfig,
                levers: &$crate::model::ModelLevers,
            ) -> Option<$crate::speculative::DraftBinding>, default(None);
            SetCircuitDraft => fn set_circuit_draft(
                runner: Option<std::sync::Arc<dyn $crate::speculative::DraftRunner>>,
            ) -> (), default(());
        }
    };
}
pub(crate) use with_protocol_methods;

/// Declares [`ProtocolMethod`] from the method list.
macro_rules! declare_protocol_method {
    ($($variant:ident => fn $name:ident ($($args:tt)*) -> $ret:ty, $answer:ident $(($default:expr))?;)+) => {
        /// One method of the [`DraftProposer`] protocol.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ProtocolMethod {
            $(
                #[doc = concat!("`", stringify!($name), "`")]
                $variant,
            )+
        }

        impl ProtocolMethod {
            /// How many methods the protocol has.
            pub const COUNT: usize = [$(stringify!($name)),+].len();
            /// Every method, in the specification's order.
            pub const ALL: [ProtocolMethod; ProtocolMethod::COUNT] = [$(ProtocolMethod::$variant),+];
            /// Every method's name, in the same order.
            pub const NAMES: [&'static str; ProtocolMethod::COUNT] = [$(stringify!($name)),+];
        }

        // Each name must be a method of the trait: a typo does not compile.
        const _: () = {
            #[allow(dead_code)]
            fn every_name_is_a_trait_method() {
                $(let _ = <dyn DraftProposer as DraftProposer>::$name;)+
            }
        };
    };
}

with_protocol_methods!(declare_protocol_method);

impl ProtocolMethod {
    /// How many of the methods (the first ones) a proposer must implement.
    pub const REQUIRED: usize = 3;

    /// The method's name, as in the trait and in Python.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Its position in [`ProtocolMethod::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether every proposer must implement it (it has no default).
    pub fn is_required(self) -> bool {
        self.index() < Self::REQUIRED
    }
}

#[cfg(test)]
mod tests {
    use super::ProtocolMethod;

    /// The method names of `trait DraftProposer` in this file, in order.
    fn trait_methods() -> Vec<String> {
        let source = include_str!("protocol.rs");
        let start = source
            .find("pub trait DraftProposer")
            .expect("the trait is defined here");
        let body = &source[start..];
        let end = body.find("\n}\n").expect("the trait ends");
        body[..end]
            .lines()
            .filter_map(|line| line.trim_start().strip_prefix("fn "))
            .map(|rest| rest.split(['(', '<']).next().unwrap_or("").to_string())
            .collect()
    }

    #[test]
    fn the_method_list_is_the_trait_in_order() {
        let names: Vec<&str> = ProtocolMethod::NAMES.to_vec();
        assert_eq!(trait_methods(), names);
        assert_eq!(ProtocolMethod::COUNT, 27);
        assert_eq!(
            ProtocolMethod::ALL[..ProtocolMethod::REQUIRED]
                .iter()
                .map(|m| m.name())
                .collect::<Vec<_>>(),
            ["alloc_state", "propose", "after_verify"]
        );
        for (i, m) in ProtocolMethod::ALL.iter().enumerate() {
            assert_eq!(m.index(), i);
            assert_eq!(m.is_required(), i < 3);
        }
    }
}
