/*
 * test_store.c: the rendezvous store (store.h) against what it promises.
 *
 *   threads      4 ranks as threads on 127.0.0.1: every rank's key seen by every other,
 *                a get that waits for a later set, barriers, a 1 MiB value (and a get of it
 *                into a smaller buffer), a key set twice, bad keys and values, a duplicate
 *                rank and a wrong world size refused, a missing key timing out on time
 *   rank 0 first rank 0 sets a key and closes before rank 1 gets it: it still gets it
 *   processes    3 forked children and the parent as rank 0, all from RANK, WORLD_SIZE,
 *                MASTER_ADDR=localhost, MASTER_PORT
 *   environment  missing, malformed and out-of-range variables, each by its message
 *   no server    a client whose server never starts fails on time, naming host:port
 *   dead rank    a child that exits without closing while the others wait in a barrier:
 *                they fail with peer_failed naming it, long before the timeout
 *   stray        a non-store client (HTTP) refused, a half header forgotten; the store
 *                (one rank) carries on
 *   server dies  rank 0's process exits while rank 1 waits in a get: peer_failed at once,
 *                and every later call refused with that failure
 *   torchrun     with TORCHELASTIC_USE_AGENT_STORE=True, 2 forked ranks are clients of a
 *                store in PyTorch's TCPStore protocol (a stand-in served here, from the
 *                messages as PyTorch's TCPStoreBackend.hpp and TCPStoreLibUvBackend.cpp
 *                define them): validated first, keys under the run's prefix, a 1 MiB value
 *                waited for and got whole, a missing key timing out with its message
 * Errors are checked by status and message.  Forked children count their failures with
 * the same checks and report them through their exit status.  Ports come from binding port
 * 0 on 127.0.0.1.
 *
 * Time.  A timeout is checked from below (never before its length: that holds however
 * loaded the machine is); from above only against a hang or a timeout on the wrong scale,
 * at HANG_FACTOR times its length.  "At once" (a dead peer, a closing server) is checked as
 * "well before the timeout": those stores get a long one (LONG_TIMEOUT_S), so that the
 * bound, half of it, is far beyond any scheduling delay of a busy CI machine.  A check
 * that a call waited (for a later set, for a peer's close) makes the peer start its pause
 * only once the waiting rank has recorded its start time, so the lower bound holds
 * whatever the scheduling.  ctest's TIMEOUT catches a real hang.
 */
#include "store.h"

#include "check_mt.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HANG_FACTOR 10.0
static const double LONG_TIMEOUT_S = 30.0;

static void sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A TCP port free on 127.0.0.1 right now. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    int port = 0;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
        getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
        port = ntohs(sa.sin_port);
    if (fd >= 0) close(fd);
    CHECK(port > 0);
    return port;
}

/* ---------------------------------------------------------------- shared steps */

/* Sets "r<rank>" and gets every other rank's, checking their values. */
static void exchange(ms_store *s) {
    int rank = ms__store_rank(s), world = ms__store_world(s);
    char key[32], want[64], got[64];
    snprintf(key, sizeof key, "r%d", rank);
    snprintf(want, sizeof want, "value of rank %d", rank);
    CHECK_OK(ms__store_set(s, key, want, strlen(want)));
    for (int r = 0; r < world; r++) {
        if (r == rank) continue;
        size_t len = 0;
        snprintf(key, sizeof key, "r%d", r);
        snprintf(want, sizeof want, "value of rank %d", r);
        memset(got, 0, sizeof got);
        CHECK_OK(ms__store_get(s, key, got, sizeof got, &len));
        CHECK(len == strlen(want) && memcmp(got, want, len) == 0);
    }
}

/* Runs fn(rank, arg) on `world` threads. */
static void run_threads(int world, void *(*fn)(void *), void *args, size_t arg_size) {
    pthread_t tid[8];
    for (int r = 0; r < world; r++) pthread_create(&tid[r], NULL, fn, (char *)args + r * arg_size);
    for (int r = 0; r < world; r++) pthread_join(tid[r], NULL);
}

