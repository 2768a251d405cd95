//! Every kernel source compiles with NVRTC for Hopper, for each storage dtype
//! and the chunk sizes the host uses. Needs NVRTC but no GPU: ignored unless
//! `DELTAREF_NVRTC` (or `DELTAREF_GPU_TESTS=1`) is set at build time, as CI
//! does; then a missing NVRTC is a failure (see `build.rs`).

use deltaref_gpu::device::{ensure_nvrtc, ptx};
use deltaref_gpu::kernels::{Defines, ALL};
use deltaref_gpu::GpuError;

fn nvrtc() {
    if let Err(e) = ensure_nvrtc() {
        panic!("the kernel compile checks are enabled but NVRTC cannot be used: {e}");
    }
}

#[cfg_attr(
    not(deltaref_nvrtc),
    ignore = "needs NVRTC: set DELTAREF_NVRTC=/path/to/libnvrtc.so (see README)"
)]
#[test]
fn every_kernel_source_compiles() {
    nvrtc();
    for src in ALL {
        for in_bf16 in [false, true] {
            for (kd, chunk) in [(16, 16), (128, 64)] {
                let d = Defines { in_bf16, kd, chunk };
                let text = ptx(&src, d, "compute_90")
                    .unwrap_or_else(|e| panic!("{} with {d:?}: {e}", src.name));
                assert!(
                    text.contains(".entry"),
                    "{}: no kernel entry in the PTX",
                    src.name
                );
            }
        }
    }
}

#[cfg_attr(
    not(deltaref_nvrtc),
    ignore = "needs NVRTC: set DELTAREF_NVRTC=/path/to/libnvrtc.so (see README)"
)]
#[test]
fn a_compile_error_reports_the_source_and_the_log() {
    nvrtc();
    let broken = deltaref_gpu::kernels::Source::from_text(
        "broken",
        "extern \"C\" __global__ void f() { undeclared_thing(); }",
    );
    let d = Defines {
        in_bf16: false,
        kd: 16,
        chunk: 16,
    };
    match ptx(&broken, d, "compute_90") {
        Err(GpuError::Compile {
            source_name, log, ..
        }) => {
            assert_eq!(source_name, "broken");
            assert!(log.contains("undeclared_thing"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}
