// Fused AdamW step, identical to adamw_update in src/model/kernels.rs:
//   g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   p -= lr * (m/bc1 / (sqrt(v/bc2) + eps) + wd * p)
// bc1 = 1 - b1^t and bc2 = 1 - b2^t are computed on the host in f32.
extern "C" __global__ void gwtf_adamw(float *p, const float *grad, float *m, float *v, gwtf_size n,
                                      float lr, float b1, float b2, float eps, float wd, float bc1,
                                      float bc2, float grad_scale) {
    GWTF_FOR(i, n) {
        float g = grad[i] * grad_scale;
        float mi = b1 * m[i] + (1.0f - b1) * g;
        float vi = b2 * v[i] + (1.0f - b2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1;
        float vhat = vi / bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
    }
}