/* Forks a child running fn(arg); it exits 0 when fn's checks all passed. */
static pid_t fork_rank(void (*fn)(int rank, int port), int rank, int port) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        int before = atomic_load(&failed);
        fn(rank, port);
        _exit(atomic_load(&failed) == before ? 0 : 1); /* no atexit handlers: the parent's */
    }
    CHECK(pid > 0);
    return pid;
}

/* The child exited with status 0. */
static void check_child(pid_t pid, const char *what) {
    int status = 0;
    if (pid <= 0) return;
    CHECK(waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_at(__LINE__, what, " (pid %d) failed: status 0x%x", (int)pid, status);
    else atomic_fetch_add(&passed, 1);
}

/* ---------------------------------------------------------------- 4 ranks as threads */

enum { WORLD = 4 };
static const double THREAD_TIMEOUT_S = 1.0;

typedef struct rank_arg {
    int rank, port;
} rank_arg;

static unsigned char big_byte(size_t i) { return (unsigned char)(i * 31u + 7u + (i >> 12)); }

/* Waits (up to 30 s, so that a rank lost earlier cannot hang the test) until *n >= want. */
static void wait_count(atomic_int *n, int want) {
    for (int i = 0; i < 30000 && atomic_load(n) < want; i++) sleep_ms(1);
}

/* Rank 3 sets "late" 200 ms after the others have all started waiting for it: each one
 * counts itself in after taking its start time, so its get returns at least 200 ms after
 * that start, however the threads are scheduled. */
static atomic_int late_waiters;

static void late_set(ms_store *s, int rank) {
    if (rank == 3) {
        wait_count(&late_waiters, WORLD - 1);
        sleep_ms(200);
        CHECK_OK(ms__store_set(s, "late", "later", 5));
        return;
    }
    char got[8];
    size_t len = 0;
    double t0 = now_s();
    atomic_fetch_add(&late_waiters, 1);
    CHECK_OK(ms__store_get(s, "late", got, sizeof got, &len));
    CHECK(now_s() - t0 > 0.15, "(rank %d: got \"late\" %.3f s after asking; it was set 0.2 s after that)", rank,
          now_s() - t0);
    CHECK(len == 5 && memcmp(got, "later", 5) == 0);
}

/* Rank 2 sets a 1 MiB value; the others get it whole, then its first 16 bytes alone. */
static void big_value(ms_store *s, int rank) {
    size_t n = MS_STORE_VALUE_MAX, len = 0;
    unsigned char *v = malloc(n), head[16];
    CHECK(v != NULL);
    if (!v) return;
    if (rank == 2) {
        for (size_t i = 0; i < n; i++) v[i] = big_byte(i);
        CHECK_OK(ms__store_set(s, "big", v, n));
    } else {
        CHECK_OK(ms__store_get(s, "big", v, n, &len));
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += v[i] != big_byte(i);
        CHECK(len == n && bad == 0);
        CHECK_OK(ms__store_get(s, "big", head, sizeof head, &len));
        CHECK(len == n && head[0] == big_byte(0) && head[15] == big_byte(15));
    }
    free(v);
}

/* Arguments refused before anything is sent. */
static void bad_arguments(ms_store *s) {
    char long_key[300], value[8] = {0};
    size_t len;
    memset(long_key, 'k', sizeof long_key - 1);
    long_key[sizeof long_key - 1] = '\0';
    CHECK_ST(ms__store_set(s, long_key, value, 1), MS_ERR_ARG, "a key has 1..255 bytes, not 299");
    CHECK_ST(ms__store_set(s, "", value, 1), MS_ERR_ARG, "a key has 1..255 bytes, not 0");
    CHECK_ST(ms__store_set(s, "huge", value, MS_STORE_VALUE_MAX + 1), MS_ERR_ARG,
             "the value has 1048577 bytes");
    CHECK_ST(ms__store_get(s, "r0", NULL, 4, &len), MS_ERR_ARG, "value is NULL with cap 4");
    CHECK_ST(ms__store_barrier(s, long_key), MS_ERR_ARG, "barrier name of 299 bytes is too long");
}

/* Clients the server refuses while ranks 0..3 are joined. */
static void refused_clients(int port) {
    ms_store *x = NULL;
    CHECK_ST(ms__store_open(&x, "127.0.0.1", port, 2, WORLD, THREAD_TIMEOUT_S), MS_ERR_ARG,
             "rank 2 has already joined the store");
    CHECK_ST(ms__store_open(&x, "127.0.0.1", port, 1, 5, THREAD_TIMEOUT_S), MS_ERR_MISMATCH,
             "rank 1 says the world has 5 ranks, the store's rank 0 says 4");
    CHECK_ST(ms__store_open(&x, "127.0.0.1", port, 4, WORLD, THREAD_TIMEOUT_S), MS_ERR_ARG,
             "rank 4 of world 4");
    CHECK(x == NULL);
}

/* Every rank asks for a key nobody sets: timeout after the store's, naming the key. */
static void missing_key(ms_store *s, int rank) {
    char key[32], needle[64], got[8];
    size_t len = 0;
    snprintf(key, sizeof key, "missing/%d", rank);
    snprintf(needle, sizeof needle, "key \"%s\" was not set within 1.0 s", key);
    double t0 = now_s();
    CHECK_ST(ms__store_get(s, key, got, sizeof got, &len), MS_ERR_TIMEOUT, needle);
    double waited = now_s() - t0;
    CHECK(waited >= THREAD_TIMEOUT_S - 0.01, "(rank %d: timed out after %.3f s, before the store's %g s)", rank,
          waited, THREAD_TIMEOUT_S);
    CHECK(waited < HANG_FACTOR * THREAD_TIMEOUT_S, "(rank %d: timed out only after %.3f s)", rank, waited);
    CHECK(strstr(ms_last_error(), "127.0.0.1:") != NULL);
}

static void *thread_rank(void *p) {
    const rank_arg *a = p;
    ms_store *s = NULL;
    CHECK_OK(ms__store_open(&s, "127.0.0.1", a->port, a->rank, WORLD, THREAD_TIMEOUT_S));
    if (!s) return NULL;
    CHECK(ms__store_rank(s) == a->rank && ms__store_world(s) == WORLD);
    exchange(s);
    CHECK_OK(ms__store_barrier(s, "exchanged"));
    if (a->rank == 1) refused_clients(a->port);
    late_set(s, a->rank);
    big_value(s, a->rank);
    char key[32];
    snprintf(key, sizeof key, "r%d", a->rank);
    CHECK_ST(ms__store_set(s, key, "again", 5), MS_ERR_ARG, "is already set (keys are set once)");
    if (a->rank == 0) bad_arguments(s);
    CHECK_OK(ms__store_barrier(s, "checked"));
    missing_key(s, a->rank);
    CHECK_OK(ms__store_barrier(s, "end"));
    CHECK_ST(ms__store_barrier(s, "end"), MS_ERR_ARG, "barrier \"end\"");
    ms__store_close(s);
    return NULL;
}

static void test_threads(void) {
    rank_arg args[WORLD];
    int port = free_port();
    for (int r = 0; r < WORLD; r++) args[r] = (rank_arg){r, port};
    run_threads(WORLD, thread_rank, args, sizeof args[0]);
}

/* ---------------------------------------------------------------- rank 0 closes first */

static atomic_int rank0_closing; /* set by rank 0 right before ms__store_close */

static void *close_first_rank(void *p) {
    const rank_arg *a = p;
    ms_store *s = NULL;
    CHECK_OK(ms__store_open(&s, "127.0.0.1", a->port, a->rank, 2, 2.0));
    if (!s) return NULL;
    if (a->rank == 0) {
        CHECK_OK(ms__store_set(s, "nccl-id", "0123456789", 10));
        double t0 = now_s();
        atomic_store(&rank0_closing, 1);
        ms__store_close(s);
        /* it served rank 1 until rank 1 closed, which is 200 ms after t0 at the earliest */
        CHECK(now_s() - t0 > 0.15, "(rank 0's close returned after %.3f s)", now_s() - t0);
        return NULL;
    }
    char got[16];
    size_t len = 0;
    wait_count(&rank0_closing, 1);
    sleep_ms(200); /* rank 0 is in ms__store_close by now */
    CHECK_OK(ms__store_get(s, "nccl-id", got, sizeof got, &len));
    CHECK(len == 10 && memcmp(got, "0123456789", 10) == 0);
    ms__store_close(s);
    return NULL;
}

static void test_rank0_closes_first(void) {
    rank_arg args[2] = {{0, free_port()}, {1, 0}};
    args[1].port = args[0].port;
    run_threads(2, close_first_rank, args, sizeof args[0]);
}

/* ---------------------------------------------------------------- processes */

static void set_env(int rank, int world, const char *addr, int port) {
    char v[32];
    snprintf(v, sizeof v, "%d", rank);
    setenv("RANK", v, 1);
    snprintf(v, sizeof v, "%d", world);
    setenv("WORLD_SIZE", v, 1);
    setenv("MASTER_ADDR", addr, 1);
    snprintf(v, sizeof v, "%d", port);
    setenv("MASTER_PORT", v, 1);
}

static void unset_env(void) {
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
}

/* One rank of the process test: from the environment, exchange, barrier, close. */
static void env_rank(int rank, int port) {
    set_env(rank, WORLD, "localhost", port);
    ms_store *s = NULL;
    CHECK_OK(ms__store_open_env(&s, 5.0));
    if (!s) return;
    CHECK(ms__store_rank(s) == rank && ms__store_world(s) == WORLD);
    exchange(s);
    CHECK_OK(ms__store_barrier(s, "done"));
    ms__store_close(s);
}

static void test_processes(void) {
    int port = free_port();
    pid_t kids[WORLD - 1];
    for (int r = 1; r < WORLD; r++) kids[r - 1] = fork_rank(env_rank, r, port);
    env_rank(0, port);
    for (int r = 1; r < WORLD; r++) check_child(kids[r - 1], "rank process");
    unset_env();
}

/* ---------------------------------------------------------------- environment errors */

static void test_env_errors(void) {
    ms_store *s = NULL;
    set_env(1, 2, "127.0.0.1", 1234);
    unsetenv("MASTER_PORT");
    CHECK_ST(ms__store_open_env(&s, 1.0), MS_ERR_ARG, "MASTER_PORT is not set (expected the port");
    set_env(1, 2, "127.0.0.1", 1234);
    setenv("RANK", "abc", 1);
    CHECK_ST(ms__store_open_env(&s, 1.0), MS_ERR_ARG, "RANK=\"abc\" is not an integer (expected");
    set_env(4, 4, "127.0.0.1", 1234);
    CHECK_ST(ms__store_open_env(&s, 1.0), MS_ERR_ARG,
             "RANK=4 is not below WORLD_SIZE=4 (expected 0 <= RANK < WORLD_SIZE)");
    set_env(0, 0, "127.0.0.1", 70000);
    CHECK_ST(ms__store_open_env(&s, 1.0), MS_ERR_ARG, "WORLD_SIZE=0 is out of range");
    CHECK(strstr(ms_last_error(), "MASTER_PORT=70000 is out of range") != NULL);
    setenv("MASTER_ADDR", "", 1);
    CHECK_ST(ms__store_open_env(&s, 1.0), MS_ERR_ARG, "MASTER_ADDR is empty");
    unset_env();
    CHECK_ST(ms__store_open_env(&s, 1.0), MS_ERR_ARG, "RANK is not set");
    const char *msg = ms_last_error();
    CHECK(strstr(msg, "WORLD_SIZE is not set") && strstr(msg, "MASTER_ADDR is not set") &&
          strstr(msg, "MASTER_PORT is not set"));
    CHECK(s == NULL);
    CHECK_ST(ms__store_open(&s, "127.0.0.1", 1234, 0, 1, 0.0), MS_ERR_ARG, "timeout 0 s");
    CHECK_ST(ms__store_open(&s, "127.0.0.1", 0, 0, 1, 1.0), MS_ERR_ARG, "port 0 is not in 1..65535");
}

/* ---------------------------------------------------------------- no server */

static void test_no_server(void) {
    ms_store *s = NULL;
    int port = free_port();
    char needle[64];
    snprintf(needle, sizeof needle, "store 127.0.0.1:%d (rank 1 of 2): could not connect", port);
    double t0 = now_s();
    CHECK_ST(ms__store_open(&s, "127.0.0.1", port, 1, 2, 0.5), MS_ERR_TIMEOUT, needle);
    double waited = now_s() - t0;
    CHECK(waited >= 0.5 - 0.01, "(gave up after %.3f s, before its 0.5 s)", waited);
    CHECK(waited < HANG_FACTOR * 0.5, "(gave up only after %.3f s)", waited);
    CHECK(strstr(ms_last_error(), "Connection refused") != NULL);
    CHECK(s == NULL);
}

/* ---------------------------------------------------------------- a rank that dies */

enum { DEAD_WORLD = 3 };
static const double DEAD_TIMEOUT_S = LONG_TIMEOUT_S; /* the peers must fail long before it */

/* Rank 1 waits in the barrier; rank 2 joins, then exits without closing. */
static void dead_test_rank(int rank, int port) {
    ms_store *s = NULL;
    CHECK_OK(ms__store_open(&s, "127.0.0.1", port, rank, DEAD_WORLD, DEAD_TIMEOUT_S));
    if (!s) return;
    if (rank == 2) {
        sleep_ms(200);
        _exit(0); /* dies without closing: the kernel closes its socket */
    }
    CHECK_ST(ms__store_barrier(s, "dead"), MS_ERR_PEER, "rank 2 left without closing the store");
    ms__store_close(s);
}

static void test_dead_rank(void) {
    int port = free_port();
    pid_t kids[2] = {fork_rank(dead_test_rank, 1, port), fork_rank(dead_test_rank, 2, port)};
    ms_store *s = NULL;
    CHECK_OK(ms__store_open(&s, "127.0.0.1", port, 0, DEAD_WORLD, DEAD_TIMEOUT_S));
    if (s) {
        double t0 = now_s();
        CHECK_ST(ms__store_barrier(s, "dead"), MS_ERR_PEER,
                 "barrier \"dead\": store 127.0.0.1:");
        CHECK(strstr(ms_last_error(), "key \"barrier/dead/2\" is not set and rank 2 left without "
                                      "closing the store") != NULL);
        CHECK(now_s() - t0 < DEAD_TIMEOUT_S / 2, "(rank 0 failed only after %.3f s)", now_s() - t0);
        char got[4];
        size_t len = 1;
        CHECK_OK(ms__store_get(s, "barrier/dead/0", got, sizeof got, &len)); /* still usable */
        CHECK(len == 0);
        ms__store_close(s);
    }
    check_child(kids[0], "rank 1 (waiting in the barrier)");
    check_child(kids[1], "rank 2 (dying)");
}

/* ---------------------------------------------------------------- stray clients */

/* A raw TCP connection to 127.0.0.1:port. */
static int raw_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    return fd;
}

