//! The engine pieces: the types the operator contract ([`crate::op::Operator`])
//! names as associated types (the validated inputs and their sizes, one piece
//! of one head, its gradients). They are `pub`, as an associated type of a public trait
//! must be, but live in this private module: outside the crate they are
//! reached only through the contract (`<Op as Operator<T>>::Head<'_>`), never
//! by name. Their methods are in the operator's `mod.rs`.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenShiftDims {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub n: usize,
}

/// Validated inputs as one-head tensors: `x [B, T, 1, D]`, `cache [N, 1, 1, D]`
/// (the cache is the state, `K = 1`, `V = D`).
#[derive(Clone, Debug)]
pub struct Prepared<'a, T> {
    pub dims: TokenShiftDims,
    pub segments: Vec<Segment>,
    pub x: ArrayView4<'a, T>,
    pub cache: Option<ArrayView4<'a, T>>,
}

/// The tokens of one sequence (or CP piece): `x [L, D]`.
#[derive(Clone, Debug)]
pub struct TokenShiftHead<T> {
    pub x: Array2<T>,
}

/// `dx [L, D]` and the gradient of the token before the piece, `dcache [1, D]`.
#[derive(Clone, Debug)]
pub struct TokenShiftHeadGrads<T> {
    pub dx: Array2<T>,
    pub dcache: Array2<T>,
}
