//! Working buffers that the naive engines reuse from one (sequence, head)
//! pair to the next on the same thread.
//!
//! A naive forward+backward of a pair needs a few MiB of buffers (states at
//! the checkpoints, a block of replayed states, residuals, decays) that die
//! with the pair. Fresh ones come from the allocator, which hands freed
//! memory back to the OS after a delay, so a run of pairs keeps faulting in
//! (and the kernel zeroing) new pages; reusing them keeps them warm. Only
//! buffers up to [`MAX_KEPT`] bytes are kept, so a long case's large
//! buffers go back to the allocator as before and the peak memory of long
//! runs is unchanged.

use std::any::Any;
use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use ndarray::ArrayView2;

use crate::scalar::Scalar;

/// The largest buffer kept for reuse, in bytes.
pub(crate) const MAX_KEPT: usize = 4 << 20;
/// Buffers kept per thread at most.
pub(crate) const KEPT: usize = 8;

thread_local! {
    static POOL: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

/// A `Vec<T>` taken from this thread's pool, given back when dropped.
pub(crate) struct Scratch<T: 'static>(Vec<T>);

/// A buffer of `len` zeros, reusing a kept one when one is large enough.
pub(crate) fn zeros<T: Scalar>(len: usize) -> Scratch<T> {
    match kept::<T>(len) {
        Some(mut v) => {
            v.clear();
            v.resize(len, T::zero());
            Scratch(v)
        }
        None => Scratch(fresh(len)),
    }
}

/// A buffer of `len` values that the caller writes in full before it reads
/// any: a kept buffer keeps what it last held (initialised values, never
/// read here; zeros past its old length), which saves clearing megabytes
/// that are about to be overwritten.
pub(crate) fn overwritten<T: Scalar>(len: usize) -> Scratch<T> {
    match kept::<T>(len) {
        Some(mut v) => {
            v.truncate(len);
            v.resize(len, T::zero());
            Scratch(v)
        }
        None => Scratch(fresh(len)),
    }
}

/// A new buffer of `len` zeros from the allocator's zeroed memory
/// (`calloc`): freshly mapped pages are already zero, so a long head's
/// buffers (tens of MiB, never kept) are not cleared in a pass of their own.
fn fresh<T: Scalar>(len: usize) -> Vec<T> {
    vec![T::zero(); len]
}

/// An empty buffer with room for `cap` values.
pub(crate) fn with_capacity<T: Scalar>(cap: usize) -> Scratch<T> {
    let mut v = kept::<T>(cap).unwrap_or_else(|| Vec::with_capacity(cap));
    v.clear();
    Scratch(v)
}

/// A kept buffer with room for `cap` values, as it was given back.
fn kept<T: Scalar>(cap: usize) -> Option<Vec<T>> {
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        let at = p.iter().position(|b| {
            b.downcast_ref::<Vec<T>>()
                .is_some_and(|v| v.capacity() >= cap)
        })?;
        Some(
            *p.swap_remove(at)
                .downcast::<Vec<T>>()
                .expect("checked type"),
        )
    })
}

impl<T: 'static> Drop for Scratch<T> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() * std::mem::size_of::<T>() > MAX_KEPT {
            return;
        }
        // During thread teardown the pool may be gone: then the buffer is
        // simply freed.
        let _ = POOL.try_with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < KEPT {
                p.push(Box::new(v));
            }
        });
    }
}

impl<T> Deref for Scratch<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T> DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

/// A row-major `[rows, cols]` matrix in a [`Scratch`] buffer.
pub(crate) struct Rows<T: 'static> {
    data: Scratch<T>,
    cols: usize,
}

impl<T: Scalar> Rows<T> {
    /// A matrix whose every row the caller writes before reading it
    /// ([`overwritten`]).
    pub(crate) fn overwritten(rows: usize, cols: usize) -> Self {
        Rows {
            data: overwritten(rows * cols),
            cols,
        }
    }

    /// `e^a` of each element of `a [rows, cols]` (rows contiguous, see
    /// [`crate::fast::views::row`]), with libm's bits ([`Scalar::exp_into`]).
    #[inline(always)]
    pub(crate) fn exp(a: ArrayView2<'_, T>) -> Self {
        let (rows, cols) = a.dim();
        let mut out = Self::overwritten(rows, cols);
        for t in 0..rows {
            T::exp_into(crate::fast::views::row(&a, t), out.row_mut(t));
        }
        out
    }

    #[inline(always)]
    pub(crate) fn row(&self, t: usize) -> &[T] {
        &self.data[t * self.cols..(t + 1) * self.cols]
    }

    #[inline(always)]
    pub(crate) fn row_mut(&mut self, t: usize) -> &mut [T] {
        &mut self.data[t * self.cols..(t + 1) * self.cols]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer given back is handed out again: cleared by `zeros` and
    /// `with_capacity`, as it was by `overwritten`.
    #[test]
    fn buffers_are_reused_and_cleared() {
        let ptr = {
            let mut a = zeros::<f64>(1000);
            a.iter_mut().for_each(|x| *x = 7.0);
            a.as_ptr()
        };
        let b = zeros::<f64>(900);
        assert_eq!(b.as_ptr(), ptr, "the kept buffer");
        assert!(b.iter().all(|&x| x == 0.0));
        drop(b);
        let c = with_capacity::<f64>(10);
        assert!(c.is_empty());
        drop(c);
        {
            let mut d = overwritten::<f64>(500);
            d.fill(3.0);
        }
        let e = overwritten::<f64>(600);
        assert!(e[..500].iter().all(|&x| x == 3.0) && e[500..].iter().all(|&x| x == 0.0));
    }

    /// Buffers over [`MAX_KEPT`] go back to the allocator.
    #[test]
    fn large_buffers_are_not_kept() {
        let n = MAX_KEPT / std::mem::size_of::<f32>() + 1;
        drop(zeros::<f32>(n));
        let kept = POOL.with(|p| {
            p.borrow()
                .iter()
                .filter_map(|b| b.downcast_ref::<Vec<f32>>())
                .any(|v| v.capacity() >= n)
        });
        assert!(!kept);
    }

    #[test]
    fn rows_hold_exponentials_with_libms_bits() {
        let a = ndarray::Array2::from_shape_fn((3, 5), |(i, j)| -0.3 * (i * 5 + j) as f64);
        let e = Rows::exp(a.view());
        for i in 0..3 {
            for (j, &x) in e.row(i).iter().enumerate() {
                assert_eq!(x.to_bits(), a[[i, j]].exp().to_bits());
            }
        }
    }
}
