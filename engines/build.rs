//! With the `cuda` feature: compile `src/cuda/kernels.cu` to PTX for sm_90 with `nvcc`
//! from PATH (see scripts/build-cuda.sh). With `flash-attn` too: compile the vendored
//! FlashAttention-2 kernels (`vendor/flash-attn`, CUTLASS's headers from
//! `KVBENCH_CUTLASS_DIR`) into a static library, cached by the hash of its sources and
//! flags (minutes of nvcc); with `flash-attn3`, FlashAttention-3's (`vendor/flash-attn3`,
//! for sm_90a, CUTLASS from `KVBENCH_CUTLASS3_DIR`) the same way. Without the features
//! this does nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The vendored FlashAttention-2 files compiled (the headers are hashed too).
const FA2_SOURCES: [&str; 3] = [
    "flash_api.cu",
    "flash_fwd_hdim128_bf16_sm80.cu",
    "flash_fwd_hdim128_bf16_causal_sm80.cu",
];
/// The same for FlashAttention-3 (Hopper only).
const FA3_SOURCES: [&str; 2] = ["flash_api.cu", "flash_fwd_hdim128_bf16_causal_sm90.cu"];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/cuda/kernels.cu");
    println!("cargo::rerun-if-env-changed=KVBENCH_CUDA_ARCH");
    println!("cargo::rerun-if-env-changed=KVBENCH_FLASH_CACHE");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = std::env::var("KVBENCH_CUDA_ARCH").unwrap_or_else(|_| "sm_90".into());
    let status = Command::new("nvcc")
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch={arch}"))
        .arg("src/cuda/kernels.cu")
        .arg("-o")
        .arg(out.join("kernels.ptx"))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("nvcc failed ({s}) compiling src/cuda/kernels.cu"),
        Err(e) => panic!(
            "the `cuda` feature needs nvcc on PATH ({e}); scripts/build-cuda.sh installs one"
        ),
    }
    if std::env::var_os("CARGO_FEATURE_FLASH_ATTN").is_some() {
        flash_attn(&out, &arch, &FA2);
    }
    if std::env::var_os("CARGO_FEATURE_FLASH_ATTN3").is_some() {
        // FlashAttention-3's kernels use sm_90a's wgmma and TMA: arch-specific code.
        flash_attn(&out, &format!("{}a", arch.trim_end_matches('a')), &FA3);
    }
}

/// FNV-1a over bytes, for the cache key of the compiled library.
fn fnv(hash: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *hash ^= u64::from(b);
        *hash = hash.wrapping_mul(0x100_0000_01b3);
    }
}

/// One vendored FlashAttention library: its directory, kernel files, the variable
/// naming its CUTLASS headers, its feature, library name and extra nvcc flags.
struct Vendored {
    dir: &'static str,
    sources: &'static [&'static str],
    cutlass_var: &'static str,
    feature: &'static str,
    lib: &'static str,
    extra: &'static [&'static str],
}

const FA2: Vendored = Vendored {
    dir: "vendor/flash-attn",
    sources: &FA2_SOURCES,
    cutlass_var: "KVBENCH_CUTLASS_DIR",
    feature: "flash-attn",
    lib: "kvbench_flash_attn",
    extra: &[],
};

const FA3: Vendored = Vendored {
    dir: "vendor/flash-attn3",
    sources: &FA3_SOURCES,
    cutlass_var: "KVBENCH_CUTLASS3_DIR",
    feature: "flash-attn3",
    lib: "kvbench_flash_attn3",
    extra: &[
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT162_OPERATORS__",
        "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
        // CUDA 13's cudaTypedefs.h names these by version only; the CUTLASS this
        // FlashAttention-3 pins predates that.
        "-DPFN_cuTensorMapEncodeTiled=PFN_cuTensorMapEncodeTiled_v12000",
        "-DPFN_cuTensorMapEncodeIm2col=PFN_cuTensorMapEncodeIm2col_v12000",
    ],
};

