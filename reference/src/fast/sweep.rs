//! Pieces shared by the naive engines, which sweep a `[K, V]` state held as
//! a row-major slice once or twice per token.

use ndarray::ArrayView2;

use crate::scalar::Scalar;

/// Columns per tile of a forward sweep: a sweep walks down the `K` rows one
/// tile of columns at a time, so the tile's `[V]` accumulators stay in
/// registers. 16 (two cache lines of `f64` per row, two AVX-512 registers
/// per accumulator) against 8: the K = V = 256 naive forward+backward, whose
/// state lives in L2, takes 177 instead of 350 ms (AVX-512) and 178 instead
/// of 309 ms (AVX2) on the 2-core VM; K = V = 64 about 5 % less. The bits do
/// not depend on it (each element's operations are the same).
pub(crate) const TILE: usize = 16;

/// Tokens per block of a checkpointed backward at the `O(√L · K · V)`
/// spacing: `⌈√L⌉`, at least 16. The GPU's naive backward uses it as is;
/// the CPU engines shorten it to their cache ([`state_block_len`]).
pub(crate) fn block_len(l: usize) -> usize {
    ((l as f64).sqrt().ceil() as usize).max(16)
}

/// Bytes of replayed states one block may hold on the CPU. A block's
/// states are written by the replay and read back in reverse by the
/// sweeps, so they must stay in the cache between the two: at K = V = 256
/// (512 KiB states) the `√L` block of 32–64 tokens is 16–32 MiB, the size
/// of the whole L3, and cutting it to 16 tokens (8 MiB) took the naive
/// forward+backward at T = 4096, H = 1 from 463–469 to 337–342 ms (KDA) and
/// 506 to 350–363 ms (DPLR) on the AMD VM; at K = V = 64 and 128 a block
/// under 8 MiB was no faster (BENCHMARKS.md, fifteenth round).
const BLOCK_BYTES: usize = 8 << 20;

/// Tokens per block of the naive engines' checkpointed backward for states
/// of `state_bytes`: [`block_len`], shortened so the block's states fit
/// `BLOCK_BYTES`, but never below a quarter of it, so the checkpoints
/// stay `O(√L)` (at most about `4√L` of them). Where the checkpoints fall
/// does not change a bit: replaying from one repeats the forward's steps.
pub(crate) fn state_block_len(l: usize, state_bytes: usize) -> usize {
    let sqrt = block_len(l);
    let fits = BLOCK_BYTES / state_bytes.max(1);
    sqrt.min(fits.max(sqrt.div_ceil(4)))
}

/// States a checkpointed backward of `l` tokens holds at once: its
/// checkpoints and one block ([`state_block_len`]).
pub(crate) fn held_states(l: usize, state_bytes: usize) -> usize {
    let bl = state_block_len(l, state_bytes);
    l.div_ceil(bl) + bl
}

/// The forward schedule of the naive engines over tokens `0 .. l`: sweep
/// `t` (one call `sweep(s, fin, start)`) finishes token `fin = t − 1` and
/// starts token `start = t`. With `checkpoints`, the state entering the first
/// token of every block of [`state_block_len`] tokens is appended to it, so
/// there the two halves run as two calls around the copy.
#[inline(always)]
pub(crate) fn run_tokens<T: Copy>(
    l: usize,
    s: &mut [T],
    checkpoints: Option<&mut Vec<T>>,
    sweep: impl FnMut(&mut [T], Option<usize>, Option<usize>),
) {
    let bl = state_block_len(l, std::mem::size_of_val(s));
    run_tokens_in_blocks(l, bl, s, checkpoints, sweep)
}

/// [`run_tokens`] with checkpoints every `bl` tokens.
#[inline(always)]
fn run_tokens_in_blocks<T: Copy>(
    l: usize,
    bl: usize,
    s: &mut [T],
    mut checkpoints: Option<&mut Vec<T>>,
    mut sweep: impl FnMut(&mut [T], Option<usize>, Option<usize>),
) {
    if let Some(states) = &mut checkpoints {
        states.reserve(l.div_ceil(bl) * s.len());
    }
    for t in 0..=l {
        let (fin, start) = (t.checked_sub(1), (t < l).then_some(t));
        match &mut checkpoints {
            Some(states) if t < l && t % bl == 0 => {
                sweep(s, fin, None);
                states.extend_from_slice(s);
                sweep(s, None, start);
            }
            _ => sweep(s, fin, start),
        }
    }
}

