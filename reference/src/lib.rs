//! deltaref: the float64 oracle for delta-rule linear attention (KDA, DPLR,
//! GDN, GDN-2, token-shift, causal conv1d) in FLA's conventions. See
//! `SPEC.md` §2–§6 for the maths.
//!
//! Layout: one module per operator, each with a `mod.rs` holding the shared
//! tensors/options/validation/driver, one file per form (`naive`, `chunk`)
//! and its registry entry (`entry`). Around them: the operator contract
//! ([`op`]) and the registry ([`registry`]); context parallel ([`cp`]);
//! precision emulation ([`precision`], [`dtype`]); the case generators
//! ([`inputs`], [`rng`]); the gates ([`gates`]); each operator's definition
//! as a plain recurrence ([`truth`]); checks and sequences ([`tensor`],
//! [`varlen`]); what the engines hold ([`registry::MemoryModel`]) and the
//! product kernel `deltaref bench` measures its peak with ([`throughput`]).
//! The speed machinery (matrix products, vector dispatch, the naive sweeps,
//! thread splits) is behind one wall, in the private module `fast`.

// `unsafe` lives behind that wall only, and each block there says why it holds.
#![deny(unsafe_code)]

mod chunked;
pub mod conv;
pub mod cp;
pub mod dplr;
pub mod dtype;
pub mod error;
#[allow(unsafe_code)]
pub(crate) mod fast;
pub mod gates;
pub mod gdn;
pub mod gdn2;
pub mod inputs;
pub mod kda;
pub mod op;
pub mod precision;
pub mod registry;
// Machinery (the generators' random streams): public for the workspace's crates, not the
// oracle's API, so hidden from its documentation.
#[doc(hidden)]
pub mod rng;
pub mod scalar;
// Machinery (shape and finiteness checks shared by the operators): public for the workspace's crates, not the
// oracle's API, so hidden from its documentation.
#[doc(hidden)]
pub mod tensor;
pub mod throughput;
pub mod token_shift;
pub mod truth;
pub mod varlen;

pub use dtype::Dtype;
pub use error::{Error, Result};
pub use gates::Gate;
pub use scalar::Scalar;

// The operator modules' `Operator` gradient items (`crate::grads_in_place!`).
pub(crate) use op::{grads_collected, grads_in_place};
