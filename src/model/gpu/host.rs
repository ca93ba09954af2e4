//! [`HostBackend`]: the [`Backend`] whose memory is host memory and whose ops are the CPU
//! functions of `ops.rs` (the twins of the CUDA kernels). A [`super::DeviceStage`] on it
//! runs exactly the sequence of ops a CUDA device runs, one after another on the CPU: it
//! checks the device stage's bookkeeping (offsets, buffers, accumulation) anywhere, and
//! is the reference the CUDA backend is compared with.
use super::backend::{Backend, DPtr, DeviceBuffer};
use crate::model::kernels::{adamw_update, AdamW};
use crate::model::ops;
use crate::model::ModelError;

/// Host memory and the CPU ops (rayon + matrixmultiply).
#[derive(Debug, Default)]
pub struct HostBackend;

/// A host buffer: its values never move while it lives, so its address can be handed out.
pub struct HostBuf<T> {
    data: Vec<T>,
    addr: u64,
}

impl<T> HostBuf<T> {
    fn new(mut data: Vec<T>) -> Self {
        // The heap block of a Vec does not move when the Vec struct moves; only this
        // address is used to reach the values from now on.
        let addr = data.as_mut_ptr() as u64;
        HostBuf { data, addr }
    }
}

impl<T> DeviceBuffer<T> for HostBuf<T> {
    fn ptr(&self) -> DPtr<T> {
        // SAFETY: `addr` starts the `data.len()` values this buffer owns.
        unsafe { DPtr::from_raw(self.addr, self.data.len()) }
    }
}

/// # Safety
/// `p` must be live host memory of this backend, not written while the slice is used.
unsafe fn r<'a, T>(p: DPtr<T>) -> &'a [T] {
    // SAFETY: caller's contract; a DPtr of a HostBuf is aligned and non-null.
    unsafe { std::slice::from_raw_parts(p.addr() as *const T, p.len()) }
}

/// # Safety
/// `p` must be live host memory of this backend that nothing else reads or writes while
/// the slice is used (the ops check that outputs overlap nothing).
#[allow(clippy::mut_from_ref)]
unsafe fn w<'a, T>(p: DPtr<T>) -> &'a mut [T] {
    // SAFETY: caller's contract.
    unsafe { std::slice::from_raw_parts_mut(p.addr() as *mut T, p.len()) }
}

impl Backend for HostBackend {
    type Buf = HostBuf<f32>;
    type Ids = HostBuf<u32>;

