//! `kvroute-bench kernels`: GB/s of offload (gather + D2H) and onboard (H2D + scatter) of
//! 32, 256 and 2,048 random blocks on a GPU, next to one contiguous copy of the same bytes,
//! and the fixed cost of a transfer (a one-block transfer less its bytes at the contiguous
//! rate), split into the time the call takes to queue it (the engine thread's) and the rest
//! (the device's). The contiguous copies run between G1 and the pinned G2, so they are the
//! page-locked bandwidth the device reaches with a plain copy: the link's limit. Last, how
//! long the engine thread spends in a one-block fill (a prefill's KV writes), idle and while
//! a 2,048-block onboard holds the H2D link (the fills queue behind it, as the engine's do):
//! the worker's call (slots by value), next to the same fill over an uploaded piece list
//! (the path before, [`GpuKv::fill_by_pieces`]). Needs a CUDA
//! device; says what is missing otherwise.

use std::time::Instant;

use anyhow::Context;
use kvroute_kernels::cuda::{GpuError, GpuKv, Transfer};
use kvroute_kernels::{Dtype, KvLayout};
use serde::Serialize;

/// Flags of `kvroute-bench kernels`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Timed repetitions per figure (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Write the report here as JSON.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// One row: a transfer size.
#[derive(Debug, Serialize)]
pub struct Row {
    /// Blocks moved.
    pub blocks: usize,
    /// Bytes moved.
    pub bytes: usize,
    /// Offload (gather + D2H), median µs and GB/s.
    pub offload_us: f64,
    /// GB/s of the offload.
    pub offload_gbps: f64,
    /// One contiguous D2H of the same bytes, GB/s.
    pub d2h_contiguous_gbps: f64,
    /// Onboard (H2D + scatter), median µs.
    pub onboard_us: f64,
    /// GB/s of the onboard.
    pub onboard_gbps: f64,
    /// One contiguous H2D of the same bytes, GB/s.
    pub h2d_contiguous_gbps: f64,
}

/// The report.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Device name and compute capability.
    pub device: String,
    /// Geometry.
    pub layout: KvLayout,
    /// Fixed cost of an offload / onboard, µs.
    pub fixed_offload_us: f64,
    /// Fixed cost of an onboard, µs.
    pub fixed_onboard_us: f64,
    /// Fixed cost of an onboard with its verification (the worker's path), µs.
    pub fixed_onboard_checked_us: f64,
    /// Median µs the offload call of one block takes to queue it (host side of the fixed
    /// cost).
    pub submit_offload_us: f64,
    /// The same for an onboard of one block.
    pub submit_onboard_us: f64,
    /// Per size.
    pub rows: Vec<Row>,
    /// Host µs of one-block fill calls.
    pub fill_calls: FillCalls,
}

/// Host µs of a one-block fill call, p50 and p99 of every call timed.
#[derive(Debug, Default, Serialize)]
pub struct FillCalls {
    /// Calls timed per case.
    pub calls: usize,
    /// [`GpuKv::fill`] (slots by value), no transfer in flight.
    pub slots_idle: Quantiles,
    /// The same, while an onboard holds the H2D link.
    pub slots_busy: Quantiles,
    /// [`GpuKv::fill_by_pieces`] (the path before: the block's piece list uploaded), no
    /// transfer in flight.
    pub pieces_idle: Quantiles,
    /// The same, while an onboard holds the H2D link.
    pub pieces_busy: Quantiles,
}

/// p50 and p99, µs.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

impl Quantiles {
    fn of(mut v: Vec<f64>) -> Quantiles {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v.get(((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1)));
        Quantiles {
            p50_us: at(0.5).copied().unwrap_or(0.0),
            p99_us: at(0.99).copied().unwrap_or(0.0),
        }
    }
}