/* Something that is not a store client (an HTTP request), a client that hangs up halfway
 * through a header: refused or forgotten, and the store (one rank) carries on. */
static void test_stray_clients(void) {
    int port = free_port();
    ms_store *s = NULL;
    CHECK_OK(ms__store_open(&s, "127.0.0.1", port, 0, 1, LONG_TIMEOUT_S));
    if (!s) return;
    int fd = raw_connect(port);
    const char http[] = "GET /index HTTP/1.0\n"; /* one header's worth: nothing left unread */
    CHECK(write(fd, http, sizeof http - 1) == (ssize_t)(sizeof http - 1));
    char reply[256] = {0};
    ssize_t n = 0, k;
    while ((k = read(fd, reply + n, sizeof reply - 1 - (size_t)n)) > 0) n += k; /* until EOF */
    CHECK(n > 8 && reply[3] == MS_ERR_ARG && strstr(reply + 8, "not a moonshard store client"));
    close(fd);
    fd = raw_connect(port);
    CHECK(write(fd, "MSS1", 4) == 4);
    close(fd);
    char got[8];
    size_t len = 0;
    CHECK_OK(ms__store_set(s, "alone", "yes", 3));
    CHECK_OK(ms__store_get(s, "alone", got, sizeof got, &len));
    CHECK(len == 3 && memcmp(got, "yes", 3) == 0);
    CHECK_OK(ms__store_barrier(s, "alone"));
    double t0 = now_s();
    ms__store_close(s);
    /* its one rank closed: the server stops at once, not one timeout after rank 0's BYE */
    CHECK(now_s() - t0 < LONG_TIMEOUT_S / 2, "(the close took %.3f s)", now_s() - t0);
}

