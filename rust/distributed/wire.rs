//! The little-endian field codec of the command channel (see `command` for the layout):
//! a writer that appends fields, and a reader whose every read fails cleanly past the end
//! and whose counts are checked against the bytes left, so a corrupt count never reserves
//! memory.

use super::command::SeqTokens;

/// Appends little-endian fields.
pub(super) struct Writer(pub Vec<u8>);

impl Writer {
    pub(super) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// A count: no list in a command can pass u32::MAX items (a context window is far
    /// shorter).
    pub(super) fn len(&mut self, n: usize) {
        self.u32(n as u32);
    }
    pub(super) fn list(&mut self, items: &[u32]) {
        self.len(items.len());
        items.iter().for_each(|&v| self.u32(v));
    }
    pub(super) fn list64(&mut self, items: &[u64]) {
        self.len(items.len());
        items.iter().for_each(|&v| self.u64(v));
    }
    pub(super) fn bytes(&mut self, bytes: &[u8]) {
        self.len(bytes.len());
        self.0.extend_from_slice(bytes);
    }
    pub(super) fn batch(&mut self, batch: &[SeqTokens]) {
        self.len(batch.len());
        for s in batch {
            self.u64(s.seq);
            self.list(&s.tokens);
        }
    }
}

/// A cursor over command bytes; each read is `None` past the end.
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }
    pub(super) fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let end = self.at.checked_add(N)?;
        let out = self.bytes.get(self.at..end)?.try_into().ok()?;
        self.at = end;
        Some(out)
    }
    pub(super) fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    pub(super) fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    pub(super) fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    pub(super) fn left(&self) -> usize {
        self.bytes.len() - self.at
    }
    pub(super) fn seq(&mut self) -> Result<u64, String> {
        self.u64()
            .ok_or_else(|| "truncated sequence id".to_string())
    }
    /// A count of items of at least `item_bytes` each, refused when the bytes left cannot
    /// hold them (so a corrupt count never reserves memory).
    pub(super) fn count(&mut self, what: &str, item_bytes: usize) -> Result<usize, String> {
        let n = self
            .u32()
            .ok_or_else(|| format!("truncated {what} count"))? as usize;
        if n.saturating_mul(item_bytes) > self.left() {
            return Err(format!(
                "{n} {what}s need at least {} bytes, {} are left",
                n.saturating_mul(item_bytes),
                self.left()
            ));
        }
        Ok(n)
    }
    pub(super) fn list(&mut self, what: &str) -> Result<Vec<u32>, String> {
        let n = self.count(what, 4)?;
        Ok((0..n).filter_map(|_| self.u32()).collect())
    }
    pub(super) fn list64(&mut self, what: &str) -> Result<Vec<u64>, String> {
        let n = self.count(what, 8)?;
        Ok((0..n).filter_map(|_| self.u64()).collect())
    }
    pub(super) fn bytes(&mut self, what: &str) -> Result<Vec<u8>, String> {
        let n = self.count(what, 1)?;
        let out = self.bytes[self.at..self.at + n].to_vec();
        self.at += n;
        Ok(out)
    }
    pub(super) fn batch(&mut self) -> Result<Vec<SeqTokens>, String> {
        let n = self.count("sequence", 12)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let seq = self.seq()?;
            out.push(SeqTokens {
                seq,
                tokens: self.list("token")?,
            });
        }
        Ok(out)
    }
}
