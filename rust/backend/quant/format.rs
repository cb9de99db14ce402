//! The weight formats: GGUF's block layouts as ggml defines them, with checked size arithmetic.
//!
//! A quantized row of `n` elements is `n / block_len` blocks of `block_bytes` bytes each;
//! float formats are blocks of one element. Every size computation here is checked: a size
//! that overflows or a row that is not a whole number of blocks is an error, never a wrap.

use super::QuantError;
use std::fmt;
use std::str::FromStr;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Elements per block of the legacy formats (Q4_0 .. Q8_0).
pub const QK: usize = 32;

/// A weight format as stored in a GGUF file (names and ids as ggml's `ggml_type`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// IEEE single precision, 4 bytes an element.
    F32,
    /// IEEE half precision, 2 bytes an element.
    F16,
    /// bfloat16 (the top half of an f32), 2 bytes an element.
    BF16,
    /// 32 4-bit codes with one f16 scale (`w = d * (q - 8)`), 18 bytes a block.
    Q4_0,
    /// 32 4-bit codes with an f16 scale and minimum (`w = d * q + m`), 20 bytes a block.
    Q4_1,
    /// 32 5-bit codes with one f16 scale (`w = d * (q - 16)`), 22 bytes a block.
    Q5_0,
    /// 32 5-bit codes with an f16 scale and minimum (`w = d * q + m`), 24 bytes a block.
    Q5_1,
    /// 32 signed 8-bit codes with one f16 scale (`w = d * q`), 34 bytes a block.
    Q8_0,
    /// 256-element super-block of 2-bit codes, 4-bit sub-block scales and minimums, 84 bytes.
    Q2_K,
    /// 256-element super-block of 3-bit codes with 6-bit sub-block scales, 110 bytes.
    Q3_K,
    /// 256-element super-block of 4-bit codes, 6-bit sub-block scales and minimums, 144 bytes.
    Q4_K,
    /// 256-element super-block of 5-bit codes, 6-bit sub-block scales and minimums, 176 bytes.
    Q5_K,
    /// 256-element super-block of 6-bit codes with 8-bit sub-block scales, 210 bytes.
    Q6_K,
}

impl BlockFormat {
    /// Every format, floats first.
    pub const ALL: [BlockFormat; 13] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    /// The format of a GGUF tensor's `ggml_type` id.
    pub fn from_ggml_type(id: u32) -> Result<Self, QuantError> {
        Self::ALL
            .into_iter()
            .find(|f| f.ggml_type() == id)
            .ok_or(QuantError::UnknownGgmlType(id))
    }

    /// ggml's type id (the value stored in a GGUF tensor header).
    pub fn ggml_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2_K => 10,
            Self::Q3_K => 11,
            Self::Q4_K => 12,
            Self::Q5_K => 13,
            Self::Q6_K => 14,
            Self::BF16 => 30,
        }
    }

    /// The lower-case name (`"q4_k"`), as `load_model(weights=...)` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q8_0 => "q8_0",
            Self::Q2_K => "q2_k",
            Self::Q3_K => "q3_k",
            Self::Q4_K => "q4_k",
            Self::Q5_K => "q5_k",
            Self::Q6_K => "q6_k",
        }
    }

    /// Whether the format stores blocks of integers with scales (not plain floats).
    pub fn is_quantized(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }

    /// Whether the format uses 256-element super-blocks (the K-quants).
    pub fn is_k_quant(self) -> bool {
        self.block_len() == QK_K
    }

    /// Elements per block.
    pub const fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => QK,
            Self::Q2_K | Self::Q3_K | Self::Q4_K | Self::Q5_K | Self::Q6_K => QK_K,
        }
    }

    /// Bytes per block (ggml's `type_size`).
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2_K => 84,
            Self::Q3_K => 110,
            Self::Q4_K => 144,
            Self::Q5_K => 176,
            Self::Q6_K => 210,
        }
    }

    /// Blocks in a row of `len` elements; an error unless `len` is a whole number of blocks.
    pub fn blocks_per_row(self, len: usize) -> Result<usize, QuantError> {
        let block_len = self.block_len();
        if !len.is_multiple_of(block_len) {
            return Err(QuantError::NotBlockAligned {
                format: self,
                len,
                block_len,
            });
        }
        Ok(len / block_len)
    }

    /// Bytes of a row of `len` elements.
    pub fn row_bytes(self, len: usize) -> Result<usize, QuantError> {
        checked_mul("row bytes", self.blocks_per_row(len)?, self.block_bytes())
    }

    /// Bytes of a `[rows, cols]` matrix stored row by row.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> Result<usize, QuantError> {
        checked_mul("matrix bytes", rows, self.row_bytes(cols)?)
    }
}