/* ---------------------------------------------------------------- the server dies */

/* Rank 0 serves, then its process exits without closing. */
static void dying_server(int rank, int port) {
    ms_store *s = NULL;
    CHECK_OK(ms__store_open(&s, "127.0.0.1", port, rank, 2, DEAD_TIMEOUT_S));
    if (!s) return;
    sleep_ms(200);
    _exit(0); /* dies without closing: its server thread goes with it */
}

static void test_server_dies(void) {
    int port = free_port();
    pid_t kid = fork_rank(dying_server, 0, port);
    ms_store *s = NULL;
    char got[4];
    size_t len = 0;
    CHECK_OK(ms__store_open(&s, "127.0.0.1", port, 1, 2, DEAD_TIMEOUT_S));
    if (s) {
        double t0 = now_s();
        CHECK_ST(ms__store_get(s, "never", got, sizeof got, &len), MS_ERR_PEER,
                 "(rank 1 of 2): get \"never\": the server closed the connection: "
                 "rank 0 stopped serving or died");
        CHECK(now_s() - t0 < DEAD_TIMEOUT_S / 2, "(rank 1 failed only after %.3f s)", now_s() - t0);
        CHECK_ST(ms__store_set(s, "k", "v", 1), MS_ERR_STATE,
                 "set \"k\": unusable after an earlier failure: store 127.0.0.1:");
        ms__store_close(s);
    }
    check_child(kid, "rank 0 (dying)");
}