/// The backward schedule matching [`run_tokens`]: blocks in reverse; each
/// block's entering states `S_{t−1}` (`kv` values each) are rebuilt from its
/// checkpoint by `replay(t, S_{t−1}, S_t)`, then `back(start, end, states,
/// ds)` runs the block's reverse sweeps, taking `ds` from `∂L/∂S_{end−1}` to
/// `∂L/∂S_{start−1}`. The states `replay` and `back` see, and `ds` between
/// the two conversions here, are in the [`Pairs`] layout of `pairs`; `ds`
/// enters and leaves row-major. Memory: one block of states.
#[inline(always)]
pub(crate) fn reverse_blocks<T: Scalar>(
    l: usize,
    pairs: Pairs,
    checkpoints: &[T],
    ds: &mut [T],
    replay: impl Fn(usize, &[T], &mut [T]),
    back: impl FnMut(usize, usize, &[T], &mut [T]),
) {
    let bl = state_block_len(l, pairs.len() * std::mem::size_of::<T>());
    reverse_blocks_of(l, bl, pairs, checkpoints, ds, replay, back)
}

/// [`reverse_blocks`] for checkpoints every `bl` tokens.
#[inline(always)]
fn reverse_blocks_of<T: Scalar>(
    l: usize,
    bl: usize,
    pairs: Pairs,
    checkpoints: &[T],
    ds: &mut [T],
    replay: impl Fn(usize, &[T], &mut [T]),
    mut back: impl FnMut(usize, usize, &[T], &mut [T]),
) {
    let kv = pairs.len();
    // Each block's states are written (the checkpoint, then the replays)
    // before its sweeps read them.
    let mut prev = crate::fast::scratch::overwritten(bl * kv);
    let mut ds_pairs = crate::fast::scratch::zeros(kv);
    pairs.pack(ds, &mut ds_pairs);
    for (blk, start) in (0..l).step_by(bl).enumerate().rev() {
        let end = (start + bl).min(l);
        pairs.pack(&checkpoints[blk * kv..(blk + 1) * kv], &mut prev[..kv]);
        for t in start..end - 1 {
            let (done, next) = prev.split_at_mut((t + 1 - start) * kv);
            replay(t, &done[(t - start) * kv..], &mut next[..kv]);
        }
        back(start, end, &prev, &mut ds_pairs);
    }
    pairs.unpack(&ds_pairs, ds);
}

/// The layout of a `[K, V]` state in the reverse sweeps: rows in pairs
/// (`2p`, `2p + 1`; an odd last row alone), each pair's `2V` values
/// interleaved by chunks of four columns (`[row 2p, cols 4c..4c+4; row
/// 2p+1, the same cols]` for each full chunk `c`), then the two rows'
/// leftover `V mod 4` columns one row after the other. A row pass then reads
/// two rows' chunks as one contiguous run of eight values, which is one
/// AVX-512 register of `f64` and needs no shuffle, while each row keeps its
/// own 4-lane sums (the order the bits come from).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pairs {
    pub k: usize,
    pub v: usize,
}

/// Rows `row .. row + rows` of a [`Pairs`] state (`rows` is 2, or 1 for an
/// odd last row): `rows · V` values from `row · V`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Group {
    pub row: usize,
    pub rows: usize,
}

impl Group {
    /// The group's values in a [`Pairs`] state of `v` columns.
    #[inline(always)]
    pub(crate) fn range(&self, v: usize) -> std::ops::Range<usize> {
        self.row * v..(self.row + self.rows) * v
    }
}

impl Pairs {
    pub(crate) fn len(&self) -> usize {
        self.k * self.v
    }

    /// The row groups in row order.
    #[inline(always)]
    pub(crate) fn groups(&self) -> impl Iterator<Item = Group> {
        let k = self.k;
        (0..k.div_ceil(2)).map(move |p| Group {
            row: 2 * p,
            rows: (k - 2 * p).min(2),
        })
    }

    /// Row-major `src` into this layout.
    #[inline(always)]
    pub(crate) fn pack<T: Copy>(&self, src: &[T], dst: &mut [T]) {
        for g in self.groups() {
            let rows = &src[g.range(self.v)];
            let group = &mut dst[g.range(self.v)];
            self.each_chunk(g, rows.len(), |row_at, group_at, n| {
                group[group_at..group_at + n].copy_from_slice(&rows[row_at..row_at + n]);
            });
        }
    }

    /// This layout back to row-major.
    #[inline(always)]
    pub(crate) fn unpack<T: Copy>(&self, src: &[T], dst: &mut [T]) {
        for g in self.groups() {
            let group = &src[g.range(self.v)];
            let rows = &mut dst[g.range(self.v)];
            self.each_chunk(g, rows.len(), |row_at, group_at, n| {
                rows[row_at..row_at + n].copy_from_slice(&group[group_at..group_at + n]);
            });
        }
    }

