//! Sequences of a batch: `B` independent rows, or `B == 1` with sequences
//! packed along T by `cu_seqlens` (FlashAttention/FLA convention); and how an
//! engine's work splits over rayon's threads without changing a bit: over
//! (sequence, head) pairs, and with fewer pairs than threads over a pair's
//! chunks and its state's value columns (a chunked engine's pair then runs
//! stage by stage; with as many pairs as threads, chunk by chunk).

use std::ops::Range;

use ndarray::{s, Array, Array2, Array3, ArrayView2, ArrayViewMut2, Axis, Dimension, Slice};
use num_traits::Zero;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::fused::RowStack;

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
    par_pairs_with(vec![(); n_segments * heads], heads, |si, h, ()| f(si, h))
}

/// [`par_pairs`] with one `item` per pair (in pair order) handed to
/// `f(segment, head, item)`.
pub fn par_pairs_with<I, R, F>(items: Vec<I>, heads: usize, f: F) -> Vec<R>
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
pub fn for_chunks<R, F, C>(count: usize, f: F, mut consume: C)
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

/// Tokens per span of a chunked engine's long pair by default
/// ([`in_spans`]): a span's intermediates at K = V = 128 are about 75 MB,
/// where a 65,536-token pair's were 590 MB.
pub const SPAN_LEN: usize = 8192;

/// A chunked engine's forward+backward of one pair of `len` tokens in
/// spans of `span` tokens (whole chunks), holding one span's intermediates
/// at a time. The forward runs the spans in order from `h0 [K, V]`,
/// keeping only the state entering each; the backward, from the last span,
/// runs each span's forward again and its backward from the state gradient
/// the later span handed back (`dht [K, V]` for the last). The states carry
/// unrounded both ways, as from one chunk to the next inside a span, so
/// every chunk sees the operands of a whole-pair run and the results are
/// its bits, for the price of a second forward pass.
///
/// `head(r)` is tokens `r` of the pair's head; `forward(x, h0, read_out)`
/// runs them from `h0` (with the readout where asked) and returns their
/// intermediates; `backward(x, r, intermediates, ds, dh0)` writes their
/// gradients from `ds = ∂L/∂(state after r)` and the state gradient at
/// `r.start` into `dh0`. Writes `o [L, V]` and `S_L [K, V]`; returns `dh0`.
#[allow(clippy::too_many_arguments)]
pub fn in_spans<T: Clone + Zero, H, F: SpanForward<T>>(
    len: usize,
    span: usize,
    h0: ArrayView2<T>,
    dht: ArrayView2<T>,
    mut o: ArrayViewMut2<T>,
    final_state: ArrayViewMut2<T>,
    head: impl Fn(Range<usize>) -> H,
    forward: impl Fn(&H, ArrayView2<T>, bool) -> F,
    mut backward: impl FnMut(&H, Range<usize>, &F, ArrayView2<T>, ArrayViewMut2<T>),
) -> Array2<T> {
    let spans: Vec<_> = (0..len)
        .step_by(span.max(1))
        .map(|s| s..(s + span).min(len))
        .collect();
    let mut entering = Vec::with_capacity(spans.len());
    let mut state = h0.to_owned();
    for r in &spans {
        let fwd = forward(&head(r.clone()), state.view(), true);
        fwd.o().assign_to(o.slice_mut(s![r.clone(), ..]));
        entering.push(std::mem::replace(&mut state, fwd.final_state().to_owned()));
    }
    state.assign_to(final_state);
    let mut ds = dht.to_owned();
    for (r, h0) in spans.iter().zip(&entering).rev() {
        let x = head(r.clone());
        let fwd = forward(&x, h0.view(), false);
        let mut dh0 = Array2::zeros(ds.raw_dim());
        backward(&x, r.clone(), &fwd, ds.view(), dh0.view_mut());
        ds = dh0;
    }
    ds
}

