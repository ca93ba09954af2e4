/* A deliberate panic inside an exported function comes back as
 * GWTF_STATUS_PANIC and poisons the handle it used. gwtf_debug_panic exists in
 * debug builds only and is not in the header. */
#include "gwtf.h"
#include <stdio.h>

gwtf_status gwtf_debug_panic(const gwtf_cuda_info *info, gwtf_error **out_err);

int main(void) {
    gwtf_error *err = NULL;
    gwtf_cuda_info *info = NULL;
    int32_t state = 0;
    gwtf_status st = gwtf_debug_panic(NULL, &err);
    printf("no handle: %s | %s\n", gwtf_status_str(st), gwtf_error_message(err));
    if (st != GWTF_STATUS_PANIC) return 1;
    gwtf_error_free(err);

    if (gwtf_cuda_probe(NULL, &info, NULL) != GWTF_STATUS_OK) return 2;
    if (gwtf_cuda_info_state(info, &state, NULL) != GWTF_STATUS_OK) return 3;
    st = gwtf_debug_panic(info, &err);
    printf("with handle: %s | %s\n", gwtf_status_str(st), gwtf_error_message(err));
    if (st != GWTF_STATUS_PANIC) return 4;
    gwtf_error_free(err);
    st = gwtf_cuda_info_state(info, &state, &err);
    printf("after: %s | %s\n", gwtf_status_str(st), gwtf_error_message(err));
    if (st != GWTF_STATUS_POISONED) return 5;
    gwtf_error_free(err);
    gwtf_cuda_info_free(info); /* a poisoned handle can still be freed */
    printf("panic: ok\n");
    return 0;
}
