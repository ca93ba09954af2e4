/* gwtf_peer from C: a data holder and a relay in one process run two
 * iterations of a toy model (stage boundaries of different sizes), and every
 * wrong answer a trainer can give (a task never given, answered twice, with
 * a frame of the wrong size, with the wrong answer function, late, after
 * the peer left) gets a status and an error message and loses nothing: the
 * refused frame is still the caller's, the task still outstanding. */
#define _POSIX_C_SOURCE 200809L
#include "expect.h"
#include "peer_toy.h"

#include <stddef.h>
#include <stdlib.h>

static const char KEY[] = "0123456789abcdef-peer-c-test";

/* Boundary 0 (holder -> relay): 16 floats; boundary 1 (relay -> holder): 8. */
static const uint64_t ACT[2] = {64, 32};
static const uint64_t STATE[2] = {0, 64};

static gwtf_peer *new_peer(int32_t role, int32_t stage, const char *key_path, const char *listen,
                           const gwtf_peer_contact *boot, size_t nboot) {
    gwtf_peer_options o;
    gwtf_peer *p = NULL;
    gwtf_error *err = NULL;
    EXPECT(gwtf_peer_options_init(&o) == GWTF_STATUS_OK);
    o.role = role;
    o.stage = stage;
    o.node_key_path = key_path; /* its id follows from the key */
    o.listen_addr = listen;
    o.bootstrap = boot;
    o.bootstrap_len = nboot;
    o.swarm_key = (const uint8_t *)KEY;
    o.swarm_key_len = sizeof KEY - 1;
    o.relay_stages = 1;
    o.microbatches_per_iteration = 2;
    o.activation_bytes = ACT;
    o.state_bytes = STATE;
    o.memory_budget_bytes = 16u << 20;
    if (gwtf_peer_new(&o, &p, &err) != GWTF_STATUS_OK) {
        fprintf(stderr, "gwtf_peer_new: %s\n", gwtf_error_message(err));
        gwtf_error_free(err);
        failures++;
        return NULL;
    }
    return p;
}

