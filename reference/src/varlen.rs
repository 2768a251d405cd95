//! Sequences of a batch: `B` independent rows, or `B == 1` with sequences
//! packed along T by `cu_seqlens` (FlashAttention/FLA convention).

use rayon::prelude::*;

use crate::error::{Error, Result};

/// One sequence, or one contiguous piece of one (CP), inside a `[B, T, …]` tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the sequence (row of `initial_state` / `final_state`).
    pub seq: usize,
    /// Batch row holding it (always 0 in varlen mode).
    pub batch: usize,
    /// First token (inclusive) along T.
    pub start: usize,
    /// Last token (exclusive) along T.
    pub end: usize,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Validates `cu_seqlens` against a `[B, T, …]` input and lists its sequences.
///
/// Without `cu_seqlens` there is one sequence per batch row (`N = B`); with it,
/// `B` must be 1 and `cu_seqlens` must be `[0, …, T]`, non-decreasing
/// (zero-length sequences are legal).
pub fn sequences(b: usize, t: usize, cu_seqlens: Option<&[i64]>) -> Result<Vec<Segment>> {
    let Some(cu) = cu_seqlens else {
        return Ok((0..b)
            .map(|i| Segment {
                seq: i,
                batch: i,
                start: 0,
                end: t,
            })
            .collect());
    };
    if b != 1 {
        return Err(Error::CuSeqlens(format!(
            "varlen mode needs batch size B = 1 (sequences packed along T), got B = {b}"
        )));
    }
    validate_cu_seqlens(cu, t)?;
    Ok(cu
        .windows(2)
        .enumerate()
        .map(|(n, w)| Segment {
            seq: n,
            batch: 0,
            start: w[0] as usize,
            end: w[1] as usize,
        })
        .collect())
}

/// `cu_seqlens` must have N + 1 ≥ 2 entries, start at 0, never decrease and end at `t`.
pub fn validate_cu_seqlens(cu: &[i64], t: usize) -> Result<()> {
    if cu.len() < 2 {
        return Err(Error::CuSeqlens(format!(
            "needs at least 2 entries [0, …, T], got {cu:?}"
        )));
    }
    if cu[0] != 0 {
        return Err(Error::CuSeqlens(format!("must start at 0, got {cu:?}")));
    }
    if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1]) {
        return Err(Error::CuSeqlens(format!(
            "must be non-decreasing, but entry {i} ({}) < entry {} ({})",
            cu[i],
            i - 1,
            cu[i - 1]
        )));
    }
    let last = *cu.last().expect("length checked");
    if last != t as i64 {
        return Err(Error::CuSeqlens(format!(
            "must end at T = {t} (the packed length), got {last}"
        )));
    }
    Ok(())
}

/// Runs `f(segment_index, head)` for every pair, in parallel, returning results
/// in pair order. Each pair is computed by one thread from its own inputs, so
/// the results do not depend on the thread count. When there are at least as
/// many pairs as threads, [`par_chunks`] inside `f` runs sequentially.
pub fn par_pairs<R, F>(n_segments: usize, heads: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(usize, usize) -> R + Sync + Send,
{
    let pairs = n_segments * heads;
    let busy = pairs >= rayon::current_num_threads();
    (0..pairs)
        .into_par_iter()
        .map(|i| {
            let _busy = BusyGuard::set(busy);
            f(i / heads, i % heads)
        })
        .collect()
}

thread_local! {
    /// Whether the enclosing [`par_pairs`] already keeps every thread busy.
    static PAIRS_FILL_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sets [`PAIRS_FILL_THREADS`] for the scope of one pair, restoring the
/// previous value after it (pairs may nest, e.g. CP over an engine).
struct BusyGuard(bool);

impl BusyGuard {
    fn set(busy: bool) -> Self {
        BusyGuard(PAIRS_FILL_THREADS.with(|c| c.replace(busy)))
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        PAIRS_FILL_THREADS.with(|c| c.set(self.0));
    }
}

/// `f(n)` for `n` in `0..count`, in order: in parallel over the chunks of
/// one (sequence, head) pair only when there are fewer pairs than threads
/// (inside a [`par_pairs`] that fills the threads the per-chunk tasks would
/// be pure overhead). Each `f(n)` is computed alone, so the results do not
/// depend on the thread count either way.
pub fn par_chunks<R, F>(count: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(usize) -> R + Sync + Send,
{
    if PAIRS_FILL_THREADS.with(|c| c.get()) {
        (0..count).map(f).collect()
    } else {
        (0..count).into_par_iter().map(f).collect()
    }
}
