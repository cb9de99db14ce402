//! A structured mutator with a fixed seed, for the smoke run of the fuzz targets that needs
//! no libFuzzer build (the crate's regression tests run it; `scripts/fuzz.sh smoke` reports
//! it). libFuzzer's own mutations drive the long runs.
//!
//! Mutations aim where loaders go wrong: bit flips; bytes and 32/64-bit words overwritten
//! with boundary values; the same written over a plausible length or count field (a
//! little-endian u64 no larger than the input, the way GGUF and safetensors store them);
//! decimal numbers in JSON text replaced by boundary numbers; truncation; splices with
//! another seed; a chunk repeated. The same seed gives the same inputs.

/// Values at the edges of the integer types and of what a loader may accept.
const BOUNDARY: [u64; 12] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64,
    1 << 40,
    1 << 60,
    1 << 63,
    u64::MAX,
];

/// Decimal forms of boundary numbers, for JSON.
const BOUNDARY_TEXT: [&str; 9] = [
    "0",
    "-1",
    "1e309",
    "0.5",
    "4294967296",
    "1099511627776",
    "1152921504606846976",
    "18446744073709551615",
    "99999999999999999999999",
];

/// The mutator: a xorshift generator and the operations above.
pub struct Mutator(u64);

impl Mutator {
    /// A mutator whose inputs depend only on `seed`.
    pub fn new(seed: u64) -> Self {
        Mutator(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `data` with one to four mutations; `seeds` are spliced from.
    pub fn mutate(&mut self, data: &[u8], seeds: &[Vec<u8>]) -> Vec<u8> {
        let mut b = data.to_vec();
        for _ in 0..1 + self.below(4) {
            if b.is_empty() {
                b = seeds[self.below(seeds.len())].clone();
                continue;
            }
            let i = self.below(b.len());
            match self.below(8) {
                0 => b[i] ^= 1 << self.below(8),
                1 => b[i] = BOUNDARY[self.below(BOUNDARY.len())] as u8,
                2 => self.put_word(&mut b, i),
                3 => {
                    if let Some(at) = self.length_field(&b) {
                        self.put_word(&mut b, at);
                    }
                }
                4 => self.replace_number(&mut b),
                5 => b.truncate(i),
                6 => {
                    let other = &seeds[self.below(seeds.len())];
                    let j = self.below(other.len().max(1));
                    let end = other.len().min(j + 1 + self.below(4096));
                    b.truncate(i);
                    b.extend_from_slice(other.get(j..end).unwrap_or(&[]));
                }
                _ => {
                    let j = self.below(b.len());
                    let chunk: Vec<u8> = b[j..b.len().min(j + 1 + self.below(256))].to_vec();
                    b.splice(i..i, chunk);
                }
            }
        }
        b
    }

    /// Writes a boundary value as a 4- or 8-byte little-endian word at `at`, where it fits.
    fn put_word(&mut self, b: &mut [u8], at: usize) {
        let v = BOUNDARY[self.below(BOUNDARY.len())];
        if self.below(2) == 0 && at + 8 <= b.len() {
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        } else if at + 4 <= b.len() {
            b[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
        }
    }

    /// An offset holding a little-endian u64 in `1..=len`: likely a length or a count.
    fn length_field(&mut self, b: &[u8]) -> Option<usize> {
        if b.len() < 8 {
            return None;
        }
        (0..64).find_map(|_| {
            let at = self.below(b.len() - 7);
            let v = u64::from_le_bytes(b[at..at + 8].try_into().ok()?);
            (v >= 1 && v <= b.len() as u64).then_some(at)
        })
    }

    /// Replaces a run of ASCII digits with a boundary number.
    fn replace_number(&mut self, b: &mut Vec<u8>) {
        let start = self.below(b.len());
        let Some(first) = (start..b.len()).find(|&k| b[k].is_ascii_digit()) else {
            return;
        };
        let end = (first..b.len())
            .find(|&k| !b[k].is_ascii_digit())
            .unwrap_or(b.len());
        let text = BOUNDARY_TEXT[self.below(BOUNDARY_TEXT.len())].as_bytes();
        b.splice(first..end, text.iter().copied());
    }
}
