/* The kernel C API on host buffers (CPU twins) and the device entry points'
 * behaviour without a GPU; run under AddressSanitizer by tests/abi_c.rs. */
#include "gwtf.h"
#include "expect.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
    enum { N = 1000, BLOCK = 64, NB = (N + BLOCK - 1) / BLOCK };
    float *x = malloc(N * sizeof *x), *back = malloc(N * sizeof *back);
    uint16_t *h = malloc(N * sizeof *h);
    int8_t *q = malloc(N);
    float scales[NB];
    float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8}, avg[4];
    const float *ins[2] = {a, b};
    float w[2] = {1, 3};
    gwtf_error *err = NULL;
    gwtf_gpu *gpu = NULL;
    gwtf_status st;
    int i;

    for (i = 0; i < N; i++) x[i] = (float)sin(i * 0.37) * (float)(1 + i % 7);

    /* bf16 round trip: relative error within 2^-8. */
    EXPECT(gwtf_quantize_bf16_host(x, h, N, &err) == GWTF_STATUS_OK && err == NULL);
    EXPECT(gwtf_dequantize_bf16_host(h, back, N, NULL) == GWTF_STATUS_OK);
    for (i = 0; i < N; i++) EXPECT(fabsf(back[i] - x[i]) <= fabsf(x[i]) / 256.0f);

    /* int8 round trip: error within half a scale step. */
    EXPECT(gwtf_quantize_int8_host(x, q, scales, NB, N, BLOCK, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_dequantize_int8_host(q, scales, NB, back, N, BLOCK, NULL) == GWTF_STATUS_OK);
    for (i = 0; i < N; i++) EXPECT(fabsf(back[i] - x[i]) <= scales[i / BLOCK] * 0.5f + 1e-6f);

    /* Weighted average 1:3. */
    EXPECT(gwtf_average_host(ins, w, 2, avg, 4, NULL) == GWTF_STATUS_OK);
    for (i = 0; i < 4; i++) EXPECT(fabsf(avg[i] - (a[i] + 3 * b[i]) / 4) < 1e-6f);
    printf("host kernels: ok (avg[0] = %g)\n", avg[0]);

    /* Empty buffers are (NULL, 0). */
    EXPECT(gwtf_quantize_bf16_host(NULL, NULL, 0, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_quantize_int8_host(NULL, NULL, NULL, 0, 0, BLOCK, NULL) == GWTF_STATUS_OK);

    /* Misuse. */
    expect_fail(gwtf_quantize_bf16_host(NULL, h, N, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_quantize_int8_host(x, q, scales, NB - 1, N, BLOCK, &err), &err,
                GWTF_STATUS_BUFFER_TOO_SMALL);
    expect_fail(gwtf_quantize_int8_host(x, q, scales, NB, N, 0, &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_quantize_bf16_host(x, h, (size_t)1 << 62, &err), &err,
                GWTF_STATUS_LIMIT_EXCEEDED);
    w[0] = -1;
    expect_fail(gwtf_average_host(ins, w, 2, avg, 4, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    w[0] = 0;
    w[1] = 0;
    expect_fail(gwtf_average_host(ins, w, 2, avg, 4, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_average_host(ins, w, 0, avg, 4, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    ins[1] = NULL;
    w[1] = 1;
    expect_fail(gwtf_average_host(ins, w, 2, avg, 4, &err), &err, GWTF_STATUS_NULL_POINTER);

    /* Device entry points: a NULL gpu is refused; without a GPU, opening one
     * says CUDA is unavailable. */
    expect_fail(gwtf_quantize_bf16_device(NULL, x, h, N, &err), &err, GWTF_STATUS_NULL_POINTER);
    st = gwtf_gpu_new(0, &gpu, &err);
    if (st == GWTF_STATUS_OK) {
        printf("gpu: opened\n");
        expect_fail(gwtf_quantize_bf16_device(gpu, NULL, NULL, 5, &err), &err,
                    GWTF_STATUS_NULL_POINTER);
        gwtf_gpu_free(gpu);
    } else {
        printf("gpu: %s\n", gwtf_error_message(err));
        EXPECT(st == GWTF_STATUS_CUDA_UNAVAILABLE);
        EXPECT(gpu == NULL);
        gwtf_error_free(err);
        err = NULL;
    }
    gwtf_gpu_free(NULL);

    free(x);
    free(back);
    free(h);
    free(q);
    return finish("kernels");
}
