// GELU (tanh approximation, as GPT-2) and SwiGLU, as in src/model/ops.rs.
// tanhf/expf differ from the CPU's libm by an ulp or two.

#define GWTF_GELU_SCALE 0.7978845608028654f // sqrt(2/pi)

extern "C" __global__ void gwtf_gelu_forward(float *out, const float *in, gwtf_size n) {
    GWTF_FOR(i, n) {
        float x = in[i];
        float cube = 0.044715f * x * x * x;
        out[i] = 0.5f * x * (1.0f + tanhf(GWTF_GELU_SCALE * (x + cube)));
    }
}

extern "C" __global__ void gwtf_gelu_backward(float *dinp, const float *in, const float *dout,
                                              gwtf_size n) {
    GWTF_FOR(i, n) {
        float x = in[i];
        float cube = 0.044715f * x * x * x;
        float th = tanhf(GWTF_GELU_SCALE * (x + cube));
        float sech2 = 1.0f - th * th;
        float g = 0.5f * (1.0f + th) +
                  0.5f * x * sech2 * GWTF_GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] += g * dout[i];
    }
}

// Rows of `in` are [gate (h) | up (h)]; out[r, i] = silu(gate) * up.
extern "C" __global__ void gwtf_swiglu_forward(float *out, const float *in, gwtf_size rows,
                                               unsigned int h) {
    GWTF_FOR(k, rows * h) {
        gwtf_size r = k / h, i = k % h;
        float g = in[r * 2 * h + i], u = in[r * 2 * h + h + i];
        float sg = 1.0f / (1.0f + expf(-g));
        out[k] = g * sg * u;
    }
}

extern "C" __global__ void gwtf_swiglu_backward(float *dinp, const float *in, const float *dout,
                                                gwtf_size rows, unsigned int h) {
    GWTF_FOR(k, rows * h) {
        gwtf_size r = k / h, i = k % h;
        float g = in[r * 2 * h + i], u = in[r * 2 * h + h + i];
        float sg = 1.0f / (1.0f + expf(-g));
        float silu = g * sg;
        float d = dout[k];
        dinp[r * 2 * h + h + i] += d * silu;
        dinp[r * 2 * h + i] += d * u * (sg + silu * (1.0f - sg));
    }
}
