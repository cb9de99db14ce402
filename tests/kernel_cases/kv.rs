//! The copy cases, exact: `kv_write` into paged caches, `kv_copy` between blocks, and
//! `copy_rows`.

use super::*;

pub fn kv_write(
    dut: &dyn GpuBackend,
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
    num_slots: usize,
    seed: u64,
) -> Result<(), String> {
    let width = kv_heads * head_dim;
    let k = uniform(seed, rows * width, -1.0, 1.0);
    let v = uniform(seed + 1, rows * width, -1.0, 1.0);
    // Distinct slots, so the result does not depend on write order.
    let mut r = rng(seed + 2);
    let mut slots: Vec<u32> = (0..num_slots as u32).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    slots.truncate(rows);
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (pk, pv, ps) = (s.bf16(&k)?, s.bf16(&v)?, s.u32(&slots)?);
        let (kc, vc) = (
            s.out(Dtype::Bf16, num_slots * width)?,
            s.out(Dtype::Bf16, num_slots * width)?,
        );
        b.kv_write(KvWriteArgs {
            k_cache: kc,
            v_cache: vc,
            k: pk,
            v: pv,
            slots: ps,
            rows,
            kv_heads,
            head_dim,
            num_slots,
            stream: 0,
        })?;
        let mut out = b.download::<bf16>(kc, num_slots * width)?;
        out.extend(b.download::<bf16>(vc, num_slots * width)?);
        Ok(out)
    })?;
    exact("kv_write", &bits(&got), &bits(&want))
}

/// A compaction of a draft tree's accepted path in a paged cache of random rows: `path`
/// (increasing node indices) moves from the rows after `prefix` to the rows right after it,
/// through a scattered block table, as the target model compacts a sequence. The result
/// must be the copies done one at a time on the host (a later copy writes the row an
/// earlier one read whenever the path takes a node's first child).
pub fn kv_copy(
    dut: &dyn GpuBackend,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    prefix: usize,
    path: &[usize],
    seed: u64,
) -> Result<(), String> {
    let width = kv_heads * head_dim;
    let rows_used = prefix + 1 + path.last().map_or(0, |&p| p + 1);
    let blocks = rows_used.div_ceil(block_size) + 3;
    let num_slots = blocks * block_size;
    let mut r = rng(seed);
    let mut table: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, r.random_range(0..=i));
    }
    let slot = |row: usize| table[row / block_size] * block_size as u32 + (row % block_size) as u32;
    let (src, dst): (Vec<u32>, Vec<u32>) = path
        .iter()
        .enumerate()
        .map(|(k, &node)| (slot(prefix + 1 + node), slot(prefix + 1 + k)))
        .unzip();
    let k0 = uniform(seed + 1, num_slots * width, -1.0, 1.0);
    let v0 = uniform(seed + 2, num_slots * width, -1.0, 1.0);
    let mut want: Vec<bf16> = k0.iter().chain(&v0).map(|&x| bf16::from_f32(x)).collect();
    for (&s, &d) in src.iter().zip(&dst) {
        for base in [0, num_slots * width] {
            let (s, d) = (base + s as usize * width, base + d as usize * width);
            want.copy_within(s..s + width, d);
        }
    }
    let (got, reference) = both(dut, |b| {
        let sc = Scope::new(b);
        let (kc, vc) = (sc.bf16(&k0)?, sc.bf16(&v0)?);
        let (ps, pd) = (sc.u32(&src)?, sc.u32(&dst)?);
        b.kv_copy(KvCopyArgs {
            k_cache: kc,
            v_cache: vc,
            src: ps,
            dst: pd,
            copies: src.len(),
            kv_heads,
            head_dim,
            num_slots,
            stream: 0,
        })?;
        let mut out = b.download::<bf16>(kc, num_slots * width)?;
        out.extend(b.download::<bf16>(vc, num_slots * width)?);
        Ok(out)
    })?;
    exact("kv_copy reference", &bits(&reference), &bits(&want))?;
    exact("kv_copy", &bits(&got), &bits(&want))
}

/// `parts` source buffers of `rows` rows (`src_stride` elements apart, `width` used) copied
/// side by side into one poisoned `[rows, parts * width + pad]` buffer, part `j` at column
/// `j * width`, as the target's layer capture does. The reference's result is also checked
/// against the copy done here on the host (the pad columns stay poisoned).
pub fn copy_rows(
    dut: &dyn GpuBackend,
    rows: usize,
    width: usize,
    src_stride: usize,
    parts: usize,
    pad: usize,
    seed: u64,
) -> Result<(), String> {
    let dst_stride = parts * width + pad;
    let srcs: Vec<Vec<f32>> = (0..parts)
        .map(|j| uniform(seed + j as u64, rows * src_stride, -4.0, 4.0))
        .collect();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let dst = s.out(Dtype::Bf16, rows * dst_stride)?;
        for (j, src) in srcs.iter().enumerate() {
            b.copy_rows(CopyRowsArgs {
                dst,
                src: s.bf16(src)?,
                rows,
                width,
                col: j * width,
                dst_stride,
                src_stride,
                stream: 0,
            })?;
        }
        b.download::<bf16>(dst, rows * dst_stride)
    })?;
    let mut host = vec![bf16::from_bits(0xffff); rows * dst_stride];
    for (j, src) in srcs.iter().enumerate() {
        for r in 0..rows {
            for i in 0..width {
                host[r * dst_stride + j * width + i] = bf16::from_f32(src[r * src_stride + i]);
            }
        }
    }
    exact("copy_rows reference", &bits(&want), &bits(&host))?;
    exact("copy_rows", &bits(&got), &bits(&want))
}
