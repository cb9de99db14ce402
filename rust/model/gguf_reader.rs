//! A bounded reader over the header of a GGUF file (an untrusted input): the counts, names,
//! metadata values and tensor infos, each checked before anything is reserved for it.
//!
//! Invariants:
//! - every read is checked against the end of the file, with checked arithmetic;
//! - a count (key/values, tensors, array elements) is refused when the rest of the file could
//!   not hold that many entries of the smallest size such an entry has, so no loop runs and
//!   nothing is reserved for entries that cannot exist;
//! - everything the parse keeps in memory (strings, values, tensor infos) is charged to a
//!   budget of [`HEADER_MEMORY_LIMIT`] bytes before it is allocated, so no header makes the
//!   loader allocate more than that, whatever its counts say (a GGUF value takes 32 bytes in
//!   memory for one byte in the file, so the file's size alone would not bound it).
//!
//! Every error names the file, the field and the value.

use super::gguf::GgufValue;
use super::ModelError;
use std::fmt::Display;
use std::mem::size_of;

/// The most memory a parsed header may take: about ten times the largest real one (a
/// 262,144-token vocabulary with its scores and token types takes about 30 MiB).
pub const HEADER_MEMORY_LIMIT: usize = 256 << 20;
/// The longest key or tensor name (the GGUF specification caps keys at 65,535 bytes).
pub const MAX_NAME_BYTES: usize = 65_535;
/// How deep arrays may nest.
const MAX_ARRAY_DEPTH: usize = 4;
/// Fewest bytes one key/value takes: key length (8), one key byte, type (4), one value byte.
pub const MIN_KV_BYTES: usize = 14;
/// Fewest bytes one tensor info takes: name length (8), n_dims (4), type (4), offset (8).
pub const MIN_TENSOR_INFO_BYTES: usize = 24;

