//! The engine pieces: the types the operator contract ([`crate::op::Operator`])
//! names as associated types (the validated inputs and their sizes, one piece
//! of one head, its gradients). They are `pub`, as an associated type of a public trait
//! must be, but live in this private module: outside the crate they are
//! reached only through the contract (`<Op as Operator<T>>::Head<'_>`), never
//! by name. Their methods are in the operator's `mod.rs`.

use super::*;

/// One head of one sequence (or CP piece). [`Dplr::head`] borrows each
/// tensor: the head's rows of a `[B, T, H, D]` tensor, strided by the other
/// heads (rows contiguous).
#[derive(Clone, Debug)]
pub struct DplrHead<'h, T> {
    /// `[L, K]`; the query is `q · scale`.
    pub q: CowArray<'h, T, Ix2>,
    pub k: CowArray<'h, T, Ix2>,
    pub a: CowArray<'h, T, Ix2>,
    pub b: CowArray<'h, T, Ix2>,
    pub gk: CowArray<'h, T, Ix2>,
    /// `[L, V]`
    pub v: CowArray<'h, T, Ix2>,
    /// The query's factor, applied as `q` is read: each query element is
    /// the product `q · scale`.
    pub scale: T,
    /// The gates of every head of the same rows, where the head was taken
    /// from a batch ([`Dplr::head`]): only FLA #1085's faulty midpoint read
    /// ([`crate::precision::Policy::midpoint_stride_fault`]) looks at them.
    pub heads_gk: Option<HeadsGk<'h, T>>,
}

/// `gk` of every head over a head's rows, `[L, H, K]`, and which head the
/// head is: what a read with the wrong head stride reaches.
#[derive(Clone, Debug)]
pub struct HeadsGk<'h, T> {
    pub gk: CowArray<'h, T, Ix3>,
    pub head: usize,
}

#[derive(Clone, Debug)]
pub struct DplrHeadGrads<T> {
    pub dq: Array2<T>,
    pub dk: Array2<T>,
    pub dv: Array2<T>,
    pub da: Array2<T>,
    pub db: Array2<T>,
    pub dgk: Array2<T>,
    /// `[K, V]`
    pub dh0: Array2<T>,
}

/// [`DplrHeadGrads`] as views where an engine writes them: a piece's own
/// arrays, or its rows of a run's full tensors ([`PreparedGrads`]).
pub struct DplrHeadGradsMut<'s, T> {
    /// `[L, K]`
    pub dq: ArrayViewMut2<'s, T>,
    /// `[L, K]`
    pub dk: ArrayViewMut2<'s, T>,
    /// `[L, V]`
    pub dv: ArrayViewMut2<'s, T>,
    /// `[L, K]`
    pub da: ArrayViewMut2<'s, T>,
    /// `[L, K]`
    pub db: ArrayViewMut2<'s, T>,
    /// `[L, K]`
    pub dgk: ArrayViewMut2<'s, T>,
    /// `[K, V]`
    pub dh0: ArrayViewMut2<'s, T>,
}

/// Validated inputs, ready to cut into heads: views of the input tensors
/// (`scale` is applied to `q` head by head).
#[derive(Clone, Debug)]
pub struct Prepared<'a, T> {
    pub dims: DplrDims,
    pub scale: f64,
    pub segments: Vec<Segment>,
    /// `[B, T, H, K]`, not yet scaled: `Dplr::head` applies `scale`,
    /// head by head, in parallel.
    pub q: ArrayView4<'a, T>,
    pub k: ArrayView4<'a, T>,
    pub v: ArrayView4<'a, T>,
    pub a: ArrayView4<'a, T>,
    pub b: ArrayView4<'a, T>,
    pub gk: ArrayView4<'a, T>,
    pub h0: Option<ArrayView4<'a, T>>,
}

/// Gradients gathered per head before the `scale` chain on `dq`.
#[derive(Clone, Debug)]
pub struct PreparedGrads<T> {
    pub dq: Array4<T>,
    pub dk: Array4<T>,
    pub dv: Array4<T>,
    pub da: Array4<T>,
    pub db: Array4<T>,
    pub dgk: Array4<T>,
    pub dh0: Array4<T>,
}
