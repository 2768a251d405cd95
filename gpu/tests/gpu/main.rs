//! One test binary for this crate (each module was its own binary: linking
//! them one by one cost CI minutes).

mod cache;
mod compile;
