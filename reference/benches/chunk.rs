//! Chunked vs naive forward+backward (one [`deltaref::op::forward_backward`]
//! run each), f64, B=1 T=1024 H=4 at K=V=64, 128 and 256 and chunk sizes
//! 16, 32 and 64 (issue 20: chunk at least as fast as naive), with the
//! GFLOP/s of each ([`deltaref::ops`]'s counts) and its fraction of the
//! measured no-FMA mul+add peak. Then the same tokens·heads as one
//! (sequence, head) pair, T=4096 H=1: fewer pairs than threads, where the
//! naive engines run on one thread and the chunked ones split the chunks
//! and the state's value columns over all of them.
//! Run: `cargo bench -p deltaref --bench chunk` (`-- 64` for one K=V).

mod common;

use common::best_of;

use deltaref::dplr::{self, DplrOptions};
use deltaref::inputs::{self, DplrSpec, KdaSpec, Layout};
use deltaref::kda::{self, KdaOptions};
use deltaref::op;
use deltaref::ops::{self, OpCount};

const REPS: usize = 5;
const CHUNK_SIZES: [usize; 3] = [16, 32, 64];

fn main() {
    common::tune_allocator();
    let (t, h) = (1024, 4);
    // `cargo bench` passes `--bench`; a number picks one K=V.
    let only: Option<usize> = std::env::args().skip(1).find_map(|a| a.parse().ok());
    println!(
        "forward+backward, f64, B=1, {} rayon threads, best of {REPS}",
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
                rows.extend(bench(t, h, kd));
            }
        }
    }
    peak = peak.max(ops::peak_gflops(0.3));
    println!(
        "peak: {peak:.1} GFLOP/s ({}), the best of the samples",
        ops::peak_description()
    );
    for r in rows {
        println!("{}", r.line(peak));
    }
}

/// One timed run: `T=… H=… K=V=… op  name` and its time and op count.
struct Row {
    label: String,
    secs: f64,
    ops: f64,
}

impl Row {
    /// `label  time  GFLOP/s  % of peak`.
    fn line(&self, peak: f64) -> String {
        let g = self.ops / self.secs / 1e9;
        format!(
            "{} {:7.2} ms {g:5.1} GFLOP/s {:4.0}%",
            self.label,
            self.secs * 1e3,
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

fn bench(t: usize, h: usize, kd: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut row = |op: &str, name: String, secs: f64, ops: f64| {
        rows.push(Row {
            label: format!("T={t:<5} H={h} K=V={kd:<4} {op:<5} {name:<12}"),
            secs,
            ops,
        })
    };
    let opts = KdaOptions {
        output_final_state: true,
        ..Default::default()
    };
    let g = inputs::kda(&KdaSpec {
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
    let run = |e: &dyn Fn()| best_of(REPS, e);
    let naive = run(&|| {
        op::forward_backward(&kda::naive::Naive, &g.inputs, &opts, &g.d_o, Some(&g.dht))
            .expect("valid");
    });
    row(
        "kda",
        "naive".into(),
        naive,
        naive_ops(t, h, ops::kda_naive(kd, kd)),
    );
    for c in CHUNK_SIZES {
        let engine = kda::chunk::Chunk::new(c).expect("valid");
        let secs = run(&|| {
            op::forward_backward(&engine, &g.inputs, &opts, &g.d_o, Some(&g.dht)).expect("valid");
        });
        let n = chunk_ops(t, h, c, ops::kda_chunk(c, kd, kd));
        row("kda", format!("chunk(C={c})"), secs, n);
    }
    let d = inputs::dplr(&DplrSpec {
        layout: Layout::batch(1, t),
        h,
        k: kd,
        v: kd,
        initial_state: true,
        seed: 0,
    });
    let dopts = DplrOptions {
        output_final_state: true,
        ..Default::default()
    };
    let naive = run(&|| {
        op::forward_backward(&dplr::naive::Naive, &d.inputs, &dopts, &d.d_o, Some(&d.dht))
            .expect("valid");
    });
    row(
        "dplr",
        "naive".into(),
        naive,
        naive_ops(t, h, ops::dplr_naive(kd, kd)),
    );
    for c in CHUNK_SIZES {
        let engine = dplr::chunk::Chunk::new(c).expect("valid");
        let secs = run(&|| {
            op::forward_backward(&engine, &d.inputs, &dopts, &d.d_o, Some(&d.dht)).expect("valid");
        });
        let n = chunk_ops(t, h, c, ops::dplr_chunk(c, kd, kd));
        row("dplr", format!("chunk(C={c})"), secs, n);
    }
    rows
}
