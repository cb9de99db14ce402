//! The sines and cosines RoPE turns each position by, computed once per position and kept.
//!
//! A forward rotates the queries and the keys of every layer at the same positions, and each
//! angle is a `sin_cos` call of tens of nanoseconds: at a verify step of nine rows they took
//! longer than the rotations themselves (`cargo bench --bench step_profile -- --rows=9`).
//! A table holds, for one set of frequencies, `(position as f32 * inv_freq[k]).sin_cos()` for
//! the positions `0..len`: the very values a call would compute, so a rotation reads the
//! same bits from the table as it would work out itself.
//!
//! Invariants:
//! - A published table never changes: a longer one replaces it, behind an [`Arc`], so a call
//!   reading one races with nothing.
//! - A table covers at most [`MAX_POSITIONS`] positions; the angles of positions past it are
//!   computed per call, so a position read from a device buffer cannot make it grow without
//!   bound. At most [`MAX_TABLES`] sets of frequencies are kept (the oldest goes first).

use std::sync::{Arc, Mutex};

/// The most positions a table covers (2 MiB of angles at 32 frequencies).
pub(super) const MAX_POSITIONS: usize = 8192;
/// The fewest positions a new table covers: short runs need one table, not a series.
const MIN_POSITIONS: usize = 256;
/// Sets of frequencies kept (a target and a draft head with its own).
const MAX_TABLES: usize = 4;

/// The angles of positions `0..positions` for one set of frequencies.
pub(super) struct RopeAngles {
    freq_bits: Vec<u32>,
    positions: usize,
    /// `[positions, frequencies]`.
    sin: Vec<f32>,
    cos: Vec<f32>,
}

impl RopeAngles {
    fn build(inv_freq: &[f32], positions: usize) -> RopeAngles {
        let half = inv_freq.len();
        let (mut sin, mut cos) = (vec![0f32; positions * half], vec![0f32; positions * half]);
        for p in 0..positions {
            for (k, f) in inv_freq.iter().enumerate() {
                (sin[p * half + k], cos[p * half + k]) = angle(p as u32, *f);
            }
        }
        RopeAngles {
            freq_bits: inv_freq.iter().map(|f| f.to_bits()).collect(),
            positions,
            sin,
            cos,
        }
    }

    fn holds(&self, inv_freq: &[f32]) -> bool {
        self.freq_bits.len() == inv_freq.len()
            && self
                .freq_bits
                .iter()
                .zip(inv_freq)
                .all(|(&b, f)| b == f.to_bits())
    }

    /// The sines and cosines of `position` (one per frequency), if the table covers it.
    #[inline(always)]
    pub(super) fn at(&self, position: u32) -> Option<(&[f32], &[f32])> {
        let p = position as usize;
        if p >= self.positions {
            return None;
        }
        let half = self.freq_bits.len();
        Some((
            &self.sin[p * half..(p + 1) * half],
            &self.cos[p * half..(p + 1) * half],
        ))
    }
}

/// `(sin, cos)` of `position * inv_freq`, the definition every table entry holds.
#[inline(always)]
pub(super) fn angle(position: u32, inv_freq: f32) -> (f32, f32) {
    (position as f32 * inv_freq).sin_cos()
}

/// A backend's tables, one per set of frequencies it has rotated by.
#[derive(Default)]
pub(super) struct RopeCache {
    tables: Mutex<Vec<Arc<RopeAngles>>>,
}

impl RopeCache {
    /// The table of `inv_freq` covering `max_position` where [`MAX_POSITIONS`] allows (built
    /// or lengthened on the way).
    pub(super) fn table(&self, inv_freq: &[f32], max_position: u32) -> Arc<RopeAngles> {
        let want = (max_position as usize + 1)
            .next_power_of_two()
            .clamp(MIN_POSITIONS, MAX_POSITIONS);
        // The tables are replaced whole, never left half written: a poisoned lock still
        // holds good ones.
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        let found = tables.iter().position(|t| t.holds(inv_freq));
        if let Some(i) = found {
            if tables[i].positions >= want {
                return tables[i].clone();
            }
            tables.remove(i);
        } else if tables.len() >= MAX_TABLES {
            tables.remove(0);
        }
        let table = Arc::new(RopeAngles::build(inv_freq, want));
        tables.push(table.clone());
        table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_hold_the_computed_angles_and_stay_bounded() {
        let cache = RopeCache::default();
        let freqs: Vec<f32> = (0..8).map(|k| 10000f32.powf(-(k as f32) / 8.0)).collect();
        let t = cache.table(&freqs, 3);
        assert_eq!(t.positions, MIN_POSITIONS);
        for p in [0u32, 1, 17, 255] {
            let (s, c) = t.at(p).expect("covered");
            for (k, &f) in freqs.iter().enumerate() {
                let (ws, wc) = (p as f32 * f).sin_cos();
                assert_eq!(
                    (s[k].to_bits(), c[k].to_bits()),
                    (ws.to_bits(), wc.to_bits())
                );
            }
        }
        assert!(t.at(256).is_none());
        // Lengthened on demand, never past the bound, whatever the position asked for.
        assert_eq!(cache.table(&freqs, 1000).positions, 1024);
        let far = cache.table(&freqs, u32::MAX);
        assert_eq!(far.positions, MAX_POSITIONS);
        assert!(far.at(MAX_POSITIONS as u32).is_none());
        // Other frequencies get their own table; the oldest goes past MAX_TABLES.
        for i in 0..MAX_TABLES {
            let other: Vec<f32> = freqs.iter().map(|f| f * (i + 2) as f32).collect();
            assert!(cache.table(&other, 0).holds(&other));
        }
        let tables = cache.tables.lock().unwrap();
        assert_eq!(tables.len(), MAX_TABLES);
        assert!(!tables.iter().any(|t| t.holds(&freqs)));
    }
}
