/*
 * test_mpi_comm.c: moonshard on a host's own MPI communicator (ms_mpi_world_from_comm),
 * beside the world of MPI_COMM_WORLD, under mpirun -np 4 (tests/mpi/run.sh):
 *
 *   - the four ranks split MPI_COMM_WORLD by parity into two communicators of two; each
 *     half makes a moonshard world of its communicator, which the host frees at once
 *     (moonshard keeps its duplicate);
 *   - on each half: an all_reduce (sum of the global ranks + 1: 1 + 3 = 4, 2 + 4 = 6), an
 *     all_gather (the global ranks, in the half's rank order) and a group of the half's
 *     rank 0 alone; on the whole world, an all_reduce after them (1 + 2 + 3 + 4 = 10);
 *   - errors: a NULL pointer, MPI_COMM_NULL;
 *   - a mismatch last: on each half, the same all_reduce (dtype, count, op) posted for two
 *     different shard units (comm.h's label, which travels in the MPI backend's exchanged
 *     descriptors): both ranks fail with MS_ERR_MISMATCH naming both units.
 *
 * Every rank checks its own results and prints "rank R: mpi comm ok (...)".
 */
#include "check.h"
#include "comm.h" /* ms__coll_label */

#include <mpi.h>

static float one(ms_tensor *t) { return ((const float *)ms_tensor_data(t))[0]; }

int main(void) {
    ms_world *all = NULL, *half = NULL;
    CHECK_OK(ms_mpi_world_new(&all, 60)); /* initialises MPI (MPI_THREAD_MULTIPLE) */
    if (!all) return check_summary("test_mpi_comm");
    int rank = -1, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CHECK(size == 4);

    MPI_Comm split = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &split);
    CHECK_OK(ms_mpi_world_from_comm(&half, &split, 60));
    int sub = -1;
    MPI_Comm_rank(split, &sub);
    MPI_Comm_free(&split); /* moonshard holds its own duplicate */
    CHECK_ERR(ms_mpi_world_from_comm(&(ms_world *){NULL}, NULL, 60), MS_ERR_ARG, "ms_mpi_world_from_comm: mpi_comm is NULL");
    MPI_Comm null = MPI_COMM_NULL;
    CHECK_ERR(ms_mpi_world_from_comm(&(ms_world *){NULL}, &null, 60), MS_ERR_ARG, "MPI_COMM_NULL");
    if (!half) return check_summary("test_mpi_comm");
    CHECK(ms_world_size(half) == 2 && sub == rank / 2);

    ms_comm *hc = NULL, *wc = NULL, *solo = NULL;
    CHECK_OK(ms_world_comm(half, sub, &hc));
    CHECK_OK(ms_world_comm(all, rank, &wc));
    ms_tensor *t = NULL, *mine = NULL, *gathered = NULL;
    CHECK_OK(ms_tensor_new(&t, 1, (int64_t[]){1}, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&mine, 1, (int64_t[]){1}, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&gathered, 1, (int64_t[]){2}, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_fill(t, rank + 1));
    CHECK_OK(ms_all_reduce(hc, t, MS_OP_SUM));
    const float half_sum = one(t), want_half = rank % 2 ? 2 + 4 : 1 + 3;
    CHECK(half_sum == want_half);
    CHECK_OK(ms_tensor_fill(mine, rank));
    CHECK_OK(ms_all_gather(hc, gathered, mine));
    const float *g = ms_tensor_data(gathered);
    CHECK(g[0] == (float)(rank % 2) && g[1] == (float)(rank % 2 + 2));
    if (sub == 0) { /* a group holds the rank that asks for it */
        CHECK_OK(ms_comm_group(hc, 1, (int[]){0}, &solo));
        CHECK_OK(ms_tensor_fill(t, 7));
        CHECK_OK(ms_all_reduce(solo, t, MS_OP_SUM));
        CHECK(one(t) == 7 && ms_comm_size(solo) == 1);
    }
    CHECK_OK(ms_tensor_fill(t, rank + 1));
    CHECK_OK(ms_all_reduce(wc, t, MS_OP_SUM));
    CHECK(one(t) == 10);
    /* Agreement covers the label: rank 0 of the half posts for unit layers.0, rank 1 for
     * layers.1, and each gets the message naming both. */
    ms__coll_label = sub == 0 ? "layers.0" : "layers.1";
    CHECK_ERR(ms_all_reduce(hc, t, MS_OP_SUM), MS_ERR_MISMATCH,
              "all_reduce on group [0 1]: ranks disagree: rank 0: 1 x f32 sum for unit layers.0; "
              "rank 1: 1 x f32 sum for unit layers.1");
    ms__coll_label = NULL;
    CHECK(one(t) == 10); /* a mismatch touches no data */
    if (!check_failed)
        printf("rank %d: mpi comm ok (half %d of 2 ranks: sum %g, gathered %g %g; world sum %g)\n", rank, rank % 2,
               (double)half_sum, (double)g[0], (double)g[1], (double)one(t));
    ms_tensor_release(t);
    ms_tensor_release(mine);
    ms_tensor_release(gathered);
    ms_comm_release(solo);
    ms_comm_release(hc);
    ms_comm_release(wc);
    ms_world_release(half);
    ms_world_release(all);
    return check_summary("test_mpi_comm");
}
