//! Layer operations of the reference models, in the style of llm.c: each op is a `*_forward`
//! and a `*_backward` function over flat row-major slices. Backward functions **accumulate**
//! (`+=`) into their gradient outputs, so residual branches and gradient accumulation across
//! microbatches need no extra copies.
//!
//! The ops are generic over [`Real`] (f32 for training, f64 for the finite-difference gradient
//! checks). Conventions: `n = batch * seq` rows; a linear layer's weight is `[out, in]`
//! (PyTorch layout); attention's input is the fused `qkv` of shape `[n, 3 * c]`; the attention
//! probabilities are kept as `[batch, heads, seq, seq]`.
use rayon::prelude::*;
use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// The float types the ops run on (f32 and f64).
pub trait Real:
    Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + Debug
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    /// 0
    const ZERO: Self;
    /// 1
    const ONE: Self;
    /// Conversion from f64 (rounding).
    fn from_f64(x: f64) -> Self;
    /// Conversion to f64 (exact).
    fn to_f64(self) -> f64;
    /// e^x
    fn exp(self) -> Self;
    /// tanh(x)
    fn tanh(self) -> Self;
    /// sqrt(x)
    fn sqrt(self) -> Self;
    /// ln(x)
    fn ln(self) -> Self;
    /// Larger of two values.
    fn max(self, o: Self) -> Self;
    /// `c = alpha * a * b + beta * c` with strides (matrixmultiply's sgemm / dgemm).
    ///
    /// # Safety
    /// The pointers and strides must describe valid matrices of the given sizes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

macro_rules! impl_real {
    ($t:ty, $gemm:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn max(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
            unsafe fn gemm_raw(
                m: usize,
                k: usize,
                n: usize,
                alpha: Self,
                a: *const Self,
                rsa: isize,
                csa: isize,
                b: *const Self,
                rsb: isize,
                csb: isize,
                beta: Self,
                c: *mut Self,
                rsc: isize,
                csc: isize,
            ) {
                // SAFETY: forwarded; the caller upholds the contract.
                unsafe { $gemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
            }
        }
    };
}
impl_real!(f32, matrixmultiply::sgemm);
impl_real!(f64, matrixmultiply::dgemm);

/// Matrix product `c = a' * b' + beta * c` on row-major buffers, where `a'` is `a` (`[m, k]`)
/// or, with `ta`, the transpose of `a` stored as `[k, m]`; likewise `b'` is `[k, n]` or, with
/// `tb`, `b` stored as `[n, k]`. `c` is `[m, n]`. Panics if a buffer is too short (internal
/// invariant: callers pass buffers sized from the same shapes).
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: Real>(
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    ta: bool,
    b: &[T],
    tb: bool,
    beta: T,
    c: &mut [T],
) {
    assert!(
        a.len() >= m * k && b.len() >= k * n && c.len() >= m * n,
        "gemm: buffer too short"
    );
    if m == 0 || n == 0 {
        return;
    }
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    // SAFETY: sizes were checked above; strides describe the stated row-major layouts.
    unsafe {
        T::gemm_raw(
            m,
            k,
            n,
            T::ONE,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    }
}

// ------------------------------------------------------------------------------------------
// Embedding (token table + optional learned positions)

/// `out[i] = wte[tokens[i]] + wpe[i % seq]` (no positions when `wpe` is `None`).
/// `out` is `[n, c]`; tokens must be `< vocab` (checked by the caller).
pub fn encoder_forward<T: Real>(
    out: &mut [T],
    tokens: &[u32],
    wte: &[T],
    wpe: Option<&[T]>,
    seq: usize,
    c: usize,
) {
    out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
        let tok = tokens[i] as usize;
        o.copy_from_slice(&wte[tok * c..tok * c + c]);
        if let Some(wpe) = wpe {
            let t = i % seq;
            for (x, p) in o.iter_mut().zip(&wpe[t * c..t * c + c]) {
                *x += *p;
            }
        }
    });
}