/* ---------------------------------------------------------------- torchrun's store */

/* A stand-in for torchrun's agent store: PyTorch's TCPStore messages VALIDATE, SET, GET
 * and WAIT (one key), little-endian, one thread per connection.  What a client sent that
 * PyTorch's server would refuse is counted in agent.bad. */
enum { AGENT_KEYS = 8, AGENT_CONNS = 2 };
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char key[AGENT_KEYS][300];
    unsigned char *val[AGENT_KEYS];
    size_t len[AGENT_KEYS];
    int nkeys, bad, validated, listen_fd;
    char last_key[300];
} agent = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static bool read_full(int fd, void *buf, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t k = read(fd, (char *)buf + got, n - got);
        if (k <= 0) return false;
        got += (size_t)k;
    }
    return true;
}

static bool read_u64(int fd, uint64_t *v) {
    unsigned char b[8];
    if (!read_full(fd, b, 8)) return false;
    *v = 0;
    for (int i = 7; i >= 0; i--) *v = *v << 8 | b[i];
    return true;
}

static void write_u64(int fd, uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    CHECK(write(fd, b, 8) == 8);
}

static bool read_key(int fd, char *key) {
    uint64_t n;
    if (!read_u64(fd, &n) || n == 0 || n >= 300 || !read_full(fd, key, (size_t)n)) return false;
    key[n] = '\0';
    return true;
}

