//! `deltaref bench`: wall time of implementations on one case, each next to
//! its worst norm_ratio against the f64 oracle. GPU rows split forward and
//! backward device time; CPU rows time forward+backward together, with the
//! GFLOP/s that time achieves (ops counted by
//! [`deltaref_verify::bench::op_count`]) and its fraction of the machine's
//! measured mul+add peak ([`deltaref_verify::bench::op_count::peak_gflops`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args as ClapArgs;
use deltaref::gates::Gate;
use deltaref_gpu::Timings;
use deltaref_verify::bench::op_count as ops;
use deltaref_verify::bench::timing::{Quartiles, Rounds};
use deltaref_verify::case::{Case, CaseError, Dtype, Op};
use deltaref_verify::generate::{generate, GenSpec};
use deltaref_verify::impls::{oracle_truth, Compute, Device, Engine, Impl, ImplName};
use deltaref_verify::metrics::norm_ratio;
use deltaref_verify::outputs::Tensors;
use deltaref_verify::progress::Progress;
use serde::Serialize;

use super::{fail, ImplArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Case file (default: a built-in KDA case: varlen lengths [400, 624],
    /// H = HV = 4, K = V = 128, lower-bound gate −5, l2norm, bf16 inputs).
    #[arg(long)]
    pub case: Option<PathBuf>,
    /// Comma-separated implementations (default: naive,chunk, and
    /// gpu-naive,gpu-chunk,gpu-cp when a GPU is present).
    #[arg(long, value_delimiter = ',')]
    pub impls: Option<Vec<ImplName>>,
    /// CP world size for cp and gpu-cp.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Rounds (1 to 1000), each running every implementation once, so that
    /// a busy spell of a shared machine falls on all of them alike; the best
    /// and median times are reported, and each row's time over the first
    /// implementation's in the same round.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// More runs than this measure nothing new and only keep the machine busy.
const MAX_REPS: usize = 1000;

#[derive(Debug, Serialize)]
struct Row {
    imp: String,
    /// Best wall time of forward+backward, seconds.
    total_s: f64,
    /// Median wall time over the rounds, seconds.
    median_s: f64,
    /// Quartiles over the rounds of this row's time over the first row's
    /// in the same round (`None` for the first row).
    ratio_to_first: Option<Ratio>,
    /// GPU device time of the forward and backward phases (best run).
    forward_s: Option<f64>,
    backward_s: Option<f64>,
    /// GPU rows: host seconds of the best run, by part (see [`Timings`]).
    upload_s: Option<f64>,
    /// The input checks, part of `upload_s`.
    check_s: Option<f64>,
    download_s: Option<f64>,
    compile_s: Option<f64>,
    /// Achieved GFLOP/s of a CPU KDA or DPLR row without CP.
    gflops: Option<f64>,
    /// `gflops` over the measured peak (the best of the samples taken
    /// after each counted row).
    peak_fraction: Option<f64>,
    worst_norm_ratio: f64,
    worst_tensor: String,
}

/// [`Quartiles`] of a ratio, as JSON.
#[derive(Debug, Serialize, Clone, Copy)]
struct Ratio {
    low: f64,
    median: f64,
    high: f64,
}

impl From<Quartiles> for Ratio {
    fn from(q: Quartiles) -> Self {
        Ratio {
            low: q.low,
            median: q.median,
            high: q.high,
        }
    }
}

/// Seconds the mul+add peak microbenchmark runs for.
const PEAK_SECONDS: f64 = 0.3;

/// Per-token op count of a naive engine, `(K, V)`.
type NaiveCount = fn(usize, usize) -> ops::OpCount;
/// Per-chunk op count of a chunked engine, `(C, K, V)`.
type ChunkCount = fn(usize, usize, usize) -> ops::OpCount;

/// Ops of one forward+backward of `imp` on `case` ([`deltaref_verify::bench::op_count`]): per
/// token of every (sequence, value head) for the naive engine, per chunk
/// (the last one of a sequence possibly short) for the chunked one. `None`
/// for token-shift (no matrix work), CP and GPU rows.
fn op_count(imp: &Impl, case: &Case) -> Option<f64> {
    if imp.cp.is_some() || imp.device != Device::Cpu {
        return None;
    }
    let (naive, chunk): (NaiveCount, ChunkCount) = match case.meta.op.name() {
        // GDN runs KDA's engines on its pieces.
        "kda" | "gdn" => (ops::kda_naive, ops::kda_chunk),
        "dplr" => (ops::dplr_naive, ops::dplr_chunk),
        _ => return None,
    };
    let q = case.tensors.get("q")?.shape();
    let (kd, vd, heads) = (q[3], case.value_dim(), case.tensors.get("v")?.shape()[2]);
    let lengths: Vec<usize> = match &case.cu_seqlens {
        Some(cu) => cu.windows(2).map(|w| (w[1] - w[0]) as usize).collect(),
        None => vec![q[1]; q[0]],
    };
    let per_head: f64 = lengths
        .iter()
        .map(|&l| match imp.engine {
            Engine::Naive => naive(kd, vd).total() * l as f64,
            Engine::Chunk(c) => (0..l)
                .step_by(c.get())
                .map(|s| chunk(c.get().min(l - s), kd, vd).total())
                .sum(),
        })
        .sum();
    Some(per_head * heads as f64)
}

fn default_case() -> Result<Case, CaseError> {
    generate(&GenSpec {
        shape: Some(vec![1, 1024, 4, 4, 128, 128]),
        lengths: Some(vec![400, 624]),
        gate: Gate::LowerBound { lower_bound: -5.0 },
        use_qk_l2norm_in_kernel: true,
        dtype: Dtype::Bf16,
        seed: 8,
        ..GenSpec::new(Op::Kda)
    })
}

fn worst(truth: &Tensors, got: &Tensors) -> (f64, String) {
    let flat = |t: &ndarray::ArrayD<f64>| t.iter().copied().collect::<Vec<_>>();
    truth
        .iter()
        .map(|(n, t)| {
            let r = got
                .get(n)
                .map_or(f64::NAN, |g| norm_ratio(&flat(t), &flat(g)));
            (r, n.clone())
        })
        .fold((-1.0, String::new()), |a, b| {
            if b.0 > a.0 || b.0.is_nan() {
                b
            } else {
                a
            }
        })
}

/// An implementation's fastest run so far: wall seconds, the GPU phases,
/// and its worst error against the truth (scored when it became the fastest,
/// so no run's results outlive the next run).
struct Best {
    wall_s: f64,
    phases: Option<Timings>,
    worst: (f64, String),
}

/// The rows, and the measured peak GFLOP/s when a row has an op count.
fn go(a: &Args) -> Result<(Vec<Row>, Option<f64>), CaseError> {
    if !(1..=MAX_REPS).contains(&a.reps) {
        return Err(CaseError::Usage(format!(
            "--reps: expected 1 to {MAX_REPS}, got {}",
            a.reps
        )));
    }
    let (case, path) = match &a.case {
        Some(p) => (Case::read(p)?, p.clone()),
        None => (default_case()?, PathBuf::from("<built-in KDA case>")),
    };
    let names: Vec<ImplName> = match &a.impls {
        Some(v) => v.clone(),
        None => {
            let mut v = vec![ImplName::Naive, ImplName::Chunk];
            if deltaref_verify::gpu::device().is_ok() {
                v.extend([ImplName::GpuNaive, ImplName::GpuChunk, ImplName::GpuCp]);
            }
            v
        }
    };
    let imps = names
        .into_iter()
        .map(|name| {
            let args = ImplArgs {
                imp: name,
                chunk_size: None,
                world: name.is_cp().then_some(a.world),
                layout: None,
                cuts: None,
                cp_engine: None,
                compute: None,
                precision: None,
                gpu_dtype: None,
            };
            let (imp, _) = args.resolve(&case)?;
            imp.check_memory(&case)?;
            Ok(imp)
        })
        .collect::<Result<Vec<Impl>, CaseError>>()?;
    let truth = oracle_truth(&case, &path)?;
    let counts: Vec<Option<f64>> = imps.iter().map(|imp| op_count(imp, &case)).collect();
    let counted = counts.iter().flatten().count();
    let mut best: Vec<Option<Best>> = imps.iter().map(|_| None).collect();
    let mut rounds = Rounds::new(imps.len());
    let mut peak = None;
    let progress = Progress::bar((a.reps * imps.len()) as u64, "bench");
    while rounds.len() < a.reps {
        let round = rounds.len() + 1;
        rounds.run(|i| {
            let imp = &imps[i];
            progress.step(&format!("bench {} (round {})", imp.name(), round));
            let t = Instant::now();
            let (results, phases) = imp
                .timed_compute(&case, Compute::F64)
                .map_err(CaseError::computing(&path))?;
            let wall_s = t.elapsed().as_secs_f64();
            progress.inc();
            if best[i].as_ref().is_none_or(|b| wall_s < b.wall_s) {
                best[i] = Some(Best {
                    wall_s,
                    phases,
                    worst: worst(&truth, &results),
                });
            }
            Ok::<_, CaseError>(wall_s)
        })?;
        if rounds.len() <= counted {
            // As many samples as counted rows, between rounds, the best
            // kept: a peak taken once, while a shared machine is busy, would
            // flatter every row's fraction.
            let p = ops::peak_gflops(PEAK_SECONDS);
            peak = Some(peak.map_or(p, |q: f64| q.max(p)));
        }
    }
    let rows = imps
        .iter()
        .zip(best)
        .zip(counts)
        .enumerate()
        .map(|(i, ((imp, b), count))| {
            let Best {
                wall_s,
                phases,
                worst: (worst_norm_ratio, worst_tensor),
            } = b.expect("at least one round");
            let gflops = count.map(|n| n / wall_s / 1e9);
            Row {
                imp: imp.name(),
                total_s: wall_s,
                median_s: rounds.quartiles(i).expect("rounds ran").median,
                ratio_to_first: (i > 0).then(|| rounds.ratio(i, 0).expect("rounds ran").into()),
                forward_s: phases.map(|p| p.forward_s),
                backward_s: phases.map(|p| p.backward_s),
                upload_s: phases.map(|p| p.upload_s),
                check_s: phases.map(|p| p.check_s),
                download_s: phases.map(|p| p.download_s),
                compile_s: phases.map(|p| p.compile_s),
                gflops,
                peak_fraction: gflops.zip(peak).map(|(g, p)| g / p),
                worst_norm_ratio,
                worst_tensor,
            }
        })
        .collect();
    Ok((rows, peak))
}

fn table(rows: &[Row], peak: Option<f64>) -> String {
    let ms = |s: Option<f64>| s.map_or("-".to_string(), |s| format!("{:.3}", s * 1e3));
    let opt =
        |x: Option<f64>, scale: f64| x.map_or("-".to_string(), |x| format!("{:.1}", x * scale));
    let mut out = format!(
        "{:<34} {:>12} {:>10} {:>21} {:>12} {:>12} {:>8} {:>7}  {:>11} {}\n",
        "impl",
        "fwd+bwd ms",
        "median ms",
        "÷ first (quartiles)",
        "fwd dev ms",
        "bwd dev ms",
        "GFLOP/s",
        "% peak",
        "worst ratio",
        "(tensor)"
    );
    for r in rows {
        out += &format!(
            "{:<34} {:>12.3} {:>10.3} {:>21} {:>12} {:>12} {:>8} {:>7}  {:>11.3e} ({})\n",
            r.imp,
            r.total_s * 1e3,
            r.median_s * 1e3,
            r.ratio_to_first.map_or("-".to_string(), |q| format!(
                "{:.3} ({:.3}–{:.3})",
                q.median, q.low, q.high
            )),
            ms(r.forward_s),
            ms(r.backward_s),
            opt(r.gflops, 1.0),
            opt(r.peak_fraction, 100.0),
            r.worst_norm_ratio,
            r.worst_tensor
        );
    }
    for r in rows {
        // KDA and DPLR runs time their host parts; other ops leave them zero.
        if let (Some(f), Some(b), Some(u @ 0.0..), Some(k), Some(d), Some(c)) = (
            r.forward_s,
            r.backward_s,
            r.upload_s.filter(|&u| u > 0.0),
            r.check_s,
            r.download_s,
            r.compile_s,
        ) {
            // What the phases leave: the case's tensors into the run's
            // inputs, the results into the name map.
            let other = r.total_s - f - b - u - d;
            out += &format!(
                "{} host: {:.1} ms = upload {:.1} (checks {:.1}) + download {:.1} + case copies {:.1} (device {:.1} ms; compile {:.1} ms inside fwd/bwd)\n",
                r.imp,
                (r.total_s - f - b) * 1e3,
                u * 1e3,
                k * 1e3,
                d * 1e3,
                other * 1e3,
                (f + b) * 1e3,
                c * 1e3
            );
        }
    }
    out.push_str("fwd+bwd: best wall time of a whole run (uploads and pre-processing included) over the rounds, each running every implementation once; ÷ first: this row's time over the first row's in the same round; dev: GPU stream time of each phase (best run)");
    if let Some(p) = peak {
        out += &format!(
            "\nGFLOP/s: mul+add ops counted as in README's Benchmarks section; peak: {p:.1} GFLOP/s measured ({})",
            ops::peak_description()
        );
    }
    out
}

pub fn run(a: Args) -> ExitCode {
    match go(&a) {
        Ok((rows, peak)) => {
            if a.json {
                let out = serde_json::json!({ "rows": rows, "peak_gflops": peak });
                super::print(&serde_json::to_string_pretty(&out).expect("rows serialise"));
            } else {
                super::print(&table(&rows, peak));
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}
