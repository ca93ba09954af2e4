/* gwtf_peer from C: an emptied stage rebuilt from its neighbour (CheckFree).
 * A data holder and two relay stages of one member each train a toy model
 * in one process; the stage-2 relay leaves, and no holder kept a copy of
 * its state. A joiner whose trainer can rebuild a stage
 * (`rebuild_from_neighbours`) takes the stage up: it gets the stage-1
 * member's state, as that trainer exported it, in an AVERAGE_STATES task,
 * answers it (after the wrong answers, each refused), reports the stage
 * rebuilt, and the swarm trains on through it. */
#define _POSIX_C_SOURCE 200809L
#include "expect.h"
#include "peer_toy.h"

#include <stddef.h>
#include <stdlib.h>

static const char KEY[] = "0123456789abcdef-rebuild-c-test";

/* Boundary 0 (holder -> stage 1): 16 floats; 1 (stage 1 -> stage 2): 16;
 * 2 (stage 2 -> holder): 8. Each relay's state: its 16 parameters. */
static const uint64_t ACT[3] = {64, 64, 32};
static const uint64_t STATE[3] = {0, 64, 64};

static void options(gwtf_peer_options *o, int32_t role, int32_t stage, const char *listen,
                    const gwtf_peer_contact *boot, size_t nboot) {
    EXPECT(gwtf_peer_options_init(o) == GWTF_STATUS_OK);
    o->role = role;
    o->stage = stage;
    o->listen_addr = listen;
    o->bootstrap = boot;
    o->bootstrap_len = nboot;
    o->swarm_key = (const uint8_t *)KEY;
    o->swarm_key_len = sizeof KEY - 1;
    o->relay_stages = 2;
    o->microbatches_per_iteration = 2;
    o->activation_bytes = ACT;
    o->state_bytes = STATE;
    o->memory_budget_bytes = 16u << 20;
}

static gwtf_peer *start(const gwtf_peer_options *o) {
    gwtf_peer *p = NULL;
    gwtf_error *err = NULL;
    if (gwtf_peer_new(o, &p, &err) != GWTF_STATUS_OK) {
        fprintf(stderr, "gwtf_peer_new: %s\n", gwtf_error_message(err));
        gwtf_error_free(err);
        failures++;
        return NULL;
    }
    return p;
}

/* One member's toy trainer: its 16 parameters and their digest. */
typedef struct {
    gwtf_peer *p;
    const char *name;
    float w[16];
    uint8_t digest[32];
    int iterations, averages, rebuilt_events, rebuilt_averaged, applied_after;
    float exported[16]; /* what its last EXPORT_STATE gave */
    int exports;
} toy;

static void toy_digest(toy *t) { weights_digest(t->w, t->digest); }

