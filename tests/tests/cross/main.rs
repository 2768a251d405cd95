//! One test binary for this crate (each module was its own binary: linking
//! them one by one cost CI minutes).

mod case_files;
mod dplr_chunk;
mod dplr_safe_gate;
mod f32_vs_f64;
mod fault_fixtures;
mod fd_gradients;
mod fixtures;
mod forward_only;
mod gdn2;
mod gpu;
mod kda_chunk;
mod precision;
mod regimes;
