//! [`KernelBackend`]: the [`Backend`] that runs our kernels (`src/cuda/kernels/*.cu`, each
//! the twin of its `ops.rs` function) and column-major sgemm calls for the matrix
//! multiplies, on whatever a [`KernelRunner`] launches them: a CUDA device
//! ([`super::CudaBackend`]: NVRTC modules and cuBLAS), or a CPU emulation of the device in
//! the tests. All the argument marshalling, grid sizes and shape checks live here, shared
//! by both. Work is queued without waiting; only [`Backend::download`] waits.
use super::backend::{Backend, DPtr, DeviceBuffer};
use crate::cuda::blas::{row_major_sgemm, SgemmCall};
use crate::cuda::gpu::{elementwise_grid, per_row_grid, KernelArg};
use crate::model::kernels::AdamW;
use crate::model::ModelError;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::marker::PhantomData;

use KernelArg::{Ptr, F32, I32, U32, U64};

/// What [`KernelBackend`] needs from a device: memory at plain addresses, copies, kernel
/// launches by entry-point name (the kernels of [`crate::cuda::kernels::SOURCES`], with
/// blocks of [`crate::cuda::gpu::BLOCK`] threads) and column-major sgemm. Everything is
/// queued in order on one stream.
///
/// # Safety
/// This contract applies to every `unsafe` method: the addresses must be memory of this
/// runner holding what the operation touches, allocated until it has run, and the kernel
/// arguments must match the kernel's parameters.
#[allow(clippy::missing_safety_doc)]
pub trait KernelRunner {
    /// An allocation; dropping it frees the memory after the work queued so far.
    type Mem;
    /// What it runs on.
    fn describe(&self) -> String;
    /// `bytes` zeroed bytes (at least one is allocated), aligned for any element type,
    /// and their address.
    fn alloc_zeroed(&self, bytes: usize) -> Result<(Self::Mem, u64), ModelError>;
    /// Copies host bytes to `dst`.
    unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<(), ModelError>;
    /// Waits for everything queued, then copies `dst.len()` bytes from `src`.
    unsafe fn download(&self, dst: &mut [u8], src: u64) -> Result<(), ModelError>;
    /// Queues `bytes` zero bytes at `dst`.
    unsafe fn memset_zero(&self, dst: u64, bytes: usize) -> Result<(), ModelError>;
    /// Queues a copy of `bytes` bytes (not overlapping).
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), ModelError>;
    /// Queues kernel `name` on `grid` blocks.
    unsafe fn launch(&self, name: &str, grid: u32, args: &[KernelArg]) -> Result<(), ModelError>;
    /// Queues one column-major sgemm.
    unsafe fn sgemm(&self, call: &SgemmCall) -> Result<(), ModelError>;
    /// Waits for everything queued.
    fn synchronize(&self) -> Result<(), ModelError>;
}

/// Our kernels on a [`KernelRunner`].
pub struct KernelBackend<R: KernelRunner> {
    runner: R,
    /// RoPE tables `(cos, sign * sin)`, uploaded on first use.
    rope_tables: Mutex<HashMap<RopeKey, KernelBuf<R::Mem, f32>>>,
}

/// Which RoPE table: (positions, head size, bits of the base, backward).
type RopeKey = (usize, usize, u64, bool);

/// Memory of a [`KernelRunner`] holding `len` values of `T`.
pub struct KernelBuf<M, T> {
    _mem: M,
    addr: u64,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<M, T> DeviceBuffer<T> for KernelBuf<M, T> {
    fn ptr(&self) -> DPtr<T> {
        // SAFETY: `addr` starts the `len` values of the allocation this buffer owns.
        unsafe { DPtr::from_raw(self.addr, self.len) }
    }
}

fn u32_of(what: &str, x: usize) -> Result<u32, ModelError> {
    u32::try_from(x).map_err(|_| ModelError::InvalidConfig(format!("{what} {x} exceeds u32")))
}

impl<R: KernelRunner> KernelBackend<R> {
    /// Our kernels on `runner`.
    pub fn with_runner(runner: R) -> Self {
        KernelBackend {
            runner,
            rope_tables: Mutex::new(HashMap::new()),
        }
    }

    /// The runner.
    pub fn runner(&self) -> &R {
        &self.runner
    }

    fn alloc<T>(&self, n: usize) -> Result<KernelBuf<R::Mem, T>, ModelError> {
        let bytes = n
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| ModelError::InvalidConfig(format!("{n} values overflow")))?;
        let (mem, addr) = self.runner.alloc_zeroed(bytes)?;
        Ok(KernelBuf {
            _mem: mem,
            addr,
            len: n,
            _t: PhantomData,
        })
    }

