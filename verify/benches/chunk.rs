//! Chunked vs naive forward+backward (one [`deltaref::op::forward_backward`]
//! run each), f64, B=1 T=1024 H=4 at K=V=64, 128 and 256 and chunk sizes
//! 16, 32 and 64 (issue 20: chunk at least as fast as naive), with the
//! GFLOP/s of each ([`deltaref_verify::bench::op_count`]'s counts) and its fraction of the
//! measured no-FMA mul+add peak. Then the same tokens·heads as one
//! (sequence, head) pair, T=4096 H=1: fewer pairs than threads, where the
//! naive engines run on one thread and the chunked ones split the chunks
//! and the state's value columns over all of them. Last, K=V=64 with steep
//! decays (`g −10`: every log-decay rescaled to a mean of −10 a token),
//! where a chunk of 64 is too wide for one pair of decay factors in f64 and
//! splits into blocks (the chunked engines' decay blocks).
//! Run: `cargo bench -p deltaref-verify --bench chunk` (`-- 64` for one K=V).

mod common;

use deltaref::dplr::{self, Dplr, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, Kda, KdaOptions};
use deltaref::op::{self, Engine, Operator};
use deltaref_verify::bench::op_count::{self as ops, OpCount};
use deltaref_verify::bench::timing::Quartiles;
use ndarray::ArrayD;

use common::{MAX_ROUNDS, MIN_ROUNDS, ROUND_BUDGET_S};

const CHUNK_SIZES: [usize; 3] = [16, 32, 64];

/// The steep shape's mean log-decay a token.
const STEEP: f64 = -10.0;

/// `g` (all `≤ 0`) rescaled to a mean of `mean`.
fn rescale(g: &mut ArrayD<f64>, mean: f64) {
    let m = g.iter().sum::<f64>() / g.len() as f64;
    g.mapv_inplace(|x| x * mean / m);
}

fn main() {
    common::tune_allocator();
    let (t, h) = (1024, 4);
    // `cargo bench` passes `--bench`; a number picks one K=V.
    let only: Option<usize> = std::env::args().skip(1).find_map(|a| a.parse().ok());
    println!(
        "forward+backward, f64, B=1, {} rayon threads; per shape every engine once per round \
         ({MIN_ROUNDS} to {MAX_ROUNDS} rounds, ~{ROUND_BUDGET_S} s), after one untimed round",
        rayon::current_num_threads()
    );
    // The peak is sampled before every shape and once at the end, the best
    // kept, and every row's fraction is against it: one sample, taken while
    // a shared machine is busy, would flatter every row.
    let mut peak = 0.0f64;
    let mut rows = Vec::new();
    for (t, h) in [(t, h), (t * h, 1)] {
        for kd in [64, 128, 256] {
            if only.is_none_or(|o| o == kd) {
                peak = peak.max(ops::peak_gflops(0.3));
                rows.extend(bench(t, h, kd, None));
            }
        }
    }
    if only.is_none_or(|o| o == 64) {
        peak = peak.max(ops::peak_gflops(0.3));
        rows.extend(bench(t, h, 64, Some(STEEP)));
    }
    peak = peak.max(ops::peak_gflops(0.3));
    println!(
        "peak: {peak:.1} GFLOP/s ({}), the best of the samples",
        ops::peak_description()
    );
    println!(
        "{:<46} {:>9} {:>9} {:>13} {:>6}  ÷ naive: median (quartiles) of the rounds",
        "", "best ms", "median ms", "GFLOP/s best", "% peak",
    );
    for r in rows {
        println!("{}", r.line(peak));
    }
}

/// One engine's rounds: `T=… H=… K=V=… op  name`, its best and median time,
/// its op count, and its time over its operator's naive engine in the same
/// round (`None` for naive itself).
struct Row {
    label: String,
    best: f64,
    median: f64,
    ops: f64,
    vs_naive: Option<Quartiles>,
}

impl Row {
    /// `label  best  median  GFLOP/s  % of peak  ÷ naive`, the GFLOP/s from
    /// the best time (the peak is the best of its samples too).
    fn line(&self, peak: f64) -> String {
        let g = self.ops / self.best / 1e9;
        let ratio = self.vs_naive.map_or(String::new(), |q| {
            format!("{:.3} ({:.3}–{:.3})", q.median, q.low, q.high)
        });
        format!(
            "{} {:9.2} {:9.2} {g:13.1} {:5.0}%  {ratio}",
            self.label,
            self.best * 1e3,
            self.median * 1e3,
            100.0 * g / peak
        )
    }
}

/// Ops of one forward+backward over `h` heads of `t` tokens, naive form.
fn naive_ops(t: usize, h: usize, naive: OpCount) -> f64 {
    naive.total() * (t * h) as f64
}

