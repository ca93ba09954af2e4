//! What the device stage runs on: buffers in a backend's memory and the layer ops of
//! [`crate::model::ops`] over them.
//!
//! A [`Backend`] owns memory ([`Backend::Buf`], [`Backend::Ids`]) and queues operations on
//! it; addresses are passed around as [`DPtr`] (address + length, like a raw pointer). Two
//! backends implement it: [`super::CudaBackend`] (our NVRTC kernels and cuBLAS, on a CUDA
//! device) and [`super::HostBackend`] (the CPU ops of `ops.rs`, the twins of the kernels).
//! Every op has the semantics of its `ops.rs` namesake (backward ops accumulate), takes
//! its shapes in the same order, and checks them first ([`ModelError::ShapeMismatch`],
//! [`ModelError::InvalidConfig`]); an op's outputs must not overlap each other or its
//! inputs (checked too). The checks are said once, here: each op is a provided method
//! that runs them and then calls the backend's `raw_` twin (`matmul_backward` calls
//! `raw_matmul_backward`), so a backend only marshals its arguments or calls `ops.rs`.
use super::super::kernels::AdamW;
use super::super::ModelError;
use std::fmt;
use std::marker::PhantomData;

/// `len` values of `T` at address `addr` of a backend's memory (a CUDA device address, or
/// a host address for [`super::HostBackend`]). Like a raw pointer it does not keep the
/// memory alive, which is why the ops that take one are `unsafe`.
pub struct DPtr<T> {
    addr: u64,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for DPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DPtr<T> {}

impl<T> fmt::Debug for DPtr<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DPtr({:#x}, {})", self.addr, self.len)
    }
}

impl<T> DPtr<T> {
    /// An address range.
    ///
    /// # Safety
    /// `addr` must start `len` values of `T` of the memory of the backend this is given to.
    pub unsafe fn from_raw(addr: u64, len: usize) -> Self {
        DPtr {
            addr,
            len,
            _t: PhantomData,
        }
    }
    /// The address of the first value.
    pub fn addr(self) -> u64 {
        self.addr
    }
    /// Number of values.
    pub fn len(self) -> usize {
        self.len
    }
    /// No values.
    pub fn is_empty(self) -> bool {
        self.len == 0
    }
    /// Values `start..start + len` of this range (checked).
    pub fn sub(self, start: usize, len: usize) -> Result<DPtr<T>, ModelError> {
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(DPtr {
                addr: self.addr + (start * std::mem::size_of::<T>()) as u64,
                len,
                _t: PhantomData,
            }),
            _ => Err(ModelError::InvalidConfig(format!(
                "range {start}..{start}+{len} outside a buffer of {}",
                self.len
            ))),
        }
    }
    fn bytes(self) -> (u64, u64) {
        let n = (self.len * std::mem::size_of::<T>()) as u64;
        (self.addr, self.addr + n)
    }
    /// Whether the two ranges share a byte (empty ranges share none).
    pub fn overlaps<U>(self, other: DPtr<U>) -> bool {
        let (a0, a1) = self.bytes();
        let (b0, b1) = other.bytes();
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    }
}

/// A buffer owned by a backend; dropping it frees the memory (after the queued work that
/// uses it, for a device).
pub trait DeviceBuffer<T> {
    /// Its address range.
    fn ptr(&self) -> DPtr<T>;
    /// Number of values.
    fn len(&self) -> usize {
        self.ptr().len()
    }
    /// No values.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Memory and the layer ops of the reference models. Ops are queued in order; results are
/// visible to later ops and to [`Backend::download`], which waits for everything queued.
///
/// # Safety
/// This contract applies to every `unsafe` method: each [`DPtr`] argument must be memory
/// of this backend that stays allocated until the operation has run (buffers dropped
/// after queuing are fine: a device frees them in stream order), and token and target ids
/// must be `<` the rows of the table they index (vocabulary, `v`).
#[allow(clippy::too_many_arguments, clippy::missing_safety_doc)]
pub trait Backend {
    /// A buffer of f32.
    type Buf: DeviceBuffer<f32>;
    /// A buffer of u32 (token ids and targets).
    type Ids: DeviceBuffer<u32>;

