//! The memory estimates (`deltaref_verify::memory`, `Impl::memory_needed`)
//! against the peak heap of the runs they stand for, measured by a counting
//! allocator: never below it (the up-front check must not let a run past
//! the budget) and at most [`SLACK`] times above it (nor refuse a run that
//! fits).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use deltaref::gates::Gate;
use deltaref_verify::case::{stored_width, Case, Dtype, Op};
use deltaref_verify::generate::{fill_heads, generate, generate_streamed, head_draws, GenSpec};
use deltaref_verify::impls::{Compute, Impl, ImplName, ImplRequest};
use deltaref_verify::memory::Problem;

/// How far above the measured peak an estimate may be.
const SLACK: f64 = 2.0;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every call goes to the system allocator unchanged; the counters
// only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        // A moving reallocation briefly holds both blocks.
        grew(n);
        let q = System.realloc(p, l, n);
        LIVE.fetch_sub(l.size(), Relaxed);
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

use crate::SERIAL;

/// `f`'s result and the peak heap bytes it held above what was live when
/// it started.
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let r = f();
    (r, (PEAK.load(Relaxed) - base) as u64)
}

fn assert_bounds(what: &str, measured: u64, estimate: u64) {
    let ratio = estimate as f64 / measured as f64;
    println!("{what:60} measured {measured:>10} estimate {estimate:>10} ({ratio:.2}x)");
    assert!(
        (1.0..=SLACK).contains(&ratio),
        "{what}: estimate {estimate} B against a measured peak of {measured} B ({ratio:.2}x)"
    );
}

fn kda(shape: [usize; 6], gate: Gate, l2norm: bool) -> GenSpec {
    let mut s = GenSpec::new(Op::Kda);
    s.shape = Some(shape.to_vec());
    s.gate = gate;
    s.use_qk_l2norm_in_kernel = l2norm;
    s
}

/// KDA with each combination of gate and l2norm, GVA over varlen
/// sequences with initial states, a single head long enough for two spans;
/// DPLR, GDN, token-shift and causal conv1d. Inputs of 20 to 70 MB, so the
/// fixed allocations do not matter.
fn specs() -> Vec<(String, GenSpec)> {
    let lb = Gate::LowerBound { lower_bound: -5.0 };
    let mut v = vec![];
    for (gate, l2) in [
        (Gate::None, false),
        (Gate::Kda, false),
        (Gate::None, true),
        (lb, true),
    ] {
        v.push((
            format!("kda {gate:?} l2norm={l2}"),
            kda([1, 4096, 2, 2, 64, 64], gate, l2),
        ));
    }
    let mut wide = kda([1, 4096, 2, 2, 32, 128], lb, true);
    wide.dtype = Dtype::Bf16;
    v.push(("kda K=32 V=128 bf16".into(), wide));
    let mut gva = kda([1, 4096, 2, 4, 32, 64], Gate::Kda, false);
    gva.lengths = Some(vec![1000, 3096]);
    gva.initial_state = true;
    v.push(("kda GVA varlen".into(), gva));
    v.push((
        "kda one head, two spans".into(),
        kda([1, 16384, 1, 1, 32, 32], lb, true),
    ));
    let mut dplr = GenSpec::new(Op::Dplr);
    dplr.shape = Some(vec![1, 4096, 2, 64, 64]);
    v.push(("dplr".into(), dplr.clone()));
    dplr.shape = Some(vec![1, 16384, 1, 32, 32]);
    v.push(("dplr one head, two spans".into(), dplr));
    for l2 in [false, true] {
        let mut gdn = GenSpec::new(Op::Gdn);
        gdn.shape = Some(vec![1, 4096, 2, 2, 64, 64]);
        gdn.use_qk_l2norm_in_kernel = l2;
        v.push((format!("gdn l2norm={l2}"), gdn));
    }
    let mut ts = GenSpec::new(Op::TokenShift);
    ts.shape = Some(vec![1, 16384, 256]);
    v.push(("token_shift".into(), ts));
    let mut conv = GenSpec::new(Op::CausalConv1d);
    conv.shape = Some(vec![1, 16384, 256, 4]);
    v.push(("causal_conv1d".into(), conv));
    v
}

