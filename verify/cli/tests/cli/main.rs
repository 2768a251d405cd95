//! The `deltaref` program, run as a user runs it (one test binary): every
//! subcommand's output, exit codes and refusals, hostile inputs, and a
//! short mutation-fuzzing run of the case reader and the command line.

mod band;
mod basics;
mod cases;
mod common;
mod compose;
mod fuzz;
mod gpu;
mod head_blocks;
mod hostile;
mod intermediates;
mod mutation;
mod mutation_smoke;
mod newops;
mod precision;
mod workflow;
