//! The MTP head's device scratch ([`Scratch`]): the slots one forward of up to `rows` rows
//! reads and writes, the decoder layer's and the head's own around it, carved from one
//! buffer arena.
//!
//! Invariant: every slot is sized for `rows` rows, so a forward of at most `rows` rows never
//! writes past one.

use super::forward::HeadSpec;
use super::tree::TREE_TOP_K;
use crate::backend::{DevicePtr, Dtype, GpuBackend};
use crate::memory::{ArenaSlot, BufferArena, SlotSpec};
use crate::model::layers::{layer_slots, LayerScratch, ScratchShape};

/// Device scratch for one forward of up to `rows` rows: the decoder layer's, and the
/// head's own around it.
pub(crate) struct Scratch {
    pub rows: usize,
    pub layer: LayerScratch,
    pub token_ids: DevicePtr,
    pub positions: DevicePtr,
    pub slots: DevicePtr,
    pub row_seq: DevicePtr,
    pub row_ctx_len: DevicePtr,
    /// u32 `[rows, max_blocks_per_seq]`: the block table of each sequence in the forward.
    pub block_tables: DevicePtr,
    /// The normed token embeddings.
    pub embedding: DevicePtr,
    /// The normed hiddens the rows came with (EAGLE-3: the rows as they came, as wide as a
    /// target row, then `hnorm(fused)`).
    pub target_hidden: DevicePtr,
    /// `[rows, 2 * hidden]`: the two above, concatenated in the layout's order.
    pub concat: DevicePtr,
    /// The layer's residual stream: its output hidden (before the final norm).
    pub residual: DevicePtr,
    /// The final norm's output, the LM head's input.
    pub final_normed: DevicePtr,
    pub logits: DevicePtr,
    pub probs: DevicePtr,
    pub picks: DevicePtr,
    /// f32 `[rows]`: each row's probability of its pick.
    pub picked_probs: DevicePtr,
    /// One row's grammar mask (the first row of the slot).
    pub grammar_mask: DevicePtr,
    /// u32 `[rows, 2 * TREE_TOP_K]`: a tree round's children, each row's ids and then their
    /// f32 probabilities (`top_k`'s two outputs side by side).
    pub children: DevicePtr,
}

impl Scratch {
    /// The head's own slots around the layer's.
    fn head_slots(
        hidden: usize,
        target_width: usize,
        vocab: usize,
        max_blocks_per_seq: usize,
    ) -> [SlotSpec; 17] {
        let slot = |name, dtype, row_elems| SlotSpec {
            name,
            dtype,
            row_elems,
        };
        use Dtype::*;
        [
            slot("token_ids", U32, 1),
            slot("positions", U32, 1),
            slot("slots", U32, 1),
            slot("row_seq", U32, 1),
            slot("row_ctx_len", U32, 1),
            slot("block_tables", U32, max_blocks_per_seq),
            slot("embedding", Bf16, hidden),
            slot("target_hidden", Bf16, hidden.max(target_width)),
            slot("concat", Bf16, 2 * hidden),
            slot("residual", Bf16, hidden),
            slot("final_normed", Bf16, hidden),
            slot("logits", F32, vocab),
            slot("probs", F32, vocab),
            slot("picks", U32, 1),
            slot("picked_probs", F32, 1),
            slot("grammar_mask", I32, vocab.div_ceil(32)),
            slot("children", U32, 2 * TREE_TOP_K),
        ]
    }

    /// Allocates the scratch of `spec` for `rows` rows as one arena whose buffers the
    /// caller owns from then on (the returned slots); on failure nothing stays allocated.
    pub fn alloc(
        gpu: &dyn GpuBackend,
        spec: &HeadSpec,
        rows: usize,
    ) -> crate::Result<(Scratch, Vec<ArenaSlot>)> {
        let h = spec.config.hidden_size;
        let layer = &spec.weights.layer;
        let mut slots = layer_slots(&ScratchShape {
            hidden: h,
            q_size: spec.config.q_size(),
            kv_size: spec.config.kv_size(),
            mlp_width: layer.mlp.max_width(),
            gated_attention: layer.gated_attention,
            experts: layer.moe().map_or(0, |m| m.num_experts()),
            mla: spec
                .config
                .mla
                .map(|m| (m, spec.config.num_attention_heads)),
        });
        slots.extend(Self::head_slots(
            h,
            spec.target_width(),
            spec.draft_vocab,
            spec.max_blocks_per_seq,
        ));
        let mut arena = BufferArena::new(gpu, "mtp", &slots, rows)?;
        match Self::from_arena(&arena, rows) {
            Ok(sc) => Ok((sc, arena.slots().to_vec())),
            Err(e) => {
                arena.free(gpu)?;
                Err(e)
            }
        }
    }

    fn from_arena(arena: &BufferArena, rows: usize) -> crate::Result<Scratch> {
        let at = |name: &str| -> crate::Result<DevicePtr> { Ok(arena.slot(name)?.ptr) };
        Ok(Scratch {
            rows,
            layer: LayerScratch::from_arena(arena)?,
            token_ids: at("token_ids")?,
            positions: at("positions")?,
            slots: at("slots")?,
            row_seq: at("row_seq")?,
            row_ctx_len: at("row_ctx_len")?,
            block_tables: at("block_tables")?,
            embedding: at("embedding")?,
            target_hidden: at("target_hidden")?,
            concat: at("concat")?,
            residual: at("residual")?,
            final_normed: at("final_normed")?,
            logits: at("logits")?,
            probs: at("probs")?,
            picks: at("picks")?,
            picked_probs: at("picked_probs")?,
            grammar_mask: at("grammar_mask")?,
            children: at("children")?,
        })
    }
}