static int agent_find(const char *key) {
    for (int i = 0; i < agent.nkeys; i++)
        if (strcmp(agent.key[i], key) == 0) return i;
    return -1;
}

static void *agent_conn(void *arg) {
    int fd = (int)(intptr_t)arg;
    unsigned char op, magic[4];
    bool valid = false;
    char key[300];
    while (read_full(fd, &op, 1)) {
        pthread_mutex_lock(&agent.mu);
        bool ok = valid || op == 0;
        pthread_mutex_unlock(&agent.mu);
        if (!ok) break; /* PyTorch's server ignores a client until it validates */
        if (op == 0) { /* VALIDATE */
            ok = read_full(fd, magic, 4) && magic[0] == 0xCE && magic[1] == 0xF7 && magic[2] == 0x85 &&
                 magic[3] == 0x3C;
            valid = ok;
            pthread_mutex_lock(&agent.mu);
            agent.validated += ok;
            pthread_mutex_unlock(&agent.mu);
        } else if (op == 1) { /* SET */
            uint64_t n = 0;
            ok = read_key(fd, key) && read_u64(fd, &n) && n <= (8u << 20);
            unsigned char *v = ok ? malloc(n ? (size_t)n : 1) : NULL;
            ok = ok && v && read_full(fd, v, (size_t)n);
            pthread_mutex_lock(&agent.mu);
            if (ok && agent.nkeys < AGENT_KEYS) {
                int i = agent.nkeys++;
                snprintf(agent.key[i], sizeof agent.key[i], "%s", key);
                agent.val[i] = v, agent.len[i] = (size_t)n, v = NULL;
                snprintf(agent.last_key, sizeof agent.last_key, "%s", key);
                pthread_cond_broadcast(&agent.cv);
            }
            pthread_mutex_unlock(&agent.mu);
            free(v);
        } else if (op == 6) { /* WAIT for 1 key */
            uint64_t count = 0;
            ok = read_u64(fd, &count) && count == 1 && read_key(fd, key);
            pthread_mutex_lock(&agent.mu);
            while (ok && agent_find(key) < 0 && agent.listen_fd >= 0) pthread_cond_wait(&agent.cv, &agent.mu);
            pthread_mutex_unlock(&agent.mu);
            unsigned char stop = 0;
            if (ok) CHECK(write(fd, &stop, 1) == 1);
        } else if (op == 3) { /* GET */
            ok = read_key(fd, key);
            pthread_mutex_lock(&agent.mu);
            int i = ok ? agent_find(key) : -1;
            ok = i >= 0; /* a GET before the key is set: PyTorch's client never sends one */
            if (ok) {
                write_u64(fd, agent.len[i]);
                CHECK(write(fd, agent.val[i], agent.len[i]) == (ssize_t)agent.len[i]);
            }
            pthread_mutex_unlock(&agent.mu);
        } else ok = false;
        if (!ok) {
            pthread_mutex_lock(&agent.mu);
            agent.bad++;
            pthread_mutex_unlock(&agent.mu);
            break;
        }
    }
    close(fd);
    return NULL;
}

