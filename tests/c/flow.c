/* The routing solver from C: a general graph solved and repaired after
 * changes, a small GWTF routing model with a crash, DIMACS input, misuse.
 * AddressSanitizer build, run by tests/abi_c.rs. */
#include "gwtf.h"
#include "expect.h"
#include <stdio.h>
#include <string.h>

static gwtf_flow_metrics metrics(gwtf_flow *f) {
    gwtf_flow_metrics m;
    gwtf_flow_metrics_init(&m);
    EXPECT(gwtf_flow_get_metrics(f, &m, NULL) == GWTF_STATUS_OK);
    return m;
}

int main(void) {
    gwtf_flow *g = NULL, *r = NULL, *d = NULL;
    gwtf_error *err = NULL;
    uint32_t n[4], a[5], h, r1a, r1b, r2a, r2b, members[8];
    int32_t state = -1;
    int64_t flows[5], count = 0, cost = 0;
    size_t len = 0, k;
    gwtf_flow_metrics m;

    /* A diamond: 2 units from 0 to 3 over two paths of cost 2 and 5. */
    EXPECT(gwtf_flow_new_graph(&g, NULL) == GWTF_STATUS_OK);
    gwtf_flow_add_node(g, 2, &n[0], NULL);
    gwtf_flow_add_node(g, 0, &n[1], NULL);
    gwtf_flow_add_node(g, 0, &n[2], NULL);
    gwtf_flow_add_node(g, -2, &n[3], NULL);
    gwtf_flow_add_arc(g, n[0], n[1], 1, 1, &a[0], NULL);
    gwtf_flow_add_arc(g, n[1], n[3], 1, 1, &a[1], NULL);
    gwtf_flow_add_arc(g, n[0], n[2], 2, 2, &a[2], NULL);
    gwtf_flow_add_arc(g, n[2], n[3], 2, 3, &a[3], NULL);
    EXPECT(gwtf_flow_solve(g, &state, NULL) == GWTF_STATUS_OK && state == GWTF_FLOW_STATE_OPTIMAL);
    m = metrics(g);
    printf("graph: cost %lld flow %lld\n", (long long)m.total_cost, (long long)m.flow_value);
    EXPECT(m.total_cost == 2 + 5 && m.flow_value == 2);
    EXPECT(gwtf_flow_arc_flows(g, NULL, 0, &len, NULL) == GWTF_STATUS_BUFFER_TOO_SMALL && len == 4);
    EXPECT(gwtf_flow_arc_flows(g, flows, 5, &len, NULL) == GWTF_STATUS_OK);
    EXPECT(flows[0] == 1 && flows[1] == 1 && flows[2] == 1 && flows[3] == 1);
    /* Repair after removing the cheap path's middle node: both units go the other way. */
    EXPECT(gwtf_flow_remove_node(g, n[1], NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_flow_solve(g, &state, NULL) == GWTF_STATUS_OK && state == GWTF_FLOW_STATE_OPTIMAL);
    EXPECT(metrics(g).total_cost == 10);
    /* Less capacity than supply: infeasible is an answer, not an error. */
    EXPECT(gwtf_flow_set_arc_capacity(g, a[2], 1, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_flow_solve(g, &state, NULL) == GWTF_STATUS_OK && state == GWTF_FLOW_STATE_INFEASIBLE);
    expect_fail(gwtf_flow_add_arc(g, n[0], 999, 1, 1, NULL, &err), &err, GWTF_STATUS_NOT_FOUND);
    expect_fail(gwtf_flow_add_arc(g, n[0], n[2], -1, 1, NULL, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_flow_add_relay(g, 1, 1, 10, NULL, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_flow_route(g, 0, members, 8, &len, &count, &cost, &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);

    /* Routing: one data holder, two stages of two relays; relay r1a is fast. */
    EXPECT(gwtf_flow_new_routing(2, 1 << 20, &r, NULL) == GWTF_STATUS_OK);
    gwtf_flow_add_data_holder(r, 2, 1000, &h, NULL);
    gwtf_flow_add_relay(r, 1, 1, 1000, &r1a, NULL);
    gwtf_flow_add_relay(r, 1, 1, 9000, &r1b, NULL);
    gwtf_flow_add_relay(r, 2, 2, 1000, &r2a, NULL);
    gwtf_flow_add_relay(r, 2, 2, 1000, &r2b, NULL);
    {
        uint32_t s1[2] = {r1a, r1b}, s2[2] = {r2a, r2b};
        int i, j;
        for (i = 0; i < 2; i++) {
            EXPECT(gwtf_flow_set_link(r, h, s1[i], 5000, 5000, 1e9, 1e9, NULL) == GWTF_STATUS_OK);
            EXPECT(gwtf_flow_set_link(r, s2[i], h, 5000, 5000, 1e9, 1e9, NULL) == GWTF_STATUS_OK);
            for (j = 0; j < 2; j++)
                EXPECT(gwtf_flow_set_link(r, s1[i], s2[j], 1000 + 1000 * j, 1000, 1e9, 1e9, NULL) ==
                       GWTF_STATUS_OK);
        }
    }
    EXPECT(gwtf_flow_solve(r, &state, NULL) == GWTF_STATUS_OK && state == GWTF_FLOW_STATE_OPTIMAL);
    m = metrics(r);
    printf("routing: flow %lld, %llu route(s), critical path %lld us\n", (long long)m.flow_value,
           (unsigned long long)m.route_count, (long long)m.critical_path_us);
    EXPECT(m.flow_value == 2 && m.unrouted == 0 && m.route_count >= 1);
    for (k = 0; k < m.route_count; k++) {
        EXPECT(gwtf_flow_route(r, k, members, 8, &len, &count, &cost, NULL) == GWTF_STATUS_OK);
        EXPECT(len == 4 && members[0] == h && members[3] == h);
        printf("  route %zu: x%lld cost %lld us: %u -> %u -> %u -> %u\n", k, (long long)count,
               (long long)cost, members[0], members[1], members[2], members[3]);
    }
    /* Crash the fast stage-1 relay: one microbatch can no longer be routed
     * (the slow relay holds one), and the routes are repaired. */
    EXPECT(gwtf_flow_remove_member(r, r1a, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_flow_solve(r, &state, NULL) == GWTF_STATUS_OK);
    m = metrics(r);
    printf("after crash: flow %lld, unrouted %lld, solve %.3f ms\n", (long long)m.flow_value,
           (long long)m.unrouted, m.solve_ms);
    EXPECT(m.flow_value == 1 && m.unrouted == 1);
    EXPECT(gwtf_flow_route(r, 0, members, 8, &len, &count, &cost, NULL) == GWTF_STATUS_OK);
    EXPECT(members[1] == r1b);
    expect_fail(gwtf_flow_route(r, 99, members, 8, &len, &count, &cost, &err), &err,
                GWTF_STATUS_NOT_FOUND);
    expect_fail(gwtf_flow_route(r, 0, members, 2, &len, &count, &cost, &err), &err,
                GWTF_STATUS_BUFFER_TOO_SMALL);
    EXPECT(len == 4);
    expect_fail(gwtf_flow_remove_member(r, r1a, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_flow_add_relay(r, 3, 1, 10, NULL, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_flow_set_link(r, h, r1b, -1, 0, 1, 1, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_flow_add_node(r, 1, NULL, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);

    /* DIMACS text, and a malformed one with its line number. */
    {
        const char *ok = "c tiny\np min 3 2\nn 1 4\nn 3 -4\na 1 2 0 5 3\na 2 3 0 5 1\n";
        const char *bad = "p min 3 2\nn 1 4\na 1 2 zero 5 3\n";
        EXPECT(gwtf_flow_new_from_dimacs(ok, strlen(ok), &d, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_flow_solve(d, &state, NULL) == GWTF_STATUS_OK && state == GWTF_FLOW_STATE_OPTIMAL);
        EXPECT(metrics(d).total_cost == 16 && metrics(d).flow_value == 4);
        gwtf_flow_free(d);
        d = NULL;
        expect_fail(gwtf_flow_new_from_dimacs(bad, strlen(bad), &d, &err), &err, GWTF_STATUS_PROTOCOL);
        EXPECT(d == NULL);
    }
    expect_fail(gwtf_flow_new_routing(0, 1, &d, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_flow_solve(NULL, &state, &err), &err, GWTF_STATUS_NULL_POINTER);

    gwtf_flow_free(g);
    gwtf_flow_free(r);
    gwtf_flow_free(NULL);
    return finish("flow");
}
