/*
 * test_mpi_p2p.c: sends and receives on the MPI backend, under mpirun -np 4
 * (tests/mpi/run.sh, once plainly and once with MOONSHARD_MPI_MAX_BYTES=16 so that every
 * tensor travels in pieces).  Element i of what rank r sends in test s is value(s, r, i)
 * cast to the dtype; every rank computes what its peers sent the same way and compares the
 * bytes it received:
 *
 *   - a ring in every dtype and size (0, 1, 7 and 5003 elements, one of them 2-D): each
 *     rank sends to the next and receives from the previous in one batch, the odd ranks
 *     listing the receive first;
 *   - a pipeline of blocking calls through the 4 ranks;
 *   - pairs (0 1) and (2 3) exchanging two tensors each way (tags 1 and 2, other shapes and
 *     dtypes), the sends and receives interleaved differently on the two sides;
 *   - every rank with every other in one batch, four tensors each way per pair (more than
 *     a header holds: the other descriptors travel in a second message), in an order of
 *     each rank's own;
 *   - the groups [0 2] and [1 3]: a blocking ping-pong by group ranks;
 *   - errors: a peer out of range and the rank itself (MS_ERR_ARG, the comm still usable);
 *     on a world of its own, pairs (0 1) and (2 3) disagreeing on a shape (MS_ERR_MISMATCH,
 *     the same message on both sides, nothing moved); on a world with a 1 s timeout, rank
 *     0 sending to ranks 1 and 3 while rank 3 never comes (rank 0: MS_ERR_TIMEOUT naming
 *     rank 3, not before the second; rank 1 gets its tensor); on another, rank 3 releasing
 *     its world while rank 2 waits to receive from it (MS_ERR_PEER at once).
 *
 * Every rank prints "rank R: mpi p2p ok (N tensors checked)" when all its checks held.
 */
#include "check.h"

#include <mpi.h>
#include <stdlib.h>
#include <time.h>

static int rank, checked;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Small integers, some negative: in range for every dtype but fp8's, which round them. */
static double value(int s, int r, int64_t i) {
    return (double)((s * 31 + r * 131 + i * 7) % 251 - 125) / (s % 2 ? 4.0 : 1.0);
}

/* A tensor of dtype dt and shape d0 (x d1 when d1 > 0) holding value(s, r, .). */
static ms_tensor *filled(ms_dtype dt, int64_t d0, int64_t d1, int s, int r) {
    int64_t shape[2] = {d0, d1};
    ms_tensor *f = NULL, *t = NULL;
    CHECK_OK(ms_tensor_new(&f, d1 ? 2 : 1, shape, MS_F64, MS_DEVICE_CPU, 0));
    double *v = ms_tensor_data(f);
    for (int64_t i = 0; i < ms_tensor_numel(f); i++) v[i] = dt == MS_BOOL ? (double)((i + r + s) % 2) : value(s, r, i);
    CHECK_OK(ms_tensor_to(&t, f, dt));
    ms_tensor_release(f);
    return t;
}

static ms_tensor *empty_like(const ms_tensor *t) {
    int64_t shape[MS_MAX_DIMS];
    for (int d = 0; d < ms_tensor_ndim(t); d++) shape[d] = ms_tensor_size(t, d);
    ms_tensor *e = NULL;
    CHECK_OK(ms_tensor_new(&e, ms_tensor_ndim(t), shape, ms_tensor_dtype(t), MS_DEVICE_CPU, 0));
    if (e && ms_tensor_nbytes(e)) memset(ms_tensor_data(e), 0xA5, (size_t)ms_tensor_nbytes(e));
    return e;
}

/* got holds what rank `from` sent in test s (its shape and dtype). */
static void check_from(const char *what, const ms_tensor *got, int s, int from) {
    ms_tensor *want = NULL;
    int64_t shape[MS_MAX_DIMS];
    for (int d = 0; d < ms_tensor_ndim(got); d++) shape[d] = ms_tensor_size(got, d);
    want = filled(ms_tensor_dtype(got), shape[0], ms_tensor_ndim(got) > 1 ? shape[1] : 0, s, from);
    int same = want && ms_tensor_nbytes(want) == ms_tensor_nbytes(got) &&
               (!ms_tensor_nbytes(got) ||
                !memcmp(ms_tensor_data(want), ms_tensor_data(got), (size_t)ms_tensor_nbytes(got)));
    if (same) {
        check_passed++;
        checked++;
    } else {
        check_failed++;
        fprintf(stderr, "rank %d: %s: the tensor from rank %d differs from what it sent\n", rank, what, from);
    }
    ms_tensor_release(want);
}

