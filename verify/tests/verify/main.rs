//! One test binary for this crate (each module was its own binary: linking
//! them one by one cost CI minutes).

mod memory_estimate;
mod op_count;

/// One measured run at a time in this process: the heap counters of
/// `memory_estimate` and the op counters of `op_count` are process-wide, and
/// a run of one would count into the other's measurement.
pub(crate) static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