/// Times `per_rep` one-block fills per repetition through both paths, each path alone and
/// while an onboard of `busy` pairs is in flight (the engine's stream waits for it).
fn fill_calls(
    kv: &mut GpuKv,
    reps: usize,
    busy: &[(usize, usize)],
    slots: &[usize],
) -> anyhow::Result<FillCalls> {
    let per_rep = 64;
    let mut times: [Vec<f64>; 4] = Default::default();
    for rep in 0..reps.max(1) + 1 {
        for (in_flight, case) in [(false, 0), (true, 1)] {
            let transfer = if in_flight {
                Some(kv.onboard(busy)?)
            } else {
                None
            };
            for i in 0..per_rep {
                let block = [(slots[i % slots.len()], (rep * per_rep + i) as u64)];
                let start = Instant::now();
                kv.fill(&block)?;
                times[case].push(start.elapsed().as_secs_f64() * 1e6);
                let start = Instant::now();
                kv.fill_by_pieces(&block)?;
                times[case + 2].push(start.elapsed().as_secs_f64() * 1e6);
            }
            if let Some(transfer) = transfer {
                kv.finish(transfer)?;
            }
            kv.synchronize()?;
        }
        if rep == 0 {
            // Warm-up: module load and first allocations stay out of the figures.
            times.iter_mut().for_each(Vec::clear);
        }
    }
    let [slots_idle, slots_busy, pieces_idle, pieces_busy] = times.map(Quantiles::of);
    Ok(FillCalls {
        calls: reps.max(1) * per_rep,
        slots_idle,
        slots_busy,
        pieces_idle,
        pieces_busy,
    })
}

/// Medians of one operation, µs: from the call to the end of the transfer, and of the call
/// alone.
#[derive(Clone, Copy, Debug, Default)]
struct Timed {
    total_us: f64,
    submit_us: f64,
}

/// Times `run` on `kv`, ending each transfer with [`GpuKv::finish`] (which returns a
/// verification's pinned result buffer to the pool, as the worker does).
fn median_us(
    kv: &mut GpuKv,
    reps: usize,
    mut run: impl FnMut(&mut GpuKv) -> Result<Transfer, GpuError>,
) -> anyhow::Result<Timed> {
    for _ in 0..3 {
        let transfer = run(kv)?;
        kv.finish(transfer)?;
    }
    let mut totals = Vec::with_capacity(reps);
    let mut submits = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        let transfer = run(kv)?;
        submits.push(start.elapsed().as_secs_f64() * 1e6);
        kv.finish(transfer)?;
        totals.push(start.elapsed().as_secs_f64() * 1e6);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(Timed {
        total_us: median(&mut totals),
        submit_us: median(&mut submits),
    })
}