static void ring(ms_comm *c) {
    static const int64_t counts[] = {0, 1, 7, 5003, 6};
    const int n = ms_comm_size(c), next = (rank + 1) % n, prev = (rank + n - 1) % n;
    int s = 100;
    char what[96];
    for (int d = 0; d < MS_DTYPE_COUNT; d++)
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++, s++) {
            int64_t d0 = counts[k] == 6 ? 2 : counts[k], d1 = counts[k] == 6 ? 3 : 0;
            ms_tensor *out = filled((ms_dtype)d, d0, d1, s, rank), *in = empty_like(out);
            ms_p2p_op ops[2] = {{MS_P2P_SEND, out, next, 0}, {MS_P2P_RECV, in, prev, 0}};
            if (rank % 2) ops[0] = ops[1], ops[1] = (ms_p2p_op){MS_P2P_SEND, out, next, 0};
            CHECK_OK(ms_batch_p2p(c, ops, 2));
            snprintf(what, sizeof what, "ring, %s x %lld", ms_dtype_name((ms_dtype)d), (long long)counts[k]);
            check_from(what, in, s, prev);
            ms_tensor_release(out);
            ms_tensor_release(in);
        }
}

static void pipeline(ms_comm *c) {
    const int n = ms_comm_size(c);
    ms_tensor *t = filled(MS_BF16, 4, 33, 200, 0);
    if (rank == 0) {
        CHECK_OK(ms_send(c, t, 1, 3));
    } else {
        ms_tensor *in = empty_like(t);
        CHECK_OK(ms_recv(c, in, rank - 1, 3));
        check_from("pipeline", in, 200, 0);
        if (rank + 1 < n) CHECK_OK(ms_send(c, in, rank + 1, 3));
        ms_tensor_release(in);
    }
    ms_tensor_release(t);
}

static void pairs(ms_comm *c) {
    const int partner = rank ^ 1;
    ms_tensor *a = filled(MS_F32, 5, 7, 301, rank), *b = filled(MS_I64, 3, 0, 302, rank);
    ms_tensor *ga = empty_like(a), *gb = empty_like(b);
    ms_p2p_op even[4] = {{MS_P2P_SEND, a, partner, 1}, {MS_P2P_SEND, b, partner, 2}, {MS_P2P_RECV, ga, partner, 1},
                         {MS_P2P_RECV, gb, partner, 2}};
    ms_p2p_op odd[4] = {{MS_P2P_RECV, ga, partner, 1}, {MS_P2P_SEND, a, partner, 1}, {MS_P2P_RECV, gb, partner, 2},
                        {MS_P2P_SEND, b, partner, 2}};
    CHECK_OK(ms_batch_p2p(c, rank % 2 ? odd : even, 4));
    check_from("pair, tag 1", ga, 301, partner);
    check_from("pair, tag 2", gb, 302, partner);
    ms_tensor *all[] = {a, b, ga, gb};
    for (int i = 0; i < 4; i++) ms_tensor_release(all[i]);
}

enum { EACH = 4 }; /* tensors each way per pair: more than MS_P2P_INLINE */

static void everyone(ms_comm *c) {
    const int n = ms_comm_size(c);
    ms_tensor *mine[EACH], *got[4][EACH] = {{0}};
    ms_p2p_op ops[2 * EACH * 4];
    int nops = 0;
    for (int k = 0; k < EACH; k++) mine[k] = filled(MS_F16, 100 + k, 0, 400 + k, rank);
    for (int i = 1; i < n; i++) {
        const int to = (rank + i) % n, from = (rank + n - i) % n;
        for (int k = 0; k < EACH; k++) {
            got[from][k] = empty_like(mine[k]);
            ops[nops++] = (ms_p2p_op){MS_P2P_SEND, mine[k], to, k};
            ops[nops++] = (ms_p2p_op){MS_P2P_RECV, got[from][k], from, k};
        }
    }
    CHECK_OK(ms_batch_p2p(c, ops, nops));
    for (int j = 0; j < n; j++)
        for (int k = 0; k < EACH && j != rank; k++) {
            check_from("every peer", got[j][k], 400 + k, j);
            ms_tensor_release(got[j][k]);
        }
    for (int k = 0; k < EACH; k++) ms_tensor_release(mine[k]);
}

static void halves(ms_comm *c) {
    ms_comm *g = NULL;
    CHECK_OK(ms_comm_group(c, 2, (int[]){rank % 2, rank % 2 + 2}, &g));
    if (!g) return;
    ms_tensor *t = filled(MS_I32, 6, 0, 500, rank), *in = empty_like(t);
    if (ms_comm_rank(g) == 0) {
        CHECK_OK(ms_send(g, t, 1, 4));
        CHECK_OK(ms_recv(g, in, 1, 5));
        check_from("ping-pong", in, 501, rank + 2);
    } else {
        CHECK_OK(ms_recv(g, in, 0, 4));
        check_from("ping-pong", in, 500, rank - 2);
        ms_tensor_release(t);
        t = filled(MS_I32, 6, 0, 501, rank);
        CHECK_OK(ms_send(g, t, 0, 5));
    }
    ms_tensor_release(t);
    ms_tensor_release(in);
    ms_comm_release(g);
}

static void bad_peers(ms_comm *c) {
    ms_tensor *t = filled(MS_F32, 4, 0, 600, rank);
    char want[128];
    CHECK_ERR(ms_send(c, t, 4, 0), MS_ERR_ARG, "send on group [0 1 2 3]: peer 4 is not a group rank (0..3)");
    snprintf(want, sizeof want, "recv on group [0 1 2 3]: peer %d is this rank (a rank cannot receive from itself)",
             rank);
    CHECK_ERR(ms_recv(c, t, rank, 0), MS_ERR_ARG, want);
    ms_tensor_release(t);
}