/// The size in the file of one value of `ty`, or of its smallest possible encoding for
/// strings (the length field) and arrays (type and count fields); `None` for an unknown type.
fn min_encoded_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// The cursor, the file it reads and the memory budget left.
pub struct Reader<'a> {
    bytes: &'a [u8],
    /// Where the next read starts.
    pub pos: usize,
    path: &'a str,
    budget: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`; `path` is named in errors.
    pub fn new(bytes: &'a [u8], path: &'a str) -> Self {
        Reader {
            bytes,
            pos: 0,
            path,
            budget: HEADER_MEMORY_LIMIT,
        }
    }

    /// The file, as named in errors.
    pub fn path(&self) -> &str {
        self.path
    }

    /// A malformed-file error.
    pub fn format_err(&self, message: String) -> ModelError {
        ModelError::Format {
            path: self.path.to_string(),
            format: "GGUF",
            message,
        }
    }

    /// An out-of-range error naming `field` and `value`.
    pub fn out_of_range(
        &self,
        field: impl Into<String>,
        value: impl Display,
        reason: impl Into<String>,
    ) -> ModelError {
        ModelError::OutOfRange {
            path: self.path.to_string(),
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// Bytes after the cursor.
    pub fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// Takes `bytes` of the memory budget for `what`, or refuses.
    pub fn charge(&mut self, bytes: usize, what: &str) -> Result<(), ModelError> {
        match self.budget.checked_sub(bytes) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => Err(self.out_of_range(
                format!("the header's size in memory at {what}"),
                format!(
                    "{} bytes",
                    (HEADER_MEMORY_LIMIT - self.budget).saturating_add(bytes)
                ),
                format!("a GGUF header may take at most {HEADER_MEMORY_LIMIT} bytes"),
            )),
        }
    }

    /// The next `n` bytes; a file that ends first is cut short.
    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ModelError> {
        if n > self.left() {
            return Err(self.format_err(format!(
                "the file ends at byte {} while reading {what} ({n} bytes at {})",
                self.bytes.len(),
                self.pos
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// A little-endian u32.
    pub fn u32(&mut self, what: &str) -> Result<u32, ModelError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A little-endian u64.
    pub fn u64(&mut self, what: &str) -> Result<u64, ModelError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of entries each at least `min_bytes` long, refused when the rest of the
    /// file cannot hold that many.
    pub fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize, ModelError> {
        let n = self.u64(what)?;
        let most = self.left() / min_bytes.max(1);
        match usize::try_from(n) {
            Ok(n) if n <= most => Ok(n),
            _ => Err(self.out_of_range(
                what,
                n,
                format!(
                    "the {} bytes left in the file hold at most {most} entries of {min_bytes} bytes",
                    self.left()
                ),
            )),
        }
    }

    /// A length-prefixed string (invalid UTF-8 replaced), charged to the budget.
    pub fn string(&mut self, what: &str) -> Result<String, ModelError> {
        self.string_at_most(what, usize::MAX, "")
    }

    /// A key or tensor name: a string of at most [`MAX_NAME_BYTES`].
    pub fn name(&mut self, what: &str) -> Result<String, ModelError> {
        let rule = format!("; names are at most {MAX_NAME_BYTES} bytes");
        self.string_at_most(what, MAX_NAME_BYTES, &rule)
    }

    fn string_at_most(&mut self, what: &str, max: usize, rule: &str) -> Result<String, ModelError> {
        let field = format!("the length of {what} at byte {}", self.pos);
        let n = self.u64(&field)?;
        let raw = match usize::try_from(n) {
            Ok(n) if n <= self.left() && n <= max => self.take(n, what)?,
            _ => {
                let reason = format!("{} bytes are left in the file{rule}", self.left());
                return Err(self.out_of_range(field, n, reason));
            }
        };
        // The exact length after replacement, known before allocating: each invalid
        // sequence becomes U+FFFD (3 bytes).
        let len: usize = raw
            .utf8_chunks()
            .map(|c| c.valid().len() + if c.invalid().is_empty() { 0 } else { 3 })
            .sum();
        self.charge(len, what)?;
        Ok(String::from_utf8_lossy(raw).into_owned())
    }

    /// One metadata value of type `ty` for `key` (the caller charges the value itself;
    /// strings and array elements are charged here).
    pub fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue, ModelError> {
        let what = format!("the value of {key:?}");
        let mut fixed = |n: usize| -> Result<u64, ModelError> {
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(self.take(n, &what)?);
            Ok(u64::from_le_bytes(a))
        };
        Ok(match ty {
            0 => GgufValue::UInt(fixed(1)?),
            1 => GgufValue::Int(fixed(1)? as u8 as i8 as i64),
            2 => GgufValue::UInt(fixed(2)?),
            3 => GgufValue::Int(fixed(2)? as u16 as i16 as i64),
            4 => GgufValue::UInt(fixed(4)?),
            5 => GgufValue::Int(fixed(4)? as u32 as i32 as i64),
            6 => GgufValue::Float(f32::from_bits(fixed(4)? as u32) as f64),
            7 => GgufValue::Bool(fixed(1)? != 0),
            8 => GgufValue::Str(self.string(&what)?),
            9 => self.array(key, depth)?,
            10 => GgufValue::UInt(fixed(8)?),
            11 => GgufValue::Int(fixed(8)? as i64),
            12 => GgufValue::Float(f64::from_bits(fixed(8)?)),
            other => {
                return Err(self.out_of_range(
                    format!("the type of {key:?}"),
                    other,
                    "GGUF value types are 0 to 12",
                ))
            }
        })
    }

    fn array(&mut self, key: &str, depth: usize) -> Result<GgufValue, ModelError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.out_of_range(
                format!("the nesting of arrays in {key:?}"),
                depth + 1,
                format!("arrays nest at most {MAX_ARRAY_DEPTH} deep"),
            ));
        }
        let inner = self.u32(&format!("the element type of {key:?}"))?;
        let Some(min) = min_encoded_size(inner) else {
            return Err(self.out_of_range(
                format!("the element type of {key:?}"),
                inner,
                "GGUF value types are 0 to 12",
            ));
        };
        let n = self.count(&format!("the length of array {key:?}"), min)?;
        self.charge(n.saturating_mul(size_of::<GgufValue>()), key)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.value(inner, key, depth + 1)?);
        }
        Ok(GgufValue::Array(v))
    }
}
