/* The header compiles alone (C99/C++17, -Wall -Wextra -Werror -pedantic) and
 * prints its version macros so the test can compare them with Cargo.toml. */
#include "gwtf.h"
#include <stdio.h>

int main(void) {
    printf("%d.%d.%d %d %d\n", GWTF_VERSION_MAJOR, GWTF_VERSION_MINOR, GWTF_VERSION_PATCH,
           GWTF_VERSION_NUMBER, GWTF_ABI_VERSION);
    printf("runtime %s %u\n", gwtf_version(), (unsigned)gwtf_abi_version());
    return gwtf_abi_version() == GWTF_ABI_VERSION ? 0 : 3;
}
