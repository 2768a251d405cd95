//! Dot products in a fixed order of four partial sums, and the row passes'
//! unfinished sums that finish with the same bits.

use crate::scalar::Scalar;

/// `Σ a_i b_i` with four independent partial sums (fixed order, so
/// deterministic): a strict left-to-right sum is one long dependency chain.
#[inline(always)]
pub(crate) fn dot<T: Scalar>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut sum = DotSum::new();
    for (x, y) in a.chunks_exact(4).zip(b.chunks_exact(4)) {
        for l in 0..4 {
            sum.lanes[l] += x[l] * y[l];
        }
    }
    let full = n / 4 * 4;
    for (&x, &y) in a[full..].iter().zip(&b[full..]) {
        sum.tail += x * y;
    }
    sum.finish()
}

/// The partial sums of [`dot`], for passes that accumulate dot products
/// while doing other work on the same row: `lanes[l]` sums the products at
/// `4c + l` over the full chunks of 4, `tail` the rest, and `finish`
/// combines them in `dot`'s order, so the result has `dot`'s bits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DotSum<T> {
    pub lanes: [T; 4],
    pub tail: T,
}

impl<T: Scalar> DotSum<T> {
    /// The tail starts at −0 like `Iterator::sum`, so an empty tail adds nothing.
    #[inline(always)]
    pub(crate) fn new() -> Self {
        DotSum {
            lanes: [T::zero(); 4],
            tail: -T::zero(),
        }
    }

    #[inline(always)]
    pub(crate) fn finish(self) -> T {
        // Passing the lanes through memory keeps them one vector register in
        // the loop: otherwise LLVM pairs lanes (0, 2) and (1, 3) to suit this
        // final sum and shuffles every load.
        let l = std::hint::black_box(self.lanes);
        (l[0] + l[1]) + (l[2] + l[3]) + self.tail
    }
}

/// `S` sums of [`dot`]'s order for each of the `N / 4` (1 or 2) state rows
/// of a row group in the [`crate::fast::sweep::Pairs`] layout, as a row pass
/// accumulates them: `lanes[s][4h + l]` is row `h`'s lane `l` of sum `s`,
/// `tails[s][h]` its tail.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowSums<T, const N: usize, const S: usize> {
    pub lanes: [[T; N]; S],
    pub tails: [[T; 2]; S],
}

impl<T: Scalar, const N: usize, const S: usize> Default for RowSums<T, N, S> {
    #[inline(always)]
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Scalar, const N: usize, const S: usize> RowSums<T, N, S> {
    #[inline(always)]
    pub(crate) fn new() -> Self {
        RowSums {
            lanes: [[T::zero(); N]; S],
            tails: [[-T::zero(); 2]; S],
        }
    }

    /// Keeps the sums of rows `row .. row + N / 4` in `out`, unfinished.
    #[inline(always)]
    pub(crate) fn store(&self, row: usize, out: &mut SweepSums<T, S>) {
        for s in 0..S {
            out.lanes[s][4 * row..4 * row + N].copy_from_slice(&self.lanes[s]);
            let rows = N / 4;
            out.tails[s][row..row + rows].copy_from_slice(&self.tails[s][..rows]);
        }
    }
}

/// The `S` sums of every row of a `[K, V]` state over one sweep, kept
/// unfinished by the row passes ([`RowSums::store`]) and finished together
/// once the sweep is done: the sums feed only the per-row gradients, so the
/// adds that finish them run as vectors over the rows instead of as a few
/// scalar adds and shuffles after each row group.
#[derive(Clone, Debug)]
pub(crate) struct SweepSums<T, const S: usize> {
    /// `[K · 4]` each: row `i`'s lanes at `4i ..`.
    lanes: [Vec<T>; S],
    /// `[K]` each.
    tails: [Vec<T>; S],
    /// `[K]` each: the finished sums, [`dot`]'s bits.
    pub done: [Vec<T>; S],
}

impl<T: Scalar, const S: usize> SweepSums<T, S> {
    pub(crate) fn new(k: usize) -> Self {
        SweepSums {
            lanes: std::array::from_fn(|_| vec![T::zero(); 4 * k]),
            tails: std::array::from_fn(|_| vec![T::zero(); k]),
            done: std::array::from_fn(|_| vec![T::zero(); k]),
        }
    }

    /// `done[s][i] = (l₀ + l₁) + (l₂ + l₃) + tail` for the sums kept, as
    /// [`DotSum::finish`].
    #[inline(always)]
    pub(crate) fn finish(&mut self) {
        for s in 0..S {
            let rows = self.lanes[s].chunks_exact(4).zip(&self.tails[s]);
            for (d, (l, &tail)) in self.done[s].iter_mut().zip(rows) {
                *d = ((l[0] + l[1]) + (l[2] + l[3])) + tail;
            }
        }
    }
}

impl<T: Scalar> Default for DotSum<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row passes' sums, kept per row group (one row, or a pair in
    /// the `Pairs` layout) and finished over the sweep, have the bits of
    /// each row's [`DotSum::finish`], in f64 and f32, for lanes of mixed
    /// magnitudes and signs (where the order of the adds shows in the
    /// result) and for `−0`, `+0` and non-empty tails.
    #[test]
    fn sweep_sums_finish_with_the_bits_of_each_dot_sum() {
        fn check<T: Scalar + std::fmt::Debug>(rng: &crate::rng::Stream) {
            const K: usize = 5;
            let mut reordered_differs = false;
            for case in 0..400u64 {
                let draw = |s: usize, i: usize, l: u64| {
                    let n = case * 4000 + (s * K + i) as u64 * 8 + l;
                    let (x, e) = (rng.normal(n), rng.uniform(n, 1));
                    T::c(x * 2f64.powi((e * 60.0) as i32 - 30))
                };
                let alone: [[DotSum<T>; 3]; K] = std::array::from_fn(|i| {
                    std::array::from_fn(|s| DotSum {
                        lanes: std::array::from_fn(|l| draw(s, i, l as u64)),
                        tail: match (case + i as u64) % 3 {
                            0 => -T::zero(),
                            1 => T::zero(),
                            _ => draw(s, i, 4),
                        },
                    })
                });
                let mut kept = SweepSums::<T, 3>::new(K);
                // Rows 0-1 and 2-3 as pairs, row 4 alone.
                for row in [0, 2] {
                    let mut pair = RowSums::<T, 8, 3>::new();
                    for (h, sums) in alone[row..row + 2].iter().enumerate() {
                        for (s, d) in sums.iter().enumerate() {
                            pair.lanes[s][4 * h..4 * h + 4].copy_from_slice(&d.lanes);
                            pair.tails[s][h] = d.tail;
                        }
                    }
                    pair.store(row, &mut kept);
                }
                let mut one = RowSums::<T, 4, 3>::new();
                for (s, d) in alone[4].iter().enumerate() {
                    one.lanes[s] = d.lanes;
                    one.tails[s][0] = d.tail;
                }
                one.store(4, &mut kept);
                kept.finish();
                for (i, sums) in alone.iter().enumerate() {
                    for (s, d) in sums.iter().enumerate() {
                        let want = d.finish();
                        assert_eq!(kept.done[s][i].f64().to_bits(), want.f64().to_bits());
                        let l = d.lanes;
                        reordered_differs |= ((l[0] + l[2]) + (l[1] + l[3]) + d.tail) != want;
                    }
                }
            }
            assert!(
                reordered_differs,
                "the draws never expose the order of the adds"
            );
        }
        let rng = crate::rng::Stream::new(3, "sweep sums");
        check::<f64>(&rng);
        check::<f32>(&rng);
    }
}
