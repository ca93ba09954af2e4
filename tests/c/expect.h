/* Shared checks of the C test programs (one translation unit each). */
#ifndef GWTF_TEST_EXPECT_H
#define GWTF_TEST_EXPECT_H

#include "gwtf.h"
#include <stdio.h>
#include <string.h>

static int failures = 0;

#define EXPECT(cond)                                                   \
    do {                                                               \
        if (!(cond)) {                                                 \
            fprintf(stderr, "FAILED line %d: %s\n", __LINE__, #cond); \
            failures++;                                                \
        }                                                              \
    } while (0)

/* Checks that a call failed with `want` and left an error object with that
 * status and a message; prints and frees it. Reads *errp inside the function:
 * C leaves the order of argument evaluation unspecified, so the error must
 * not be passed by value next to the call that sets it. */
static void expect_fail(gwtf_status st, gwtf_error **errp, gwtf_status want) {
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
}

/* The program's exit status, with a last line the tests look for. */
static int finish(const char *name) {
    if (failures) {
        fprintf(stderr, "%s: %d failure(s)\n", name, failures);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

#endif