    /// What it runs on (e.g. the device's name).
    fn describe(&self) -> String;
    /// `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Buf, ModelError>;
    /// A copy of host values.
    fn upload(&self, x: &[f32]) -> Result<Self::Buf, ModelError>;
    /// A copy of host ids.
    fn upload_ids(&self, x: &[u32]) -> Result<Self::Ids, ModelError>;
    /// Waits for everything queued, then copies `x` to the host.
    unsafe fn download(&self, x: DPtr<f32>) -> Result<Vec<f32>, ModelError>;
    /// A buffer's values on the host (waits for everything queued).
    fn download_buf(&self, x: &Self::Buf) -> Result<Vec<f32>, ModelError> {
        // SAFETY: the buffer is borrowed, so alive, and belongs to this backend.
        unsafe { self.download(x.ptr()) }
    }
    /// `x = 0`.
    unsafe fn fill_zero(&self, x: DPtr<f32>) -> Result<(), ModelError>;
    /// `dst = src` (same length).
    unsafe fn copy(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError> {
        check::len("copy destination", dst, src.len())?;
        check::disjoint(&[dst], &[src])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_copy(dst, src) }
    }
    /// [`Backend::copy`] once its arguments passed its checks.
    unsafe fn raw_copy(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError>;

    /// [`crate::model::ops::encoder_forward`] (rows = `tokens.len()`).
    unsafe fn encoder_forward(
        &self,
        out: DPtr<f32>,
        tokens: DPtr<u32>,
        wte: DPtr<f32>,
        wpe: Option<DPtr<f32>>,
        seq: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        check::encoder(out, tokens, wte, wpe, seq, c)?;
        check::disjoint(&[out], &[wte])?;
        check::disjoint(&[out], wpe.as_slice())?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_encoder_forward(out, tokens, wte, wpe, seq, c) }
    }
    /// [`Backend::encoder_forward`] once its arguments passed its checks.
    unsafe fn raw_encoder_forward(
        &self,
        out: DPtr<f32>,
        tokens: DPtr<u32>,
        wte: DPtr<f32>,
        wpe: Option<DPtr<f32>>,
        seq: usize,
        c: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::encoder_backward`].
    unsafe fn encoder_backward(
        &self,
        dwte: DPtr<f32>,
        dwpe: Option<DPtr<f32>>,
        dout: DPtr<f32>,
        tokens: DPtr<u32>,
        seq: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        check::encoder(dout, tokens, dwte, dwpe, seq, c)?;
        let outs: Vec<DPtr<f32>> = std::iter::once(dwte).chain(dwpe).collect();
        check::disjoint(&outs, &[dout])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_encoder_backward(dwte, dwpe, dout, tokens, seq, c) }
    }
    /// [`Backend::encoder_backward`] once its arguments passed its checks.
    unsafe fn raw_encoder_backward(
        &self,
        dwte: DPtr<f32>,
        dwpe: Option<DPtr<f32>>,
        dout: DPtr<f32>,
        tokens: DPtr<u32>,
        seq: usize,
        c: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::matmul_forward`].
    unsafe fn matmul_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        bias: Option<DPtr<f32>>,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        check::matmul(out, inp, w, bias, n, ic, oc)?;
        let ins: Vec<DPtr<f32>> = [inp, w].into_iter().chain(bias).collect();
        check::disjoint(&[out], &ins)?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_matmul_forward(out, inp, w, bias, n, ic, oc) }
    }
    /// [`Backend::matmul_forward`] once its arguments passed its checks.
    unsafe fn raw_matmul_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        bias: Option<DPtr<f32>>,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::matmul_backward`].
    unsafe fn matmul_backward(
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
        check::matmul(dout, inp, w, dbias, n, ic, oc)?;
        check::len("matmul input gradient", dinp, inp.len())?;
        check::len("matmul weight gradient", dw, w.len())?;
        let outs: Vec<DPtr<f32>> = [dinp, dw].into_iter().chain(dbias).collect();
        check::disjoint(&outs, &[dout, inp, w])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_matmul_backward(dinp, dw, dbias, dout, inp, w, n, ic, oc) }
    }
    /// [`Backend::matmul_backward`] once its arguments passed its checks.
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
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::layernorm_forward`].
    unsafe fn layernorm_forward(
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
        check::norm(out, &[mean, rstd], inp, &[w, b], c)?;
        check::disjoint(&[out, mean, rstd], &[inp, w, b])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_layernorm_forward(out, mean, rstd, inp, w, b, c, eps) }
    }
    /// [`Backend::layernorm_forward`] once its arguments passed its checks.
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
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::layernorm_backward`].
    unsafe fn layernorm_backward(
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
        check::norm(dinp, &[mean, rstd], inp, &[w, dw, db], c)?;
        check::len("norm output gradient", dout, inp.len())?;
        check::disjoint(&[dinp, dw, db], &[dout, inp, w, mean, rstd])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, c) }
    }
    /// [`Backend::layernorm_backward`] once its arguments passed its checks.
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
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::rmsnorm_forward`].
    unsafe fn rmsnorm_forward(
        &self,
        out: DPtr<f32>,
        rstd: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        c: usize,
        eps: f64,
    ) -> Result<(), ModelError> {
        check::norm(out, &[rstd], inp, &[w], c)?;
        check::disjoint(&[out, rstd], &[inp, w])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_rmsnorm_forward(out, rstd, inp, w, c, eps) }
    }
    /// [`Backend::rmsnorm_forward`] once its arguments passed its checks.
    unsafe fn raw_rmsnorm_forward(
        &self,
        out: DPtr<f32>,
        rstd: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        c: usize,
        eps: f64,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::rmsnorm_backward`].
    unsafe fn rmsnorm_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        rstd: DPtr<f32>,
        c: usize,
    ) -> Result<(), ModelError> {
        check::norm(dinp, &[rstd], inp, &[w, dw], c)?;
        check::len("norm output gradient", dout, inp.len())?;
        check::disjoint(&[dinp, dw], &[dout, inp, w, rstd])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_rmsnorm_backward(dinp, dw, dout, inp, w, rstd, c) }
    }
    /// [`Backend::rmsnorm_backward`] once its arguments passed its checks.
    unsafe fn raw_rmsnorm_backward(
        &self,
        dinp: DPtr<f32>,
        dw: DPtr<f32>,
        dout: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        rstd: DPtr<f32>,
        c: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::gelu_forward`].
    unsafe fn gelu_forward(&self, out: DPtr<f32>, inp: DPtr<f32>) -> Result<(), ModelError> {
        check::len("gelu output", out, inp.len())?;
        check::disjoint(&[out], &[inp])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_gelu_forward(out, inp) }
    }
    /// [`Backend::gelu_forward`] once its arguments passed its checks.
    unsafe fn raw_gelu_forward(&self, out: DPtr<f32>, inp: DPtr<f32>) -> Result<(), ModelError>;
    /// [`crate::model::ops::gelu_backward`].
    unsafe fn gelu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
    ) -> Result<(), ModelError> {
        check::len("gelu input gradient", dinp, inp.len())?;
        check::len("gelu output gradient", dout, inp.len())?;
        check::disjoint(&[dinp], &[inp, dout])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_gelu_backward(dinp, inp, dout) }
    }
    /// [`Backend::gelu_backward`] once its arguments passed its checks.
    unsafe fn raw_gelu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::swiglu_forward`].
    unsafe fn swiglu_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError> {
        check::swiglu(out, inp, h)?;
        check::disjoint(&[out], &[inp])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_swiglu_forward(out, inp, h) }
    }
    /// [`Backend::swiglu_forward`] once its arguments passed its checks.
    unsafe fn raw_swiglu_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::swiglu_backward`].
    unsafe fn swiglu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError> {
        check::swiglu(dout, inp, h)?;
        check::len("swiglu input gradient", dinp, inp.len())?;
        check::disjoint(&[dinp], &[inp, dout])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_swiglu_backward(dinp, inp, dout, h) }
    }
    /// [`Backend::swiglu_backward`] once its arguments passed its checks.
    unsafe fn raw_swiglu_backward(
        &self,
        dinp: DPtr<f32>,
        inp: DPtr<f32>,
        dout: DPtr<f32>,
        h: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::rope_forward`].
    unsafe fn rope_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
    ) -> Result<(), ModelError> {
        check::rope(out, inp, seq, width, rot_heads, hs, base)?;
        check::disjoint(&[out], &[inp])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_rope_forward(out, inp, seq, width, rot_heads, hs, base) }
    }
    /// [`Backend::rope_forward`] once its arguments passed its checks.
    unsafe fn raw_rope_forward(
        &self,
        out: DPtr<f32>,
        inp: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::rope_backward`].
    unsafe fn rope_backward(
        &self,
        dinp: DPtr<f32>,
        dout: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
    ) -> Result<(), ModelError> {
        check::rope(dinp, dout, seq, width, rot_heads, hs, base)?;
        check::disjoint(&[dinp], &[dout])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_rope_backward(dinp, dout, seq, width, rot_heads, hs, base) }
    }
    /// [`Backend::rope_backward`] once its arguments passed its checks.
    unsafe fn raw_rope_backward(
        &self,
        dinp: DPtr<f32>,
        dout: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::attention_forward`].
    unsafe fn attention_forward(
        &self,
        out: DPtr<f32>,
        att: DPtr<f32>,
        qkv: DPtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), ModelError> {
        check::attention(out, att, qkv, b, t, c, nh)?;
        check::disjoint(&[out, att], &[qkv])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_attention_forward(out, att, qkv, b, t, c, nh) }
    }
    /// [`Backend::attention_forward`] once its arguments passed its checks.
    unsafe fn raw_attention_forward(
        &self,
        out: DPtr<f32>,
        att: DPtr<f32>,
        qkv: DPtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::attention_backward`].
    unsafe fn attention_backward(
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
        check::attention(dout, att, qkv, b, t, c, nh)?;
        check::len("attention qkv gradient", dqkv, qkv.len())?;
        check::disjoint(&[dqkv], &[dout, qkv, att])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_attention_backward(dqkv, dout, qkv, att, b, t, c, nh) }
    }
    /// [`Backend::attention_backward`] once its arguments passed its checks.
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
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::crossentropy_forward_rows`], with each row's loss rounded to
    /// f32 into `losses` (rows = `targets.len()`).
    unsafe fn crossentropy_forward(
        &self,
        probs: DPtr<f32>,
        losses: DPtr<f32>,
        logits: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
    ) -> Result<(), ModelError> {
        let rows = check::crossentropy(probs, logits, targets, v)?;
        check::len("losses", losses, rows)?;
        check::disjoint(&[probs, losses], &[logits])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_crossentropy_forward(probs, losses, logits, targets, v) }
    }
    /// [`Backend::crossentropy_forward`] once its arguments passed its checks.
    unsafe fn raw_crossentropy_forward(
        &self,
        probs: DPtr<f32>,
        losses: DPtr<f32>,
        logits: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::crossentropy_backward`].
    unsafe fn crossentropy_backward(
        &self,
        dlogits: DPtr<f32>,
        probs: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
        dloss: f64,
    ) -> Result<(), ModelError> {
        check::crossentropy(probs, dlogits, targets, v)?;
        check::disjoint(&[dlogits], &[probs])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_crossentropy_backward(dlogits, probs, targets, v, dloss) }
    }
    /// [`Backend::crossentropy_backward`] once its arguments passed its checks.
    unsafe fn raw_crossentropy_backward(
        &self,
        dlogits: DPtr<f32>,
        probs: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
        dloss: f64,
    ) -> Result<(), ModelError>;
    /// [`crate::model::ops::add_inplace`].
    unsafe fn add_inplace(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError> {
        check::len("add destination", dst, src.len())?;
        check::disjoint(&[dst], &[src])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_add_inplace(dst, src) }
    }
    /// [`Backend::add_inplace`] once its arguments passed its checks.
    unsafe fn raw_add_inplace(&self, dst: DPtr<f32>, src: DPtr<f32>) -> Result<(), ModelError>;
    /// [`crate::model::kernels::adamw_update`].
    unsafe fn adamw(
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
        for (what, p) in [
            ("gradients", grads),
            ("first moments", m),
            ("second moments", v),
        ] {
            check::len(what, p, params.len())?;
        }
        check::disjoint(&[params, m, v], &[grads])?;
        // SAFETY: the caller's contract; the shapes passed the checks above.
        unsafe { self.raw_adamw(params, grads, m, v, opt, t, grad_scale, decay) }
    }
    /// [`Backend::adamw`] once its arguments passed its checks.
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
    ) -> Result<(), ModelError>;
}

