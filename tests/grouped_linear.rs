//! A grouped linear (several weights over one input: q/k/v, gate/up) gives each part exactly
//! what that weight's own linear gives, bit for bit: for odd shapes, mixed block formats
//! (one or two kinds of 8-bit input blocks, float weights among them), more parts than one
//! pool job takes, biases, f32 and BF16 outputs, rows 1..17, both instruction sets and
//! several thread counts; on the CPU backend too, with its argument checks.

mod quant_common;

use half::bf16;
use quant_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::{
    linear, linear_group, Bias, BlockFormat, GroupPart, Isa, KernelPool, LinearOut, PackedWeight,
};
use specdraft::backend::{
    CpuBackend, DevicePtr, Dtype, GpuBackend, GpuBackendExt, GroupedLinearArgs, Kernels,
    LinearPart, LinearWeight,
};
use std::time::Duration;

fn pool(threads: usize, isa: Isa) -> KernelPool {
    KernelPool::with_options(threads, isa, Duration::from_micros(50))
}

fn packed(rng: &mut SmallRng, format: BlockFormat, outf: usize, inf: usize) -> PackedWeight {
    let blocks = outf * inf / format.block_len();
    let bytes = random_blocks(rng, format, blocks, &mut scale_in(1.0 / 256.0, 1.0 / 16.0));
    PackedWeight::new(format, outf, inf, &bytes).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Groups as `(in_features, [(format, out_features)])`.
fn groups() -> Vec<(usize, Vec<(BlockFormat, usize)>)> {
    use BlockFormat::*;
    vec![
        // Legacy formats only: one kind of input block; odd heights, one below a group.
        (160, vec![(Q4_1, 37), (Q8_0, 8), (Q5_0, 13)]),
        // K-quants and a float weight: 8-bit blocks of 256 plus the f32 input.
        (512, vec![(Q4_K, 21), (Q6_K, 9), (F16, 3)]),
        // Both kinds of input block in one group.
        (256, vec![(Q4_0, 17), (Q5_K, 11), (Q5_1, 1)]),
        // More parts than one pool job takes.
        (
            96,
            vec![(Q4_1, 24), (Q4_1, 5), (Q8_0, 40), (Q4_0, 7), (Q5_1, 16)],
        ),
        (64, vec![(Q4_1, 19)]),
    ]
}

#[test]
fn grouped_parts_equal_their_own_linears_bit_for_bit() {
    let mut rng = SmallRng::seed_from_u64(41);
    let isas = Isa::available();
    let pools: Vec<KernelPool> = isas
        .iter()
        .flat_map(|&isa| [pool(1, isa), pool(2, isa), pool(3, isa)])
        .collect();
    for (inf, shapes) in groups() {
        let weights: Vec<PackedWeight> = shapes
            .iter()
            .map(|&(f, outf)| packed(&mut rng, f, outf, inf))
            .collect();
        let views: Vec<_> = weights.iter().map(|w| w.view()).collect();
        // Every other part has a bias, f32 or BF16 (the same values).
        let biases: Vec<Option<Vec<f32>>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(_, outf))| {
                (i % 2 == 0).then(|| {
                    (0..outf)
                        .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)).to_f32())
                        .collect()
                })
            })
            .collect();
        let biases16: Vec<Option<Vec<bf16>>> = biases
            .iter()
            .map(|b| {
                b.as_ref()
                    .map(|b| b.iter().map(|&v| bf16::from_f32(v)).collect())
            })
            .collect();
        let x: Vec<bf16> = (0..17 * inf)
            .map(|_| bf16::from_f32(rng.random_range(-3.0..3.0)))
            .collect();
        for rows in 1..=17 {
            let x = &x[..rows * inf];
            for p in &pools {
                let what = |i: usize| {
                    let (f, outf) = shapes[i];
                    format!(
                        "{f} {outf}x{inf}, part {i}, {rows} rows, {:?} {} threads",
                        p.isa(),
                        p.threads()
                    )
                };
                // Each part alone, on a one-thread portable pool: the definition.
                let want: Vec<Vec<f32>> = (0..shapes.len())
                    .map(|i| {
                        let mut out = vec![0f32; rows * shapes[i].1];
                        let b = biases[i].as_deref();
                        linear(&pools[0], &weights[i], x, rows, b, &mut out).unwrap();
                        out
                    })
                    .collect();
                let mut f32_outs: Vec<Vec<f32>> =
                    shapes.iter().map(|s| vec![f32::NAN; rows * s.1]).collect();
                let mut parts: Vec<GroupPart> = views
                    .iter()
                    .zip(&mut f32_outs)
                    .zip(&biases)
                    .map(|((w, out), b)| GroupPart {
                        weight: w,
                        bias: b.as_deref().map(Bias::F32),
                        out: LinearOut::F32(out),
                    })
                    .collect();
                linear_group(p, x, rows, &mut parts).unwrap();
                for (i, got) in f32_outs.iter().enumerate() {
                    assert_eq!(bits(got), bits(&want[i]), "f32 out: {}", what(i));
                }
                let mut bf16_outs: Vec<Vec<bf16>> =
                    shapes.iter().map(|s| vec![bf16::NAN; rows * s.1]).collect();
                let mut parts: Vec<GroupPart> = views
                    .iter()
                    .zip(&mut bf16_outs)
                    .zip(&biases16)
                    .map(|((w, out), b)| GroupPart {
                        weight: w,
                        bias: b.as_deref().map(Bias::Bf16),
                        out: LinearOut::Bf16(out),
                    })
                    .collect();
                linear_group(p, x, rows, &mut parts).unwrap();
                for (i, got) in bf16_outs.iter().enumerate() {
                    let want: Vec<bf16> = want[i].iter().map(|&v| bf16::from_f32(v)).collect();
                    assert_eq!(bits16(got), bits16(&want), "bf16 out: {}", what(i));
                }
            }
        }
    }
}