    /// `f(row_at, group_at, n)` for each run of `n` values that sits at
    /// `row_at` in a group's rows (row-major, `len` values) and at
    /// `group_at` in the group's block of this layout.
    #[inline(always)]
    fn each_chunk(&self, g: Group, len: usize, mut f: impl FnMut(usize, usize, usize)) {
        let (v, full) = (self.v, self.v / 4 * 4);
        debug_assert_eq!(len, g.rows * v);
        for c in 0..full / 4 {
            for h in 0..g.rows {
                f(h * v + 4 * c, 4 * (c * g.rows + h), 4);
            }
        }
        for h in 0..g.rows {
            f(h * v + full, full * g.rows + h * (v - full), v - full);
        }
    }
}

/// A `[K, V]` view as a row-major vector.
pub(crate) fn state<T: Scalar>(a: ArrayView2<T>) -> Vec<T> {
    a.as_standard_layout()
        .into_owned()
        .into_raw_vec_and_offset()
        .0
}

/// Asks the CPU to start loading `a` into the cache: the rows a sweep will
/// read next, which sit `heads · D` values apart in `[B, T, heads, D]`
/// tensors (the backward walks them in reverse), where the hardware
/// prefetchers do not follow.
#[inline(always)]
pub(crate) fn prefetch<T>(a: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(a);
        let start = a.as_ptr().cast::<i8>();
        for at in (0..bytes).step_by(64) {
            // SAFETY: SSE is part of x86-64; a prefetch reads nothing and
            // never faults, and `at` stays inside `a`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(at)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = a;
}

/// `x`'s whole chunks of four, each written twice in a row (`out[8c + 4h +
/// l] = x[4c + l]`): a `[V]` vector as it meets a [`Pairs`] row pair, so that
/// a pair's chunk and the vector's chunk load alike.
#[inline(always)]
pub(crate) fn spread<T: Copy>(x: &[T], out: &mut [T]) {
    for (o, q) in out.chunks_exact_mut(8).zip(x.chunks_exact(4)) {
        o[..4].copy_from_slice(q);
        o[4..].copy_from_slice(q);
    }
}

/// The first `n` whole chunks of `N` of `a`. Row kernels index these (each
/// chunk one array, each slice cut to the loop's length) so that no index in
/// the loop is checked.
#[inline(always)]
pub(crate) fn chunks<T, const N: usize>(a: &[T], n: usize) -> &[[T; N]] {
    &a.as_chunks::<N>().0[..n]
}

/// [`chunks`], mutable.
#[inline(always)]
pub(crate) fn chunks_mut<T, const N: usize>(a: &mut [T], n: usize) -> &mut [[T; N]] {
    &mut a.as_chunks_mut::<N>().0[..n]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major values of a `[k, v]` state numbered by place.
    fn numbered(k: usize, v: usize) -> Vec<f64> {
        (0..k * v).map(|i| i as f64).collect()
    }

    /// Every (row, column) lands where the layout's doc says, and unpacking
    /// gives the state back, for odd and even `K` and every `V mod 4`.
    #[test]
    fn pairs_place_each_value_as_documented_and_unpack_back() {
        for k in [1, 2, 3, 4, 7] {
            for v in [1, 3, 4, 5, 8, 10] {
                let p = Pairs { k, v };
                let src = numbered(k, v);
                let mut packed = vec![f64::NAN; k * v];
                p.pack(&src, &mut packed);
                let full = v / 4 * 4;
                for i in 0..k {
                    let (row0, rows) = (i / 2 * 2, (k - i / 2 * 2).min(2));
                    let h = i - row0;
                    for j in 0..v {
                        let at = row0 * v
                            + if j < full {
                                (j / 4) * 4 * rows + 4 * h + j % 4
                            } else {
                                full * rows + h * (v - full) + j - full
                            };
                        assert_eq!(packed[at], src[i * v + j], "K={k} V={v} ({i}, {j})");
                    }
                }
                let mut back = vec![f64::NAN; k * v];
                p.unpack(&packed, &mut back);
                assert_eq!(back, src, "K={k} V={v}");
            }
        }
    }

    #[test]
    fn spread_writes_each_chunk_of_four_twice() {
        let x: Vec<f64> = (0..9).map(f64::from).collect();
        let mut out = vec![0.0; 16];
        spread(&x, &mut out);
        assert_eq!(
            out,
            [0., 1., 2., 3., 0., 1., 2., 3., 4., 5., 6., 7., 4., 5., 6., 7.]
        );
    }

    /// The toy recurrence `S_t = S_{t−1}·c_t + d_t` run through the
    /// schedules with checkpoints every `bl` tokens: returns, per token `t`,
    /// the state the forward left after it and the state the backward's
    /// block handed over for it (`S_{t−1}`, row-major), and the order in
    /// which the blocks arrived.
    #[allow(clippy::type_complexity)]
    fn toy_schedule(
        l: usize,
        bl: usize,
        pairs: Pairs,
    ) -> (Vec<Vec<f64>>, Vec<Option<Vec<f64>>>, Vec<usize>) {
        let c = |t: usize| 0.9 + 0.013 * (t % 7) as f64;
        let d = |t: usize| 0.1 / (1.0 + t as f64);
        let start: Vec<f64> = (0..pairs.len()).map(|i| 1.0 + i as f64 / 3.0).collect();
        let (mut s, mut after, mut checkpoints) = (start.clone(), Vec::new(), Vec::new());
        run_tokens_in_blocks(l, bl, &mut s, Some(&mut checkpoints), |s, fin, begin| {
            if let Some(t) = fin {
                s.iter_mut().for_each(|x| *x += d(t));
                after.push(s.to_vec());
            }
            if let Some(t) = begin {
                s.iter_mut().for_each(|x| *x *= c(t));
            }
        });
        let (mut entering, mut order) = (vec![None; l], Vec::new());
        let mut ds = vec![0.5; pairs.len()];
        reverse_blocks_of(
            l,
            bl,
            pairs,
            &checkpoints,
            &mut ds,
            |t, prev, next| {
                for (n, p) in next.iter_mut().zip(prev) {
                    *n = *p * c(t) + d(t);
                }
            },
            |first, end, states, _ds| {
                order.push(first);
                for t in first..end {
                    let mut row_major = vec![0.0; pairs.len()];
                    pairs.unpack(
                        &states[(t - first) * pairs.len()..][..pairs.len()],
                        &mut row_major,
                    );
                    entering[t] = Some(row_major);
                }
            },
        );
        assert_eq!(ds, vec![0.5; pairs.len()], "ds leaves as it entered");
        let mut before = vec![start];
        before.extend(after.iter().take(l - 1).cloned());
        (before, entering, order)
    }

    /// Wherever the checkpoints fall, every token's block sees the very
    /// state the forward entered it with (bit for bit), each token once,
    /// the blocks from the last to the first.
    #[test]
    fn replayed_states_do_not_depend_on_the_spacing() {
        let (l, pairs) = (37, Pairs { k: 3, v: 5 });
        for bl in [1, 3, 16, 36, 37, 50] {
            let (before, entering, order) = toy_schedule(l, bl, pairs);
            for t in 0..l {
                let got = entering[t]
                    .as_ref()
                    .unwrap_or_else(|| panic!("bl={bl}: token {t} never replayed"));
                let same = got
                    .iter()
                    .zip(&before[t])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "bl={bl}: state entering token {t}");
            }
            let mut firsts: Vec<usize> = (0..l).step_by(bl).collect();
            firsts.reverse();
            assert_eq!(order, firsts, "bl={bl}");
        }
    }

    /// The CPU's blocks: `√L` where a block fits 8 MiB, shorter where it
    /// does not, never below a quarter of `√L`.
    #[test]
    fn state_blocks_fit_the_cache_and_keep_checkpoints_o_sqrt_l() {
        let kib = |n: usize| n << 10;
        // K = V = 64 f64 states (32 KiB): 32 tokens = 1 MiB, the √L spacing.
        assert_eq!(state_block_len(1024, kib(32)), block_len(1024));
        // K = V = 256 (512 KiB): 16 states fill 8 MiB.
        assert_eq!(state_block_len(4096, kib(512)), 16);
        assert_eq!(state_block_len(1024, kib(512)), 16);
        // K = V = 128 (128 KiB) over 65,536 tokens: 64 = 8 MiB = √L / 4.
        assert_eq!(state_block_len(65536, kib(128)), 64);
        // 2 MiB states: 4 fill the budget, and √(1 << 20) / 4 = 256 bounds it.
        assert_eq!(state_block_len(100, 2 << 20), 4);
        assert_eq!(state_block_len(1 << 20, 2 << 20), 256);
        for (l, bytes) in [(1, 8), (37, kib(512)), (4096, kib(512)), (1 << 20, 2 << 20)] {
            let bl = state_block_len(l, bytes);
            assert_eq!(held_states(l, bytes), l.div_ceil(bl) + bl);
            assert!(l.div_ceil(bl) <= 4 * block_len(l), "L={l}: checkpoints");
        }
    }
}
