/* Misuse from C: NULL handles and out-pointers, out-of-range enum integers,
 * bad options versions, tiny buffers, freeing NULL. Every call must return a
 * status (never crash); run under AddressSanitizer by tests/abi_c.rs. */
#include "gwtf.h"
#include <stdio.h>
#include <string.h>

static int failures = 0;

#define EXPECT(cond)                                                         \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "FAILED line %d: %s\n", __LINE__, #cond);       \
            failures++;                                                      \
        }                                                                    \
    } while (0)

/* Reads *errp inside the function: C leaves the order of argument evaluation
 * unspecified, so the error must not be passed by value next to the call. */
static gwtf_status expect_error(gwtf_status st, gwtf_error **errp, gwtf_status want) {
    gwtf_error *err = *errp;
    *errp = NULL;
    EXPECT(st == want);
    EXPECT(err != NULL);
    if (err) {
        EXPECT(gwtf_error_status(err) == (int32_t)want);
        EXPECT(strlen(gwtf_error_message(err)) > 0);
        printf("  %-28s -> %s\n", gwtf_status_str(st), gwtf_error_message(err));
        gwtf_error_free(err);
    }
    return st;
}

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
    expect_error(gwtf_cuda_probe(NULL, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    err = NULL;
    EXPECT(gwtf_cuda_probe(NULL, NULL, NULL) == GWTF_STATUS_NULL_POINTER); /* no error object wanted */

    /* NULL handles. */
    expect_error(gwtf_cuda_info_state(NULL, &state, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_error(gwtf_cuda_info_device_count(NULL, &count, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_error(gwtf_cuda_info_describe(NULL, small, sizeof small, &len, &err), &err,
                 GWTF_STATUS_NULL_POINTER);
    EXPECT(state == -1 && count == 77); /* outputs untouched on failure */

    /* Out-of-range enum integer and unknown options versions. */
    EXPECT(gwtf_cuda_probe_options_init(&opts) == GWTF_STATUS_OK);
    EXPECT(opts.version == GWTF_CUDA_PROBE_OPTIONS_VERSION);
    opts.detail = 42;
    expect_error(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    EXPECT(info == NULL);
    opts.detail = -2147483647 - 1;
    expect_error(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    opts.detail = GWTF_CUDA_PROBE_DETAIL_DEVICES;
    opts.version = 0;
    expect_error(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_UNSUPPORTED_VERSION);
    opts.version = 999;
    expect_error(gwtf_cuda_probe(&opts, &info, &err), &err, GWTF_STATUS_UNSUPPORTED_VERSION);
    EXPECT(info == NULL);

    /* A valid handle, then NULL out-pointers and too-small buffers on it. */
    opts.version = GWTF_CUDA_PROBE_OPTIONS_VERSION;
    EXPECT(gwtf_cuda_probe(&opts, &info, &err) == GWTF_STATUS_OK);
    EXPECT(info != NULL && err == NULL);
    expect_error(gwtf_cuda_info_state(info, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_error(gwtf_cuda_info_device_count(info, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    len = 0;
    expect_error(gwtf_cuda_info_describe(info, small, sizeof small, &len, &err), &err,
                 GWTF_STATUS_BUFFER_TOO_SMALL);
    EXPECT(len > sizeof small); /* the required length is reported */
    expect_error(gwtf_cuda_info_describe(info, NULL, 16, &len, &err), &err, GWTF_STATUS_NULL_POINTER);
    EXPECT(gwtf_cuda_info_describe(info, NULL, 0, &len, NULL) == GWTF_STATUS_BUFFER_TOO_SMALL);
    expect_error(gwtf_cuda_info_device_name(info, 4000000000u, small, sizeof small, &len, NULL, &err),
                 &err, GWTF_STATUS_NOT_FOUND);
    /* A pointer to something that is not a gwtf_cuda_info is refused. */
    {
        uint64_t fake[64];
        memset(fake, 0x5a, sizeof fake);
        expect_error(gwtf_cuda_info_state((const gwtf_cuda_info *)fake, &state, &err), &err,
                     GWTF_STATUS_INVALID_ARGUMENT);
    }
    gwtf_cuda_info_free(info);

    if (failures) {
        fprintf(stderr, "misuse: %d failure(s)\n", failures);
        return 1;
    }
    printf("misuse: all checks passed\n");
    return 0;
}
