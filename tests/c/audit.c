/* The run audit from C: an operator feeds what it did and what its nodes
 * printed, and reads the verdict (a clean run passes; replicas that print
 * different weights fail it); misuse gets statuses. AddressSanitizer build,
 * run by tests/abi_c.rs. */
#include "gwtf.h"
#include "expect.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Holders 0 and 1, one relay stage (1) served by nodes 2 and 3, which print
 * `weights` of node 3's stage at every iteration (node 2 prints "w<i>"). */
static gwtf_audit *run(int iterations, const char *node3_weights) {
    gwtf_audit *a = NULL;
    char line[512];
    int id, i, h;
    EXPECT(gwtf_audit_new(3, &a, NULL) == GWTF_STATUS_OK);
    for (id = 0; id < 4; id++) {
        EXPECT(gwtf_audit_launched(a, 0.0, (uint64_t)id, id < 2, 0, id < 2 ? 0 : 1, NULL) ==
               GWTF_STATUS_OK);
        snprintf(line, sizeof line, "{\"event\":\"active\",\"node\":%d,\"stage\":%d}\n", id,
                 id < 2 ? 0 : 1);
        EXPECT(gwtf_audit_line(a, 0.5, (uint64_t)id, line, NULL) == GWTF_STATUS_OK);
    }
    for (i = 0; i < iterations; i++) {
        double t = 1.0 + i;
        snprintf(line, sizeof line,
                 "{\"event\":\"committed\",\"node\":2,\"stage\":1,\"iteration\":%d,"
                 "\"microbatches\":4,\"dropped\":0}",
                 i);
        EXPECT(gwtf_audit_line(a, t, 2, line, NULL) == GWTF_STATUS_OK);
        for (id = 0; id < 4; id++) {
            snprintf(line, sizeof line,
                     "{\"event\":\"applied\",\"node\":%d,\"stage\":%d,\"iteration\":%d,"
                     "\"weights_sha256\":\"%s%d\"}",
                     id, id < 2 ? 0 : 1, i, id == 3 ? node3_weights : "w", i);
            EXPECT(gwtf_audit_line(a, t, (uint64_t)id, line, NULL) == GWTF_STATUS_OK);
        }
        for (h = 0; h < 2; h++) {
            snprintf(line, sizeof line,
                     "{\"event\":\"iteration\",\"node\":%d,\"iteration\":%d,\"loss\":%.2f,"
                     "\"microbatches\":2,\"tokens\":256}",
                     h, i, 5.0 - 0.1 * i);
            EXPECT(gwtf_audit_line(a, t, (uint64_t)h, line, NULL) == GWTF_STATUS_OK);
        }
    }
    for (h = 0; h < 2; h++) {
        EXPECT(gwtf_audit_line(a, iterations + 1.0, (uint64_t)h, "{\"event\":\"done\",\"node\":0}",
                               NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_audit_exited(a, iterations + 1.5, (uint64_t)h, 0, 0, NULL) == GWTF_STATUS_OK);
    }
    return a;
}

/* The verdict's JSON (malloc'd) and whether it passed. */
static char *verdict(gwtf_audit *a, int iterations, uint32_t *ok) {
    double reference[3] = {5.0, 4.9, 4.8};
    size_t len = 0;
    char *json;
    EXPECT(gwtf_audit_summary(a, "llama-tiny", (uint64_t)iterations, 2, reference, 3, 4.0, NULL, 0,
                              &len, ok, NULL) == GWTF_STATUS_BUFFER_TOO_SMALL);
    EXPECT(len > 10);
    json = malloc(len + 1);
    EXPECT(gwtf_audit_summary(a, "llama-tiny", (uint64_t)iterations, 2, reference, 3, 4.0, json,
                              len + 1, &len, ok, NULL) == GWTF_STATUS_OK);
    EXPECT(strlen(json) == len);
    return json;
}

int main(void) {
    gwtf_audit *a, *bad;
    gwtf_error *err = NULL;
    uint32_t ok = 7;
    char small[8];
    double nan_ref[1];
    char *json;

    a = run(3, "w");
    EXPECT(gwtf_audit_line(a, 4.2, 3, "not an event", NULL) == GWTF_STATUS_OK);
    json = verdict(a, 3, &ok);
    printf("clean run: ok %u\n", ok);
    if (ok != 1) printf("%s\n", json);
    EXPECT(ok == 1);
    EXPECT(strstr(json, "\"replicas_agree\":true") != NULL);
    EXPECT(strstr(json, "\"lost_microbatches\":0") != NULL);
    free(json);

    bad = run(3, "other");
    json = verdict(bad, 3, &ok);
    printf("diverged replicas: ok %u\n", ok);
    EXPECT(ok == 0);
    EXPECT(strstr(json, "\"replicas_agree\":false") != NULL);
    free(json);
    gwtf_audit_free(bad);

    /* Misuse. */
    expect_fail(gwtf_audit_new(2, &bad, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_audit_new(3, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_audit_line(NULL, 1.0, 1, "{}", &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_audit_line(a, 1.0, 1, NULL, &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_audit_line(a, -1.0, 1, "{}", &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_audit_launched(a, 1.0, 9, 2, 0, 1, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_audit_launched(a, 1.0, 9, 0, 0, -2, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_audit_exited(a, 1.0, 9, 0, 5, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_audit_summary(a, "m", 3, 4, NULL, 3, 1.0, NULL, 0, NULL, NULL, &err), &err,
                GWTF_STATUS_NULL_POINTER);
    nan_ref[0] = 0.0 / 0.0;
    expect_fail(gwtf_audit_summary(a, "m", 3, 4, nan_ref, 1, 1.0, NULL, 0, NULL, NULL, &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_audit_summary(a, "m", 3, 4, NULL, 0, 1.0, small, sizeof small, NULL, NULL, &err),
                &err, GWTF_STATUS_BUFFER_TOO_SMALL);
    EXPECT(gwtf_audit_killed(a, 5.0, 2, NULL) == GWTF_STATUS_OK);
    gwtf_audit_free(a);
    gwtf_audit_free(NULL);
    return finish("audit");
}