/// Backward of [`encoder_forward`]: scatter-add `dout` rows into `dwte` (and `dwpe`).
pub fn encoder_backward<T: Real>(
    dwte: &mut [T],
    dwpe: Option<&mut [T]>,
    dout: &[T],
    tokens: &[u32],
    seq: usize,
    c: usize,
) {
    for (i, d) in dout.chunks(c).enumerate() {
        let tok = tokens[i] as usize;
        for (w, g) in dwte[tok * c..tok * c + c].iter_mut().zip(d) {
            *w += *g;
        }
    }
    if let Some(dwpe) = dwpe {
        for (i, d) in dout.chunks(c).enumerate() {
            let t = i % seq;
            for (w, g) in dwpe[t * c..t * c + c].iter_mut().zip(d) {
                *w += *g;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Linear layer

/// `out[n, oc] = inp[n, ic] * w[oc, ic]^T + bias[oc]`.
pub fn matmul_forward<T: Real>(
    out: &mut [T],
    inp: &[T],
    w: &[T],
    bias: Option<&[T]>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    gemm(n, ic, oc, inp, false, w, true, T::ZERO, out);
    if let Some(b) = bias {
        bias_forward(out, b, oc);
    }
}

/// `out[r, j] += bias[j]` for every row `r` of `oc` columns (the bias of [`matmul_forward`]).
pub fn bias_forward<T: Real>(out: &mut [T], bias: &[T], oc: usize) {
    out.par_chunks_mut(oc).for_each(|row| {
        for (o, bb) in row.iter_mut().zip(bias) {
            *o += *bb;
        }
    });
}

/// `dbias[j] += sum_r dout[r, j]`, rows added in order (the bias of [`matmul_backward`]).
pub fn bias_backward<T: Real>(dbias: &mut [T], dout: &[T], oc: usize) {
    for row in dout.chunks(oc) {
        for (d, g) in dbias.iter_mut().zip(row) {
            *d += *g;
        }
    }
}

/// Backward of [`matmul_forward`]: `dinp += dout * w`, `dw += dout^T * inp`,
/// `dbias += sum_rows(dout)`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<T: Real>(
    dinp: &mut [T],
    dw: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    w: &[T],
    n: usize,
    ic: usize,
    oc: usize,
) {
    gemm(n, oc, ic, dout, false, w, false, T::ONE, dinp);
    gemm(oc, n, ic, dout, true, inp, false, T::ONE, dw);
    if let Some(db) = dbias {
        bias_backward(db, dout, oc);
    }
}

// ------------------------------------------------------------------------------------------
// LayerNorm

/// LayerNorm over the last dimension `c`: `out = (x - mean) * rstd * w + b`. Saves `mean`
/// and `rstd` (`[n]`) for the backward pass.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Real>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    w: &[T],
    b: &[T],
    c: usize,
    eps: f64,
) {
    out.par_chunks_mut(c)
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .zip(inp.par_chunks(c))
        .for_each(|((o, (m, r)), x)| {
            let cf = T::from_f64(c as f64);
            let mut mu = T::ZERO;
            for &v in x {
                mu += v;
            }
            mu = mu / cf;
            let mut var = T::ZERO;
            for &v in x {
                let d = v - mu;
                var += d * d;
            }
            var = var / cf;
            let rs = T::ONE / (var + T::from_f64(eps)).sqrt();
            for i in 0..c {
                o[i] = (x[i] - mu) * rs * w[i] + b[i];
            }
            *m = mu;
            *r = rs;
        });
}

/// Backward of [`layernorm_forward`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Real>(
    dinp: &mut [T],
    dw: &mut [T],
    db: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    mean: &[T],
    rstd: &[T],
    c: usize,
) {
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|(((di, d), x), (&mu, &rs))| {
            let mut dnorm_mean = T::ZERO;
            let mut dnorm_norm_mean = T::ZERO;
            for i in 0..c {
                let norm = (x[i] - mu) * rs;
                let dnorm = w[i] * d[i];
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * norm;
            }
            let cf = T::from_f64(c as f64);
            dnorm_mean = dnorm_mean / cf;
            dnorm_norm_mean = dnorm_norm_mean / cf;
            for i in 0..c {
                let norm = (x[i] - mu) * rs;
                let dnorm = w[i] * d[i];
                di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs;
            }
        });
    for ((d, x), (&mu, &rs)) in dout.chunks(c).zip(inp.chunks(c)).zip(mean.iter().zip(rstd)) {
        for i in 0..c {
            let norm = (x[i] - mu) * rs;
            db[i] += d[i];
            dw[i] += norm * d[i];
        }
    }
}

