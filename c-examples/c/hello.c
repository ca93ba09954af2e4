/* hello.c: the smallest useful libgwtf program in C.
 * Checks the ABI, shows status and error handling, and probes CUDA. */
#include <gwtf.h>
#include <stdio.h>
#include <stdlib.h>

/* Prints the error of a failed call and frees it. */
static void report(const char *what, gwtf_status st, gwtf_error *err) {
    printf("%s failed: status %d (%s): %s\n", what, (int)st, gwtf_status_str(st),
           gwtf_error_message(err));
    gwtf_error_free(err);
}

int main(void) {
    gwtf_cuda_probe_options opts;
    gwtf_cuda_info *info = NULL;
    gwtf_error *err = NULL;
    gwtf_status st;
    int32_t state = 0;
    uint32_t count = 0, i;
    size_t len = 0;
    char *text;

    printf("libgwtf %s (ABI %u, header ABI %d)\n", gwtf_version(), (unsigned)gwtf_abi_version(),
           GWTF_ABI_VERSION);
    if (gwtf_abi_version() != GWTF_ABI_VERSION) {
        fprintf(stderr, "ABI mismatch: rebuild against the installed gwtf.h\n");
        return 1;
    }

    /* Errors are values: a bad option comes back as a status and a message. */
    gwtf_cuda_probe_options_init(&opts);
    opts.detail = 7;
    st = gwtf_cuda_probe(&opts, &info, &err);
    report("probe with detail=7", st, err);

    opts.detail = GWTF_CUDA_PROBE_DETAIL_DEVICES;
    st = gwtf_cuda_probe(&opts, &info, &err);
    if (st != GWTF_STATUS_OK) {
        report("probe", st, err);
        return 1;
    }
    gwtf_cuda_info_state(info, &state, NULL);
    gwtf_cuda_info_device_count(info, &count, NULL);
    gwtf_cuda_info_describe(info, NULL, 0, &len, NULL); /* asks the length */
    text = malloc(len + 1);
    if (text && gwtf_cuda_info_describe(info, text, len + 1, NULL, NULL) == GWTF_STATUS_OK)
        printf("cuda: %s\n", text);
    free(text);
    printf("cuda state %d, %u device(s)\n", (int)state, (unsigned)count);
    for (i = 0; i < count; i++) {
        char name[256];
        uint64_t mem = 0;
        if (gwtf_cuda_info_device_name(info, i, name, sizeof name, NULL, &mem, NULL) == GWTF_STATUS_OK)
            printf("  device %u: %s, %llu MiB\n", (unsigned)i, name, (unsigned long long)(mem >> 20));
    }
    gwtf_cuda_info_free(info);
    printf("hello_c: ok\n");
    return 0;
}
