//! Bad arguments: the backend under test must refuse each exactly as the reference does.

use super::*;

/// Bad arguments: the backend under test must reject each exactly as the reference does.
pub fn same_errors(dut: &dyn GpuBackend) -> Result<(), String> {
    let run = |b: &dyn GpuBackend| -> Result<Vec<String>, BackendError> {
        let s = Scope::new(b);
        let table = s.bf16(&[0.5; 4 * 8])?;
        let ids = s.u32(&[1, 4])?;
        let out = s.out(Dtype::Bf16, 2 * 8)?;
        let slots = s.u32(&[0, 9])?;
        let lens = s.u32(&[5])?;
        let seqs = s.u32(&[0])?;
        let logits = s.f32(&[0.0; 10])?;
        let u = s.out(Dtype::U32, 4)?;
        let attention = |heads, kv_heads| PagedAttentionArgs {
            out,
            q: out,
            k_cache: table,
            v_cache: table,
            block_table: seqs,
            row_seq: seqs,
            row_ctx_len: lens,
            row_parent: None,
            rows: 1,
            heads,
            kv_heads,
            head_dim: 8,
            block_size: 4,
            max_blocks_per_seq: 1,
            scale: 1.0,
            stream: 0,
        };
        let linear = |out_dtype, weight, in_features, x| LinearArgs {
            out,
            out_dtype,
            x,
            weight,
            bias: None,
            rows: 1,
            in_features,
            out_features: 1,
            stream: 0,
        };
        let nvfp4 = LinearWeight::Nvfp4 {
            codes: out,
            block_scales: out,
            global_scale: 1.0,
        };
        let add = |out, a, b, n| ElementwiseArgs {
            op: ElementwiseOp::Add,
            out,
            a,
            b,
            n,
            stream: 0,
        };
        let errs = [
            b.embedding(EmbeddingArgs {
                out,
                table: LinearWeight::Bf16 { weight: table },
                ids,
                rows: 2,
                hidden: 8,
                vocab: 4,
                stream: 0,
            }),
            b.kv_write(KvWriteArgs {
                k_cache: table,
                v_cache: table,
                k: out,
                v: out,
                slots,
                rows: 2,
                kv_heads: 1,
                head_dim: 8,
                num_slots: 4,
                stream: 0,
            }),
            b.paged_attention(attention(2, 1)),
            b.paged_attention(attention(3, 2)),
            b.argmax(ArgmaxArgs {
                out: u,
                logits,
                bitmask: None,
                rows: 2,
                vocab: 10,
                stream: 0,
            }),
            b.softmax(SoftmaxArgs {
                out: logits,
                logits,
                rows: 1,
                vocab: 10,
                temperature: 0.0,
                stream: 0,
            }),
            b.rope(RopeArgs {
                x: out,
                positions: ids,
                inv_freq: logits,
                rows: 1,
                heads: 1,
                head_dim: 8,
                rotary_dim: 10,
                style: RopeStyle::Half,
                stream: 0,
            }),
            b.linear(linear(Dtype::Bf16, nvfp4, 8, out)),
            b.linear(linear(
                Dtype::U32,
                LinearWeight::Bf16 { weight: out },
                8,
                out,
            )),
            b.elementwise(add(out, out, table, 100)),
            // Aliasing: each refused after every range checked out.
            b.linear(linear(
                Dtype::Bf16,
                LinearWeight::Bf16 { weight: table },
                8,
                out,
            )),
            b.elementwise(add(out.offset(2), out, table, 8)),
            b.kv_write(KvWriteArgs {
                k_cache: table,
                v_cache: table.offset(16),
                k: out,
                v: out,
                slots: ids,
                rows: 1,
                kv_heads: 1,
                head_dim: 8,
                num_slots: 2,
                stream: 0,
            }),
            // A row wider than the source's stride, then columns past the destination's.
            // (Each span lies inside its buffer: only the shape check refuses it.)
            b.copy_rows(CopyRowsArgs {
                dst: out,
                src: table,
                rows: 1,
                width: 9,
                col: 0,
                dst_stride: 9,
                src_stride: 8,
                stream: 0,
            }),
            b.copy_rows(CopyRowsArgs {
                dst: out,
                src: table,
                rows: 1,
                width: 8,
                col: 1,
                dst_stride: 8,
                src_stride: 8,
                stream: 0,
            }),
            // The last destination row runs past its buffer (2 rows of 8 hold 16 elements).
            b.copy_rows(CopyRowsArgs {
                dst: out,
                src: table,
                rows: 2,
                width: 4,
                col: 6,
                dst_stride: 8,
                src_stride: 8,
                stream: 0,
            }),
            // A misaligned f32 pointer.
            b.softmax(SoftmaxArgs {
                out: u,
                logits: logits.offset(2),
                rows: 1,
                vocab: 4,
                temperature: 1.0,
                stream: 0,
            }),
        ];
        Ok(errs
            .into_iter()
            .map(|e| match e {
                Ok(()) => "ok".to_string(),
                // Addresses differ between backends; what was out of bounds must not.
                Err(BackendError::OutOfBounds { what, .. }) => format!("out of bounds: {what}"),
                Err(e) => e.to_string(),
            })
            .collect())
    };
    let (got, want) = both(dut, run)?;
    if want.iter().any(|e| e == "ok") {
        return Err(format!("the reference accepted a bad argument: {want:?}"));
    }
    exact("errors", &got, &want)
}
