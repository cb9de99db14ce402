//! Element types that cross the backend boundary.

/// The element type of a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bfloat16, the dtype of hidden states at the protocol's seams.
    Bf16,
    /// IEEE half precision.
    F16,
    /// 32-bit float, used for logits and accumulation.
    F32,
    /// Token ids and block tables.
    U32,
    /// Grammar bitmask words.
    I32,
    /// Raw bytes (packed quantized weights, FP8 scales).
    U8,
    /// FP8 E4M3 (`float8_e4m3fn`) elements, one byte each.
    F8E4M3,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 | Dtype::U32 | Dtype::I32 => 4,
            Dtype::U8 | Dtype::F8E4M3 => 1,
        }
    }

    /// The lower-case name used in messages and in Python (`"bf16"`, `"f32"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
            Dtype::U32 => "u32",
            Dtype::I32 => "i32",
            Dtype::U8 => "u8",
            Dtype::F8E4M3 => "f8_e4m3",
        }
    }

    /// Parses [`Dtype::name`] and the numpy spellings (`"float32"`, `"uint32"`, ...).
    pub fn parse(name: &str) -> Option<Dtype> {
        Some(match name {
            "bf16" | "bfloat16" => Dtype::Bf16,
            "f16" | "float16" => Dtype::F16,
            "f32" | "float32" => Dtype::F32,
            "u32" | "uint32" => Dtype::U32,
            "i32" | "int32" => Dtype::I32,
            "u8" | "uint8" => Dtype::U8,
            "f8_e4m3" | "float8_e4m3fn" => Dtype::F8E4M3,
            _ => return None,
        })
    }
}
