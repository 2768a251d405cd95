pub mod diagnose;
pub mod fd;
pub mod metrics;
pub mod outputs;
pub mod selfcheck;
