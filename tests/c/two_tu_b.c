/* Second translation unit including the header. */
#include "gwtf.h"

int tu_b_status_is_ok(void) { return GWTF_STATUS_OK == 0 && GWTF_ABI_VERSION >= 1; }
