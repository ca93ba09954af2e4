// Activation compression for the wire: fp32 <-> bf16 and blockwise int8.
// Semantics (identical to the CPU twins in src/model/kernels.rs):
// - bf16: round to nearest, ties to even; NaN stays NaN (quieted, sign kept).
// - int8: per block of `block` values, scale = absmax / 127 over the finite
//   values; q = clamp(rne(x / scale), -127, 127); NaN -> 0, +-inf -> +-127;
//   an all-zero block has scale 0 and codes 0. Dequantize: x' = q * scale.

extern "C" __global__ void gwtf_f32_to_bf16(const float *in, unsigned short *out, gwtf_size n) {
    GWTF_FOR(i, n) {
        unsigned int bits = __float_as_uint(in[i]);
        unsigned short b;
        if (isnan(in[i])) {
            b = (unsigned short)((bits >> 16) | 0x0040u);
        } else {
            unsigned int lsb = (bits >> 16) & 1u;
            b = (unsigned short)((bits + 0x7FFFu + lsb) >> 16);
        }
        out[i] = b;
    }
}

extern "C" __global__ void gwtf_bf16_to_f32(const unsigned short *in, float *out, gwtf_size n) {
    GWTF_FOR(i, n) { out[i] = __uint_as_float(((unsigned int)in[i]) << 16); }
}

// One thread block per quantization block (grid-stride over blocks).
extern "C" __global__ void gwtf_quantize_int8(const float *in, signed char *codes, float *scales,
                                              gwtf_size n, unsigned int block) {
    __shared__ float shared[32];
    gwtf_size nblocks = (n + block - 1) / block;
    for (gwtf_size b = blockIdx.x; b < nblocks; b += gridDim.x) {
        gwtf_size start = b * block;
        gwtf_size end = start + block < n ? start + block : n;
        float m = 0.0f;
        for (gwtf_size i = start + threadIdx.x; i < end; i += blockDim.x) {
            float a = fabsf(in[i]);
            a = a < __int_as_float(0x7f800000) ? a : 0.0f; // inf and NaN do not count
            m = a > m ? a : m;
        }
        float absmax = gwtf_block_max(m, shared, 0.0f);
        float scale = absmax / 127.0f;
        for (gwtf_size i = start + threadIdx.x; i < end; i += blockDim.x) {
            float y = in[i] / scale; // NaN input, and 0/0 for an all-zero block, give NaN
            y = isnan(y) ? 0.0f : y;
            y = fminf(fmaxf(y, -127.0f), 127.0f);
            codes[i] = (signed char)__float2int_rn(y);
        }
        if (threadIdx.x == 0) scales[b] = scale;
    }
}

extern "C" __global__ void gwtf_dequantize_int8(const signed char *codes, const float *scales,
                                                float *out, gwtf_size n, unsigned int block) {
    GWTF_FOR(i, n) { out[i] = (float)codes[i] * scales[i / block]; }
}