    fn describe(&self) -> String {
        format!("host ({} threads)", rayon::current_num_threads())
    }
    fn zeros(&self, n: usize) -> Result<HostBuf<f32>, ModelError> {
        Ok(HostBuf::new(vec![0.0; n]))
    }
    fn upload(&self, x: &[f32]) -> Result<HostBuf<f32>, ModelError> {
        Ok(HostBuf::new(x.to_vec()))
    }
    fn upload_ids(&self, x: &[u32]) -> Result<HostBuf<u32>, ModelError> {
        Ok(HostBuf::new(x.to_vec()))
    }
    unsafe fn download(&self, x: DPtr<f32>) -> Result<Vec<f32>, ModelError> {
        // SAFETY: caller's contract.
        Ok(unsafe { r(x) }.to_vec())
    }
    unsafe fn fill_zero(&self, x: DPtr<f32>) -> Result<(), ModelError> {
        // SAFETY: caller's contract.
        unsafe { w(x) }.fill(0.0);
        Ok(())
    }
    unsafe fn raw_copy(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError> {
        // SAFETY: caller's contract; disjoint (checked).
        unsafe { w(dst) }.copy_from_slice(unsafe { r(src) });
        Ok(())
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
        // SAFETY: caller's contract; outputs overlap nothing (checked).
        unsafe { ops::encoder_forward(w(out), r(tokens), r(wte), wpe.map(|p| r(p)), seq, c) };
        Ok(())
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
        // SAFETY: as above.
        unsafe { ops::encoder_backward(w(dwte), dwpe.map(|p| w(p)), r(dout), r(tokens), seq, c) };
        Ok(())
    }

    unsafe fn raw_matmul_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        wt: DPtr<f32>,
        bias: Option<DPtr<f32>>,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::matmul_forward(w(out), r(inp), r(wt), bias.map(|b| r(b)), n, ic, oc) };
        Ok(())
    }

    unsafe fn raw_matmul_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        dbias: Option<DPtr<f32>>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        wt: DPtr<f32>,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe {
            ops::matmul_backward(
                w(dinp),
                w(dw),
                dbias.map(|b| w(b)),
                r(dout),
                r(inp),
                r(wt),
                n,
                ic,
                oc,
            )
        };
        Ok(())
    }

    unsafe fn raw_layernorm_forward(
        &self,
        out: DPtr<f32>,
        mean: DPtr<f32>,
        rstd: DPtr<f32>,
        inp: DPtr<f32>,
        wt: DPtr<f32>,
        b: DPtr<f32>,
        c: usize,
        eps: f64,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::layernorm_forward(w(out), w(mean), w(rstd), r(inp), r(wt), r(b), c, eps) };
        Ok(())
    }

    unsafe fn raw_layernorm_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        db: DPtr<f32>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        wt: DPtr<f32>,
        mean: DPtr<f32>,
        rstd: DPtr<f32>,
        c: usize,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe {
            ops::layernorm_backward(
                w(dinp),
                w(dw),
                w(db),
                r(dout),
                r(inp),
                r(wt),
                r(mean),
                r(rstd),
                c,
            )
        };
        Ok(())
    }

    unsafe fn raw_rmsnorm_forward(
        &self,
        out: DPtr<f32>,
        rstd: DPtr<f32>,
        inp: DPtr<f32>,
        wt: DPtr<f32>,
        c: usize,
        eps: f64,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::rmsnorm_forward(w(out), w(rstd), r(inp), r(wt), c, eps) };
        Ok(())
    }

    unsafe fn raw_rmsnorm_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        wt: DPtr<f32>,
        rstd: DPtr<f32>,
        c: usize,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::rmsnorm_backward(w(dinp), w(dw), r(dout), r(inp), r(wt), r(rstd), c) };
        Ok(())
    }

    unsafe fn raw_gelu_forward(&self, out: DPtr<f32>, inp: DPtr<f32>) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::gelu_forward(w(out), r(inp)) };
        Ok(())
    }

    unsafe fn raw_gelu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::gelu_backward(w(dinp), r(inp), r(dout)) };
        Ok(())
    }

    unsafe fn raw_swiglu_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::swiglu_forward(w(out), r(inp), h) };
        Ok(())
    }

    unsafe fn raw_swiglu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::swiglu_backward(w(dinp), r(inp), r(dout), h) };
        Ok(())
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
        // SAFETY: as above.
        unsafe { ops::rope_forward(w(out), r(inp), seq, width, rot_heads, hs, base) };
        Ok(())
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
        // SAFETY: as above.
        unsafe { ops::rope_backward(w(dinp), r(dout), seq, width, rot_heads, hs, base) };
        Ok(())
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
        // SAFETY: as above.
        unsafe { ops::attention_forward(w(out), w(att), r(qkv), b, t, c, nh) };
        Ok(())
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
        // SAFETY: as above.
        unsafe { ops::attention_backward(w(dqkv), r(dout), r(qkv), r(att), b, t, c, nh) };
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
        // SAFETY: as above.
        let rows = unsafe { ops::crossentropy_forward_rows(w(probs), r(logits), r(targets), v) };
        // SAFETY: as above.
        for (l, x) in unsafe { w(losses) }.iter_mut().zip(rows) {
            *l = x as f32;
        }
        Ok(())
    }

    unsafe fn raw_crossentropy_backward(
        &self,
        dlogits: DPtr<f32>,
        probs: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
        dloss: f64,
    ) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::crossentropy_backward(w(dlogits), r(probs), r(targets), v, dloss) };
        Ok(())
    }

    unsafe fn raw_add_inplace(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError> {
        // SAFETY: as above.
        unsafe { ops::add_inplace(w(dst), r(src)) };
        Ok(())
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
        // SAFETY: as above.
        unsafe { adamw_update(w(params), r(grads), w(m), w(v), opt, t, grad_scale, decay) };
        Ok(())
    }
}
