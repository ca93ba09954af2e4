/* Misuse from C: NULL handles and out-pointers, out-of-range enum integers,
 * bad options versions, tiny buffers, freeing NULL. Every call must return a
 * status (never crash); run under AddressSanitizer by tests/abi_c.rs. */
#include "gwtf.h"
#include "expect.h"
#include <stdio.h>
#include <string.h>

int main(void) {
    gwtf_error *err = NULL;
    gwtf_cuda_info *info = NULL;
    gwtf_cuda_probe_options opts;
    int32_t state = -1;
    uint32_t count = 77;
    size_t len = 0;
    char small[2];

    /* Frees of NULL are no-ops. */
    gwtf_error_free(NULL);
    gwtf_cuda_info_free(NULL);

    /* Status strings accept any integer. */
    EXPECT(strcmp(gwtf_status_str(-1), "unknown status") == 0);
    EXPECT(strcmp(gwtf_status_str(1000000), "unknown status") == 0);
    EXPECT(strcmp(gwtf_status_str(GWTF_STATUS_PANIC), "panic caught at the C boundary") == 0);
    EXPECT(gwtf_error_status(NULL) == GWTF_STATUS_NULL_POINTER);
    EXPECT(gwtf_error_message(NULL) != NULL);

    /* NULL out-pointers. */
    EXPECT(gwtf_cuda_probe_options_init(NULL) == GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_cuda_probe(NULL, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    err = NULL;
    EXPECT(gwtf_cuda_probe(NULL, NULL, NULL) == GWTF_STATUS_NULL_POINTER); /* no error object wanted */

    /* NULL handles. */
    expect_fail(gwtf_cuda_info_state(NULL, &state, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_cuda_info_device_count(NULL, &count, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_cuda_info_describe(NULL, small, sizeof small, &len, &err), &err,
                 GWTF_STATUS_NULL_POINTER);
    EXPECT(state == -1 && count == 77); /* outputs untouched on failure */

    /* Out-of-range enum integer and unknown options versions. */
    EXPECT(gwtf_cuda_probe_options_init(&opts) == GWTF_STATUS_OK);
    EXPECT(opts.version == GWTF_CUDA_PROBE_OPTIONS_VERSION);
    opts.detail = 42;
    expect_fail(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    EXPECT(info == NULL);
    opts.detail = -2147483647 - 1;
    expect_fail(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    opts.detail = GWTF_CUDA_PROBE_DETAIL_DEVICES;
    opts.version = 0;
    expect_fail(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_UNSUPPORTED_VERSION);
    opts.version = 999;
    expect_fail(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_UNSUPPORTED_VERSION);
    EXPECT(info == NULL);

    /* A valid handle, then NULL out-pointers and too-small buffers on it. */
    opts.version = GWTF_CUDA_PROBE_OPTIONS_VERSION;
    EXPECT(gwtf_cuda_probe(&opts, &info, &err) == GWTF_STATUS_OK);
    EXPECT(info != NULL && err == NULL);
    expect_fail(gwtf_cuda_info_state(info, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_cuda_info_device_count(info, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    len = 0;
    expect_fail(gwtf_cuda_info_describe(info, small, sizeof small, &len, &err), &err,
                 GWTF_STATUS_BUFFER_TOO_SMALL);
    EXPECT(len > sizeof small); /* the required length is reported */
    expect_fail(gwtf_cuda_info_describe(info, NULL, 16, &len, &err), &err, GWTF_STATUS_NULL_POINTER);
    EXPECT(gwtf_cuda_info_describe(info, NULL, 0, &len, NULL) == GWTF_STATUS_BUFFER_TOO_SMALL);
    expect_fail(gwtf_cuda_info_device_name(info, 4000000000u, small, sizeof small, &len, NULL, &err),
                 &err, GWTF_STATUS_NOT_FOUND);
    /* A pointer to something that is not a gwtf_cuda_info is refused. */
    {
        uint64_t fake[64];
        memset(fake, 0x5a, sizeof fake);
        expect_fail(gwtf_cuda_info_state((const gwtf_cuda_info *)fake, &state, &err), &err,
                     GWTF_STATUS_INVALID_ARGUMENT);
    }
    gwtf_cuda_info_free(info);

    return finish("misuse");
}