/// `a * b`, or an error naming `what`.
pub(crate) fn checked_mul(what: &'static str, a: usize, b: usize) -> Result<usize, QuantError> {
    a.checked_mul(b).ok_or(QuantError::Overflow { what, a, b })
}

impl fmt::Display for BlockFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BlockFormat {
    type Err = QuantError;

    /// Parses a name case-insensitively (`"Q4_K"`, `"q8_0"`, `"bf16"`).
    fn from_str(s: &str) -> Result<Self, QuantError> {
        let lower = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|f| f.name() == lower)
            .ok_or_else(|| QuantError::UnknownFormatName(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_ggml() {
        // Bytes per block from the field lists of ggml's block structs.
        let fields: [(BlockFormat, usize); 10] = [
            (BlockFormat::Q4_0, 2 + 16),
            (BlockFormat::Q4_1, 2 + 2 + 16),
            (BlockFormat::Q5_0, 2 + 4 + 16),
            (BlockFormat::Q5_1, 2 + 2 + 4 + 16),
            (BlockFormat::Q8_0, 2 + 32),
            (BlockFormat::Q2_K, 16 + 64 + 2 + 2),
            (BlockFormat::Q3_K, 32 + 64 + 12 + 2),
            (BlockFormat::Q4_K, 2 + 2 + 12 + 128),
            (BlockFormat::Q5_K, 2 + 2 + 12 + 32 + 128),
            (BlockFormat::Q6_K, 128 + 64 + 16 + 2),
        ];
        for (f, bytes) in fields {
            assert_eq!(f.block_bytes(), bytes, "{f}");
        }
        assert_eq!(BlockFormat::Q4_1.row_bytes(576).unwrap(), 18 * 20);
        assert_eq!(BlockFormat::Q6_K.matrix_bytes(3, 512).unwrap(), 3 * 2 * 210);
    }

    #[test]
    fn names_and_ids_round_trip() {
        for f in BlockFormat::ALL {
            assert_eq!(f.name().parse::<BlockFormat>().unwrap(), f);
            assert_eq!(f.name().to_uppercase().parse::<BlockFormat>().unwrap(), f);
            assert_eq!(BlockFormat::from_ggml_type(f.ggml_type()).unwrap(), f);
        }
        assert_eq!(
            "q4_k_m".parse::<BlockFormat>(),
            Err(QuantError::UnknownFormatName("q4_k_m".into()))
        );
        // 9 is Q8_1 and 15 is Q8_K: activation formats, never weights in a file.
        assert_eq!(
            BlockFormat::from_ggml_type(9),
            Err(QuantError::UnknownGgmlType(9))
        );
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(matches!(
            BlockFormat::Q4_K.row_bytes(576),
            Err(QuantError::NotBlockAligned {
                len: 576,
                block_len: 256,
                ..
            })
        ));
        assert!(matches!(
            BlockFormat::Q8_0.matrix_bytes(usize::MAX / 2, 64),
            Err(QuantError::Overflow { .. })
        ));
        assert!(matches!(
            BlockFormat::F32.row_bytes(usize::MAX),
            Err(QuantError::Overflow { .. })
        ));
    }
}
