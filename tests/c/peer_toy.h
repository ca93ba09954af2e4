/* What the C peer test programs share: a free loopback address, a toy
 * trainer's weights digest, frames filled with one value, and the next task
 * of a peer. Include after expect.h. */
#ifndef GWTF_TEST_PEER_TOY_H
#define GWTF_TEST_PEER_TOY_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* A free port on a loopback address of its own (127.a.b.c, drawn from the
 * process id, the clock and a counter), as "127.a.b.c:PORT" in buf: bound
 * and released for a peer to bind next. Not 127.0.0.1, whose ports the
 * kernel also hands to outgoing connections (a port released there can be
 * taken by another test's connection before the peer binds it); a random
 * address makes a clash with another test improbable too (as the Rust
 * tests' free_addr). */
static void free_addr(char *buf, size_t len) {
    static uint32_t drawn = 0;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint32_t h = 2166136261u;
    uint32_t parts[4] = {(uint32_t)getpid(), (uint32_t)t.tv_nsec, (uint32_t)t.tv_sec, drawn++};
    for (int i = 0; i < 4; i++) h = (h ^ parts[i]) * 16777619u;
    unsigned b1 = 1 + (h % 250), b2 = 1 + ((h >> 8) % 250), b3 = 1 + ((h >> 16) % 250);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    socklen_t n = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl((127u << 24) | (b1 << 16) | (b2 << 8) | b3);
    a.sin_port = 0;
    EXPECT(bind(s, (struct sockaddr *)&a, sizeof a) == 0);
    EXPECT(getsockname(s, (struct sockaddr *)&a, &n) == 0);
    snprintf(buf, len, "127.%u.%u.%u:%u", b1, b2, b3, (unsigned)ntohs(a.sin_port));
    close(s);
}

/* The digest of a toy trainer's 16 parameters. Not cryptographic: replicas
 * only compare bytes. */
static void weights_digest(const float w[16], uint8_t digest[32]) {
    uint32_t h = 2166136261u;
    const uint8_t *b = (const uint8_t *)w;
    for (size_t i = 0; i < 16 * sizeof(float); i++) h = (h ^ b[i]) * 16777619u;
    for (int i = 0; i < 32; i++) digest[i] = (uint8_t)(h >> ((i % 4) * 8)) ^ (uint8_t)i;
}

/* A frame of `len` bytes from `p`'s pool, every float `v`. */
static gwtf_frame *alloc_filled(gwtf_peer *p, uint64_t len, float v) {
    gwtf_frame *f = NULL;
    gwtf_frame_view view;
    gwtf_error *err = NULL;
    gwtf_status st = gwtf_peer_alloc(p, len, 1000, &f, &err);
    if (st != GWTF_STATUS_OK) {
        fprintf(stderr, "alloc %llu: %s\n", (unsigned long long)len, gwtf_error_message(err));
        gwtf_error_free(err);
        failures++;
    }
    if (!f) return NULL;
    EXPECT(gwtf_frame_get_view(f, &view, NULL) == GWTF_STATUS_OK);
    for (size_t i = 0; i < view.len / 4; i++) memcpy(view.data + 4 * i, &v, 4);
    return f;
}

/* `p`'s next task or event within `timeout_ms` into `k`: 1, or 0 on a
 * timeout or an error (counted as a failure). */
static int next_task(gwtf_peer *p, const char *name, uint32_t timeout_ms, gwtf_peer_task *k) {
    gwtf_error *err = NULL;
    gwtf_status st = gwtf_peer_next_task(p, timeout_ms, k, sizeof *k, &err);
    if (st == GWTF_STATUS_TIMEOUT) {
        gwtf_error_free(err);
        return 0;
    }
    if (st != GWTF_STATUS_OK) {
        fprintf(stderr, "%s: next_task: %s\n", name, gwtf_error_message(err));
        gwtf_error_free(err);
        failures++;
        return 0;
    }
    return 1;
}

#endif
