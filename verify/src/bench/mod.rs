//! What `deltaref bench` (and the benchmarks in `verify/benches`) measure
//! with: interleaved timing rounds ([`timing`]) and the engines' operation
//! counts and the machine's peak, for GFLOP/s ([`op_count`]).

pub mod op_count;
pub mod timing;
