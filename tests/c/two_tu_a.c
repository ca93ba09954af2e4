/* First of two translation units that both include the header: nothing in it
 * may be defined twice at link time. */
#include "gwtf.h"
#include <stdio.h>

int tu_b_status_is_ok(void);

int main(void) {
    printf("two translation units: %s %d\n", gwtf_status_str(GWTF_STATUS_OK), tu_b_status_is_ok());
    return tu_b_status_is_ok() ? 0 : 1;
}
