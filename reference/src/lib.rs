//! deltaref: the float64 oracle for delta-rule linear attention (KDA, DPLR,
//! token-shift) in FLA's conventions. See `SPEC.md` §2–§6 for the maths.
//!
//! Layout: one module per operator, each with a `mod.rs` holding the shared
//! tensors/options/validation/driver and one file per form (`naive`, `chunk`).
//! Shared pieces: [`gates`] (l2norm, gates, beta sigmoid), [`varlen`]
//! (sequences and the parallel pair runner), [`tensor`] (checks, gather/scatter),
//! [`sweep`] (what the naive engines share), [`simd`] (runtime AVX2 dispatch).

pub mod conv;
pub mod cp;
pub mod decay_blocks;
pub mod dplr;
pub mod dtype;
pub mod error;
pub mod exp;
pub mod fused;
pub mod gates;
pub mod gdn;
pub mod gdn2;
pub mod gemm;
pub mod inputs;
pub mod kda;
pub mod op;
pub mod ops;
pub mod precision;
pub mod registry;
pub mod rng;
pub mod scalar;
pub mod scratch;
pub mod simd;
pub mod stagger;
pub mod sweep;
pub mod tensor;
pub mod timing;
pub mod token_shift;
pub mod tri;
pub mod truth;
pub mod varlen;

pub use dtype::Dtype;
pub use error::{Error, Result};
pub use gates::Gate;
pub use scalar::Scalar;