/// Shape checks shared by the backends: each returns the derived sizes, or the error.
pub(crate) mod check {
    use super::{DPtr, ModelError};

    /// `p` holds exactly `n` values.
    pub fn len<T>(what: &'static str, p: DPtr<T>, n: usize) -> Result<(), ModelError> {
        if p.len() != n {
            return Err(ModelError::ShapeMismatch {
                what,
                expected: n,
                got: p.len(),
            });
        }
        Ok(())
    }

    /// A dimension is > 0.
    pub fn positive(what: &str, x: usize) -> Result<(), ModelError> {
        if x == 0 {
            return Err(ModelError::InvalidConfig(format!("{what} must be > 0")));
        }
        Ok(())
    }

    /// `total` is a whole number of rows of `c`; returns the rows.
    pub fn rows(what: &'static str, total: usize, c: usize) -> Result<usize, ModelError> {
        positive(what, c)?;
        if total % c != 0 {
            return Err(ModelError::InvalidConfig(format!(
                "{what}: {total} values are not rows of {c}"
            )));
        }
        Ok(total / c)
    }

    /// `n1 * n2` without overflow.
    pub fn mul(a: usize, b: usize) -> Result<usize, ModelError> {
        a.checked_mul(b)
            .ok_or_else(|| ModelError::InvalidConfig(format!("{a} x {b} overflows")))
    }