fn flash_attn(out: &Path, arch: &str, v: &Vendored) {
    println!("cargo::rerun-if-changed={}", v.dir);
    println!("cargo::rerun-if-env-changed={}", v.cutlass_var);
    let cutlass = std::env::var(v.cutlass_var).unwrap_or_else(|_| {
        panic!(
            "the `{}` feature needs CUTLASS's headers: {} names a directory holding \
             include/cute and include/cutlass (scripts/build-cuda.sh fetches them)",
            v.feature, v.cutlass_var
        )
    });
    let include = Path::new(&cutlass).join("include");
    assert!(
        include.join("cute").is_dir(),
        "{}={cutlass} has no include/cute",
        v.cutlass_var
    );
    let sm = arch.trim_start_matches("sm_");
    let flags: Vec<String> = [
        "-std=c++17",
        "-O3",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "--use_fast_math",
        "-Xcompiler",
        "-fPIC",
    ]
    .iter()
    .chain(v.extra)
    .map(|s| s.to_string())
    .chain([
        format!("-gencode=arch=compute_{sm},code=sm_{sm}"),
        format!("-I{}", include.display()),
        format!("-I{}", v.dir),
    ])
    .collect();
    // The cache key: every vendored file and the flags (not CUTLASS's path: its commit
    // is pinned by the build script that fetches it).
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut files: Vec<PathBuf> = std::fs::read_dir(v.dir)
        .unwrap_or_else(|e| panic!("{}: {e}", v.dir))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    files.sort();
    for f in &files {
        fnv(&mut hash, f.to_string_lossy().as_bytes());
        fnv(&mut hash, &std::fs::read(f).expect("a vendored file"));
    }
    for f in &flags {
        fnv(&mut hash, f.as_bytes());
    }
    // A build of other features or another profile runs this script in another OUT_DIR:
    // `KVBENCH_FLASH_CACHE` (scripts/build-cuda.sh sets it) keeps the libraries where
    // every such build finds them, each under the hash of what made it.
    let cache =
        std::env::var_os("KVBENCH_FLASH_CACHE").map_or_else(|| out.to_path_buf(), PathBuf::from);
    let dir = cache.join(format!("{}-{hash:016x}", v.feature));
    let lib = dir.join(format!("lib{}.a", v.lib));
    if !lib.exists() {
        std::fs::create_dir_all(&dir).expect("create the flash-attn build directory");
        // The kernel files take minutes each: compiled side by side.
        let objects: Vec<PathBuf> = std::thread::scope(|s| {
            let jobs: Vec<_> = v
                .sources
                .iter()
                .map(|src| {
                    let (flags, dir) = (&flags, &dir);
                    s.spawn(move || {
                        let obj = dir.join(src.replace(".cu", ".o"));
                        let status = Command::new("nvcc")
                            .args(flags)
                            .arg("-c")
                            .arg(Path::new(v.dir).join(src))
                            .arg("-o")
                            .arg(&obj)
                            .status()
                            .unwrap_or_else(|e| panic!("nvcc for {src}: {e}"));
                        assert!(status.success(), "nvcc failed ({status}) compiling {src}");
                        obj
                    })
                })
                .collect();
            jobs.into_iter()
                .map(|j| j.join().expect("an nvcc job"))
                .collect()
        });
        let tmp = dir.join(format!("lib{}.a.tmp", v.lib));
        let _ = std::fs::remove_file(&tmp);
        let status = Command::new("ar")
            .arg("rcs")
            .arg(&tmp)
            .args(&objects)
            .status()
            .expect("ar");
        assert!(status.success(), "ar failed ({status})");
        std::fs::rename(&tmp, &lib).expect("move the library into place");
    }
    println!("cargo::rustc-link-search=native={}", dir.display());
    println!("cargo::rustc-link-lib=static={}", v.lib);
    println!("cargo::rustc-link-lib=dylib=stdc++");
}