static uint64_t le64(const uint8_t *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static uint32_t le32(const uint8_t *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* The average-states task: the neighbour's state as it exported it; the
 * wrong answers first, each refused and the task still outstanding. */
static void average(toy *t, const gwtf_peer_task *k, const toy *neighbour) {
    gwtf_error *err = NULL;
    printf("%s: average states: %llu state(s), %zu bytes, iteration %u (set %u)\n", t->name,
           (unsigned long long)k->microbatches, k->input_len, k->iteration, k->has_iteration);
    EXPECT(k->stage == 2);
    EXPECT(k->microbatches == 1);
    EXPECT(k->input != NULL && k->input_len == 16 + sizeof t->w);
    EXPECT(k->has_iteration == 1);
    float sum[16] = {0};
    uint64_t n = 0, off = 0;
    while (k->input && off + 16 <= k->input_len) {
        uint32_t stage = le32(k->input + off);
        uint64_t len = le64(k->input + off + 8);
        EXPECT(stage == 1);
        EXPECT(le32(k->input + off + 4) == 0);
        EXPECT(len == sizeof t->w && off + 16 + len <= k->input_len);
        if (len != sizeof t->w || off + 16 + len > k->input_len) break;
        float s[16];
        memcpy(s, k->input + off + 16, sizeof s);
        /* As the stage-1 trainer exported it, bit for bit. */
        EXPECT(neighbour->exports > 0 && memcmp(s, neighbour->exported, sizeof s) == 0);
        for (int i = 0; i < 16; i++) sum[i] += s[i];
        n++;
        off += 16 + len;
    }
    EXPECT(n == k->microbatches && off == k->input_len);
    for (int i = 0; i < 16; i++) t->w[i] = n ? sum[i] / (float)n : 0.1f * (float)i;
    toy_digest(t);
    printf("wrong answers to it:\n");
    expect_fail(gwtf_peer_task_done_weights(t->p, k->id, t->digest, &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_peer_task_done_rebuilt(t->p, k->id, t->digest, 2, &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_peer_task_done_rebuilt(t->p, k->id, NULL, 1, &err), &err,
                GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_peer_task_done(t->p, k->id, NULL, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    EXPECT(gwtf_peer_task_done_rebuilt(t->p, k->id, t->digest, (uint32_t)n, NULL) ==
           GWTF_STATUS_OK);
    expect_fail(gwtf_peer_task_done_rebuilt(t->p, k->id, t->digest, (uint32_t)n, &err), &err,
                GWTF_STATUS_NOT_FOUND);
    t->averages++;
}

/* One task or event of `t` (its neighbour: the stage-1 member, for an
 * average); returns 0 on a timeout. */
static int step(toy *t, const toy *neighbour) {
    gwtf_peer_task k;
    if (!next_task(t->p, t->name, 5, &k)) return 0;
    const float *in = (const float *)k.input;
    size_t n_in = k.input_len / 4;
    switch (k.kind) {
    case GWTF_TASK_KIND_EMBED:
        EXPECT(k.output_bytes == ACT[0]);
        EXPECT(gwtf_peer_task_done(t->p, k.id, alloc_filled(t->p, k.output_bytes, 1.0f), NULL) ==
               GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_FORWARD: {
        EXPECT(k.stage == 1 || k.stage == 2);
        EXPECT(k.input_len == ACT[k.stage - 1] && k.output_bytes == ACT[k.stage]);
        float s = 0;
        for (size_t i = 0; i < n_in; i++) s += in[i] * t->w[i % 16];
        EXPECT(gwtf_peer_task_done(t->p, k.id, alloc_filled(t->p, k.output_bytes, s / 16), NULL) ==
               GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_LOSS:
        EXPECT(k.input_len == ACT[2] && k.output_bytes == ACT[2]);
        EXPECT(gwtf_peer_task_done_loss(t->p, k.id, 2.0f, alloc_filled(t->p, k.output_bytes, 0.25f),
                                        NULL) == GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_BACKWARD:
        EXPECT(k.stage == 1 || k.stage == 2);
        EXPECT(k.input_len == ACT[k.stage] && k.output_bytes == ACT[k.stage - 1]);
        EXPECT(gwtf_peer_task_done(t->p, k.id, alloc_filled(t->p, k.output_bytes, 0.125f), NULL) ==
               GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_EMBED_BACKWARD:
    case GWTF_TASK_KIND_FORGET:
        EXPECT(gwtf_peer_task_done(t->p, k.id, NULL, NULL) == GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_GRADIENT: {
        float g[16];
        for (int i = 0; i < 16; i++) g[i] = (float)k.granted_len;
        EXPECT(gwtf_peer_task_done_gradient(t->p, k.id, g, 16, t->digest, NULL) ==
               GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_APPLY:
        for (size_t i = 0; i < k.mean_len && i < 16; i++) t->w[i] -= 0.01f * k.mean[i];
        toy_digest(t);
        EXPECT(gwtf_peer_task_done_weights(t->p, k.id, t->digest, NULL) == GWTF_STATUS_OK);
        if (t->averages) t->applied_after++;
        break;
    case GWTF_TASK_KIND_EXPORT_STATE: {
        gwtf_frame *f = NULL;
        gwtf_frame_view view;
        EXPECT(gwtf_peer_alloc(t->p, sizeof t->w, 1000, &f, NULL) == GWTF_STATUS_OK);
        gwtf_frame_get_view(f, &view, NULL);
        memcpy(view.data, t->w, sizeof t->w);
        memcpy(t->exported, t->w, sizeof t->w);
        t->exports++;
        EXPECT(gwtf_peer_task_done(t->p, k.id, f, NULL) == GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_INIT_STATE:
        fprintf(stderr, "%s: stage %u started from the initial weights\n", t->name, k.stage);
        failures++;
        for (int i = 0; i < 16; i++) t->w[i] = 0.1f * (float)i;
        toy_digest(t);
        EXPECT(gwtf_peer_task_done_weights(t->p, k.id, t->digest, NULL) == GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_IMPORT_STATE:
        if (k.input_len == sizeof t->w) memcpy(t->w, k.input, sizeof t->w);
        toy_digest(t);
        EXPECT(gwtf_peer_task_done_weights(t->p, k.id, t->digest, NULL) == GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_AVERAGE_STATES:
        average(t, &k, neighbour);
        break;
    case GWTF_TASK_KIND_EVENT_STAGE_REBUILT:
        printf("%s: %s\n", t->name, k.message);
        EXPECT(k.stage == 2 && k.microbatches == 1);
        EXPECT(memcmp(k.weights, t->digest, 32) == 0);
        t->rebuilt_events++;
        t->rebuilt_averaged = (int)k.microbatches;
        break;
    case GWTF_TASK_KIND_EVENT_STAGE_RESTARTED:
        fprintf(stderr, "%s: restarted: %s\n", t->name, k.message);
        failures++;
        break;
    case GWTF_TASK_KIND_EVENT_ITERATION:
        printf("%s: %s\n", t->name, k.message);
        t->iterations++;
        break;
    case GWTF_TASK_KIND_EVENT_ERROR:
        printf("%s: error event: %s\n", t->name, k.message);
        break;
    default:
        if (getenv("REBUILD_DEBUG")) printf("%s: event %d: %s\n", t->name, k.kind, k.message);
        EXPECT(k.kind >= 100);
        EXPECT(k.id == 0);
        break;
    }
    return 1;
}

/* The option is a relay's, and 0 or 1. */
static void bad_options(const char *listen, const gwtf_peer_contact *boot,
                        const gwtf_peer_contact *join) {
    gwtf_peer_options o;
    gwtf_peer *p = NULL;
    gwtf_error *err = NULL;
    printf("bad options:\n");
    options(&o, GWTF_PEER_ROLE_HOLDER, 0, listen, boot, 3);
    o.rebuild_from_neighbours = 1;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    options(&o, GWTF_PEER_ROLE_RELAY, GWTF_STAGE_AUTO, listen, join, 1);
    o.rebuild_from_neighbours = 2;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    EXPECT(p == NULL);
}

int main(void) {
    char ha[64], aa[64], ba[64], ca[64];
    gwtf_error *err = NULL;
    free_addr(ha, sizeof ha);
    free_addr(aa, sizeof aa);
    free_addr(ba, sizeof ba);
    free_addr(ca, sizeof ca);
    char dir[] = "/tmp/gwtf-rebuild-c-XXXXXX", hk[64], ak[64], bk[64];
    uint32_t hid = 0, aid = 0, bid = 0;
    EXPECT(mkdtemp(dir) != NULL);
    snprintf(hk, sizeof hk, "%s/holder.key", dir);
    snprintf(ak, sizeof ak, "%s/a.key", dir);
    snprintf(bk, sizeof bk, "%s/b.key", dir);
    EXPECT(gwtf_node_key_id(hk, &hid, &err) == GWTF_STATUS_OK);
    EXPECT(gwtf_node_key_id(ak, &aid, &err) == GWTF_STATUS_OK);
    EXPECT(gwtf_node_key_id(bk, &bid, &err) == GWTF_STATUS_OK);
    gwtf_peer_contact boot[3] = {{hid, 0, ha}, {aid, 1, aa}, {bid, 2, ba}};
    gwtf_peer_contact join[1] = {{0, 0, ha}};
    bad_options(ca, boot, join);

    toy h = {0}, a = {0}, b = {0}, c = {0};
    h.name = "holder";
    a.name = "stage 1";
    b.name = "stage 2";
    c.name = "joiner";
    gwtf_peer_options o;
    options(&o, GWTF_PEER_ROLE_HOLDER, 0, ha, boot, 3);
    o.node_key_path = hk;
    h.p = start(&o);
    options(&o, GWTF_PEER_ROLE_RELAY, 1, aa, boot, 3);
    o.node_key_path = ak;
    a.p = start(&o);
    options(&o, GWTF_PEER_ROLE_RELAY, 2, ba, boot, 3);
    o.node_key_path = bk;
    b.p = start(&o);
    remove(hk);
    remove(ak);
    remove(bk);
    rmdir(dir);
    if (!h.p || !a.p || !b.p) return finish("rebuild");
    for (int i = 0; i < 16; i++) a.w[i] = b.w[i] = 0.1f * (float)i;
    toy_digest(&h);
    toy_digest(&a);
    toy_digest(&b);

    /* Two iterations final (bounded: about 60 s). */
    for (int rounds = 0; rounds < 4000 && h.iterations < 2; rounds++) {
        step(&h, NULL);
        step(&a, NULL);
        step(&b, NULL);
    }
    EXPECT(h.iterations >= 2);
    printf("stage 2's only member leaves\n");
    EXPECT(gwtf_peer_leave(b.p, NULL) == GWTF_STATUS_OK);
    gwtf_peer_free(b.p);
    b.p = NULL;

    options(&o, GWTF_PEER_ROLE_RELAY, GWTF_STAGE_AUTO, ca, join, 1);
    o.rebuild_from_neighbours = 1;
    o.log_to_stderr = getenv("REBUILD_DEBUG") != NULL;
    c.p = start(&o);
    if (!c.p) return finish("rebuild");
    int before = h.iterations;
    for (int rounds = 0; rounds < 12000 && (h.iterations < before + 2 || !c.rebuilt_events);
         rounds++) {
        step(&h, NULL);
        step(&a, NULL);
        step(&c, &a);
    }
    EXPECT(c.averages == 1);
    EXPECT(c.rebuilt_events == 1 && c.rebuilt_averaged == 1);
    EXPECT(h.iterations >= before + 2);
    EXPECT(c.applied_after >= 1);
    printf("joiner: %d update(s) applied after the rebuild; holder: %d iterations\n",
           c.applied_after, h.iterations);

    EXPECT(gwtf_peer_leave(h.p, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_peer_leave(a.p, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_peer_leave(c.p, NULL) == GWTF_STATUS_OK);
    gwtf_peer_free(h.p);
    gwtf_peer_free(a.p);
    gwtf_peer_free(c.p);
    return finish("rebuild");
}