/* Bad options: each refused with a status, nothing created. */
static void bad_options(void) {
    gwtf_peer_options o;
    gwtf_peer *p = NULL;
    gwtf_error *err = NULL;
    gwtf_peer_contact c = {1, 0, "127.0.0.1:1"};
    uint64_t huge[2] = {64, (uint64_t)1 << 40};
    uint64_t zero[2] = {64, 0};
    printf("bad options:\n");
    expect_fail(gwtf_peer_new(NULL, &p, &err), &err, GWTF_STATUS_NULL_POINTER);
    gwtf_peer_options_init(&o);
    o.version = 99;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_UNSUPPORTED_VERSION);
    gwtf_peer_options_init(&o);
    o.role = 7;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    gwtf_peer_options_init(&o);
    o.relay_stages = 0;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.relay_stages = 1;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_NULL_POINTER);
    o.activation_bytes = huge;
    o.state_bytes = STATE;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_LIMIT_EXCEEDED);
    o.activation_bytes = zero;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.activation_bytes = ACT;
    o.role = GWTF_PEER_ROLE_RELAY;
    o.stage = 2;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.stage = 1;
    o.swarm_key = (const uint8_t *)KEY;
    o.swarm_key_len = sizeof KEY - 1;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.bootstrap = &c;
    o.bootstrap_len = 1;
    c.addr = "not an address";
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    c.addr = "127.0.0.1:1";
    o.recompute = 2;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.recompute = 0;
    o.chosen_ids = 2;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.chosen_ids = 0;
    o.node_key_path = "";
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.node_key_path = "/nonexistent-dir/node.key";
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_IO);
    o.node_key_path = NULL;
    /* Copies and checkpoints are the data holders': a relay is refused. */
    o.save_every = 5;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.save_every = 0;
    o.keep_states_every = 5;
    expect_fail(gwtf_peer_new(&o, &p, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    o.keep_states_every = 0;
    /* A caller built against version 1 passes a shorter struct (no
     * `recompute`): only that much is read (AddressSanitizer would see a
     * read past it), and it is judged on its own fields. */
    {
        union {
            uint64_t align;
            unsigned char b[offsetof(gwtf_peer_options, recompute)];
        } v1;
        o.version = 1;
        o.relay_stages = 0;
        memcpy(v1.b, &o, sizeof v1.b);
        expect_fail(gwtf_peer_new((const gwtf_peer_options *)(const void *)v1.b, &p, &err), &err,
                    GWTF_STATUS_INVALID_ARGUMENT);
    }
    EXPECT(p == NULL);
}

/* The toy trainer's state for one peer: parameters (16 floats), per-task
 * bookkeeping is not needed (outputs are functions of the inputs). */
typedef struct {
    gwtf_peer *p;
    const char *name;
    float w[16];
    uint8_t digest[32];
    int forwards_checked, gradient_checked, iterations, applied, keep_next;
    uint64_t kept_task; /* a task left unanswered on purpose (0: none) */
} toy;

static void toy_digest(toy *t) { weights_digest(t->w, t->digest); }

/* The first forward: every wrong answer before the right one. */
static void misanswer_forward(toy *t, const gwtf_peer_task *k) {
    gwtf_error *err = NULL;
    gwtf_frame_view view;
    printf("wrong answers to a forward (task %llu, %llu output bytes):\n",
           (unsigned long long)k->id, (unsigned long long)k->output_bytes);
    gwtf_frame *wrong = alloc_filled(t->p, k->output_bytes + 4, 1.0f);
    expect_fail(gwtf_peer_task_done(t->p, k->id, wrong, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    /* The refused frame is still ours, whole. */
    EXPECT(gwtf_frame_get_view(wrong, &view, NULL) == GWTF_STATUS_OK);
    EXPECT(view.len == k->output_bytes + 4);
    gwtf_frame_release(wrong);
    gwtf_frame *right = alloc_filled(t->p, k->output_bytes, 0.5f);
    expect_fail(gwtf_peer_task_done(t->p, k->id + 1000000, right, &err), &err, GWTF_STATUS_NOT_FOUND);
    expect_fail(gwtf_peer_task_done_loss(t->p, k->id, 1.0f, right, &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_peer_task_done(t->p, k->id, NULL, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    EXPECT(gwtf_frame_get_view(right, &view, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_peer_task_done(t->p, k->id, right, NULL) == GWTF_STATUS_OK);
    /* Answered twice: refused, and a fresh frame is not taken. */
    gwtf_frame *again = alloc_filled(t->p, k->output_bytes, 0.5f);
    expect_fail(gwtf_peer_task_done(t->p, k->id, again, &err), &err, GWTF_STATUS_NOT_FOUND);
    EXPECT(gwtf_frame_get_view(again, &view, NULL) == GWTF_STATUS_OK);
    gwtf_frame_release(again);
    t->forwards_checked = 1;
}

/* One task or event of `t`; returns 0 on a timeout. */
static int step(toy *t) {
    gwtf_peer_task k;
    gwtf_error *err = NULL;
    if (!next_task(t->p, t->name, 10, &k)) return 0;
    const float *in = (const float *)k.input;
    size_t n_in = k.input_len / 4;
    switch (k.kind) {
    case GWTF_TASK_KIND_EMBED: {
        EXPECT(k.output_bytes == ACT[0]);
        gwtf_frame *f = alloc_filled(t->p, k.output_bytes, (float)(k.mb.index + 1));
        EXPECT(gwtf_peer_task_done(t->p, k.id, f, NULL) == GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_FORWARD:
        EXPECT(k.input_len == ACT[0] && k.output_bytes == ACT[1]);
        if (!t->forwards_checked) {
            misanswer_forward(t, &k);
        } else if (t->keep_next && !t->kept_task) {
            t->kept_task = k.id; /* answered late, after leaving */
        } else {
            float s = 0;
            for (size_t i = 0; i < n_in; i++) s += in[i] * t->w[i % 16];
            gwtf_frame *f = alloc_filled(t->p, k.output_bytes, s);
            EXPECT(gwtf_peer_task_done(t->p, k.id, f, NULL) == GWTF_STATUS_OK);
        }
        break;
    case GWTF_TASK_KIND_LOSS: {
        EXPECT(k.input_len == ACT[1] && k.output_bytes == ACT[1]);
        gwtf_frame *f = alloc_filled(t->p, k.output_bytes, 0.25f);
        EXPECT(gwtf_peer_task_done_loss(t->p, k.id, 2.0f, f, NULL) == GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_BACKWARD: {
        EXPECT(k.input_len == ACT[1] && k.output_bytes == ACT[0]);
        gwtf_frame *f = alloc_filled(t->p, k.output_bytes, 0.125f);
        EXPECT(gwtf_peer_task_done(t->p, k.id, f, NULL) == GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_EMBED_BACKWARD:
    case GWTF_TASK_KIND_FORGET:
        EXPECT(gwtf_peer_task_done(t->p, k.id, NULL, NULL) == GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_GRADIENT: {
        float g[16];
        for (int i = 0; i < 16; i++) g[i] = (float)k.granted_len;
        EXPECT(k.granted_len > 0 && k.granted != NULL);
        if (!t->gradient_checked) {
            printf("wrong answers to a gradient (%zu granted):\n", k.granted_len);
            expect_fail(gwtf_peer_task_done(t->p, k.id, NULL, &err), &err,
                        GWTF_STATUS_INVALID_ARGUMENT);
            expect_fail(gwtf_peer_task_done_gradient(t->p, k.id, g, 16, NULL, &err), &err,
                        GWTF_STATUS_NULL_POINTER);
            g[3] = 1.0f / 0.0f;
            expect_fail(gwtf_peer_task_done_gradient(t->p, k.id, g, 16, t->digest, &err), &err,
                        GWTF_STATUS_INVALID_ARGUMENT);
            g[3] = (float)k.granted_len;
            t->gradient_checked = 1;
        }
        EXPECT(gwtf_peer_task_done_gradient(t->p, k.id, g, 16, t->digest, NULL) == GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_APPLY:
        EXPECT(k.mean_len == 16 && k.mean != NULL);
        for (size_t i = 0; i < k.mean_len && i < 16; i++) t->w[i] -= 0.01f * k.mean[i];
        toy_digest(t);
        EXPECT(gwtf_peer_task_done_weights(t->p, k.id, t->digest, NULL) == GWTF_STATUS_OK);
        t->applied++;
        break;
    case GWTF_TASK_KIND_EXPORT_STATE: {
        gwtf_frame *f = NULL;
        gwtf_frame_view view;
        EXPECT(gwtf_peer_alloc(t->p, sizeof t->w, 1000, &f, NULL) == GWTF_STATUS_OK);
        gwtf_frame_get_view(f, &view, NULL);
        memcpy(view.data, t->w, sizeof t->w);
        EXPECT(gwtf_peer_task_done(t->p, k.id, f, NULL) == GWTF_STATUS_OK);
        break;
    }
    case GWTF_TASK_KIND_INIT_STATE:
        for (int i = 0; i < 16; i++) t->w[i] = 0.1f * (float)i; /* the initial weights */
        toy_digest(t);
        EXPECT(gwtf_peer_task_done_weights(t->p, k.id, t->digest, NULL) == GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_IMPORT_STATE:
        if (k.input_len == sizeof t->w) memcpy(t->w, k.input, sizeof t->w);
        toy_digest(t);
        EXPECT(gwtf_peer_task_done_weights(t->p, k.id, t->digest, NULL) == GWTF_STATUS_OK);
        break;
    case GWTF_TASK_KIND_EVENT_ITERATION:
        printf("%s: %s\n", t->name, k.message);
        t->iterations++;
        break;
    case GWTF_TASK_KIND_EVENT_ERROR:
        fprintf(stderr, "%s: error event: %s\n", t->name, k.message);
        failures++;
        break;
    default:
        EXPECT(k.kind >= 100); /* other events */
        EXPECT(k.id == 0);
        break;
    }
    return 1;
}

int main(void) {
    char ha[64], ra[64];
    gwtf_error *err = NULL;
    bad_options();
    free_addr(ha, sizeof ha);
    free_addr(ra, sizeof ra);
    /* Each member's key file, created by gwtf_node_key_id, gives its id. */
    char dir[] = "/tmp/gwtf-peer-c-XXXXXX", hk[64], rk[64], bad[64];
    uint32_t hid = 0, rid = 0, again = 0;
    EXPECT(mkdtemp(dir) != NULL);
    snprintf(hk, sizeof hk, "%s/holder.key", dir);
    snprintf(rk, sizeof rk, "%s/relay.key", dir);
    snprintf(bad, sizeof bad, "%s/bad.key", dir);
    EXPECT(gwtf_node_key_id(hk, &hid, &err) == GWTF_STATUS_OK);
    EXPECT(gwtf_node_key_id(rk, &rid, &err) == GWTF_STATUS_OK);
    EXPECT(gwtf_node_key_id(hk, &again, &err) == GWTF_STATUS_OK);
    EXPECT(hid != 0 && rid != 0 && hid != rid && again == hid);
    expect_fail(gwtf_node_key_id(NULL, &again, &err), &err, GWTF_STATUS_NULL_POINTER);
    {
        FILE *f = fopen(bad, "w");
        EXPECT(f != NULL);
        fputs("not a key\n", f);
        fclose(f);
        expect_fail(gwtf_node_key_id(bad, &again, &err), &err, GWTF_STATUS_IO);
        remove(bad);
    }
    gwtf_peer_contact boot[2] = {{hid, 0, ha}, {rid, 1, ra}};
    toy h = {0}, r = {0};
    h.name = "holder";
    r.name = "relay";
    h.p = new_peer(GWTF_PEER_ROLE_HOLDER, 0, hk, ha, boot, 2);
    r.p = new_peer(GWTF_PEER_ROLE_RELAY, 1, rk, ra, boot, 2);
    remove(hk);
    remove(rk);
    rmdir(dir);
    if (!h.p || !r.p) return finish("peer");
    for (int i = 0; i < 16; i++) r.w[i] = 0.1f * (float)i;
    toy_digest(&r);
    toy_digest(&h);

    gwtf_peer_task small;
    expect_fail(gwtf_peer_next_task(r.p, 0, &small, sizeof small - 8, &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_peer_next_task(r.p, 0, NULL, sizeof small, &err), &err,
                GWTF_STATUS_NULL_POINTER);
    {
        /* No checkpoint yet (this holder writes none): not found. */
        const uint8_t *data = NULL;
        size_t len = 0;
        expect_fail(gwtf_peer_checkpoint_state(h.p, 4, 0, &data, &len, NULL, &err), &err,
                    GWTF_STATUS_NOT_FOUND);
        expect_fail(gwtf_peer_checkpoint_state(h.p, 4, 0, NULL, &len, NULL, &err), &err,
                    GWTF_STATUS_NULL_POINTER);
        EXPECT(data == NULL && len == 0);
    }

    /* Until the holder saw two iterations final (bounded: 60 s). */
    for (int rounds = 0; rounds < 3000 && h.iterations < 2; rounds++) {
        step(&h);
        step(&r);
    }
    EXPECT(h.iterations >= 2);
    EXPECT(r.forwards_checked && r.gradient_checked);
    EXPECT(r.applied >= 1);

    gwtf_peer_stats s;
    EXPECT(gwtf_peer_get_stats(r.p, &s, sizeof s, NULL) == GWTF_STATUS_OK);
    EXPECT(s.version == GWTF_PEER_STATS_VERSION);
    EXPECT(s.tasks_given > 0 && s.tasks_done > 0);
    EXPECT(s.answers_refused >= 7);
    printf("relay: %llu tasks given, %llu done, %llu answers refused\n",
           (unsigned long long)s.tasks_given, (unsigned long long)s.tasks_done,
           (unsigned long long)s.answers_refused);

    /* A forward left unanswered, to answer it after leaving. */
    r.keep_next = 1;
    for (int rounds = 0; rounds < 3000 && !r.kept_task; rounds++) {
        step(&h);
        step(&r);
    }
    EXPECT(r.kept_task != 0);

    EXPECT(gwtf_peer_leave(h.p, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_peer_leave(r.p, NULL) == GWTF_STATUS_OK);
    EXPECT(gwtf_peer_leave(r.p, NULL) == GWTF_STATUS_OK); /* idempotent */
    printf("after leaving:\n");
    gwtf_frame *late = NULL;
    expect_fail(gwtf_peer_alloc(r.p, ACT[1], 0, &late, &err), &err, GWTF_STATUS_CLOSED);
    EXPECT(late == NULL);
    expect_fail(gwtf_peer_task_done(r.p, r.kept_task, NULL, &err), &err, GWTF_STATUS_CLOSED);
    /* The events from before leaving still come, then: closed. */
    int events = 0;
    gwtf_status st = GWTF_STATUS_OK;
    while (events < 10000 && (st = gwtf_peer_next_task(r.p, 0, &small, sizeof small, &err)) ==
                                 GWTF_STATUS_OK) {
        EXPECT(small.kind >= 100);
        events++;
    }
    printf("  %d events after leaving, then:\n", events);
    expect_fail(st, &err, GWTF_STATUS_CLOSED);
    EXPECT(gwtf_peer_get_stats(r.p, &s, sizeof s, NULL) == GWTF_STATUS_OK);
    gwtf_peer_free(h.p);
    gwtf_peer_free(r.p);
    gwtf_peer_free(NULL);
    return finish("peer");
}