/// A chunked engine's `forward_backward_into` of a pair longer than its
/// span: [`in_spans`] over the engine's `forward_pass` and `backward_into`,
/// the head's `standard_rows` and the gradient sink's `rows_mut`, writing
/// `out` (a `HeadSink`). Expands inside the engine's impl (those are its
/// private methods).
#[macro_export]
macro_rules! chunked_in_spans {
    ($engine:expr, $x:expr, $h0:expr, $d_o:expr, $dht:expr, $out:expr) => {{
        let (engine, x, d_o, out) = ($engine, $x, $d_o, $out);
        let mut grads = out.grads;
        let dh0 = $crate::varlen::in_spans(
            x.len(),
            engine.span_len,
            $h0,
            $dht,
            out.o,
            out.final_state,
            |r| x.standard_rows(r),
            |xs, h0, read_out| engine.forward_pass(xs, h0, read_out),
            |xs, r, fwd, ds, dh0| {
                let d_o = d_o.slice(ndarray::s![r.clone(), ..]);
                let sink = grads.rows_mut(r, dh0);
                engine.backward_into(xs, fwd, d_o, ds, false, sink);
            },
        );
        $crate::tensor::copy_into(grads.dh0, dh0.view());
    }};
}

/// What [`in_spans`] reads of a span's forward intermediates.
pub trait SpanForward<T> {
    /// `o [c, V]` (with the readout).
    fn o(&self) -> ArrayView2<'_, T>;
    /// The state after the span, `[K, V]`.
    fn final_state(&self) -> ArrayView2<'_, T>;
}