#[test]
fn parts_that_disagree_on_the_input_width_are_refused() {
    let mut rng = SmallRng::seed_from_u64(42);
    let (a, b) = (
        packed(&mut rng, BlockFormat::Q4_1, 8, 64),
        packed(&mut rng, BlockFormat::Q4_1, 8, 96),
    );
    let (va, vb) = (a.view(), b.view());
    let (mut oa, mut ob) = (vec![0f32; 8], vec![0f32; 8]);
    let x = vec![0f32; 64];
    let mut parts = [
        GroupPart {
            weight: &va,
            bias: None,
            out: LinearOut::F32(&mut oa),
        },
        GroupPart {
            weight: &vb,
            bias: None,
            out: LinearOut::F32(&mut ob),
        },
    ];
    let err = linear_group(&pool(2, Isa::detect()), &x, 1, &mut parts).unwrap_err();
    assert!(
        err.to_string().contains("in_features of a grouped weight"),
        "{err}"
    );
}

/// A packed q/k/v-like group on the CPU backend, as device buffers.
struct Qkv {
    x: DevicePtr,
    weights: Vec<(LinearWeight, usize)>,
    biases: Vec<DevicePtr>,
    outs: Vec<DevicePtr>,
    inf: usize,
    rows: usize,
}

impl Qkv {
    fn new(gpu: &CpuBackend, rng: &mut SmallRng, out_dtype: Dtype) -> Qkv {
        let (inf, rows) = (192, 5);
        let shapes = [
            (BlockFormat::Q4_1, 72),
            (BlockFormat::Q4_1, 24),
            (BlockFormat::Q8_0, 27),
        ];
        let mut weights = Vec::new();
        let (mut biases, mut outs) = (Vec::new(), Vec::new());
        for (format, outf) in shapes {
            let w = packed(rng, format, outf, inf);
            let blocks = gpu.upload(w.bytes(), "test w").unwrap();
            let weight = LinearWeight::Packed {
                blocks,
                format,
                out_features: outf,
                in_features: inf,
            };
            weights.push((weight, outf));
            let b: Vec<f32> = (0..outf).map(|_| rng.random_range(-1.0..1.0)).collect();
            biases.push(gpu.upload_bf16(&b, "test bias").unwrap());
            outs.push(
                gpu.alloc(rows * outf * out_dtype.size(), "test out")
                    .unwrap(),
            );
        }
        let x: Vec<f32> = (0..rows * inf)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let x = gpu.upload_bf16(&x, "test x").unwrap();
        Qkv {
            x,
            weights,
            biases,
            outs,
            inf,
            rows,
        }
    }