// ------------------------------------------------------------------------------------------
// RMSNorm

/// RMSNorm over the last dimension: `out = x * rstd * w`, `rstd = 1/sqrt(mean(x^2) + eps)`.
pub fn rmsnorm_forward<T: Real>(
    out: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    w: &[T],
    c: usize,
    eps: f64,
) {
    out.par_chunks_mut(c)
        .zip(rstd.par_iter_mut())
        .zip(inp.par_chunks(c))
        .for_each(|((o, r), x)| {
            let mut ss = T::ZERO;
            for &v in x {
                ss += v * v;
            }
            let rs = T::ONE / (ss / T::from_f64(c as f64) + T::from_f64(eps)).sqrt();
            for i in 0..c {
                o[i] = x[i] * rs * w[i];
            }
            *r = rs;
        });
}

/// Backward of [`rmsnorm_forward`].
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<T: Real>(
    dinp: &mut [T],
    dw: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    rstd: &[T],
    c: usize,
) {
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c))
        .zip(rstd.par_iter())
        .for_each(|(((di, d), x), &rs)| {
            // y_i = x_i * rs * w_i ; d rs / d x_j = -rs^3 * x_j / c
            let mut dot = T::ZERO;
            for i in 0..c {
                dot += d[i] * w[i] * x[i];
            }
            let k = dot * rs * rs * rs / T::from_f64(c as f64);
            for i in 0..c {
                di[i] += d[i] * w[i] * rs - x[i] * k;
            }
        });
    for ((d, x), &rs) in dout.chunks(c).zip(inp.chunks(c)).zip(rstd) {
        for i in 0..c {
            dw[i] += d[i] * x[i] * rs;
        }
    }
}

// ------------------------------------------------------------------------------------------
// GELU (tanh approximation, as GPT-2)

const GELU_SCALE: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)

/// `out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_forward<T: Real>(out: &mut [T], inp: &[T]) {
    let s = T::from_f64(GELU_SCALE);
    let k = T::from_f64(0.044715);
    let half = T::from_f64(0.5);
    out.par_chunks_mut(4096)
        .zip(inp.par_chunks(4096))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                let cube = k * x * x * x;
                *o = half * x * (T::ONE + (s * (x + cube)).tanh());
            }
        });
}

/// Backward of [`gelu_forward`]: `dinp += gelu'(x) * dout`.
pub fn gelu_backward<T: Real>(dinp: &mut [T], inp: &[T], dout: &[T]) {
    let s = T::from_f64(GELU_SCALE);
    let k = T::from_f64(0.044715);
    let k3 = T::from_f64(3.0 * 0.044715);
    let half = T::from_f64(0.5);
    dinp.par_chunks_mut(4096)
        .zip(inp.par_chunks(4096).zip(dout.par_chunks(4096)))
        .for_each(|(di, (x, d))| {
            for ((di, &x), &d) in di.iter_mut().zip(x).zip(d) {
                let cube = k * x * x * x;
                let th = (s * (x + cube)).tanh();
                let sech2 = T::ONE - th * th;
                let g = half * (T::ONE + th) + half * x * sech2 * s * (T::ONE + k3 * x * x);
                *di += g * d;
            }
        });
}

// ------------------------------------------------------------------------------------------
// SwiGLU: out = silu(gate) * up, input rows are [gate (h) | up (h)]

#[inline]
fn sigmoid<T: Real>(x: T) -> T {
    T::ONE / (T::ONE + (-x).exp())
}