/// Runs `f` on a pool of `threads` (the estimates count threads, and the
/// measurements should not depend on the machine's).
fn on_threads(threads: usize, f: impl FnOnce() + Send) {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// Naive, chunked and CP (4 ranks) runs, on a borrowed case (the run
/// copies the inputs) and on an owned one (they move in), on 2 threads
/// (as many as the cases' pairs) and 5 (more: the chunked engine splits
/// a pair's chunks over them).
#[test]
fn engine_runs_stay_within_their_estimate() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    on_threads(2, engine_runs);
    on_threads(5, engine_runs);
}

fn engine_runs() {
    let threads = rayon::current_num_threads();
    for (label, spec) in specs() {
        let label = format!("{label}, {threads} threads");
        let case = generate(&spec).unwrap();
        for (name, world) in [
            (ImplName::Naive, None),
            (ImplName::Chunk, None),
            (ImplName::Cp, Some(4)),
        ] {
            let req = ImplRequest {
                name,
                world,
                ..Default::default()
            };
            let imp = req.resolve(&case).unwrap();
            // The per-thread buffers the naive engines keep are fixed_bytes'.
            imp.compute(&case, Compute::F64).unwrap();
            let estimate = imp.memory_needed(&case);
            let (_, run) = peak_of(|| imp.compute(&case, Compute::F64).unwrap());
            assert_bounds(&format!("{label}, {name:?} borrowed"), run, estimate);
            let owned = case.clone();
            let (_, run) = peak_of(|| imp.compute_owned(owned, Compute::F64).unwrap());
            assert_bounds(
                &format!("{label}, {name:?} owned"),
                run + case.bytes(),
                estimate,
            );
        }
    }
}

/// `gen`: the draws and the write, the whole-case truth, and the truth
/// head block by head block (one head, every head).
#[test]
fn generating_stays_within_its_estimate() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    on_threads(2, generating);
}

fn generating() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    for (label, mut spec) in specs() {
        let (case, drawn) = peak_of(|| generate(&spec).unwrap());
        let p = Problem::of_case(&case);
        let (_, written) = peak_of(|| case.write(&path("inputs.safetensors")).unwrap());
        let held = drawn.max(written + case.bytes());
        assert_bounds(&format!("{label}, gen"), held, p.draw_bytes());
        drop(case);
        spec.expected = true;
        // The per-thread buffers the naive engines keep are fixed_bytes'.
        drop(generate(&spec).unwrap());
        let (case, whole) = peak_of(|| generate(&spec).unwrap());
        assert_bounds(&format!("{label}, gen --expected"), whole, p.gen_bytes());
        if !spec.op.info().streams_by_head {
            continue;
        }
        case.write(&path("whole.safetensors")).unwrap();
        let drawn = head_draws(&spec).unwrap();
        let (_, draws) = peak_of(|| {
            Case::new(spec.meta().unwrap())
                .write_filled(&path("drawn.safetensors"), drawn, &[], |_| Ok(()))
                .unwrap()
        });
        assert_bounds(
            &format!("{label}, drawn one by one"),
            draws,
            p.streamed_draw_bytes(stored_width(spec.dtype)),
        );
        for expected in [false, true] {
            spec.expected = expected;
            for heads in [1, p.h] {
                let out = path("streamed.safetensors");
                let (_, streamed) = peak_of(|| generate_streamed(&spec, &out, heads).unwrap());
                assert_bounds(
                    &format!("{label}, gen (expected: {expected}), {heads} heads a block"),
                    streamed,
                    p.gen_streamed_bytes(
                        fill_heads(heads, expected),
                        expected,
                        stored_width(spec.dtype),
                    ),
                );
            }
        }
        let same = std::fs::read(path("whole.safetensors")).unwrap()
            == std::fs::read(path("streamed.safetensors")).unwrap();
        assert!(same, "{label}: the streamed file is not the whole case's");
    }
}

/// The check itself: a budget just above a run's estimate passes, one
/// just below refuses, naming the estimate.
#[test]
fn the_check_refuses_at_its_estimate() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let case = generate(&kda([1, 256, 2, 2, 16, 16], Gate::None, true)).unwrap();
    let imp = Impl::chunk(64).unwrap();
    let need = imp.memory_needed(&case) + deltaref_verify::memory::fixed_bytes();
    deltaref_verify::memory::set_limit(Some(need));
    assert!(imp.check_memory_owned(&case, false).is_ok());
    deltaref_verify::memory::set_limit(Some(need - 1));
    let e = imp
        .check_memory_owned(&case, false)
        .unwrap_err()
        .to_string();
    deltaref_verify::memory::set_limit(None);
    assert!(
        e.contains("impl:chunk(C=64) on this case needs about"),
        "{e}"
    );
}