    /// The outputs overlap neither each other nor the inputs.
    pub fn disjoint(outs: &[DPtr<f32>], ins: &[DPtr<f32>]) -> Result<(), ModelError> {
        for (i, o) in outs.iter().enumerate() {
            let clash = outs[i + 1..].iter().chain(ins).any(|x| o.overlaps(*x));
            if clash {
                return Err(ModelError::InvalidConfig(
                    "an output of an op overlaps another of its buffers".into(),
                ));
            }
        }
        Ok(())
    }

    pub fn encoder(
        out: DPtr<f32>,
        tokens: DPtr<u32>,
        wte: DPtr<f32>,
        wpe: Option<DPtr<f32>>,
        seq: usize,
        c: usize,
    ) -> Result<usize, ModelError> {
        positive("seq", seq)?;
        let rows = tokens.len();
        len("embedding activations", out, mul(rows, c)?)?;
        rows_of_table("token table", wte, c)?;
        if let Some(p) = wpe {
            let r = rows_of_table("position table", p, c)?;
            if r < seq {
                return Err(ModelError::InvalidConfig(format!(
                    "position table of {r} rows for sequences of {seq}"
                )));
            }
        }
        Ok(rows)
    }

    /// A table `[rows, c]` with at least one row.
    pub fn rows_of_table(what: &'static str, p: DPtr<f32>, c: usize) -> Result<usize, ModelError> {
        let r = rows(what, p.len(), c)?;
        positive(what, r)?;
        Ok(r)
    }