/// `out[n, h] = silu(inp[:, :h]) * inp[:, h:]` with `inp` of shape `[n, 2h]`.
pub fn swiglu_forward<T: Real>(out: &mut [T], inp: &[T], h: usize) {
    out.par_chunks_mut(h)
        .zip(inp.par_chunks(2 * h))
        .for_each(|(o, x)| {
            let (g, u) = x.split_at(h);
            for i in 0..h {
                o[i] = g[i] * sigmoid(g[i]) * u[i];
            }
        });
}

/// Backward of [`swiglu_forward`].
pub fn swiglu_backward<T: Real>(dinp: &mut [T], inp: &[T], dout: &[T], h: usize) {
    dinp.par_chunks_mut(2 * h)
        .zip(inp.par_chunks(2 * h).zip(dout.par_chunks(h)))
        .for_each(|(di, (x, d))| {
            let (g, u) = x.split_at(h);
            let (dg, du) = di.split_at_mut(h);
            for i in 0..h {
                let sg = sigmoid(g[i]);
                let silu = g[i] * sg;
                du[i] += d[i] * silu;
                dg[i] += d[i] * u[i] * (sg + silu * (T::ONE - sg));
            }
        });
}

// ------------------------------------------------------------------------------------------
// Rotary position embedding (interleaved pairs (2j, 2j+1), as Meta's LLaMA)

/// Rotates, in each row of width `width`, the first `rot_heads` heads of size `hs` by the
/// angle `pos * base^(-2j/hs)` for the pair `(2j, 2j+1)`; other columns are copied. The row
/// `i` has position `i % seq`. Used on the fused `qkv` rows with `rot_heads = 2 * heads`
/// (q and k rotated, v copied).
#[allow(clippy::too_many_arguments)]
pub fn rope_forward<T: Real>(
    out: &mut [T],
    inp: &[T],
    seq: usize,
    width: usize,
    rot_heads: usize,
    hs: usize,
    base: f64,
) {
    rope_apply(out, inp, seq, width, rot_heads, hs, base, 1.0, false);
}

/// Backward of [`rope_forward`]: `dinp += R^T dout` (rotation by the opposite angle).
#[allow(clippy::too_many_arguments)]
pub fn rope_backward<T: Real>(
    dinp: &mut [T],
    dout: &[T],
    seq: usize,
    width: usize,
    rot_heads: usize,
    hs: usize,
    base: f64,
) {
    rope_apply(dinp, dout, seq, width, rot_heads, hs, base, -1.0, true);
}

#[allow(clippy::too_many_arguments)]
fn rope_apply<T: Real>(
    out: &mut [T],
    inp: &[T],
    seq: usize,
    width: usize,
    rot_heads: usize,
    hs: usize,
    base: f64,
    sign: f64,
    accumulate: bool,
) {
    let half = hs / 2;
    // Angle table per (position, pair), computed in f64 for both float types.
    let mut cs = vec![(T::ZERO, T::ZERO); seq * half];
    for t in 0..seq {
        for j in 0..half {
            let theta = t as f64 * base.powf(-2.0 * j as f64 / hs as f64);
            cs[t * half + j] = (T::from_f64(theta.cos()), T::from_f64(sign * theta.sin()));
        }
    }
    out.par_chunks_mut(width)
        .zip(inp.par_chunks(width))
        .enumerate()
        .for_each(|(i, (o, x))| {
            let t = i % seq;
            let rot = rot_heads * hs;
            for h in 0..rot_heads {
                for j in 0..half {
                    let (c, s) = cs[t * half + j];
                    let a = x[h * hs + 2 * j];
                    let b = x[h * hs + 2 * j + 1];
                    let ra = a * c - b * s;
                    let rb = a * s + b * c;
                    if accumulate {
                        o[h * hs + 2 * j] += ra;
                        o[h * hs + 2 * j + 1] += rb;
                    } else {
                        o[h * hs + 2 * j] = ra;
                        o[h * hs + 2 * j + 1] = rb;
                    }
                }
            }
            for k in rot..width {
                if accumulate {
                    o[k] += x[k];
                } else {
                    o[k] = x[k];
                }
            }
        });
}

// ------------------------------------------------------------------------------------------
// Multi-head causal self-attention