    fn upload_bytes<T>(&self, n: usize, bytes: &[u8]) -> Result<KernelBuf<R::Mem, T>, ModelError> {
        let b = self.alloc::<T>(n)?;
        if !bytes.is_empty() {
            // SAFETY: the new allocation holds exactly these bytes.
            unsafe { self.runner.upload(b.addr, bytes)? };
        }
        Ok(b)
    }

    /// # Safety
    /// As [`KernelRunner::launch`].
    unsafe fn k(&self, name: &str, grid: u32, args: &[KernelArg]) -> Result<(), ModelError> {
        // SAFETY: forwarded.
        unsafe { self.runner.launch(name, grid, args) }
    }

    /// # Safety
    /// The addresses hold the row-major matrices of [`row_major_sgemm`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        &self,
        m: usize,
        k: usize,
        n: usize,
        a: DPtr<f32>,
        ta: bool,
        b: DPtr<f32>,
        tb: bool,
        beta: f32,
        c: DPtr<f32>,
    ) -> Result<(), ModelError> {
        let call = row_major_sgemm(m, k, n, a.addr(), ta, b.addr(), tb, beta, c.addr())
            .map_err(|e| ModelError::InvalidConfig(e.to_string()))?;
        match call {
            // SAFETY: forwarded.
            Some(call) => unsafe { self.runner.sgemm(&call) },
            None => Ok(()),
        }
    }

    /// The `(cos, sign * sin)` table of [`crate::model::ops::rope_forward`] for `seq`
    /// positions and head size `hs`, computed on the host in f64 exactly as the CPU twin
    /// does and uploaded on first use.
    fn rope_table(&self, seq: usize, hs: usize, base: f64, sign: f64) -> Result<u64, ModelError> {
        let key = (seq, hs, base.to_bits(), sign < 0.0);
        let mut tables = self.rope_tables.lock();
        if let Some(t) = tables.get(&key) {
            return Ok(t.addr);
        }
        let half = hs / 2;
        let mut cs = Vec::with_capacity(2 * seq * half);
        for t in 0..seq {
            for j in 0..half {
                let theta = t as f64 * base.powf(-2.0 * j as f64 / hs as f64);
                cs.push(theta.cos() as f32);
                cs.push((sign * theta.sin()) as f32);
            }
        }
        let buf = self.upload_bytes::<f32>(cs.len(), zerocopy::IntoBytes::as_bytes(&cs[..]))?;
        let addr = buf.addr;
        tables.insert(key, buf);
        Ok(addr)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn rope(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
        backward: bool,
    ) -> Result<(), ModelError> {
        let rows = inp.len() / width;
        let sign = if backward { -1.0 } else { 1.0 };
        let cs = self.rope_table(seq, hs, base, sign)?;
        // SAFETY: sizes checked; the table holds seq * hs/2 pairs.
        unsafe {
            self.k(
                "gwtf_rope",
                elementwise_grid(out.len() as u64),
                &[
                    Ptr(out.addr()),
                    Ptr(inp.addr()),
                    Ptr(cs),
                    U64(rows as u64),
                    U32(u32_of("seq", seq)?),
                    U32(u32_of("width", width)?),
                    U32(u32_of("heads", rot_heads)?),
                    U32(u32_of("head size", hs)?),
                    I32(i32::from(backward)),
                ],
            )
        }
    }
}

impl<R: KernelRunner> Backend for KernelBackend<R> {
    type Buf = KernelBuf<R::Mem, f32>;
    type Ids = KernelBuf<R::Mem, u32>;

