//! Our CUDA kernels, unchanged, on a CPU emulation of the device (tests/c/cuda_emu.*):
//! every kernel unit is compiled as C++ with the host compiler, and `KernelBackend` (the
//! same argument marshalling, grid sizes and shape checks as on a GPU) launches them with
//! blocks of `BLOCK` threads run as fibers, in shuffled orders. The matrix multiplies are
//! the column-major calls built for cuBLAS, computed by `host_sgemm` (cublasSgemm's
//! definition). This checks on any machine what needs no real GPU: the kernels' indexing
//! and synchronisation, the launch arguments, the row-major/column-major translation, and
//! training end to end; tests/cuda_gpu.rs repeats the same checks on a real device.
#[path = "common/backend_check.rs"]
mod backend_check;
mod common;

use backend_check::*;
use gwtf::cuda::blas::{host_sgemm, SgemmCall};
use gwtf::cuda::gpu::{KernelArg, BLOCK};
use gwtf::cuda::kernels::SOURCES;
use gwtf::model::gpu::*;
use gwtf::model::ModelError;
use std::ffi::{c_char, c_int, c_void, CString};
use std::process::Command;
use std::sync::{Arc, OnceLock};

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, *mut *mut c_void) -> c_int;
type CountFn = unsafe extern "C" fn() -> c_int;

struct Emu {
    launch: LaunchFn,
    count: CountFn,
}

/// Builds the emulated device once per test process: every unit of SOURCES as a C++
/// translation unit (the emulation header, the unit as NVRTC sees it, a registration of
/// each entry point), linked with the runtime into a shared library.
fn emu() -> &'static Emu {
    static EMU: OnceLock<Emu> = OnceLock::new();
    EMU.get_or_init(|| {
        let dir = common::scratch(&format!("cuda-emu-{}", std::process::id()));
        let c_dir = common::repo_root().join("tests/c");
        let mut cmd = Command::new("c++");
        cmd.args([
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-ffp-contract=off",
            "-w",
        ])
        .arg(format!("-I{}", c_dir.display()))
        .arg(c_dir.join("cuda_emu.cpp"));
        for unit in SOURCES {
            let mut tu = String::from("#include \"cuda_emu.h\"\n");
            tu += &unit.full_source();
            tu.push('\n');
            for e in unit.entries {
                tu += &format!("GWTF_EMU_REGISTER({e})\n");
            }
            let path = dir.join(format!("{}.cpp", unit.file));
            std::fs::write(&path, tu).unwrap();
            cmd.arg(path);
        }
        let so = dir.join("libgwtf_cuda_emu.so");
        common::run_ok(cmd.arg("-o").arg(&so));
        let c = CString::new(so.to_str().unwrap()).unwrap();
        // SAFETY: dlopen/dlsym of the library just built; the symbols have these types
        // (tests/c/cuda_emu.cpp). The library stays loaded for the process.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            assert!(!h.is_null(), "dlopen {}", so.display());
            let sym = |name: &str| {
                let n = CString::new(name).unwrap();
                let p = libc::dlsym(h, n.as_ptr());
                assert!(!p.is_null(), "{name} missing");
                p
            };
            Emu {
                launch: std::mem::transmute::<*mut c_void, LaunchFn>(sym("gwtf_emu_launch")),
                count: std::mem::transmute::<*mut c_void, CountFn>(sym("gwtf_emu_kernel_count")),
            }
        }
    })
}

/// The emulated device as a `KernelRunner`: memory is host memory (addresses are host
/// addresses), work runs at once.
struct EmuRunner {
    emu: &'static Emu,
}

impl KernelRunner for EmuRunner {
    /// 16-byte aligned storage.
    type Mem = Vec<u128>;

    fn describe(&self) -> String {
        "CUDA emulated on the CPU".into()
    }
    fn alloc_zeroed(&self, bytes: usize) -> Result<(Vec<u128>, u64), ModelError> {
        let mut v = vec![0u128; bytes.div_ceil(16).max(1)];
        let addr = v.as_mut_ptr() as u64;
        Ok((v, addr))
    }
    unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<(), ModelError> {
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    unsafe fn download(&self, dst: &mut [u8], src: u64) -> Result<(), ModelError> {
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    unsafe fn memset_zero(&self, dst: u64, bytes: usize) -> Result<(), ModelError> {
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
        Ok(())
    }
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), ModelError> {
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    unsafe fn launch(&self, name: &str, grid: u32, args: &[KernelArg]) -> Result<(), ModelError> {
        // cuLaunchKernel's convention: an array of pointers to each argument's value,
        // here 8-byte slots holding the value in their low bytes (little-endian).
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                KernelArg::Ptr(v) | KernelArg::U64(v) => v,
                KernelArg::U32(v) => v as u64,
                KernelArg::I32(v) => v as u32 as u64,
                KernelArg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let c = CString::new(name).unwrap();
        let rc = unsafe { (self.emu.launch)(c.as_ptr(), grid, BLOCK, ptrs.as_mut_ptr()) };
        if rc != 0 {
            return Err(ModelError::Device(format!(
                "emulated launch of {name}: {rc}"
            )));
        }
        Ok(())
    }
    unsafe fn sgemm(&self, call: &SgemmCall) -> Result<(), ModelError> {
        unsafe { host_sgemm(call) };
        Ok(())
    }
    fn synchronize(&self) -> Result<(), ModelError> {
        Ok(())
    }
}

fn backend() -> KernelBackend<EmuRunner> {
    KernelBackend::with_runner(EmuRunner { emu: emu() })
}

#[test]
fn every_entry_point_is_launchable() {
    let n: usize = SOURCES.iter().map(|u| u.entries.len()).sum();
    assert_eq!(unsafe { (emu().count)() } as usize, n);
    let be = backend();
    let e = unsafe { be.runner().launch("gwtf_no_such_kernel", 1, &[]) }.unwrap_err();
    assert!(e.to_string().contains("gwtf_no_such_kernel"), "{e}");
}

#[test]
fn every_layer_op_matches_its_cpu_twin() {
    check_every_op(&backend());
}

#[test]
fn emulated_training_matches_the_cpu() {
    for name in ["gpt-tiny", "llama-tiny"] {
        let worst = check_training(Arc::new(backend()), name, 3);
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "{name}: largest relative loss difference over 3 steps {worst:e}"
        );
    }
}
