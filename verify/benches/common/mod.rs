//! Timing helper shared by the benchmarks.

use std::convert::Infallible;
use std::time::Instant;

use deltaref_verify::bench::timing::{self, Rounds};

// The `deltaref` binary's allocator (see verify/cli/src/main.rs): with glibc's,
// page faults on the per-call buffers dominate the timings.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// The `deltaref` binary's allocator setting (`tune_allocator` in
/// verify/cli/src/main.rs): freed memory goes back to the OS after 50 ms instead
/// of mimalloc 3's default 1 s, which keeps the long cases' peak memory down.
/// The benchmarks run under it so that their figures are the binary's; at
/// the bench shape it costs both engines a few hundred page faults per call
/// (measured: 2–4 % of the time against the 1 s default).
/// `MIMALLOC_PURGE_DELAY` in the environment still wins. Call first in
/// `main`, before rayon starts its threads.
pub fn tune_allocator() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: 15 is `mi_option_purge_delay`; no other thread exists yet.
        unsafe { mi_option_set(15, 50) };
    }
}

/// Rounds per timing: at least `MIN_ROUNDS`, then more while they have
/// taken less than `ROUND_BUDGET_S`, at most `MAX_ROUNDS`.
pub const MIN_ROUNDS: usize = 5;
pub const MAX_ROUNDS: usize = 25;
pub const ROUND_BUDGET_S: f64 = 4.0;

/// `jobs` in interleaved rounds after one untimed round (the first runs'
/// page faults and cold caches), as many as [`MIN_ROUNDS`],
/// [`MAX_ROUNDS`] and [`ROUND_BUDGET_S`] say.
pub fn rounds(jobs: &[&dyn Fn()]) -> Rounds {
    jobs.iter().for_each(|j| j());
    let mut rounds = Rounds::new(jobs.len());
    let start = Instant::now();
    while rounds.len() < MIN_ROUNDS
        || (rounds.len() < MAX_ROUNDS && start.elapsed().as_secs_f64() < ROUND_BUDGET_S)
    {
        rounds
            .run(|i| Ok::<_, Infallible>(timing::seconds(jobs[i])))
            .unwrap_or_else(|e| match e {});
    }
    rounds
}