/// Runs the benchmark on `args.device`.
pub fn run(args: &Args) -> anyhow::Result<Report> {
    // Llama-3-8B-like geometry (the issue's): 32 layers, 8 KV heads of 128, 16 tokens, bf16.
    let layout = KvLayout {
        dtype: Dtype::Bf16,
        ..KvLayout::llama_8b()
    };
    let (g1_blocks, g2_blocks) = (4096, 2048);
    let mut kv = GpuKv::new(args.device, layout, g1_blocks, g2_blocks, 256)
        .context("kvroute-bench kernels needs a CUDA device")?;
    let (name, (major, minor)) = kv.device();
    let device = format!("{name} (sm_{major}{minor})");
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut shuffled = |n: usize| {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            v.swap(i, (seed % (i as u64 + 1)) as usize);
        }
        v
    };
    let g1 = shuffled(g1_blocks);
    let g2 = shuffled(g2_blocks);
    let block = layout.block_bytes();
    let mut rows = Vec::new();
    let mut one = (Timed::default(), Timed::default(), Timed::default());
    for n in [1usize, 32, 256, 2048] {
        let out: Vec<(usize, usize)> = g1[..n]
            .iter()
            .copied()
            .zip(g2[..n].iter().copied())
            .collect();
        let back: Vec<(usize, usize)> = out.iter().map(|&(a, b)| (b, a)).collect();
        let offload = median_us(&mut kv, args.reps, |kv| kv.offload(&out))?;
        let onboard = median_us(&mut kv, args.reps, |kv| kv.onboard(&back))?;
        let (offload_us, onboard_us) = (offload.total_us, onboard.total_us);
        let d2h = median_us(&mut kv, args.reps, |kv| kv.contiguous_copy(true, n * block))?;
        let h2d = median_us(&mut kv, args.reps, |kv| {
            kv.contiguous_copy(false, n * block)
        })?;
        let (d2h_us, h2d_us) = (d2h.total_us, h2d.total_us);
        let gbps = |us: f64| (n * block) as f64 / us / 1e3;
        if n == 1 {
            // The worker's onboard: verified against the block's pattern (what the result
            // says is not read here: the timing is the point).
            let checked = median_us(&mut kv, args.reps, |kv| kv.onboard_checked(&back, &[0]))?;
            one = (offload, onboard, checked);
            continue;
        }
        rows.push(Row {
            blocks: n,
            bytes: n * block,
            offload_us,
            offload_gbps: gbps(offload_us),
            d2h_contiguous_gbps: gbps(d2h_us),
            onboard_us,
            onboard_gbps: gbps(onboard_us),
            h2d_contiguous_gbps: gbps(h2d_us),
        });
    }
    // Fixed cost: a one-block transfer less its bytes at the best contiguous rate seen.
    let best = |f: fn(&Row) -> f64| rows.iter().map(f).fold(0.0, f64::max);
    let d2h = best(|r| r.d2h_contiguous_gbps);
    let h2d = best(|r| r.h2d_contiguous_gbps);
    let busy: Vec<(usize, usize)> = g2.iter().copied().zip(g1[..2048].iter().copied()).collect();
    let fill_calls = fill_calls(&mut kv, args.reps, &busy, &g1[2048..])?;
    Ok(Report {
        device,
        layout,
        fixed_offload_us: one.0.total_us - block as f64 / (d2h * 1e3),
        fixed_onboard_us: one.1.total_us - block as f64 / (h2d * 1e3),
        fixed_onboard_checked_us: one.2.total_us - block as f64 / (h2d * 1e3),
        submit_offload_us: one.0.submit_us,
        submit_onboard_us: one.1.submit_us,
        rows,
        fill_calls,
    })
}

/// Prints the table.
pub fn print(r: &Report) {
    println!(
        "device: {}  layout: {:?}  ({} B per block)",
        r.device,
        r.layout,
        r.layout.block_bytes()
    );
    println!(
        "{:>7} {:>10} | {:>12} {:>10} {:>8} | {:>12} {:>10} {:>8}",
        "blocks", "MiB", "offload GB/s", "D2H GB/s", "ratio", "onboard GB/s", "H2D GB/s", "ratio"
    );
    for row in &r.rows {
        println!(
            "{:>7} {:>10.1} | {:>12.2} {:>10.2} {:>7.1}% | {:>12.2} {:>10.2} {:>7.1}%",
            row.blocks,
            row.bytes as f64 / (1 << 20) as f64,
            row.offload_gbps,
            row.d2h_contiguous_gbps,
            100.0 * row.offload_gbps / row.d2h_contiguous_gbps,
            row.onboard_gbps,
            row.h2d_contiguous_gbps,
            100.0 * row.onboard_gbps / row.h2d_contiguous_gbps,
        );
    }
    println!(
        "fixed cost per transfer: offload {:.1} µs ({:.1} queuing it), onboard {:.1} µs ({:.1} queuing it), onboard verified {:.1} µs",
        r.fixed_offload_us,
        r.submit_offload_us,
        r.fixed_onboard_us,
        r.submit_onboard_us,
        r.fixed_onboard_checked_us
    );
    let f = &r.fill_calls;
    println!(
        "one-block fill call, host µs p50/p99 over {} calls: slots idle {:.1}/{:.1}, busy {:.1}/{:.1}; uploaded pieces idle {:.1}/{:.1}, busy {:.1}/{:.1} (busy: a 2,048-block onboard in flight)",
        f.calls,
        f.slots_idle.p50_us,
        f.slots_idle.p99_us,
        f.slots_busy.p50_us,
        f.slots_busy.p99_us,
        f.pieces_idle.p50_us,
        f.pieces_idle.p99_us,
        f.pieces_busy.p50_us,
        f.pieces_busy.p99_us,
    );
}