/* A world of MPI_COMM_WORLD's ranks of its own, for a test that leaves it unusable; *w and
 * the comm are released by done(). */
static ms_comm *own_world(double timeout_s, ms_world **w) {
    ms_comm *c = NULL;
    MPI_Comm all = MPI_COMM_WORLD;
    CHECK_OK(ms_mpi_world_from_comm(w, &all, timeout_s));
    if (*w) CHECK_OK(ms_world_comm(*w, rank, &c));
    return c;
}

static void done(ms_world *w, ms_comm *c) {
    ms_comm_release(c);
    ms_world_release(w);
}

static void mismatch(void) {
    ms_world *w = NULL;
    ms_comm *c = own_world(60, &w);
    if (!c) return;
    const int partner = rank ^ 1, lo = rank & ~1;
    ms_tensor *t = filled(MS_F32, rank % 2 ? 3 : 2, rank % 2 ? 2 : 3, 700, rank);
    char want[320];
    snprintf(want, sizeof want, "send/recv on group [0 1 2 3] between rank %d and rank %d: the sides disagree: "
             "tensor 1 of 1 from rank %d to rank %d: sent as tag 0 [2, 3] f32, received as tag 0 [3, 2] f32 (the "
             "shape differs)", lo, lo + 1, lo, lo + 1);
    CHECK_ERR(rank % 2 ? ms_recv(c, t, partner, 0) : ms_send(c, t, partner, 0), MS_ERR_MISMATCH, want);
    CHECK(!strcmp(ms_last_error(), want));
    ms_tensor *same = filled(MS_F32, rank % 2 ? 3 : 2, rank % 2 ? 2 : 3, 700, rank);
    CHECK(!memcmp(ms_tensor_data(t), ms_tensor_data(same), 24)); /* nothing moved */
    CHECK_ERR(ms_send(c, t, partner, 0), MS_ERR_STATE, "the comm is unusable after an earlier failure");
    ms_tensor_release(same);
    ms_tensor_release(t);
    done(w, c);
}

/* A world with a 1 s timeout: rank 3 never comes to rank 0's batch, and keeps its world
 * until rank 0 is back. */
static void timeout(void) {
    ms_world *w = NULL;
    ms_comm *c = own_world(1, &w);
    if (!c) return;
    ms_tensor *t = filled(MS_F32, 5, 0, 800, 0);
    if (rank == 0) {
        ms_p2p_op ops[2] = {{MS_P2P_SEND, t, 1, 0}, {MS_P2P_SEND, t, 3, 0}};
        double t0 = now_s();
        CHECK_ERR(ms_batch_p2p(c, ops, 2), MS_ERR_TIMEOUT,
                  "send/recv on group [0 1 2 3] between rank 0 and rank 3 timed out after 1 s: rank 3 did not arrive "
                  "(timeout_s=1 given to the world)");
        double waited = now_s() - t0;
        CHECK(waited >= 1 - 1e-3 && waited < 30);
    } else if (rank == 1) {
        ms_tensor *in = empty_like(t);
        CHECK_OK(ms_recv(c, in, 0, 0));
        check_from("beside a peer that timed out", in, 800, 0);
        ms_tensor_release(in);
    }
    MPI_Barrier(MPI_COMM_WORLD); /* rank 3 keeps its world (releasing it would say it finished) */
    ms_tensor_release(t);
    done(w, c);
}

/* Rank 3 releases its world while rank 2 waits to receive from it. */
static void finished(void) {
    ms_world *w = NULL;
    ms_comm *c = own_world(30, &w);
    if (!c) return;
    if (rank == 2) {
        ms_tensor *t = filled(MS_F32, 5, 0, 900, 2);
        double t0 = now_s();
        CHECK_ERR(ms_recv(c, t, 3, 0), MS_ERR_PEER,
                  "send/recv on group [0 1 2 3] between rank 2 and rank 3: rank 3 finished its script without "
                  "joining send/recv");
        CHECK(now_s() - t0 < 15); /* at once, not after the 30 s timeout */
        ms_tensor_release(t);
    }
    done(w, c);
}

int main(void) {
    ms_world *w = NULL;
    ms_comm *c = NULL;
    CHECK_OK(ms_mpi_world_new(&w, 60)); /* initialises MPI */
    if (!w) return check_summary("test_mpi_p2p");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    CHECK(ms_world_size(w) == 4);
    CHECK_OK(ms_world_comm(w, rank, &c));
    if (!c || ms_world_size(w) != 4) return check_summary("test_mpi_p2p");
    bad_peers(c);
    ring(c);
    pipeline(c);
    pairs(c);
    everyone(c);
    halves(c);
    mismatch();
    timeout();
    finished();
    ms_comm_release(c);
    ms_world_release(w);
    if (!check_failed) printf("rank %d: mpi p2p ok (%d tensors checked)\n", rank, checked);
    return check_summary("test_mpi_p2p");
}
