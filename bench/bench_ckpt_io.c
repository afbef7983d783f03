/*
 * bench_ckpt_io.c: the plain-I/O side of bench/bench_ckpt.sh (docs/performance.md).  N
 * threads, each with its own buffer of B bytes (allocated and written before the clock
 * starts), write it to a file of their own (DIR/plainRRRRR.bin, unlinked first, then
 * open, write in calls of at most 1 GiB, fsync, close: what moonshard.checkpoint does for a
 * rank file, without its index, checksums or Lua) or read it back (open, pread, close).
 * Prints one line: "write|read BYTES SECONDS", BYTES the total over the threads, SECONDS the
 * wall time from the threads' start to the last one's end.
 *
 * usage: see USAGE.
 */
#include "bench.h"
#include "bench_args.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_RANKS 64

static const char USAGE[] =
    "usage: bench_ckpt_io write|read DIR [-n RANKS] [-b BYTES]\n"
    "  RANKS threads write (unlink, open, write, fsync, close) or read (open, pread, close) a file\n"
    "  each of BYTES bytes, DIR/plainRRRRR.bin; prints 'write|read TOTAL_BYTES SECONDS'.\n"
    "  -n RANKS  threads, an integer 1.." BENCH_STR(MAX_RANKS) " (default 4)\n"
    "  -b BYTES  bytes a thread, an integer 1..2^40 (default 67108864)\n";

static int writing;
static const char *dir;
static int64_t nbytes;
static pthread_barrier_t start;

typedef struct {
    int rank;
    unsigned char *buf;
    int err;
    const char *what;
    char path[4096];
} job;

static void *run(void *arg) {
    job *j = arg;
    char *path = j->path;
    snprintf(path, sizeof j->path, "%s/plain%05d.bin", dir, j->rank);
    pthread_barrier_wait(&start);
    int fd = writing ? (unlink(path), open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644))
                     : open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        j->err = errno;
        j->what = "open";
        return NULL;
    }
    int64_t done = 0;
    while (done < nbytes) {
        size_t chunk = nbytes - done > (1 << 30) ? (size_t)1 << 30 : (size_t)(nbytes - done);
        ssize_t r = writing ? write(fd, j->buf + done, chunk) : pread(fd, j->buf + done, chunk, (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            j->err = r < 0 ? errno : EIO;
            j->what = writing ? "write" : "read";
            close(fd);
            return NULL;
        }
        done += r;
    }
    if (writing && fsync(fd) != 0) {
        j->err = errno;
        j->what = "fsync";
    }
    close(fd);
    return NULL;
}

int main(int argc, char **argv) {
    bench_args("bench_ckpt_io", USAGE, argc, argv);
    int n = 4;
    nbytes = 64 << 20;
    const char *mode = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-n")) n = (int)bench_int("-n", bench_value(argc, argv, &i), 1, MAX_RANKS);
        else if (!strcmp(argv[i], "-b")) nbytes = bench_int("-b", bench_value(argc, argv, &i), 1, 1LL << 40);
        else if (argv[i][0] == '-') bench_fail("unknown option '%s'", argv[i]);
        else if (!mode) mode = argv[i];
        else if (!dir) dir = argv[i];
        else bench_fail("unexpected argument '%s'", argv[i]);
    }
    if (!mode || (strcmp(mode, "write") && strcmp(mode, "read"))) bench_fail("the first argument is write or read");
    if (!dir) bench_fail("DIR expected");
    writing = !strcmp(mode, "write");
    bench_memory((double)n * (double)nbytes, "a smaller -b or -n");
    job jobs[MAX_RANKS];
    pthread_t th[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        jobs[r] = (job){.rank = r};
        jobs[r].buf = malloc((size_t)nbytes);
        if (!jobs[r].buf) {
            fprintf(stderr, "bench_ckpt_io: out of memory\n");
            return 1;
        }
        /* every page touched before the clock starts, as a unit's shards are */
        for (int64_t k = 0; k < nbytes; k++) jobs[r].buf[k] = (unsigned char)(k * 131 + r);
    }
    pthread_barrier_init(&start, NULL, (unsigned)n + 1);
    for (int r = 0; r < n; r++) pthread_create(&th[r], NULL, run, &jobs[r]);
    pthread_barrier_wait(&start);
    double t0 = now_s();
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    double t = now_s() - t0;
    int bad = 0;
    for (int r = 0; r < n; r++) {
        if (jobs[r].err) {
            fprintf(stderr, "bench_ckpt_io: %s %s: %s\n", jobs[r].what, jobs[r].path, strerror(jobs[r].err));
            bad = 1;
        }
        free(jobs[r].buf);
    }
    if (bad) return 1;
    printf("%s %lld %.6f\n", mode, (long long)n * (long long)nbytes, t);
    return 0;
}
