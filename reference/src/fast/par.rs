//! How an engine's work splits over rayon's threads without changing a
//! bit: over (sequence, head) pairs, and with fewer pairs than threads over
//! a pair's chunks and its state's value columns (a chunked engine's pair
//! then runs stage by stage; with as many pairs as threads, chunk by chunk:
//! [`super::columns`]).

use std::ops::Range;

use rayon::prelude::*;

/// Elements from which a fill or a scan of one tensor uses every thread
/// ([`super::views::zeros`], [`crate::tensor::check_finite`]; a bench-shape
/// tensor, `[1, 1024, 4, 64]`, is 2¹⁸).
pub(crate) const PAR_FILL: usize = 1 << 16;

/// Runs `f(segment_index, head)` for every pair, in parallel, returning results
/// in pair order. Each pair is computed by one thread from its own inputs, so
/// the results do not depend on the thread count. When there are at least as
/// many pairs as threads, [`par_chunks`] inside `f` runs sequentially.
pub(crate) fn par_pairs<R, F>(n_segments: usize, heads: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(usize, usize) -> R + Sync + Send,
{
    par_pairs_with(vec![(); n_segments * heads], heads, |si, h, ()| f(si, h))
}

/// [`par_pairs`] with one `item` per pair (in pair order) handed to
/// `f(segment, head, item)`.
pub(crate) fn par_pairs_with<I, R, F>(items: Vec<I>, heads: usize, f: F) -> Vec<R>
where
    I: Send,
    R: Send,
    F: Fn(usize, usize, I) -> R + Sync + Send,
{
    let busy = items.len() >= rayon::current_num_threads();
    items
        .into_par_iter()
        .enumerate()
        .map(|(i, item)| {
            let _busy = BusyGuard::set(busy);
            f(i / heads, i % heads, item)
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

/// `consume(n, f(n))` for `n` in `0..count`, in order. Where [`par_chunks`]
/// is parallel the `f(n)` are computed in parallel, 16 per thread at a
/// time, and each batch is consumed before the next is computed; otherwise
/// each is consumed as soon as it is computed, so only one result is alive
/// at a time and its memory is reused (still in cache) by the next.
pub(crate) fn for_chunks<R, F, C>(count: usize, f: F, mut consume: C)
where
    R: Send,
    F: Fn(usize) -> R + Sync + Send,
    C: FnMut(usize, R),
{
    if chunks_in_parallel() {
        let batch = CHUNKS_PER_THREAD * rayon::current_num_threads();
        for start in (0..count).step_by(batch) {
            let end = (start + batch).min(count);
            let results: Vec<R> = (start..end).into_par_iter().map(&f).collect();
            for (n, r) in (start..end).zip(results) {
                consume(n, r);
            }
        }
    } else {
        (0..count).for_each(|n| consume(n, f(n)));
    }
}

/// Chunks per thread in one parallel batch of [`for_chunks`]: enough that
/// the wait at the end of each batch costs nothing measurable (at 4 per
/// thread the one-pair bench lost 2–8 %), few enough that a batch's results
/// stay small (a 65,536-token head held all 1024 chunks' gradients, about
/// 340 MB at K = V = 128, before its first was consumed).
const CHUNKS_PER_THREAD: usize = 16;

/// Whether [`par_chunks`] runs in parallel here: false inside a
/// [`par_pairs`] whose pairs fill the threads.
pub(crate) fn chunks_in_parallel() -> bool {
    !PAIRS_FILL_THREADS.with(|c| c.get())
}

/// `f(n)` for `n` in `0..count`, in order: in parallel over the chunks of
/// one (sequence, head) pair only when there are fewer pairs than threads
/// (inside a [`par_pairs`] that fills the threads the per-chunk tasks would
/// be pure overhead). Each `f(n)` is computed alone, so the results do not
/// depend on the thread count either way.
pub(crate) fn par_chunks<R, F>(count: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(usize) -> R + Sync + Send,
{
    if !chunks_in_parallel() {
        (0..count).map(f).collect()
    } else {
        (0..count).into_par_iter().map(f).collect()
    }
}

/// `f(cols)` for blocks of the `vd` value columns of a state, in column
/// order: in parallel, about one block per thread, when [`par_chunks`] would
/// be parallel (fewer pairs than threads); else one block `0..vd`. A chunked
/// engine's state passes split this way: column `j` of the state `h [K, V]`
/// and of `v_new` reads only column `j` of `u`, `do` and the state itself, so
/// the sequential pass over the chunks runs on every thread. Each element is
/// computed by the same operations whatever the split: the bits do not
/// depend on it.
pub(crate) fn par_columns<R, F>(vd: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(Range<usize>) -> R + Sync + Send,
{
    let threads = if chunks_in_parallel() {
        rayon::current_num_threads()
    } else {
        1
    };
    column_blocks(vd, threads).into_par_iter().map(f).collect()
}

/// At most `n` blocks covering `0..vd`, each a multiple of 8 columns wide
/// (whole vectors) but the last.
pub(crate) fn column_blocks(vd: usize, n: usize) -> Vec<Range<usize>> {
    let width = vd.div_ceil(n.max(1)).next_multiple_of(8).max(1);
    (0..vd.max(1))
        .step_by(width)
        .map(|a| a..(a + width).min(vd))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_blocks_cover_the_columns_in_whole_vectors() {
        assert_eq!(column_blocks(20, 3), vec![0..8, 8..16, 16..20]);
        assert_eq!(column_blocks(128, 2), vec![0..64, 64..128]);
        assert_eq!(
            column_blocks(128, 16),
            (0..16).map(|i| i * 8..i * 8 + 8).collect::<Vec<_>>()
        );
        // Never narrower than a vector, so never more blocks than needed.
        assert_eq!(column_blocks(12, 8), vec![0..8, 8..12]);
        assert_eq!(column_blocks(5, 4), vec![0..5]);
        assert_eq!(column_blocks(64, 1), vec![0..64]);
    }

    /// Over several parallel batches and a partial last one, every chunk
    /// is consumed once, in order, with its own result; no more than one
    /// batch of results is alive at a time.
    #[test]
    fn for_chunks_consumes_every_chunk_in_order_a_batch_at_a_time() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool");
        let batch = CHUNKS_PER_THREAD * 2;
        let count = 3 * batch + 5;
        let alive = std::sync::atomic::AtomicUsize::new(0);
        let (mut seen, mut most) = (Vec::new(), 0);
        pool.install(|| {
            assert!(chunks_in_parallel());
            for_chunks(
                count,
                |n| {
                    let now = alive.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    (n * n, now)
                },
                |n, (sq, now)| {
                    most = most.max(now);
                    alive.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    seen.push((n, sq));
                },
            )
        });
        assert_eq!(seen, (0..count).map(|n| (n, n * n)).collect::<Vec<_>>());
        assert!(most <= batch, "{most} results alive, batch {batch}");
    }
}
