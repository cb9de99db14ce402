//! How a paged attention call is cut into pool tasks: rows into tiles, and (tile, KV head)
//! units into the tasks' shares.
//!
//! Invariant: the shares of a call cover every (row, query head) exactly once, each within
//! one tile of one sequence and one KV head's group, so tasks write disjoint outputs.

use super::TILE_ROWS;

/// Consecutive query rows of one sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Tile {
    pub seq: usize,
    pub first_row: usize,
    pub rows: usize,
    /// The longest context of its rows.
    pub ctx: usize,
}

/// Groups consecutive rows of one sequence into tiles of at most [`TILE_ROWS`].
pub(super) fn tiles(row_seq: &[u32], row_ctx_len: &[u32]) -> Vec<Tile> {
    let mut out: Vec<Tile> = Vec::new();
    for (r, (&s, &len)) in row_seq.iter().zip(row_ctx_len).enumerate() {
        let (seq, len) = (s as usize, len as usize);
        match out.last_mut() {
            Some(t) if t.seq == seq && t.rows < TILE_ROWS => {
                t.rows += 1;
                t.ctx = t.ctx.max(len);
            }
            _ => out.push(Tile {
                seq,
                first_row: r,
                rows: 1,
                ctx: len,
            }),
        }
    }
    out
}

/// One task's share of the work: the query heads `heads` (KV head `kv_head`'s whole group,
/// or a part of it) of the rows of `tile` (a whole tile, or a run of its rows).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Share {
    pub tile: Tile,
    pub kv_head: usize,
    pub heads: std::ops::Range<usize>,
}

