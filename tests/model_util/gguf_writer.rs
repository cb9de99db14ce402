//! A GGUF v3 writer for the model tests (metadata, tensor infos, 32-byte aligned data), and
//! the tiny model written the way llama.cpp's converter writes a llama: renamed tensors,
//! q/k rows permuted for adjacent-pair RoPE, norms kept in F32.

use super::{Tensors, Tiny};
use half::f16;
use std::path::Path;

/// A GGUF metadata value the writer supports.
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
}

/// The GGUF element types the writer produces.
#[derive(Clone, Copy)]
pub enum GgType {
    F32,
    F16,
    Q8_0,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Encodes values as a GGUF tensor of `ty`.
pub fn gguf_data(values: &[f32], ty: GgType) -> (u32, Vec<u8>) {
    match ty {
        GgType::F32 => (0, values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        GgType::F16 => (
            1,
            values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
        GgType::Q8_0 => {
            let mut out = Vec::new();
            for block in values.chunks(32) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
            }
            (8, out)
        }
    }
}

/// Writes a GGUF v3 file. `tensors` carry the outermost-first shape; the file stores dims
/// innermost first.
pub fn write_gguf(
    path: &Path,
    meta: &[(&str, Meta)],
    tensors: &[(String, Vec<usize>, u32, Vec<u8>)],
) {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        put_str(&mut out, k);
        match v {
            Meta::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend(6u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
        }
    }
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for (name, shape, ty, data) in tensors {
        put_str(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        offsets.push(offset);
        offset += data.len().div_ceil(32) * 32;
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    let base = out.len();
    for ((_, _, _, data), off) in tensors.iter().zip(offsets) {
        out.resize(base + off, 0);
        out.extend(data);
    }
    std::fs::write(path, out).unwrap();
}

/// llama.cpp's q/k row permutation (rotate-half pairs become adjacent pairs).
pub fn permute_rows(values: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    let half = head_dim / 2;
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + j * half + i;
                let dst = h * head_dim + 2 * i + j;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// The tiny model as a llama GGUF: HF tensors renamed, q/k permuted, in `ty`.
pub fn write_tiny_gguf(path: &Path, tiny: &Tiny, tensors: &Tensors, ty: GgType) {
    let meta = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.embedding_length", Meta::U32(tiny.hidden as u32)),
        ("llama.feed_forward_length", Meta::U32(tiny.ffn as u32)),
        ("llama.block_count", Meta::U32(tiny.layers as u32)),
        ("llama.attention.head_count", Meta::U32(tiny.heads as u32)),
        (
            "llama.attention.head_count_kv",
            Meta::U32(tiny.kv_heads as u32),
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Meta::F32(tiny.eps),
        ),
        ("llama.rope.freq_base", Meta::F32(tiny.theta)),
        ("llama.context_length", Meta::U32(256)),
        ("llama.vocab_size", Meta::U32(tiny.vocab as u32)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(2)),
    ];
    let mut out = Vec::new();
    for (name, shape, values) in tensors {
        let gg = name
            .replace("model.embed_tokens.weight", "token_embd.weight")
            .replace("model.norm.weight", "output_norm.weight")
            .replace("lm_head.weight", "output.weight")
            .replace("model.layers.", "blk.")
            .replace("input_layernorm", "attn_norm")
            .replace("post_attention_layernorm", "ffn_norm")
            .replace("self_attn.q_proj", "attn_q")
            .replace("self_attn.k_proj", "attn_k")
            .replace("self_attn.v_proj", "attn_v")
            .replace("self_attn.o_proj", "attn_output")
            .replace("mlp.gate_proj", "ffn_gate")
            .replace("mlp.up_proj", "ffn_up")
            .replace("mlp.down_proj", "ffn_down");
        let values = if gg.ends_with("attn_q.weight") {
            permute_rows(values, tiny.heads, tiny.head_dim, tiny.hidden)
        } else if gg.ends_with("attn_k.weight") {
            permute_rows(values, tiny.kv_heads, tiny.head_dim, tiny.hidden)
        } else {
            values.clone()
        };
        // Norm vectors stay F32, as llama.cpp stores them.
        let t = if shape.len() == 1 { GgType::F32 } else { ty };
        let (code, data) = gguf_data(&values, t);
        out.push((gg, shape.clone(), code, data));
    }
    write_gguf(path, &meta, &out);
}
