//! The speed machinery, behind one wall.
//!
//! The operators' modules say *what* is computed: FLA's tensors and
//! stages, the recurrences and their hand-derived gradients, the precision
//! policies' roundings. The modules here say *how fast*: matrix products in
//! a fixed summation order ([`gemm`], [`tri`]); runtime dispatch to wider
//! vectors ([`simd`]); libm's `exp` on vectors ([`exp`]); fused
//! element-wise passes and fixed-order dot products ([`fused`], [`sums`]);
//! buffers reused and arrays staggered across cache sets ([`scratch`],
//! [`stagger`]); the naive engines' shared driver, their state sweeps and
//! checkpointed replay ([`naive`], [`sweep`]); the chunked engines' decay
//! blocks ([`decay_blocks`]); and how a run splits over threads and memory
//! ([`par`], [`columns`], [`spans`], [`views`]).
//!
//! Why a wall: every piece here promises to change no bit. Each result is
//! the same operations on the same operands in the same order as the plain
//! code it stands for, at every vector width, thread count, blocking and
//! memory layout, and that promise is easier to keep, and to check (each
//! file's tests hold its piece to it), in one place than spread through the
//! engines. It is also the only place with `unsafe`, every block of it with
//! a `// SAFETY:` comment saying why it is sound. Nothing here is public:
//! users see the operators, the operator contract and the registry, and
//! the machinery can change under them without their noticing. The one
//! thing outside needs to know about it, what the engines hold for an
//! up-front memory estimate, is published in [`crate::registry::MemoryModel`];
//! `deltaref bench` measures its peak with [`crate::throughput`].

// Every `unsafe` block says, in a `// SAFETY:` comment, why it holds; every
// `unsafe fn`, in a `# Safety` section, what its caller must hold.
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

pub(crate) mod columns;
pub(crate) mod decay_blocks;
pub(crate) mod exp;
pub(crate) mod fused;
pub(crate) mod gemm;
pub(crate) mod naive;
pub(crate) mod par;
pub(crate) mod scratch;
pub(crate) mod simd;
pub(crate) mod spans;
pub(crate) mod stagger;
pub(crate) mod sums;
pub(crate) mod sweep;
pub(crate) mod tri;
pub(crate) mod views;