/// The same for the chunked form with chunks of `c`.
fn chunk_ops(t: usize, h: usize, c: usize, chunk: OpCount) -> f64 {
    chunk.total() * (t / c) as f64 * h as f64
}

/// A timed engine: what its row says, its op count, the index of its
/// operator's naive job, and one forward+backward run.
struct Job<'a> {
    op: &'static str,
    name: String,
    ops: f64,
    naive: usize,
    run: Box<dyn Fn() + 'a>,
}

/// One operator's inputs, options and upstream gradients, as its jobs
/// borrow them.
struct Case<'a, O: Operator<f64>> {
    x: &'a O::Inputs,
    opts: &'a O::Options,
    d_o: &'a ArrayD<f64>,
    dht: &'a ArrayD<f64>,
}

impl<O: Operator<f64>> Clone for Case<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O: Operator<f64>> Copy for Case<'_, O> {}

/// One forward+backward run of `engine` on `case`.
fn run<'a, E: Engine<f64> + 'a>(engine: E, case: Case<'a, E::Op>) -> Box<dyn Fn() + 'a> {
    Box::new(move || {
        op::forward_backward(&engine, case.x, case.opts, case.d_o, Some(case.dht)).expect("valid");
    })
}

/// Appends an operator's jobs on `case`: its naive engine and op count,
/// then its chunked engine at each of [`CHUNK_SIZES`] (`chunk(c)`: the
/// engine and its op count).
fn push_op<'a, N, C>(
    jobs: &mut Vec<Job<'a>>,
    op: &'static str,
    case: Case<'a, N::Op>,
    (naive, naive_ops): (N, f64),
    chunk: impl Fn(usize) -> (C, f64),
) where
    N: Engine<f64> + 'a,
    C: Engine<f64, Op = N::Op> + 'a,
{
    let first = jobs.len();
    jobs.push(Job {
        op,
        name: "naive".into(),
        ops: naive_ops,
        naive: first,
        run: run(naive, case),
    });
    for c in CHUNK_SIZES {
        let (engine, ops) = chunk(c);
        jobs.push(Job {
            op,
            name: format!("chunk(C={c})"),
            ops,
            naive: first,
            run: run(engine, case),
        });
    }
}

/// The rows of one shape; with `steep`, the log-decays rescaled to that
/// mean a token ([`rescale`]).
fn bench(t: usize, h: usize, kd: usize, steep: Option<f64>) -> Vec<Row> {
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let mut g = inputs::KdaSpec::generate(&KdaSpec {
        layout: Layout::batch(1, t),
        h,
        hv: h,
        k: kd,
        v: kd,
        opts,
        initial_state: true,
        scalar_gate: false,
        seed: 0,
    });
    let mut d = inputs::DplrSpec::generate(&DplrSpec {
        layout: Layout::batch(1, t),
        h,
        k: kd,
        v: kd,
        initial_state: true,
        seed: 0,
    });
    if let Some(mean) = steep {
        rescale(&mut g.inputs.g, mean);
        rescale(&mut d.inputs.gk, mean);
    }
    let shape = steep.map_or(String::new(), |m| format!("g {m}"));
    let dopts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let mut jobs = vec![];
    push_op(
        &mut jobs,
        "kda",
        Case::<Kda> {
            x: &g.inputs,
            opts: &opts,
            d_o: &g.d_o,
            dht: &g.dht,
        },
        (kda::Naive, naive_ops(t, h, ops::kda_naive(kd, kd))),
        |c| {
            let n = chunk_ops(t, h, c, ops::kda_chunk(c, kd, kd));
            (kda::Chunk::new(c).expect("valid"), n)
        },
    );
    push_op(
        &mut jobs,
        "dplr",
        Case::<Dplr> {
            x: &d.inputs,
            opts: &dopts,
            d_o: &d.d_o,
            dht: &d.dht,
        },
        (dplr::Naive, naive_ops(t, h, ops::dplr_naive(kd, kd))),
        |c| {
            let n = chunk_ops(t, h, c, ops::dplr_chunk(c, kd, kd));
            (dplr::Chunk::new(c).expect("valid"), n)
        },
    );
    let runs: Vec<&dyn Fn()> = jobs.iter().map(|j| &*j.run).collect();
    let rounds = common::rounds(&runs);
    jobs.iter()
        .enumerate()
        .map(|(i, j)| Row {
            label: format!(
                "T={t:<5} H={h} K=V={kd:<4} {shape:<6} {:<5} {:<12}",
                j.op, j.name
            ),
            best: rounds.best(i).expect("rounds ran"),
            median: rounds.quartiles(i).expect("rounds ran").median,
            ops: j.ops,
            vs_naive: (i != j.naive).then(|| rounds.ratio(i, j.naive).expect("rounds ran")),
        })
        .collect()
}