/// Whether [`par_chunks`] runs in parallel here: false inside a
/// [`par_pairs`] whose pairs fill the threads.
fn chunks_in_parallel() -> bool {
    !PAIRS_FILL_THREADS.with(|c| c.get())
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
pub fn par_columns<R, F>(vd: usize, f: F) -> Vec<R>
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
fn column_blocks(vd: usize, n: usize) -> Vec<Range<usize>> {
    let width = vd.div_ceil(n.max(1)).next_multiple_of(8).max(1);
    (0..vd.max(1))
        .step_by(width)
        .map(|a| a..(a + width).min(vd))
        .collect()
}

/// The blocks of [`par_columns`] put back side by side along the last axis,
/// in standard (row-major) layout; each block is freed once placed.
fn join_columns<T: Clone + Zero, D: Dimension>(mut parts: Vec<Array<T, D>>) -> Array<T, D> {
    if parts.len() == 1 {
        return parts.pop().expect("one part");
    }
    let last = Axis(parts[0].ndim() - 1);
    let mut dim = parts[0].raw_dim();
    dim[last.index()] = parts.iter().map(|p| p.len_of(last)).sum();
    let mut joined = Array::zeros(dim);
    let mut at = 0;
    for p in parts {
        let w = p.len_of(last);
        joined
            .slice_axis_mut(last, Slice::from(at..at + w))
            .assign(&p);
        at += w;
    }
    joined
}

/// One block of value columns (`w` of them) of a chunked engine's forward
/// state pass: the state entering each chunk `[NT, K, w]`, `v_new` `[L, w]`,
/// `o` `[L, w]` (`[0, w]` without the readout) and the final state `[K, w]`.
pub struct StateColumns<T> {
    pub h: Array3<T>,
    pub v_new: Array2<T>,
    pub o: Array2<T>,
    pub state: Array2<T>,
}

/// A block of value columns of a forward state pass being written, chunk by
/// chunk in order, into its [`StateColumns`].
pub struct StateRows<T> {
    h: RowStack<T>,
    v_new: RowStack<T>,
    o: RowStack<T>,
    kd: usize,
}

impl<T: Clone> StateRows<T> {
    /// Room for `nt` chunks of `l` tokens in all, with a state `[K, w]`
    /// (`dim`); `o` only with `read_out`.
    pub fn new(nt: usize, l: usize, (kd, w): (usize, usize), read_out: bool) -> Self {
        StateRows {
            h: RowStack::new(nt * kd, w),
            v_new: RowStack::new(l, w),
            o: RowStack::new(if read_out { l } else { 0 }, w),
            kd,
        }
    }

    /// One chunk: the state entering it `[K, w]` as stored and its `v_new`
    /// `[c, w]`.
    pub fn push(&mut self, h: ArrayView2<T>, v_new: ArrayView2<T>) {
        self.h.push(h);
        self.v_new.push(v_new);
    }

    /// One chunk's readout `o` `[c, w]`.
    pub fn push_o(&mut self, o: ArrayView2<T>) {
        self.o.push(o);
    }

    /// Every chunk written, with the final state `[K, w]`.
    pub fn finish(self, state: Array2<T>) -> StateColumns<T> {
        StateColumns {
            h: self.h.into_blocks(self.kd),
            v_new: self.v_new.into_rows(),
            o: self.o.into_rows(),
            state,
        }
    }
}

impl<T: Clone + Zero + Send + Sync> StateColumns<T> {
    /// `pass(h0 columns, cols)` for the blocks of [`par_columns`] of the
    /// initial state `h0 [K, V]`, joined.
    pub fn par_pass<F>(h0: ArrayView2<T>, pass: F) -> Self
    where
        F: Fn(ArrayView2<T>, Range<usize>) -> Self + Sync + Send,
    {
        let parts = par_columns(h0.ncols(), |cols| {
            pass(h0.slice(s![.., cols.clone()]), cols)
        });
        Self::join(parts)
    }

    /// The blocks of [`par_columns`] as one, `w = V`.
    fn join(parts: Vec<Self>) -> Self {
        let (mut h, mut v_new, mut o, mut state) = (vec![], vec![], vec![], vec![]);
        for p in parts {
            h.push(p.h);
            v_new.push(p.v_new);
            o.push(p.o);
            state.push(p.state);
        }
        StateColumns {
            h: join_columns(h),
            v_new: join_columns(v_new),
            o: join_columns(o),
            state: join_columns(state),
        }
    }
}

/// One block of value columns of a chunked engine's backward state pass:
/// the state gradient at the end of each chunk `[NT, K, w]` (FLA's `dh`),
/// the gradient of `v_new` `[L, w]` and `dh0` `[K, w]`.
pub struct StateGradColumns<T> {
    pub dh: Array3<T>,
    pub dv_new: Array2<T>,
    pub dh0: Array2<T>,
}

impl<T: Clone + Zero + Send + Sync> StateGradColumns<T> {
    /// A chunked engine's backward state recurrence, chunk by chunk in
    /// reverse, for the blocks of [`par_columns`] of `do [L, V]` and `dht
    /// [K, V]`, joined. `chunks[n]` are chunk `n`'s tokens; `store` rounds
    /// the state gradient as the kernel stores it (FLA's `dh`), and
    /// `step(n, do, dh_n, ds)` is chunk `n`'s state pass: it returns the
    /// gradient of its `v_new` `[c, w]` and takes the carried `ds` `[K, w]`
    /// back to the chunk's start. Each chunk needs only its own reads of the
    /// state, so the columns split.
    pub fn par_pass<S, F>(
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        chunks: &[Range<usize>],
        store: S,
        step: F,
    ) -> Self
    where
        S: Fn(&mut ArrayViewMut2<T>) + Sync + Send,
        F: Fn(usize, ArrayView2<T>, ArrayView2<T>, &mut Array2<T>) -> Array2<T> + Sync + Send,
    {
        // The outputs are written once each, not zero-filled first: every
        // block of `dh` and (the chunks tiling the rows) every row of `dv_new`.
        let mut end = 0;
        for rows in chunks {
            assert_eq!(rows.start, end, "chunks must tile the rows in order");
            end = rows.end;
        }
        assert_eq!(end, d_o.nrows(), "chunks must cover every row of do");
        let parts = par_columns(dht.ncols(), |cols| {
            let (d_o, dht) = (d_o.slice(s![.., cols.clone()]), dht.slice(s![.., cols]));
            let (kd, w) = dht.dim();
            let mut dh = Array3::uninit((chunks.len(), kd, w));
            let mut dv_new = Array2::uninit((d_o.nrows(), w));
            let mut ds = dht.to_owned();
            for (n, rows) in chunks.iter().enumerate().rev() {
                let mut slot = dh.index_axis_mut(Axis(0), n);
                ds.assign_to(&mut slot);
                // SAFETY: every element of block `n` was just written.
                let mut ds_used = unsafe { slot.assume_init() };
                store(&mut ds_used);
                let dvn = step(n, d_o, ds_used.view(), &mut ds);
                dvn.assign_to(dv_new.slice_mut(s![rows.clone(), ..]));
            }
            // SAFETY: each block and each row was written above (checked:
            // the chunks tile the rows).
            let (dh, dv_new) = unsafe { (dh.assume_init(), dv_new.assume_init()) };
            StateGradColumns {
                dh,
                dv_new,
                dh0: ds,
            }
        });
        Self::join(parts)
    }

    /// `dh0 [K, V]` alone: `dh` `[0, K, V]` and `dv_new` `[0, V]`.
    fn only_dh0(dh0: Array2<T>) -> Self {
        let (kd, vd) = dh0.dim();
        StateGradColumns {
            dh: Array3::zeros((0, kd, vd)),
            dv_new: Array2::zeros((0, vd)),
            dh0,
        }
    }

    /// The blocks of [`par_columns`] as one, `w = V`.
    fn join(parts: Vec<Self>) -> Self {
        let (mut dh, mut dv_new, mut dh0) = (vec![], vec![], vec![]);
        for p in parts {
            dh.push(p.dh);
            dv_new.push(p.dv_new);
            dh0.push(p.dh0);
        }
        StateGradColumns {
            dh: join_columns(dh),
            dv_new: join_columns(dv_new),
            dh0: join_columns(dh0),
        }
    }
}

/// A chunked engine's forward over one pair of `l` tokens in chunks of
/// `chunk_size` (the last may be shorter), from `h0 [K, V]`: `intra(n)` is
/// chunk `n`'s state-independent stage and `step(ch, state, out, cols)` its
/// state step over the value columns `cols` (it pushes the chunk's stored
/// state, `v_new` and, with `read_out`, `o` to `out`, and carries `state
/// [K, w]` over the chunk).
///
/// Where the chunks run in parallel ([`par_chunks`]) every intra stage comes
/// first, then the state pass split over value columns ([`par_columns`]).
/// Where the pair has its thread to itself, it goes chunk by chunk, each
/// intra stage straight before its state step, which reads it while it is
/// still in cache. Both do the same operations on the same operands: the
/// same bits. Returns the intra stages in chunk order and the state pass.
pub fn forward_chunks<T, I, FI, FS>(
    l: usize,
    chunk_size: usize,
    h0: ArrayView2<T>,
    read_out: bool,
    intra: FI,
    step: FS,
) -> (Vec<I>, StateColumns<T>)
where
    T: Clone + Zero + Send + Sync,
    I: Send + Sync,
    FI: Fn(usize) -> I + Sync + Send,
    FS: Fn(&I, &mut Array2<T>, &mut StateRows<T>, Range<usize>) + Sync + Send,
{
    let nt = l.div_ceil(chunk_size);
    if chunks_in_parallel() {
        let intras = par_chunks(nt, intra);
        let pass = StateColumns::par_pass(h0, |h0, cols| {
            let mut out = StateRows::new(nt, l, h0.dim(), read_out);
            let mut state = h0.to_owned();
            for ch in &intras {
                step(ch, &mut state, &mut out, cols.clone());
            }
            out.finish(state)
        });
        return (intras, pass);
    }
    let mut out = StateRows::new(nt, l, h0.dim(), read_out);
    let mut state = h0.to_owned();
    let intras = (0..nt)
        .map(|n| {
            let ch = intra(n);
            step(&ch, &mut state, &mut out, 0..h0.ncols());
            ch
        })
        .collect();
    (intras, out.finish(state))
}

/// A chunked engine's backward over one pair whose chunks `chunks` tile the
/// rows of `do [L, V]`, from `dht [K, V]`. `store` and `state_step` are
/// [`StateGradColumns::par_pass`]'s; `chunk_step(n, dh_n, dv_new_n)` is the
/// rest of chunk `n`'s backward given the state gradient at its end as
/// stored (`[K, V]`) and its rows of `v_new`'s gradient (`[c, V]`), and
/// `consume(n, result)` takes each chunk's result.
///
/// Where the chunks run in parallel, or with `keep`, the state pass runs
/// first (split over value columns) and stores `dh [NT, K, V]` and `dv_new
/// [L, V]`; then the chunk steps run in parallel batches ([`for_chunks`])
/// and are consumed in chunk order. Where the pair has its thread to itself
/// (and without `keep`), it goes chunk by chunk from the last, each chunk's
/// step straight after its state step, while the state step's operands and
/// results are in cache. The same operations either way: the same bits.
/// Returns the state gradient at the pair's start in `dh0`, and `dh`,
/// `dv_new` with `keep` (else `[0, K, V]` and `[0, V]`).
#[allow(clippy::too_many_arguments)]
pub fn backward_chunks<T, R, S, F, G, C>(
    d_o: ArrayView2<T>,
    dht: ArrayView2<T>,
    chunks: &[Range<usize>],
    keep: bool,
    store: S,
    state_step: F,
    chunk_step: G,
    mut consume: C,
) -> StateGradColumns<T>
where
    T: Clone + Zero + Send + Sync,
    R: Send,
    S: Fn(&mut ArrayViewMut2<T>) + Sync + Send,
    F: Fn(usize, ArrayView2<T>, ArrayView2<T>, &mut Array2<T>) -> Array2<T> + Sync + Send,
    G: Fn(usize, ArrayView2<T>, ArrayView2<T>) -> R + Sync + Send,
    C: FnMut(usize, R),
{
    if keep || chunks_in_parallel() {
        let pass = StateGradColumns::par_pass(d_o, dht, chunks, store, state_step);
        for_chunks(
            chunks.len(),
            |n| {
                chunk_step(
                    n,
                    pass.dh.index_axis(Axis(0), n),
                    pass.dv_new.slice(s![chunks[n].clone(), ..]),
                )
            },
            consume,
        );
        return if keep {
            pass
        } else {
            StateGradColumns::only_dh0(pass.dh0)
        };
    }
    let (mut ds, mut ds_used) = (dht.to_owned(), dht.to_owned());
    for n in (0..chunks.len()).rev() {
        ds_used.assign(&ds);
        store(&mut ds_used.view_mut());
        let dv_new = state_step(n, d_o, ds_used.view(), &mut ds);
        consume(n, chunk_step(n, ds_used.view(), dv_new.view()));
    }
    StateGradColumns::only_dh0(ds)
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

    #[test]
    fn joined_columns_are_the_blocks_side_by_side_in_row_major_order() {
        let full = Array3::from_shape_fn((2, 3, 20), |(a, b, c)| (a * 100 + b * 20 + c) as f64);
        let parts = column_blocks(20, 3)
            .into_iter()
            .map(|r| full.slice(ndarray::s![.., .., r]).to_owned())
            .collect();
        let joined = join_columns(parts);
        assert_eq!(joined, full);
        assert!(joined.is_standard_layout());
    }

    /// A toy backward state pass (`ds ← ds + Σ do rows`, `dv_new = do + ds`)
    /// on one and on two threads (two column blocks): every block of `dh`
    /// and every row of `dv_new` is what the recurrence gives, in reverse
    /// from `dht`, stored after `store`.
    #[test]
    fn state_grad_pass_writes_every_block_and_row() {
        let (l, kd, vd) = (11, 3, 20);
        let d_o = Array2::from_shape_fn((l, vd), |(t, j)| (t * 7 + j) as f64 * 0.5);
        let dht = Array2::from_shape_fn((kd, vd), |(i, j)| (i + j) as f64 - 9.0);
        let chunks = [0..4, 4..8, 8..11];
        let store = |x: &mut ArrayViewMut2<f64>| x.mapv_inplace(|v| v * 2.0);
        let step =
            |n: usize, d_o: ArrayView2<f64>, ds_used: ArrayView2<f64>, ds: &mut Array2<f64>| {
                let rows = d_o.slice(s![chunks[n].clone(), ..]);
                *ds += &rows.sum_axis(Axis(0));
                &rows + &ds_used.row(0)
            };
        // The same recurrence, written out.
        let (mut ds, mut dh, mut dv_new) = (dht.clone(), vec![], vec![]);
        for rows in chunks.iter().rev() {
            let ds_used = &ds * 2.0;
            let r = d_o.slice(s![rows.clone(), ..]);
            dv_new.push(&r + &ds_used.row(0));
            ds += &r.sum_axis(Axis(0));
            dh.push(ds_used);
        }
        dh.reverse();
        dv_new.reverse();
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            let got = pool.install(|| {
                StateGradColumns::par_pass(d_o.view(), dht.view(), &chunks, store, step)
            });
            for (n, want) in dh.iter().enumerate() {
                assert_eq!(got.dh.index_axis(Axis(0), n), want, "{threads} threads");
            }
            let rows: Vec<_> = dv_new.iter().map(|a| a.view()).collect();
            assert_eq!(got.dv_new, ndarray::concatenate(Axis(0), &rows).unwrap());
            assert_eq!(got.dh0, ds);
        }
    }

    /// `f` run as one pair on `threads` threads: with one thread the pair
    /// fills them (chunk by chunk), with more it does not (staged, the
    /// chunks and value columns split).
    fn as_one_pair<R: Send>(threads: usize, f: impl Fn() -> R + Sync + Send) -> R {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        pool.install(|| par_pairs(1, 1, |_, _| f()).pop().expect("one pair"))
    }

    /// A toy forward (`v_new = intra + state row 0`, `o = 2 v_new`, the
    /// state adding `v_new`'s column sums to every row) and a toy backward
    /// (the recurrence of `state_grad_pass_writes_every_block_and_row`, the
    /// chunk step returning its operands): chunk by chunk and staged (V =
    /// 20 in column blocks of 8, 8 and 4) hand every step the same operands
    /// and give the same results; `dh` and `dv_new` are kept only with
    /// `keep`.
    #[test]
    fn chunk_by_chunk_and_staged_schedules_agree() {
        let (l, kd, vd) = (11, 3, 20);
        let chunks = [0..4, 4..8, 8..11];
        let h0 = Array2::from_shape_fn((kd, vd), |(i, j)| (i * 3 + j) as f64 * 0.25);
        let forward = || {
            forward_chunks(
                l,
                4,
                h0.view(),
                true,
                |n| {
                    Array2::from_shape_fn((chunks[n].len(), vd), |(r, j)| {
                        (n * 50 + r * 7 + j) as f64
                    })
                },
                |ch: &Array2<f64>, state, out, cols| {
                    let vn = &ch.slice(s![.., cols]) + &state.row(0);
                    out.push_o((&vn * 2.0).view());
                    out.push(state.view(), vn.view());
                    *state += &vn.sum_axis(Axis(0));
                },
            )
        };
        let (want_intra, want) = as_one_pair(3, forward);
        let (got_intra, got) = as_one_pair(1, forward);
        assert_eq!(got_intra, want_intra);
        assert_eq!(
            (got.h, got.v_new, got.o, got.state),
            (want.h, want.v_new, want.o, want.state)
        );

        let d_o = Array2::from_shape_fn((l, vd), |(t, j)| (t * 7 + j) as f64 * 0.5);
        let dht = Array2::from_shape_fn((kd, vd), |(i, j)| (i + j) as f64 - 9.0);
        let backward = |keep: bool| {
            let mut steps = vec![];
            let pass = backward_chunks(
                d_o.view(),
                dht.view(),
                &chunks,
                keep,
                |x: &mut ArrayViewMut2<f64>| x.mapv_inplace(|v| v * 2.0),
                |n, d_o: ArrayView2<f64>, ds_used: ArrayView2<f64>, ds: &mut Array2<f64>| {
                    let rows = d_o.slice(s![chunks[n].clone(), ..]);
                    *ds += &rows.sum_axis(Axis(0));
                    &rows + &ds_used.row(0)
                },
                |n, ds_used, dvn| (n, ds_used.to_owned(), dvn.to_owned()),
                |n, step| {
                    assert_eq!(n, step.0);
                    steps.push(step);
                },
            );
            steps.sort_by_key(|s| s.0);
            (pass, steps)
        };
        let (want, want_steps) = as_one_pair(3, || backward(true));
        for keep in [false, true] {
            let (got, got_steps) = as_one_pair(1, || backward(keep));
            assert_eq!(got_steps, want_steps, "keep {keep}");
            assert_eq!(got.dh0, want.dh0, "keep {keep}");
            if keep {
                assert_eq!((&got.dh, &got.dv_new), (&want.dh, &want.dv_new));
            } else {
                assert_eq!((got.dh.len(), got.dv_new.len()), (0, 0));
            }
        }
        let (staged, _) = as_one_pair(3, || backward(false));
        assert_eq!((staged.dh.len(), staged.dv_new.len()), (0, 0));
        assert_eq!(staged.dh0, want.dh0);
    }

    /// Chunks that leave a row unwritten (or overlap) are refused, not read
    /// as uninitialised memory.
    #[test]
    fn state_grad_pass_refuses_chunks_that_do_not_tile_the_rows() {
        let (d_o, dht) = (Array2::<f64>::zeros((8, 4)), Array2::<f64>::zeros((2, 4)));
        for chunks in [vec![0..4, 4..6], vec![0..4, 5..8], vec![0..5, 4..8]] {
            let run = std::panic::catch_unwind(|| {
                StateGradColumns::par_pass(
                    d_o.view(),
                    dht.view(),
                    &chunks,
                    |_| {},
                    |n, d_o, _, _| d_o.slice(s![chunks[n].clone(), ..]).to_owned(),
                )
            });
            assert!(run.is_err(), "{chunks:?}");
        }
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