static void *agent_accept(void *arg) {
    pthread_t *conns = arg;
    for (int i = 0; i < AGENT_CONNS; i++) {
        int fd = accept(agent.listen_fd, NULL, NULL);
        CHECK(fd >= 0);
        if (fd >= 0) pthread_create(&conns[i], NULL, agent_conn, (void *)(intptr_t)fd);
    }
    return NULL;
}

static void torch_env(int rank, int port) {
    set_env(rank, 2, "127.0.0.1", port);
    setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
    setenv("TORCHELASTIC_RUN_ID", "r7", 1);
    setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
}

/* Rank 0 sets a 1 MiB value late; rank 1 waits for it, gets it whole, then times out on a
 * key nobody sets, after which the connection is refused with that failure. */
static void torch_rank(int rank, int port) {
    torch_env(rank, port);
    ms_store *s = NULL;
    CHECK_OK(ms__store_open_env(&s, 1.0));
    if (!s) return;
    CHECK(ms__store_rank(s) == rank && ms__store_world(s) == 2);
    static unsigned char big[MS_STORE_VALUE_MAX];
    if (rank == 0) {
        for (size_t i = 0; i < sizeof big; i++) big[i] = big_byte(i);
        sleep_ms(200);
        CHECK_OK(ms__store_set(s, "nccl/world/0", big, sizeof big));
    } else {
        size_t len = 0;
        CHECK_OK(ms__store_get(s, "nccl/world/0", big, sizeof big, &len));
        CHECK(len == sizeof big);
        size_t wrong = 0;
        for (size_t i = 0; i < len; i++) wrong += big[i] != big_byte(i);
        CHECK(wrong == 0);
        double t0 = now_s();
        CHECK_ST(ms__store_get(s, "never", big, 8, &len), MS_ERR_TIMEOUT,
                 "(torchrun's) (rank 1 of 2): get \"never\": the key was not set within 1.0 s");
        double waited = now_s() - t0;
        CHECK(waited >= 1.0 - 0.01, "(timed out after %.3f s, before its 1 s)", waited);
        CHECK(waited < HANG_FACTOR * 1.0, "(timed out only after %.3f s)", waited);
        CHECK_ST(ms__store_set(s, "late", "x", 1), MS_ERR_STATE, "unusable after an earlier failure");
    }
    ms__store_close(s);
}

