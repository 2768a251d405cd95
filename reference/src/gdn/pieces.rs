//! The engine pieces: the types the operator contract ([`crate::op::Operator`])
//! names as associated types (the validated inputs and their sizes, one piece
//! of one head, its gradients). They are `pub`, as an associated type of a public trait
//! must be, but live in this private module: outside the crate they are
//! reached only through the contract (`<Op as Operator<T>>::Head<'_>`), never
//! by name. Their methods are in the operator's `mod.rs`.

use super::*;

/// Validated GDN inputs after FLA's fused pre-processing (l2norm, gate,
/// beta sigmoid), states in `[N, HV, K, V]`.
#[derive(Clone, Debug)]
pub struct Prepared<'a, T> {
    pub dims: KdaDims,
    pub scale: f64,
    pub segments: Vec<Segment>,
    /// `[B, T, H, K]`, l2-normalised if asked.
    pub q: CowArray<'a, T, Ix4>,
    /// `[B, T, H, K]`, l2-normalised if asked.
    pub k: CowArray<'a, T, Ix4>,
    /// `[B, T, HV, V]`
    pub v: ArrayView4<'a, T>,
    /// `[B, T, HV]` log-space decay (a view of `g` unless the in-kernel gate
    /// evaluated it).
    pub g: CowArray<'a, T, Ix3>,
    /// `[B, T, HV]`
    pub beta: Array3<T>,
    /// `[N, HV, K, V]` (a view of the input unless `state_v_first` swapped it)
    pub h0: Option<CowArray<'a, T, Ix4>>,
    /// States are `[N, HV, V, K]` in the public tensors.
    pub state_v_first: bool,
}
