//! NVRTC compile time and PTX size of every kernel source (K = V = 128,
//! chunk 64, f32 inputs): each module is compiled once per process on first
//! use, so this is the start-up cost of a GPU run. Needs NVRTC, not a GPU.
//!
//! `cargo run --release -p deltaref-gpu --example compile_times [-- ARCH]`

use deltaref_gpu::device::ptx;
use deltaref_gpu::kernels::{Defines, ALL};

fn main() {
    let arch = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "compute_90".into());
    let d = Defines {
        in_bf16: false,
        kd: 128,
        chunk: 64,
    };
    for src in ALL {
        let t = std::time::Instant::now();
        match ptx(&src, d, &arch) {
            Ok(p) => println!(
                "{:12} {:6.2} s  {:4} KB of PTX",
                src.name,
                t.elapsed().as_secs_f64(),
                p.len() / 1024
            ),
            Err(e) => {
                eprintln!("{}: {e}", src.name);
                std::process::exit(1);
            }
        }
    }
}