    pub fn matmul(
        out: DPtr<f32>,
        inp: DPtr<f32>,
        w: DPtr<f32>,
        bias: Option<DPtr<f32>>,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        len("matmul output", out, mul(n, oc)?)?;
        len("matmul input", inp, mul(n, ic)?)?;
        len("matmul weight", w, mul(oc, ic)?)?;
        if let Some(b) = bias {
            len("matmul bias", b, oc)?;
        }
        Ok(())
    }

    /// Row count of a norm over `c` columns (`inp` is `[rows, c]`).
    pub fn norm(
        out: DPtr<f32>,
        stats: &[DPtr<f32>],
        inp: DPtr<f32>,
        params: &[DPtr<f32>],
        c: usize,
    ) -> Result<usize, ModelError> {
        let r = rows("norm input", inp.len(), c)?;
        len("norm output", out, inp.len())?;
        for s in stats {
            len("norm statistics", *s, r)?;
        }
        for p in params {
            len("norm parameters", *p, c)?;
        }
        Ok(r)
    }

    /// `inp` is `[rows, 2h]`, `out` `[rows, h]`; returns rows.
    pub fn swiglu(out: DPtr<f32>, inp: DPtr<f32>, h: usize) -> Result<usize, ModelError> {
        let r = rows("swiglu input", inp.len(), mul(2, h)?)?;
        len("swiglu output", out, mul(r, h)?)?;
        Ok(r)
    }

    /// Returns rows of `width`.
    pub fn rope(
        out: DPtr<f32>,
        inp: DPtr<f32>,
        seq: usize,
        width: usize,
        rot_heads: usize,
        hs: usize,
        base: f64,
    ) -> Result<usize, ModelError> {
        positive("seq", seq)?;
        positive("head size", hs)?;
        if hs % 2 != 0 || mul(rot_heads, hs)? > width || base.is_nan() || base <= 0.0 {
            return Err(ModelError::InvalidConfig(format!(
                "rope: {rot_heads} heads of {hs} in rows of {width}, base {base}"
            )));
        }
        let r = rows("rope input", inp.len(), width)?;
        len("rope output", out, inp.len())?;
        Ok(r)
    }

    pub fn attention(
        out: DPtr<f32>,
        att: DPtr<f32>,
        qkv: DPtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), ModelError> {
        positive("heads", nh)?;
        if c % nh != 0 || c == 0 {
            return Err(ModelError::InvalidConfig(format!(
                "attention: width {c} with {nh} heads"
            )));
        }
        let n = mul(b, t)?;
        len("attention qkv", qkv, mul(n, mul(3, c)?)?)?;
        len("attention output", out, mul(n, c)?)?;
        len(
            "attention probabilities",
            att,
            mul(mul(b, nh)?, mul(t, t)?)?,
        )?;
        Ok(())
    }

    /// Returns rows (= targets).
    pub fn crossentropy(
        probs: DPtr<f32>,
        logits: DPtr<f32>,
        targets: DPtr<u32>,
        v: usize,
    ) -> Result<usize, ModelError> {
        positive("vocabulary", v)?;
        let r = targets.len();
        len("logits", logits, mul(r, v)?)?;
        len("probabilities", probs, mul(r, v)?)?;
        Ok(r)
    }
}
