//! Quantized CPU kernels: GGUF block formats kept as they are in the file, and a linear op
//! that reads them with integer dot products.
//!
//! Works on plain host slices, so it can sit behind any backend interface:
//! - [`BlockFormat`]: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
//!   Q6_K (GGUF's layouts and type ids), with checked size arithmetic.
//! - [`dequantize`] / [`dequantize_bf16`]: file blocks to f32 (bit-identical to ggml's and the
//!   `gguf` package's dequantizers) or to BF16 (for a GPU upload).
//! - [`quantize`](fn@quantize): f32 to Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (ggml's reference
//!   quantizers, byte for byte), Q4_K, Q5_K, Q6_K (a simple scheme with stated error bounds,
//!   `quantize_k.rs`) and the float formats; Q2_K and Q3_K are read but not produced.
//! - [`PackedWeight`]: one `[out_features, in_features]` weight matrix, repacked at load into
//!   eight-row interleaved records of exactly the file's size (`packed.rs`).
//! - [`linear`](fn@linear) on a [`KernelPool`]: `out[r, o] = sum_i W[o, i] x[r, i] (+ bias[o])`
//!   for f32 or BF16 input rows; [`linear_group`]: several weights over the same rows (q/k/v,
//!   gate/up) with one input quantization and one pool job, f32 or BF16 outputs, each part
//!   bit-identical to its own `linear`.
//!
//! # Plugging it in
//! A backend owns one [`KernelPool`] (`KernelPool::per_core()`: one participant per core,
//! the calling thread included) and shares it with every op it parallelises, so kernel
//! threads never compete with another pool. A model keeps one [`PackedWeight`] per matrix,
//! built once at load (`PackedWeight::new(BlockFormat::from_ggml_type(id)?, out, in,
//! file_bytes)` for a GGUF tensor; `PackedWeight::from_f32(format, out, in, values)` to
//! quantize a float checkpoint on load), and calls `linear(&pool, &weight, x, rows, bias,
//! out)` in its forward. `PackedWeight::dequantize_row` reads one row (an embedding lookup
//! from a tied LM head). A GPU backend without block kernels uploads `dequantize_bf16` of
//! the file's bytes.
//!
//! # How the linear works (after llama.cpp's CPU backend and its repacked GEMV/GEMM,
//! written independently)
//! Each input row is quantized once per call to 8-bit blocks (Q8: blocks of 32 for the legacy
//! formats; Q8K: blocks of 256 with 16- and 32-element sums for the K-quants). Every weight record
//! (eight output rows times one block) is decoded once into unsigned codes laid out four elements
//! by eight rows per register (for legacy formats in calls of up to three rows, four for Q8_0, a
//! decode step or a short verify, straight into registers, used at once and never stored, two
//! output groups side by side at one row so their f32 chains overlap; otherwise into an L1
//! scratch), and every input row of the call meets it in AVX2 integer dots (`maddubs`, a few i16
//! sums, `madd` with the sub-block scales), one i32 lane per output, so there is no horizontal sum;
//! code offsets and mins come from the activation block sums; both block scales are applied in f32.
//! Rows are taken four at a time against each decoded record and a call reads each weight byte from
//! memory once, whatever its rows; long calls go 32 rows at a time past each decoded record, a
//! tiled matrix product rather than row-by-row dots, with their input quantized in parallel. The
//! kernels prefetch weight records 16 KiB ahead of the one they read, into the L2: a one-row call
//! mostly waits for weight bytes, and the prefetches keep more reads in flight than the hardware
//! prefetcher alone. Float weights use float dots (F16C widening for F16). Where the CPU has AVX-VNNI
//! ([`Isa::Avx2Vnni`], detected at run time), the legacy formats' dots run on `vpdpbusd`: these
//! sums never saturate `maddubs` (bounds in `avx2/mod.rs`), so both give the same integers, and the
//! tests compare every instruction set this CPU runs against the portable path bit for bit. `--
//! --kernel` on a Xeon with AVX-VNNI (fastest of many, one thread, weights hot): the Q8_0 head
//! 4096x576 at 5 rows 157 us against 296 on AVX2 (its `sign` per row is gone: `w + 128` goes in
//! unsigned and `128 * sum(qa)` comes off after), Q4_1 1536x576 at 3 rows 34 us against 40, at 128
//! rows 1285 against 1437. Where it has AVX-512 VNNI ([`Isa::Avx512Vnni`], with AVX-VNNI or without
//! it, as on Zen 4 and Ice Lake, whose 256-bit dots then take the EVEX form), a 512-bit register
//! holds two eight-row groups and 32 registers hold tiles of up to ten rows (`avx2/zmm.rs`, the
//! activation codes read by the multiplies themselves, so no register holds them): Q4_1 1536x576
//! at 5 rows 29 us against 77 on AVX2, at 9 rows 46, at 128 rows 690 against 1418; the head at 5
//! rows 75 us against 293. A whole forward's linears on two threads (`-- --step`, a Sapphire
//! Rapids class VM): 1 row 2.7-3.0 ms (the weight stream bounds it), 5 rows 4.7-5.1, 9 rows
//! 7.0-7.5, 128 rows 67-72. On a two-core Zen 4 VM (no AVX-VNNI, so AVX2 before the levels
//! were told apart), `model_decode`: a 9-row forward 14.5-15.0 ms on AVX2 against 7.7-8.1,
//! eight sequences 525-567 tokens/s against 1048-1206. The K-quants take the same two groups
//! to a register (`avx2/kquant_zmm.rs`; on that VM, `--kernel`, Q4_K 576x1536 at 5 rows
//! 35.6 us against 56.1 on AVX2, Q6_K 48.0 against 126.0). Where it also has AMX-INT8 tiles,
//! granted by the OS ([`Isa::Amx`]), a pool asked for that level runs calls of [`AMX_MIN_ROWS`] rows or more on them
//! (`avx2/amx.rs`, the input laid out as tiles by `block_pairs.rs`): one tile multiply and one
//! tile store give two blocks' sums of up to eight rows. A pool does not take that level
//! unless asked ([`Isa::preferred`]): on that VM the tiles lose to the 512-bit kernel at every
//! row count a forward makes (16 rows 14.0 ms against 11.2, 128 rows 77 against 67), the
//! per-block scale pass and the tile stores costing more than the multiplies they save.
//!
//! # Invariants
//! - Every output element is one fixed sequence of operations on its own input row and
//!   weight row (`dot_portable.rs` and `float_dot.rs` define it): integer sums are exact,
//!   and the f32 operations, fused multiply-adds included, run in one order. So a row's
//!   output is bit-identical whatever the batch it is computed in, the tiling, the thread
//!   split and the instruction set (AVX2 or portable): greedy speculative decoding emits
//!   what plain decoding emits.
//! - A packed weight is exactly as large as the file's bytes, and decodes to them exactly.
//! - Bad arguments (lengths, block alignment, overflowing sizes) are [`QuantError`]s, never
//!   panics; a panicking pool task becomes an error too.
//!
//! # Threads
//! SmolLM2-135M's linears are 60-550 KB of weights each, tens of microseconds of work on two
//! cores, so handing work to another thread must cost far less than that. [`KernelPool`]
//! keeps `cores - 1` workers that spin for 200 us after a call (the linears of one forward
//! follow each other closely) and then sleep on a condition variable; a call publishes one
//! job, the caller and the awake workers claim output tiles (eight-row groups, about four
//! tiles per thread) from one atomic counter, and the caller waits only for workers that
//! actually joined, so a descheduled worker costs nothing but its share. Measured by
//! `cargo bench --bench quant_linear` (`fork_join`, two threads, one task each), medians: an
//! empty round trip costs 0.5 us on the pool against 18-20 us for rayon's `par_iter` (its
//! idle threads sleep and must be woken), and two 30 us tasks take 31 us on the pool against
//! 50-80 us on rayon. With 10 us tasks the pool's worker took half the tasks at 14 us a call.
//! On this shared machine (load average 3 to 55 while it was measured) a worker is often
//! descheduled, and the caller then does most of the work itself, as designed.
//!
//! # Measured (`cargo bench --bench quant_linear`, 2 cores of an AMD EPYC (Zen 3) VM, AVX2)
//! The machine was shared with other builds (load average 6 to 10 during the run), so wall
//! times are noisy: the same run measured parallel reads of 2.4-4.5 GB/s and memcpy of
//! 3.2-5.7 GB/s. One SmolLM2-135M forward's linears (211 matrices, 96 MB: 30 layers of
//! Q4_1 plus the Q8_0 head), weights streamed from memory:
//!
//! | rows | 1 | 2 | 5 | 9 | 16 |
//! | --- | --- | --- | --- | --- | --- |
//! | ms per forward | 36.2 | 38.6 | 61.9 | 91.3 | 97.5 |
//! | cost vs 1 row | 1.00 | 1.07 | 1.71 | 2.52 | 2.69 |
//!
//! At one row the weights move at 2.7 GB/s, 60-100% of the read bandwidth measured around
//! it. Compute alone (CPU time of one thread, weights in cache, which other processes do
//! not inflate), Q4_1 576x576: 18 us a call at 1 row; 1.5x at 2 rows, 2.8x at 5, 4.5x at 9;
//! 128 rows at 67-100 GFLOP/s-equivalent per core (Q4_K 576x1536: 96-108). So a 5-row verify
//! costs little more than a 1-row step only where memory, not compute, bounds the 1-row
//! step: here 1.7x, with the machine's memory as slow as measured above and the compute
//! shared with other processes.
//!
//! Where a row's cost goes (`-- --kernel`: one thread, weights in cache, fastest of many batches,
//! the figure other processes inflate least): every extra row adds the same (no superlinear step
//! from 1 to 128 rows). Q4_1 576x576: 7-8 us at 1 row with the records decoded in registers (11 us
//! through the scratch), then +4.4 us a row (50-70 GMAC/s at 16-128 rows); 1536x576 and 576x1536:
//! 20-22 us (29 through the scratch), then +11.5 us a row; the Q8_0 head 4096x576: 60-70 us at 1
//! row (150-165 through the scratch). With weights streamed from memory instead
//! (`streamed_cpu_us_min`), one row of Q4_1 1536x576 costs 50-70 us with the prefetches against
//! 90-110 without. The Q8_0 head's extra rows run at half the Q4_1 rate (30-44 GMAC/s: its signed
//! codes need `sign` and a `madd` per `maddubs`; splitting codes into nibbles or widening to i16
//! takes as many multiplies, and two `maddubs` results of full-range codes can overflow an i16
//! sum), so a whole SmolLM2 forward adds about 1.4 ms (layers) + 0.6-0.9 ms (head) of one core's
//! time per row; the input's quantization is under 2% of that. With weights streamed instead of
//! hot, 16 rows cost 10-60% more than hot (the compute hides most of the memory time). A loop of
//! nothing but `maddubs` and adds peaks near 160 GMAC/s on this core and one broadcast-load per
//! `maddubs`, as here, at 70-90, so the kernel is within about 1.3x of what this form of AVX2 dot
//! allows. Two variants were measured and dropped: a 16-byte activation load spread by `vpshufd`
//! (LLVM folds it back into broadcast loads, or spills with the extra registers: Q8_0 lost a third)
//! and two weight groups sharing each broadcast (slower in isolation).

mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub(crate) mod bf16_round;
mod block_pairs;
mod blocks;
mod dequant;
mod dot_portable;
mod error;
mod float_dot;
mod format;
mod isa;
mod linear;
mod packed;
pub mod pool;
mod quantize;
mod quantize_k;
mod subscales;
mod supported;

pub use activation::InputElem;
pub use block_pairs::AMX_MIN_ROWS;
pub use dequant::{dequantize, dequantize_bf16};
pub use error::QuantError;
pub use format::{BlockFormat, QK, QK_K};
pub use isa::Isa;
pub use linear::{linear, linear_group, Bias, GroupPart, LinearOut};
pub use packed::{PackedView, PackedWeight, GROUP_ROWS};
pub use pool::KernelPool;
pub use quantize::{quantize, quantize_to_vec};
pub use supported::{Avx2Token, Avx512Token, SupportedIsa};