    fn describe(&self) -> String {
        self.runner.describe()
    }
    fn zeros(&self, n: usize) -> Result<Self::Buf, ModelError> {
        self.alloc(n)
    }
    fn upload(&self, x: &[f32]) -> Result<Self::Buf, ModelError> {
        self.upload_bytes(x.len(), zerocopy::IntoBytes::as_bytes(x))
    }
    fn upload_ids(&self, x: &[u32]) -> Result<Self::Ids, ModelError> {
        self.upload_bytes(x.len(), zerocopy::IntoBytes::as_bytes(x))
    }
    unsafe fn download(&self, x: DPtr<f32>) -> Result<Vec<f32>, ModelError> {
        let mut v = vec![0.0f32; x.len()];
        if v.is_empty() {
            self.runner.synchronize()?;
        } else {
            // SAFETY: caller's contract.
            unsafe {
                self.runner
                    .download(zerocopy::IntoBytes::as_mut_bytes(&mut v[..]), x.addr())?
            };
        }
        Ok(v)
    }
    unsafe fn fill_zero(&self, x: DPtr<f32>) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.runner.memset_zero(x.addr(), 4 * x.len()) }
    }
    unsafe fn raw_copy(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError> {
        // SAFETY: caller's contract; sizes checked.
        unsafe { self.runner.copy(dst.addr(), src.addr(), 4 * src.len()) }
    }

    unsafe fn raw_encoder_forward(
        &self,
        out: DPtr<f32>,
        tokens: DPtr<u32>,
        wte: DPtr<f32>,
        wpe: Option<DPtr<f32>>,
        seq: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        let rows = tokens.len();
        // SAFETY: sizes checked; tokens < rows of wte by the caller's contract.
        unsafe {
            self.k(
                "gwtf_encoder_forward",
                elementwise_grid(out.len() as u64),
                &[
                    Ptr(out.addr()),
                    Ptr(tokens.addr()),
                    Ptr(wte.addr()),
                    Ptr(wpe.map_or(0, |p| p.addr())),
                    U64(rows as u64),
                    U32(u32_of("seq", seq)?),
                    U32(u32_of("width", c)?),
                ],
            )
        }
    }

    unsafe fn raw_encoder_backward(
        &self,
        dwte: DPtr<f32>,
        dwpe: Option<DPtr<f32>>,
        dout: DPtr<f32>,
        tokens: DPtr<u32>,
        seq: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        let rows = tokens.len();
        let c32 = u32_of("width", c)?;
        // SAFETY: sizes checked; tokens < rows of dwte by the caller's contract.
        unsafe {
            self.k(
                "gwtf_encoder_backward_wte",
                elementwise_grid(c as u64),
                &[
                    Ptr(dwte.addr()),
                    Ptr(dout.addr()),
                    Ptr(tokens.addr()),
                    U64(rows as u64),
                    U32(c32),
                ],
            )?;
            if let Some(dwpe) = dwpe {
                self.k(
                    "gwtf_encoder_backward_wpe",
                    elementwise_grid((seq * c) as u64),
                    &[
                        Ptr(dwpe.addr()),
                        Ptr(dout.addr()),
                        U64(rows as u64),
                        U32(u32_of("seq", seq)?),
                        U32(c32),
                    ],
                )?;
            }
        }
        Ok(())
    }

    unsafe fn raw_matmul_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        bias: Option<DPtr<f32>>,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        // out[n, oc] = inp[n, ic] * w[oc, ic]^T, as ops::matmul_forward's gemm call.
        // SAFETY: sizes checked.
        unsafe {
            self.gemm(n, ic, oc, inp, false, w, true, 0.0, out)?;
            if let Some(b) = bias {
                self.k(
                    "gwtf_bias_forward",
                    elementwise_grid(out.len() as u64),
                    &[
                        Ptr(out.addr()),
                        Ptr(b.addr()),
                        U64(n as u64),
                        U32(u32_of("output width", oc)?),
                    ],
                )?;
            }
        }
        Ok(())
    }

    unsafe fn raw_matmul_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        dbias: Option<DPtr<f32>>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        // As ops::matmul_backward: dinp += dout * w ([n, oc] x [oc, ic]) and
        // dw += dout^T * inp ([oc, n] x [n, ic]), both accumulating (beta = 1).
        // SAFETY: sizes checked.
        unsafe {
            self.gemm(n, oc, ic, dout, false, w, false, 1.0, dinp)?;
            self.gemm(oc, n, ic, dout, true, inp, false, 1.0, dw)?;
            if let Some(db) = dbias {
                self.k(
                    "gwtf_bias_backward",
                    elementwise_grid(oc as u64),
                    &[
                        Ptr(db.addr()),
                        Ptr(dout.addr()),
                        U64(n as u64),
                        U32(u32_of("output width", oc)?),
                    ],
                )?;
            }
        }
        Ok(())
    }

    unsafe fn raw_layernorm_forward(
        &self,
        out: DPtr<f32>,
        mean: DPtr<f32>,
        rstd: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        b: DPtr<f32>,
        c: usize,
        eps: f64,
    ) -> Result<(), ModelError> {
        let rows = inp.len() / c;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_layernorm_forward",
                per_row_grid(rows as u64),
                &[
                    Ptr(out.addr()),
                    Ptr(mean.addr()),
                    Ptr(rstd.addr()),
                    Ptr(inp.addr()),
                    Ptr(w.addr()),
                    Ptr(b.addr()),
                    U64(rows as u64),
                    U32(u32_of("width", c)?),
                    F32(eps as f32),
                ],
            )
        }
    }

    unsafe fn raw_layernorm_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        db: DPtr<f32>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        mean: DPtr<f32>,
        rstd: DPtr<f32>,
        c: usize,
    ) -> Result<(), ModelError> {
        let rows = inp.len() / c;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_layernorm_backward",
                per_row_grid(rows as u64),
                &[
                    Ptr(dinp.addr()),
                    Ptr(dw.addr()),
                    Ptr(db.addr()),
                    Ptr(dout.addr()),
                    Ptr(inp.addr()),
                    Ptr(w.addr()),
                    Ptr(mean.addr()),
                    Ptr(rstd.addr()),
                    U64(rows as u64),
                    U32(u32_of("width", c)?),
                ],
            )
        }
    }

    unsafe fn raw_rmsnorm_forward(
        &self,
        out: DPtr<f32>,
        rstd: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        c: usize,
        eps: f64,
    ) -> Result<(), ModelError> {
        let rows = inp.len() / c;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_rmsnorm_forward",
                per_row_grid(rows as u64),
                &[
                    Ptr(out.addr()),
                    Ptr(rstd.addr()),
                    Ptr(inp.addr()),
                    Ptr(w.addr()),
                    U64(rows as u64),
                    U32(u32_of("width", c)?),
                    F32(eps as f32),
                ],
            )
        }
    }

    unsafe fn raw_rmsnorm_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        rstd: DPtr<f32>,
        c: usize,
    ) -> Result<(), ModelError> {
        let rows = inp.len() / c;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_rmsnorm_backward",
                per_row_grid(rows as u64),
                &[
                    Ptr(dinp.addr()),
                    Ptr(dw.addr()),
                    Ptr(dout.addr()),
                    Ptr(inp.addr()),
                    Ptr(w.addr()),
                    Ptr(rstd.addr()),
                    U64(rows as u64),
                    U32(u32_of("width", c)?),
                ],
            )
        }
    }

    unsafe fn raw_gelu_forward(&self, out: DPtr<f32>, inp: DPtr<f32>) -> Result<(), ModelError> {
        let n = inp.len() as u64;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_gelu_forward",
                elementwise_grid(n),
                &[Ptr(out.addr()), Ptr(inp.addr()), U64(n)],
            )
        }
    }

    unsafe fn raw_gelu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
    ) -> Result<(), ModelError> {
        let n = inp.len() as u64;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_gelu_backward",
                elementwise_grid(n),
                &[Ptr(dinp.addr()), Ptr(inp.addr()), Ptr(dout.addr()), U64(n)],
            )
        }
    }

    unsafe fn raw_swiglu_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError> {
        let rows = inp.len() / (2 * h);
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_swiglu_forward",
                elementwise_grid(out.len() as u64),
                &[
                    Ptr(out.addr()),
                    Ptr(inp.addr()),
                    U64(rows as u64),
                    U32(u32_of("hidden width", h)?),
                ],
            )
        }
    }

    unsafe fn raw_swiglu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError> {
        let rows = inp.len() / (2 * h);
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_swiglu_backward",
                elementwise_grid(dout.len() as u64),
                &[
                    Ptr(dinp.addr()),
                    Ptr(inp.addr()),
                    Ptr(dout.addr()),
                    U64(rows as u64),
                    U32(u32_of("hidden width", h)?),
                ],
            )
        }
    }

    unsafe fn raw_rope_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
    ) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.rope(out, inp, seq, width, rot_heads, hs, base, false) }
    }

    unsafe fn raw_rope_backward(
        &self,
        dinp: DPtr<f32>,
        dout: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
    ) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { self.rope(dinp, dout, seq, width, rot_heads, hs, base, true) }
    }

    unsafe fn raw_attention_forward(
        &self,
        out: DPtr<f32>,
        att: DPtr<f32>,
        qkv: DPtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), ModelError> {
        let scale = (1.0 / ((c / nh) as f64).sqrt()) as f32;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_attention_forward",
                per_row_grid((b * nh * t) as u64),
                &[
                    Ptr(out.addr()),
                    Ptr(att.addr()),
                    Ptr(qkv.addr()),
                    U32(u32_of("batch", b)?),
                    U32(u32_of("seq", t)?),
                    U32(u32_of("width", c)?),
                    U32(u32_of("heads", nh)?),
                    F32(scale),
                ],
            )
        }
    }

    unsafe fn raw_attention_backward(
        &self,
        dqkv: DPtr<f32>,
        dout: DPtr<f32>,
        qkv: DPtr<f32>,
        att: DPtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), ModelError> {
        let scale = (1.0 / ((c / nh) as f64).sqrt()) as f32;
        let dims = [
            U32(u32_of("batch", b)?),
            U32(u32_of("seq", t)?),
            U32(u32_of("width", c)?),
            U32(u32_of("heads", nh)?),
        ];
        // The gradient of the pre-softmax scores, [b, nh, t, t]; freed in stream order
        // after the two kernels that use it.
        let dpre = self.alloc::<f32>(att.len())?;
        let grid = per_row_grid((b * nh * t) as u64);
        let mut q_args = vec![
            Ptr(dqkv.addr()),
            Ptr(dpre.addr),
            Ptr(dout.addr()),
            Ptr(qkv.addr()),
            Ptr(att.addr()),
        ];
        q_args.extend(dims);
        q_args.push(F32(scale));
        let mut kv_args = vec![
            Ptr(dqkv.addr()),
            Ptr(dpre.addr),
            Ptr(dout.addr()),
            Ptr(qkv.addr()),
            Ptr(att.addr()),
        ];
        kv_args.extend(dims);
        // SAFETY: sizes checked; dpre has att's size.
        unsafe {
            self.k("gwtf_attention_backward_query", grid, &q_args)?;
            self.k("gwtf_attention_backward_key_value", grid, &kv_args)?;
        }
        drop(dpre);
        Ok(())
    }

    unsafe fn raw_crossentropy_forward(
        &self,
        probs: DPtr<f32>,
        losses: DPtr<f32>,
        logits: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
    ) -> Result<(), ModelError> {
        let rows = targets.len();
        // SAFETY: sizes checked; targets < v by the caller's contract.
        unsafe {
            self.k(
                "gwtf_crossentropy_forward",
                per_row_grid(rows as u64),
                &[
                    Ptr(probs.addr()),
                    Ptr(losses.addr()),
                    Ptr(logits.addr()),
                    Ptr(targets.addr()),
                    U64(rows as u64),
                    U32(u32_of("vocabulary", v)?),
                ],
            )
        }
    }

    unsafe fn raw_crossentropy_backward(
        &self,
        dlogits: DPtr<f32>,
        probs: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
        dloss: f64,
    ) -> Result<(), ModelError> {
        let rows = targets.len();
        // The CPU twin's scale: dloss / n in f64, rounded to f32.
        let scale = (dloss / rows.max(1) as f64) as f32;
        // SAFETY: sizes checked; targets < v by the caller's contract.
        unsafe {
            self.k(
                "gwtf_crossentropy_backward",
                elementwise_grid(dlogits.len() as u64),
                &[
                    Ptr(dlogits.addr()),
                    Ptr(probs.addr()),
                    Ptr(targets.addr()),
                    U64(rows as u64),
                    U32(u32_of("vocabulary", v)?),
                    F32(scale),
                ],
            )
        }
    }

    unsafe fn raw_add_inplace(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError> {
        let n = src.len() as u64;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_add_inplace",
                elementwise_grid(n),
                &[Ptr(dst.addr()), Ptr(src.addr()), U64(n)],
            )
        }
    }

    unsafe fn raw_adamw(
        &self,
        params: DPtr<f32>,
        grads: DPtr<f32>,
        m: DPtr<f32>,
        v: DPtr<f32>,
        opt: &AdamW,
        t: u64,
        grad_scale: f32,
        decay: bool,
    ) -> Result<(), ModelError> {
        // Bias corrections and decay exactly as kernels::adamw_update computes them.
        let ti = t.clamp(1, i32::MAX as u64) as i32;
        let bc1 = 1.0 - opt.beta1.powi(ti);
        let bc2 = 1.0 - opt.beta2.powi(ti);
        let wd = if decay { opt.weight_decay } else { 0.0 };
        let n = params.len() as u64;
        // SAFETY: sizes checked.
        unsafe {
            self.k(
                "gwtf_adamw",
                elementwise_grid(n),
                &[
                    Ptr(params.addr()),
                    Ptr(grads.addr()),
                    Ptr(m.addr()),
                    Ptr(v.addr()),
                    U64(n),
                    F32(opt.lr),
                    F32(opt.beta1),
                    F32(opt.beta2),
                    F32(opt.eps),
                    F32(wd),
                    F32(bc1),
                    F32(bc2),
                    F32(grad_scale),
                ],
            )
        }
    }
}
