/* Trains the reference model from C through four gwtf_stage objects (one per
 * pipeline stage, as four swarm nodes would): forward through the stages,
 * loss, backward in reverse, AdamW step; plus misuse. Prints the losses so
 * that tests/abi_c.rs can compare them with the Rust pipeline. ASan build. */
#include "gwtf.h"
#include "expect.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S 4
#define B 2
#define T 16

int main(void) {
    gwtf_stage *st[S] = {0};
    gwtf_stage_info info;
    gwtf_error *err = NULL;
    uint32_t tokens[B * T], targets[B * T];
    float *act[S], *grad[S];
    size_t width = 0, needed = 0;
    float loss = 0, first_loss = 0;
    int i, s, step;

    for (i = 0; i < B * T; i++) {
        tokens[i] = (uint32_t)((i * 7 + 3) % 256);
        targets[i] = (uint32_t)((i * 7 + 10) % 256);
    }
    for (s = 0; s < S; s++) {
        if (gwtf_stage_new("llama-tiny", S, (uint32_t)s, 42, &st[s], &err) != GWTF_STATUS_OK) {
            fprintf(stderr, "stage_new: %s\n", gwtf_error_message(err));
            return 1;
        }
    }
    gwtf_stage_info_init(&info);
    EXPECT(gwtf_stage_get_info(st[1], &info, NULL) == GWTF_STATUS_OK);
    EXPECT(info.index == 1 && info.num_stages == S && !info.takes_tokens && !info.computes_loss);
    width = (size_t)B * T * info.d_model;
    printf("llama-tiny: d_model %u, stage 1 has %llu parameters\n", info.d_model,
           (unsigned long long)info.num_params);
    for (s = 0; s < S; s++) {
        act[s] = calloc(width, sizeof(float));
        grad[s] = calloc(width, sizeof(float));
    }

    for (step = 0; step < 5; step++) {
        uint64_t mb = (uint64_t)step;
        EXPECT(gwtf_stage_forward(st[0], mb, B, T, tokens, NULL, B * T, NULL, 0, act[0], width,
                                  &needed, NULL, NULL) == GWTF_STATUS_OK);
        for (s = 1; s < S - 1; s++)
            EXPECT(gwtf_stage_forward(st[s], mb, B, T, NULL, act[s - 1], width, NULL, 0, act[s],
                                      width, NULL, NULL, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_forward(st[S - 1], mb, B, T, NULL, act[S - 2], width, targets, B * T,
                                  NULL, 0, NULL, &loss, NULL) == GWTF_STATUS_OK);
        if (step == 0) first_loss = loss;
        printf("step %d loss %.9g\n", step, (double)loss);
        EXPECT(gwtf_stage_backward(st[S - 1], mb, NULL, 0, grad[S - 1], width, NULL, NULL) ==
               GWTF_STATUS_OK);
        for (s = S - 2; s >= 1; s--)
            EXPECT(gwtf_stage_backward(st[s], mb, grad[s + 1], width, grad[s], width, NULL,
                                       NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_backward(st[0], mb, grad[1], width, NULL, 0, &needed, NULL) ==
               GWTF_STATUS_OK);
        EXPECT(needed == 0);
        for (s = 0; s < S; s++) EXPECT(gwtf_stage_step(st[s], NULL, NULL) == GWTF_STATUS_OK);
    }
    EXPECT(loss < first_loss);

    /* Misuse. */
    expect_fail(gwtf_stage_new("no-such-model", S, 0, 1, &st[0], &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_stage_new("llama-tiny", 99, 0, 1, &st[0], &err), &err,
                GWTF_STATUS_INVALID_ARGUMENT);
    expect_fail(gwtf_stage_new(NULL, S, 0, 1, &st[0], &err), &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_stage_forward(st[1], 100, B, T, tokens, NULL, B * T, NULL, 0, act[1], width,
                                   NULL, NULL, &err),
                &err, GWTF_STATUS_INVALID_ARGUMENT);
    needed = 0;
    expect_fail(gwtf_stage_forward(st[1], 100, B, T, NULL, act[0], width, NULL, 0, act[1], 7,
                                   &needed, NULL, &err),
                &err, GWTF_STATUS_BUFFER_TOO_SMALL);
    EXPECT(needed == width);
    expect_fail(gwtf_stage_forward(st[0], 100, B, T, NULL, NULL, B * T, NULL, 0, act[0], width,
                                   NULL, NULL, &err),
                &err, GWTF_STATUS_NULL_POINTER);
    expect_fail(gwtf_stage_backward(st[2], 12345, grad[3], width, grad[2], width, NULL, &err),
                &err, GWTF_STATUS_NOT_FOUND);
    expect_fail(gwtf_stage_step(st[2], NULL, &err), &err, GWTF_STATUS_INVALID_ARGUMENT);
    tokens[0] = 100000;
    expect_fail(gwtf_stage_forward(st[0], 200, B, T, tokens, NULL, B * T, NULL, 0, act[0], width,
                                   NULL, NULL, &err),
                &err, GWTF_STATUS_INVALID_ARGUMENT);
    /* A forward twice under one id is refused; discard frees it. */
    EXPECT(gwtf_stage_forward(st[1], 300, B, T, NULL, act[0], width, NULL, 0, act[1], width, NULL,
                              NULL, NULL) == GWTF_STATUS_OK);
    expect_fail(gwtf_stage_forward(st[1], 300, B, T, NULL, act[0], width, NULL, 0, act[1], width,
                                   NULL, NULL, &err),
                &err, GWTF_STATUS_INVALID_ARGUMENT);
    {
        bool found = false;
        EXPECT(gwtf_stage_discard(st[1], 300, &found, NULL) == GWTF_STATUS_OK && found);
    }

    /* A joining replica imports stage 1's parameters. */
    {
        gwtf_stage *replica = NULL;
        size_t n = 0;
        float *p;
        EXPECT(gwtf_stage_export_params(st[1], NULL, 0, &n, NULL) == GWTF_STATUS_BUFFER_TOO_SMALL);
        p = malloc(n * sizeof *p);
        EXPECT(gwtf_stage_export_params(st[1], p, n, NULL, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_new("llama-tiny", S, 1, 7, &replica, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_import_params(replica, p, n, NULL) == GWTF_STATUS_OK);
        expect_fail(gwtf_stage_import_params(replica, p, n - 1, &err), &err,
                    GWTF_STATUS_INVALID_ARGUMENT);
        memset(act[2], 0, width * sizeof(float));
        EXPECT(gwtf_stage_forward(replica, 1, B, T, NULL, act[0], width, NULL, 0, act[2], width,
                                  NULL, NULL, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_forward(st[1], 1, B, T, NULL, act[0], width, NULL, 0, act[3], width,
                                  NULL, NULL, NULL) == GWTF_STATUS_OK);
        EXPECT(memcmp(act[2], act[3], width * sizeof(float)) == 0);
        gwtf_stage_free(replica);
        free(p);
    }

    /* What a swarm member needs: the gradient of one microbatch, an update
     * with a given mean, the whole state and its digest. */
    {
        gwtf_stage *a = NULL, *b = NULL;
        size_t n = (size_t)info.num_params, len = 0, slen = 0;
        float *g = malloc(n * sizeof *g);
        uint8_t da[32], db[32], *state;
        gwtf_adamw_options opt;
        gwtf_model_run_info run;
        uint64_t sbytes = 0, mbytes = 0;
        EXPECT(gwtf_stage_new("llama-tiny", S, 1, 42, &a, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_new("llama-tiny", S, 1, 5, &b, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_forward(a, 9, B, T, NULL, act[0], width, NULL, 0, act[2], width, NULL,
                                  NULL, NULL) == GWTF_STATUS_OK);
        for (i = 0; i < (int)width; i++) act[3][i] = 0.01f;
        EXPECT(gwtf_stage_backward(a, 9, act[3], width, grad[2], width, NULL, NULL) ==
               GWTF_STATUS_OK);
        expect_fail(gwtf_stage_take_grads(a, g, n - 1, &len, &err), &err,
                    GWTF_STATUS_BUFFER_TOO_SMALL);
        EXPECT(len == n);
        EXPECT(gwtf_stage_take_grads(a, g, n, NULL, NULL) == GWTF_STATUS_OK);
        expect_fail(gwtf_stage_apply_mean(a, g, n - 1, NULL, &err), &err,
                    GWTF_STATUS_INVALID_ARGUMENT);
        EXPECT(gwtf_model_run_adamw("llama-tiny", S, 30, 3, &opt, NULL) == GWTF_STATUS_OK);
        EXPECT(opt.lr > 0.0f && opt.weight_decay > 0.0f);
        EXPECT(gwtf_stage_apply_mean(a, g, n, &opt, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_export_state(a, NULL, 0, &slen, NULL) == GWTF_STATUS_BUFFER_TOO_SMALL);
        state = malloc(slen);
        EXPECT(gwtf_stage_export_state(a, state, slen, NULL, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_state_digest(a, da, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_state_digest(b, db, NULL) == GWTF_STATUS_OK);
        EXPECT(memcmp(da, db, 32) != 0);
        expect_fail(gwtf_stage_import_state(b, state, slen - 1, &err), &err,
                    GWTF_STATUS_INVALID_ARGUMENT);
        EXPECT(gwtf_stage_state_digest(b, da + 0, NULL) == GWTF_STATUS_OK);
        EXPECT(memcmp(da, db, 32) == 0); /* a refused import changed nothing */
        EXPECT(gwtf_stage_import_state(b, state, slen, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_state_digest(a, da, NULL) == GWTF_STATUS_OK);
        EXPECT(gwtf_stage_state_digest(b, db, NULL) == GWTF_STATUS_OK);
        EXPECT(memcmp(da, db, 32) == 0);
        EXPECT(gwtf_model_run_info_get("llama-tiny", S, 30, &run, NULL) == GWTF_STATUS_OK);
        EXPECT(run.relay_stages == S - 2 && run.activation_bytes ==
                                              4ull * run.batch * run.seq * run.d_model);
        EXPECT(gwtf_model_run_stage_bytes("llama-tiny", S, 1, &sbytes, &mbytes, NULL) ==
               GWTF_STATUS_OK);
        /* gwtf node's transfer: the state, then the parameters from before
         * the last update (each with its length). */
        EXPECT(sbytes == 8 + slen + 8 + 4 * n && mbytes > 0);
        expect_fail(gwtf_model_run_info_get("llama-tiny", 2, 30, &run, &err), &err,
                    GWTF_STATUS_INVALID_ARGUMENT);
        printf("swarm member: state of %zu bytes imported, digests agree\n", slen);
        free(state);
        free(g);
        gwtf_stage_free(a);
        gwtf_stage_free(b);
    }

    for (s = 0; s < S; s++) {
        gwtf_stage_free(st[s]);
        free(act[s]);
        free(grad[s]);
    }
    gwtf_stage_free(NULL);
    return finish("stage");
}