/// Causal attention. `qkv` is `[b*t, 3c]` (q | k | v, heads contiguous inside each), `out` is
/// `[b*t, c]`, `att` (`[b, nh, t, t]`) receives the softmax probabilities (zero above the
/// diagonal) for the backward pass. Scale `1/sqrt(hs)`.
pub fn attention_forward<T: Real>(
    out: &mut [T],
    att: &mut [T],
    qkv: &[T],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    assert!(
        qkv.len() >= b * t * 3 * c && att.len() >= b * nh * t * t,
        "attention: short buffer"
    );
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let c3 = 3 * c;
    let parts: Vec<Vec<T>> = att
        .par_chunks_mut(t * t)
        .enumerate()
        .map(|(bh, att_bh)| {
            let (bi, h) = (bh / nh, bh % nh);
            let mut o = vec![T::ZERO; t * hs];
            for ti in 0..t {
                let q = &qkv[(bi * t + ti) * c3 + h * hs..][..hs];
                let row = &mut att_bh[ti * t..ti * t + t];
                let mut maxv = T::from_f64(f64::NEG_INFINITY);
                for t2 in 0..=ti {
                    let k = &qkv[(bi * t + t2) * c3 + c + h * hs..][..hs];
                    let mut s = T::ZERO;
                    for i in 0..hs {
                        s += q[i] * k[i];
                    }
                    s *= scale;
                    row[t2] = s;
                    maxv = maxv.max(s);
                }
                let mut sum = T::ZERO;
                for v in row[..=ti].iter_mut() {
                    *v = (*v - maxv).exp();
                    sum += *v;
                }
                let inv = T::ONE / sum;
                for v in row[..=ti].iter_mut() {
                    *v *= inv;
                }
                for v in row[ti + 1..].iter_mut() {
                    *v = T::ZERO;
                }
                let ot = &mut o[ti * hs..ti * hs + hs];
                for t2 in 0..=ti {
                    let v = &qkv[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    let a = row[t2];
                    for i in 0..hs {
                        ot[i] += a * v[i];
                    }
                }
            }
            o
        })
        .collect();
    // Scatter the per-head outputs into [b*t, c].
    out.par_chunks_mut(t * c).enumerate().for_each(|(bi, ob)| {
        for h in 0..nh {
            let o = &parts[bi * nh + h];
            for ti in 0..t {
                ob[ti * c + h * hs..ti * c + h * hs + hs]
                    .copy_from_slice(&o[ti * hs..ti * hs + hs]);
            }
        }
    });
}

/// Backward of [`attention_forward`]: accumulates into `dqkv` (`[b*t, 3c]`).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Real>(
    dqkv: &mut [T],
    dout: &[T],
    qkv: &[T],
    att: &[T],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    assert!(
        qkv.len() >= b * t * 3 * c && att.len() >= b * nh * t * t,
        "attention: short buffer"
    );
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let c3 = 3 * c;
    let parts: Vec<Vec<T>> = att
        .par_chunks(t * t)
        .enumerate()
        .map(|(bh, att_bh)| {
            let (bi, h) = (bh / nh, bh % nh);
            // [dq | dk | dv], each [t, hs]
            let mut g = vec![T::ZERO; 3 * t * hs];
            let mut datt = vec![T::ZERO; t];
            for ti in 0..t {
                let row = &att_bh[ti * t..ti * t + t];
                let d = &dout[(bi * t + ti) * c + h * hs..][..hs];
                // through out = sum att * v
                for t2 in 0..=ti {
                    let v = &qkv[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    let mut s = T::ZERO;
                    for i in 0..hs {
                        s += v[i] * d[i];
                    }
                    datt[t2] = s;
                    let dv = &mut g[2 * t * hs + t2 * hs..][..hs];
                    let a = row[t2];
                    for i in 0..hs {
                        dv[i] += a * d[i];
                    }
                }
                // through softmax: dpre = att * (datt - sum(att * datt))
                let mut dot = T::ZERO;
                for t2 in 0..=ti {
                    dot += row[t2] * datt[t2];
                }
                let q = &qkv[(bi * t + ti) * c3 + h * hs..][..hs];
                for t2 in 0..=ti {
                    let dpre = row[t2] * (datt[t2] - dot) * scale;
                    let k = &qkv[(bi * t + t2) * c3 + c + h * hs..][..hs];
                    let (dq_part, rest) = g.split_at_mut(t * hs);
                    let dq = &mut dq_part[ti * hs..ti * hs + hs];
                    let dk = &mut rest[t2 * hs..t2 * hs + hs];
                    for i in 0..hs {
                        dq[i] += dpre * k[i];
                        dk[i] += dpre * q[i];
                    }
                }
            }
            g
        })
        .collect();
    dqkv.par_chunks_mut(t * c3)
        .enumerate()
        .for_each(|(bi, db)| {
            for h in 0..nh {
                let g = &parts[bi * nh + h];
                for ti in 0..t {
                    for (part, off) in [(0, 0), (1, c), (2, 2 * c)] {
                        let src = &g[part * t * hs + ti * hs..][..hs];
                        let dst = &mut db[ti * c3 + off + h * hs..][..hs];
                        for i in 0..hs {
                            dst[i] += src[i];
                        }
                    }
                }
            }
        });
}

// ------------------------------------------------------------------------------------------
// Softmax + cross-entropy

/// Softmax over each row of `logits` (`[n, v]`) into `probs`; returns the mean over rows of
/// `-ln p[target]`. Targets must be `< v` (checked by the caller).
pub fn crossentropy_forward<T: Real>(
    probs: &mut [T],
    logits: &[T],
    targets: &[u32],
    v: usize,
) -> f64 {
    let losses = crossentropy_forward_rows(probs, logits, targets, v);
    let n = losses.len().max(1);
    losses.iter().sum::<f64>() / n as f64
}

/// [`crossentropy_forward`] without the mean: the loss `-ln p[target]` of every row.
pub fn crossentropy_forward_rows<T: Real>(
    probs: &mut [T],
    logits: &[T],
    targets: &[u32],
    v: usize,
) -> Vec<f64> {
    probs
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .zip(targets.par_iter())
        .map(|((p, l), &tg)| {
            let mut maxv = T::from_f64(f64::NEG_INFINITY);
            for &x in l {
                maxv = maxv.max(x);
            }
            let mut sum = T::ZERO;
            for (pi, &x) in p.iter_mut().zip(l) {
                *pi = (x - maxv).exp();
                sum += *pi;
            }
            let inv = T::ONE / sum;
            for pi in p.iter_mut() {
                *pi *= inv;
            }
            // -ln p[target] computed from logits for accuracy.
            -((l[tg as usize] - maxv).to_f64() - sum.to_f64().ln())
        })
        .collect()
}

/// Backward of [`crossentropy_forward`] for the mean loss scaled by `dloss`:
/// `dlogits += (probs - onehot(target)) * dloss / n`.
pub fn crossentropy_backward<T: Real>(
    dlogits: &mut [T],
    probs: &[T],
    targets: &[u32],
    v: usize,
    dloss: f64,
) {
    let n = targets.len().max(1);
    let s = T::from_f64(dloss / n as f64);
    dlogits
        .par_chunks_mut(v)
        .zip(probs.par_chunks(v))
        .zip(targets.par_iter())
        .for_each(|((d, p), &tg)| {
            for (i, (di, &pi)) in d.iter_mut().zip(p).enumerate() {
                let ind = if i == tg as usize { T::ONE } else { T::ZERO };
                *di += (pi - ind) * s;
            }
        });
}

/// `out = a + b` elementwise.
pub fn residual_forward<T: Real>(out: &mut [T], a: &[T], b: &[T]) {
    out.par_chunks_mut(4096)
        .zip(a.par_chunks(4096).zip(b.par_chunks(4096)))
        .for_each(|(o, (a, b))| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

/// `dst += src` elementwise.
pub fn add_inplace<T: Real>(dst: &mut [T], src: &[T]) {
    dst.par_chunks_mut(4096)
        .zip(src.par_chunks(4096))
        .for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                *d += s;
            }
        });
}
