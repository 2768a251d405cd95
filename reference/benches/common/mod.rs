//! Timing helper shared by the benchmarks.

use std::time::Instant;

// The `deltaref` binary's allocator (see verify/src/main.rs): with glibc's,
// page faults on the per-call buffers dominate the timings.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Best wall time of `reps` runs, in seconds.
pub fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
