//! The engine pieces: the types the operator contract ([`crate::op::Operator`])
//! names as associated types (the validated inputs and their sizes, one piece
//! of one head, its gradients). They are `pub`, as an associated type of a public trait
//! must be, but live in this private module: outside the crate they are
//! reached only through the contract (`<Op as Operator<T>>::Head<'_>`), never
//! by name. Their methods are in the operator's `mod.rs`.

use super::*;

/// One head of one sequence (or CP piece), after pre-processing: the only
/// thing an engine sees. [`Kda::head`] borrows each tensor from the
/// [`Prepared`] ones: the head's rows of a `[B, T, H, D]` tensor, strided
/// by the other heads (rows contiguous). Engines read rows as they are
/// or make the copies they need.
#[derive(Clone, Debug)]
pub struct KdaHead<'h, T> {
    /// `[L, K]`, l2-normalised if asked; the query is `q · scale`.
    pub q: CowArray<'h, T, Ix2>,
    /// `[L, K]`, l2-normalised if asked.
    pub k: CowArray<'h, T, Ix2>,
    /// `[L, V]`
    pub v: CowArray<'h, T, Ix2>,
    /// `[L, K]` log-space decay per token.
    pub g: CowArray<'h, T, Ix2>,
    /// `[L]`
    pub beta: CowArray<'h, T, Ix1>,
    /// The query's factor (FLA's `scale`), applied as `q` is read: each
    /// query element is the product `q · scale`.
    pub scale: T,
}

/// Gradients of one head with respect to [`KdaHead`]'s tensors and `h0`.
#[derive(Clone, Debug)]
pub struct KdaHeadGrads<T> {
    pub dq: Array2<T>,
    pub dk: Array2<T>,
    pub dv: Array2<T>,
    pub dg: Array2<T>,
    pub dbeta: Array1<T>,
    /// `[K, V]`
    pub dh0: Array2<T>,
}

/// [`KdaHeadGrads`] as views where an engine writes them: a piece's own
/// arrays, or its rows of a run's full tensors ([`PreparedGrads`]).
pub struct KdaHeadGradsMut<'s, T> {
    /// `[L, K]`
    pub dq: ArrayViewMut2<'s, T>,
    /// `[L, K]`
    pub dk: ArrayViewMut2<'s, T>,
    /// `[L, V]`
    pub dv: ArrayViewMut2<'s, T>,
    /// `[L, K]`
    pub dg: ArrayViewMut2<'s, T>,
    /// `[L]`
    pub dbeta: ArrayViewMut1<'s, T>,
    /// `[K, V]`
    pub dh0: ArrayViewMut2<'s, T>,
}

/// Validated inputs after FLA's fused pre-processing, ready to cut into heads.
/// Tensors the pre-processing leaves alone are views of the inputs.
#[derive(Clone, Debug)]
pub struct Prepared<'a, T> {
    pub dims: KdaDims,
    pub scale: f64,
    /// Sequences of the batch (whole sequences; CP cuts them further).
    pub segments: Vec<Segment>,
    /// `[B, T, H, K]`, l2-normalised if asked (`Kda::head` applies
    /// `scale`, head by head, in parallel).
    pub q: CowArray<'a, T, Ix4>,
    /// `[B, T, H, K]`, l2-normalised if asked.
    pub k: CowArray<'a, T, Ix4>,
    /// `[B, T, HV, V]`
    pub v: ArrayView4<'a, T>,
    /// `[B, T, HV, K]` log-space decay.
    pub g: CowArray<'a, T, Ix4>,
    /// `[B, T, HV]`
    pub beta: Array3<T>,
    /// `[N, HV, K, V]`
    pub h0: Option<ArrayView4<'a, T>>,
    /// The options it was prepared with (which in-kernel activations ran).
    pub opt: KdaOptions,
}

/// Gradients with respect to [`Prepared`]'s tensors, per value head.
#[derive(Clone, Debug)]
pub struct PreparedGrads<T> {
    /// `[B, T, HV, K]` (summed over each GVA group by `chain`)
    pub dq: Array4<T>,
    /// `[B, T, HV, K]`
    pub dk: Array4<T>,
    /// `[B, T, HV, V]`
    pub dv: Array4<T>,
    /// `[B, T, HV, K]`
    pub dg: Array4<T>,
    /// `[B, T, HV]`
    pub dbeta: Array3<T>,
    /// `[N, HV, K, V]`
    pub dh0: Array4<T>,
}
