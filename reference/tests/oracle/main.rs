//! One test binary for this crate (each module was its own binary: linking
//! them one by one cost CI minutes).

mod bad_inputs;
mod causal_conv1d;
mod common;
mod cp_props;
mod engines;
mod forward_backward;
mod gdn;
mod gdn2;
mod hand_cases;
mod naive_layouts;
mod precision_stages;
mod replay_blocks;
mod threads;
