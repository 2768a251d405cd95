//! The chunked engines' state passes over a pair's chunks: chunk by chunk
//! where the pair has its thread to itself, else every intra stage first
//! and the state recurrence split over the state's value columns
//! ([`super::par::par_columns`]). Either way each element is computed by
//! the same operations on the same operands.

use std::ops::Range;

use ndarray::{s, Array, Array2, Array3, ArrayView2, ArrayViewMut2, Axis, Dimension, Slice};
use num_traits::Zero;

use super::fused::RowStack;
use super::par::{chunks_in_parallel, for_chunks, par_chunks, par_columns};

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
pub(crate) struct StateColumns<T> {
    pub h: Array3<T>,
    pub v_new: Array2<T>,
    pub o: Array2<T>,
    pub state: Array2<T>,
}

/// A block of value columns of a forward state pass being written, chunk by
/// chunk in order, into its [`StateColumns`].
pub(crate) struct StateRows<T> {
    h: RowStack<T>,
    v_new: RowStack<T>,
    o: RowStack<T>,
    kd: usize,
}

impl<T: Clone> StateRows<T> {
    /// Room for `nt` chunks of `l` tokens in all, with a state `[K, w]`
    /// (`dim`); `o` only with `read_out`.
    pub(crate) fn new(nt: usize, l: usize, (kd, w): (usize, usize), read_out: bool) -> Self {
        StateRows {
            h: RowStack::new(nt * kd, w),
            v_new: RowStack::new(l, w),
            o: RowStack::new(if read_out { l } else { 0 }, w),
            kd,
        }
    }

    /// One chunk: the state entering it `[K, w]` as stored and its `v_new`
    /// `[c, w]`.
    pub(crate) fn push(&mut self, h: ArrayView2<T>, v_new: ArrayView2<T>) {
        self.h.push(h);
        self.v_new.push(v_new);
    }

    /// One chunk's readout `o` `[c, w]`.
    pub(crate) fn push_o(&mut self, o: ArrayView2<T>) {
        self.o.push(o);
    }

    /// Every chunk written, with the final state `[K, w]`.
    pub(crate) fn finish(self, state: Array2<T>) -> StateColumns<T> {
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
    pub(crate) fn par_pass<F>(h0: ArrayView2<T>, pass: F) -> Self
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
pub(crate) struct StateGradColumns<T> {
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
    pub(crate) fn par_pass<S, F>(
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
pub(crate) fn forward_chunks<T, I, FI, FS>(
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
pub(crate) fn backward_chunks<T, R, S, F, G, C>(
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
    use crate::fast::par::{column_blocks, par_pairs};

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
}
