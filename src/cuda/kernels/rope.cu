// Rotary position embedding on interleaved pairs (2j, 2j+1), as Meta's LLaMA
// and src/model/ops.rs: in each row of `width` floats, the first `rot_heads`
// heads of size `hs` are rotated by the angle of (position, pair); the other
// columns are copied (forward) or accumulated (backward). `cs` holds
// (cos, sign*sin) per (position, pair), computed on the host in double exactly
// as the CPU twin does; backward passes the table of the opposite angle.
extern "C" __global__ void gwtf_rope(float *out, const float *in, const float2 *cs, gwtf_size rows,
                                     unsigned int seq, unsigned int width, unsigned int rot_heads,
                                     unsigned int hs, int accumulate) {
    unsigned int half = hs / 2;
    GWTF_FOR(k, rows * width) {
        gwtf_size r = k / width;
        unsigned int col = (unsigned int)(k % width);
        unsigned int t = (unsigned int)(r % seq);
        const float *x = in + r * width;
        float v;
        if (col < rot_heads * hs) {
            unsigned int h = col / hs, j = (col % hs) / 2;
            float2 c = cs[t * half + j];
            float a = x[h * hs + 2 * j], b = x[h * hs + 2 * j + 1];
            v = (col % 2 == 0) ? (a * c.x - b * c.y) : (a * c.y + b * c.x);
        } else {
            v = x[col];
        }
        if (accumulate) out[k] += v; else out[k] = v;
    }
}
