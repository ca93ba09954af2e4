/* Probes CUDA and prints state, device count and the description. */
#include "gwtf.h"
#include <stdio.h>
#include <stdlib.h>

int main(void) {
    gwtf_cuda_info *info = NULL;
    gwtf_error *err = NULL;
    int32_t state = -1;
    uint32_t count = 0;
    size_t len = 0;
    char *text;
    if (gwtf_cuda_probe(NULL, &info, &err) != GWTF_STATUS_OK) {
        fprintf(stderr, "probe failed: %s\n", gwtf_error_message(err));
        gwtf_error_free(err);
        return 1;
    }
    if (gwtf_cuda_info_state(info, &state, NULL) != GWTF_STATUS_OK) return 2;
    if (gwtf_cuda_info_device_count(info, &count, NULL) != GWTF_STATUS_OK) return 3;
    /* Ask the length first, then fetch. */
    if (gwtf_cuda_info_describe(info, NULL, 0, &len, NULL) != GWTF_STATUS_BUFFER_TOO_SMALL) return 4;
    text = malloc(len + 1);
    if (!text || gwtf_cuda_info_describe(info, text, len + 1, NULL, NULL) != GWTF_STATUS_OK) return 5;
    printf("state=%d count=%u %s\n", (int)state, (unsigned)count, text);
    free(text);
    gwtf_cuda_info_free(info);
    return 0;
}