static void test_torchrun(void) {
    agent.listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    CHECK(bind(agent.listen_fd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(agent.listen_fd, 8) == 0 &&
          getsockname(agent.listen_fd, (struct sockaddr *)&sa, &len) == 0);
    int port = ntohs(sa.sin_port);
    pthread_t acceptor, conns[AGENT_CONNS];
    pthread_create(&acceptor, NULL, agent_accept, conns);
    pid_t kids[2] = {fork_rank(torch_rank, 0, port), fork_rank(torch_rank, 1, port)};
    check_child(kids[0], "torchrun rank 0");
    check_child(kids[1], "torchrun rank 1");
    pthread_join(acceptor, NULL);
    pthread_mutex_lock(&agent.mu);
    int fd = agent.listen_fd;
    agent.listen_fd = -1; /* ends the wait for "never" */
    pthread_cond_broadcast(&agent.cv);
    pthread_mutex_unlock(&agent.mu);
    for (int i = 0; i < AGENT_CONNS; i++) pthread_join(conns[i], NULL);
    close(fd);
    CHECK(agent.validated == 2);
    CHECK(agent.bad == 0);
    CHECK(agent.nkeys == 1 && strcmp(agent.key[0], "moonshard/r7/2/nccl/world/0") == 0);
    for (int i = 0; i < agent.nkeys; i++) free(agent.val[i]);
    unset_env();
    unsetenv("TORCHELASTIC_USE_AGENT_STORE");
    unsetenv("TORCHELASTIC_RUN_ID");
    unsetenv("TORCHELASTIC_RESTART_COUNT");
}

int main(void) {
    struct {
        const char *name;
        void (*fn)(void);
    } tests[] = {{"env errors", test_env_errors},
                 {"no server", test_no_server},
                 {"threads", test_threads},
                 {"rank 0 closes first", test_rank0_closes_first},
                 {"processes", test_processes},
                 {"dead rank", test_dead_rank},
                 {"stray clients", test_stray_clients},
                 {"server dies", test_server_dies},
                 {"torchrun", test_torchrun}};
    double start = now_s();
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        double t0 = now_s();
        tests[i].fn();
        printf("  %-20s %.2f s\n", tests[i].name, now_s() - t0);
    }
    printf("test_store: %d passed, %d failed (%.2f s)\n", atomic_load(&passed), atomic_load(&failed),
           now_s() - start);
    return atomic_load(&failed) ? 1 : 0;
}
