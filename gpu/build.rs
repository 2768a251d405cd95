//! The kernel compile checks need NVRTC (no GPU): they run when
//! `DELTAREF_NVRTC` names the library or `DELTAREF_GPU_TESTS=1` is set at
//! build time (cfg `deltaref_nvrtc`); otherwise they are reported `ignored`.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(deltaref_nvrtc)");
    println!("cargo::rerun-if-env-changed=DELTAREF_NVRTC");
    println!("cargo::rerun-if-env-changed=DELTAREF_GPU_TESTS");
    let gpu_tests = std::env::var("DELTAREF_GPU_TESTS").is_ok_and(|v| v == "1");
    if std::env::var_os("DELTAREF_NVRTC").is_some() || gpu_tests {
        println!("cargo::rustc-cfg=deltaref_nvrtc");
    }
}