    fn args(&self, out_dtype: Dtype) -> GroupedLinearArgs {
        let mut parts = [None; 3];
        for (i, slot) in parts.iter_mut().enumerate() {
            *slot = Some(LinearPart {
                out: self.outs[i],
                weight: self.weights[i].0,
                bias: Some(self.biases[i]),
                out_features: self.weights[i].1,
            });
        }
        GroupedLinearArgs {
            x: self.x,
            parts,
            out_dtype,
            rows: self.rows,
            in_features: self.inf,
            stream: 0,
        }
    }

    fn free(self, gpu: &CpuBackend) {
        let bufs = [self.x].into_iter().chain(self.biases).chain(self.outs);
        let weights = self.weights.into_iter().map(|(w, _)| match w {
            LinearWeight::Packed { blocks, .. } => blocks,
            _ => unreachable!(),
        });
        for p in bufs.chain(weights) {
            gpu.free(p).unwrap();
        }
    }
}

#[test]
fn cpu_grouped_linear_equals_one_linear_per_part() {
    let gpu = CpuBackend::new();
    let mut rng = SmallRng::seed_from_u64(43);
    for dtype in [Dtype::Bf16, Dtype::F32] {
        let g = Qkv::new(&gpu, &mut rng, dtype);
        let args = g.args(dtype);
        let read = |p: DevicePtr, n: usize| -> Vec<u8> { gpu.download::<u8>(p, n).unwrap() };
        let sizes: Vec<usize> = g
            .weights
            .iter()
            .map(|w| g.rows * w.1 * dtype.size())
            .collect();
        let mut want = Vec::new();
        for (single, &n) in args.linears().zip(&sizes) {
            gpu.linear(single).unwrap();
            want.push(read(single.out, n));
            gpu.memset(single.out, 0xff, n, 0).unwrap();
        }
        gpu.grouped_linear(args).unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            assert_eq!(read(g.outs[i], n), want[i], "{dtype:?} part {i}");
        }
        g.free(&gpu);
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn grouped_linear_arguments_are_checked_by_name() {
    let gpu = CpuBackend::new();
    let mut rng = SmallRng::seed_from_u64(44);
    let g = Qkv::new(&gpu, &mut rng, Dtype::Bf16);
    let err = |a: GroupedLinearArgs| gpu.grouped_linear(a).unwrap_err().to_string();
    // An output over the shared input.
    let mut a = g.args(Dtype::Bf16);
    if let Some(p) = a.parts[1].as_mut() {
        p.out = g.x;
    }
    let e = err(a);
    assert!(
        e.contains("grouped_linear") && e.contains("linear part 1 out overlaps linear x"),
        "{e}"
    );
    // Two outputs over each other.
    let mut a = g.args(Dtype::Bf16);
    if let Some(p) = a.parts[2].as_mut() {
        p.out = g.outs[0];
    }
    let e = err(a);
    assert!(e.contains("linear part 2 out overlaps linear out"), "{e}");
    // An output over another part's weight.
    let mut a = g.args(Dtype::Bf16);
    if let (Some(p), LinearWeight::Packed { blocks, .. }) = (a.parts[0].as_mut(), g.weights[1].0) {
        p.out = blocks;
    }
    let e = err(a);
    assert!(
        e.contains("linear out overlaps linear packed blocks"),
        "{e}"
    );
    // A gap in the list of parts, or none at all.
    let mut a = g.args(Dtype::Bf16);
    a.parts[1] = None;
    assert!(err(a).contains("filled from the front"));
    let mut a = g.args(Dtype::Bf16);
    a.parts = [None; 3];
    assert!(err(a).contains("filled from the front"));
    // A part whose weight was packed for another width.
    let mut a = g.args(Dtype::Bf16);
    if let Some(LinearPart {
        weight: LinearWeight::Packed { in_features, .. },
        ..
    }) = a.parts[2].as_mut()
    {
        *in_features = 160;
    }
    let e = err(a);
    assert!(e.contains("packed as [27, 160] used as [27, 192]"), "{e}");
    // The single linear keeps its own name in its messages.
    let mut single = g.args(Dtype::Bf16).linears().next().unwrap();
    single.out = g.x;
    let e = gpu.linear(single).unwrap_err().to_string();
    assert!(
        e.contains("linear out overlaps linear x") && !e.contains("grouped"),
        "{e}"
    );
    g.free(&gpu);
    assert_eq!(gpu.ledger().live_count(), 0);
}

/// BF16 weights (every backend's format) with biases: the grouped op's part `i` equals the
/// backend's own `linear` of it, and a bad group is refused with the same words everywhere.
fn bf16_group_matches_linears(gpu: &dyn GpuBackend) -> String {
    let mut rng = SmallRng::seed_from_u64(45);
    let (inf, rows) = (40, 3);
    let heights = [24, 8, 9];
    let mut parts = [None; 3];
    let mut bufs = Vec::new();
    for (slot, &outf) in parts.iter_mut().zip(&heights) {
        let w: Vec<f32> = (0..outf * inf)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let b: Vec<f32> = (0..outf).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (w, b) = (
            gpu.upload_bf16(&w, "test w").unwrap(),
            gpu.upload_bf16(&b, "test b").unwrap(),
        );
        let out = gpu.alloc(rows * outf * 2, "test out").unwrap();
        bufs.extend([w, b, out]);
        *slot = Some(LinearPart {
            out,
            weight: LinearWeight::Bf16 { weight: w },
            bias: Some(b),
            out_features: outf,
        });
    }
    let x: Vec<f32> = (0..rows * inf)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let x = gpu.upload_bf16(&x, "test x").unwrap();
    bufs.push(x);
    let args = GroupedLinearArgs {
        x,
        parts,
        out_dtype: Dtype::Bf16,
        rows,
        in_features: inf,
        stream: 0,
    };
    let mut want = Vec::new();
    for single in args.linears() {
        let n = rows * single.out_features * 2;
        gpu.linear(single).unwrap();
        want.push(gpu.download::<u8>(single.out, n).unwrap());
        gpu.memset(single.out, 0, n, 0).unwrap();
    }
    gpu.grouped_linear(args).unwrap();
    for (i, single) in args.linears().enumerate() {
        let n = rows * single.out_features * 2;
        assert_eq!(
            gpu.download::<u8>(single.out, n).unwrap(),
            want[i],
            "{} part {i}",
            gpu.name()
        );
    }
    let mut bad = args;
    if let Some(p) = bad.parts[1].as_mut() {
        p.out = x;
    }
    let message = gpu.grouped_linear(bad).unwrap_err().to_string();
    for p in bufs {
        gpu.free(p).unwrap();
    }
    assert_eq!(gpu.ledger().live_count(), 0);
    message
}

#[test]
fn every_backend_runs_a_group_as_its_linears() {
    let cpu = bf16_group_matches_linears(&CpuBackend::new());
    assert!(cpu.contains("linear part 1 out overlaps linear x"), "{cpu}");
    #[cfg(feature = "cuda-emu")]
    {
        let emu = bf16_group_matches_linears(&specdraft::backend::EmuBackend::new());
        assert_eq!(emu, cpu);
    }
}