/// The tasks of a call: one a (tile, KV head) unit, but a unit is split where the units
/// would leave threads idle.
///
/// - Units fewer than the threads (a decode row of a model with few KV heads): each unit's
///   group is split into as many parts as make the threads busy.
/// - Otherwise the units that remain after whole rounds of `threads` (a verify step's 3 units
///   on 2 threads: one) are each split by rows into up to `threads` parts, and come last, so
///   the threads that finish their whole units first share them. Without it the last unit
///   runs alone while the other threads wait: at 9 rows of SmolLM2 on 2 threads, 3 units
///   take two units' time instead of one and a half (`step_profile --rows=9`, attention of
///   a forward: 1.76-2.02 ms before, 1.38-1.78 after; 5 rows 1.15-1.46 before, 0.99-1.04).
///   A single row is not split by heads here: its keys dominate the unit's cost, and a part
///   re-reads them (one decode row: no gain in a forward, 30% slower alone).
///
/// Every part re-reads its keys and values (unless widened once for the sequence), which is
/// why whole rounds are not split. Splitting never changes a row's arithmetic: it depends
/// only on the row's query, its context length and the cache (the module invariant).
pub(super) fn shares(
    tiles: &[Tile],
    kv_heads: usize,
    group: usize,
    threads: usize,
    row_ctx_len: &[u32],
) -> Vec<Share> {
    let units = tiles.len() * kv_heads;
    let threads = threads.max(1);
    let (whole, parts) = if units < threads {
        (0, threads.div_ceil(units.max(1)))
    } else {
        (units - units % threads, threads)
    };
    let mut out = Vec::with_capacity(units + (units - whole) * parts);
    for u in 0..units {
        let (tile, kv_head) = (tiles[u / kv_heads], u % kv_heads);
        let heads_of = |a: usize, b: usize| kv_head * group + a..kv_head * group + b;
        let share = |tile, heads| Share {
            tile,
            kv_head,
            heads,
        };
        if u < whole {
            out.push(share(tile, heads_of(0, group)));
        } else if units < threads {
            let by_heads = parts.min(group);
            for p in 0..by_heads {
                out.push(share(
                    tile,
                    heads_of(p * group / by_heads, (p + 1) * group / by_heads),
                ));
            }
        } else {
            // A one-row unit is one run: the whole unit.
            let by_rows = parts.min(tile.rows);
            for p in 0..by_rows {
                let (a, b) = (p * tile.rows / by_rows, (p + 1) * tile.rows / by_rows);
                let first_row = tile.first_row + a;
                let ctx = row_ctx_len[first_row..tile.first_row + b]
                    .iter()
                    .map(|&c| c as usize)
                    .max()
                    .unwrap_or(0);
                let part = Tile {
                    seq: tile.seq,
                    first_row,
                    rows: b - a,
                    ctx,
                };
                out.push(share(part, heads_of(0, group)));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// One sequence's `rows` consecutive rows, the last at context `ctx`.
    fn verify_rows(rows: usize, ctx: u32) -> (Vec<u32>, Vec<u32>) {
        let lens = (0..rows as u32)
            .map(|i| ctx + 1 + i - rows as u32)
            .collect();
        (vec![0; rows], lens)
    }

    fn plan(rows: usize, kv_heads: usize, group: usize, threads: usize) -> Vec<Share> {
        let (seq, lens) = verify_rows(rows, 160);
        shares(&tiles(&seq, &lens), kv_heads, group, threads, &lens)
    }

    fn whole(rows: usize, kv_head: usize, group: usize) -> Share {
        let tile = Tile {
            seq: 0,
            first_row: 0,
            rows,
            ctx: 160,
        };
        Share {
            tile,
            kv_head,
            heads: kv_head * group..(kv_head + 1) * group,
        }
    }

    #[test]
    fn the_unit_left_over_by_whole_rounds_is_split_over_the_threads() {
        // A 9-row verify of SmolLM2's 3 KV heads on 2 threads: two whole units, then the
        // third in two runs of rows.
        let rows_part = |first_row: usize, rows: usize| Share {
            tile: Tile {
                seq: 0,
                first_row,
                rows,
                ctx: 160 - 8 + first_row + rows - 1,
            },
            kv_head: 2,
            heads: 6..9,
        };
        let want = vec![
            whole(9, 0, 3),
            whole(9, 1, 3),
            rows_part(0, 4),
            rows_part(4, 5),
        ];
        assert_eq!(plan(9, 3, 3, 2), want);
        // One decode row has no rows to split: three whole units.
        assert_eq!(
            plan(1, 3, 3, 2),
            (0..3).map(|h| whole(1, h, 3)).collect::<Vec<_>>()
        );
        // Whole rounds only: nothing is split.
        assert_eq!(
            plan(9, 3, 3, 3),
            (0..3).map(|h| whole(9, h, 3)).collect::<Vec<_>>()
        );
        assert_eq!(
            plan(9, 3, 3, 1),
            (0..3).map(|h| whole(9, h, 3)).collect::<Vec<_>>()
        );
        // Fewer units than threads: every group split by heads, as many parts as threads.
        let one = plan(1, 1, 8, 2);
        let heads: Vec<_> = one.iter().map(|s| s.heads.clone()).collect();
        assert_eq!(heads, vec![0..4, 4..8]);
    }

    #[test]
    fn shares_cover_every_row_and_head_once() {
        let mut r = SmallRng::seed_from_u64(5);
        for case in 0..2000 {
            let kv_heads = r.random_range(1..=4);
            let group = [1, 2, 3, 4, 8][r.random_range(0..5)];
            let threads = r.random_range(1..=5);
            // Runs of rows of a few sequences, each run's contexts rising from a random start.
            let (mut seq, mut lens) = (Vec::new(), Vec::new());
            for s in 0..r.random_range(1..=4u32) {
                let (n, start) = (r.random_range(1..=40u32), r.random_range(0..300u32));
                seq.extend((0..n).map(|_| s));
                lens.extend((0..n).map(|i| start + i));
            }
            let rows = seq.len();
            let tiles = tiles(&seq, &lens);
            let shares = shares(&tiles, kv_heads, group, threads, &lens);
            let mut seen = vec![0u8; rows * kv_heads * group];
            for s in &shares {
                let group_heads = s.kv_head * group..(s.kv_head + 1) * group;
                assert!(
                    s.heads.start >= group_heads.start && s.heads.end <= group_heads.end,
                    "case {case}: heads {:?} outside KV head {}'s group",
                    s.heads,
                    s.kv_head
                );
                let t = s.tile;
                let rows_of = t.first_row..t.first_row + t.rows;
                assert!(
                    tiles.iter().any(|w| w.seq == t.seq
                        && w.first_row <= t.first_row
                        && t.first_row + t.rows <= w.first_row + w.rows),
                    "case {case}: share rows {rows_of:?} are not inside one tile"
                );
                let ctx = rows_of.clone().map(|i| lens[i] as usize).max();
                assert_eq!(Some(t.ctx), ctx, "case {case}: the share's context");
                for row in rows_of {
                    for h in s.heads.clone() {
                        seen[row * kv_heads * group + h] += 1;
                    }
                }
            }
            assert!(
                seen.iter().all(|&n| n == 1),
                "case {case}: a (row, head) covered {:?} times",
                seen.iter().find(|&&n| n != 1)
            );
        }
    }
}
