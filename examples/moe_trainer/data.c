/*
 * data.c: the byte-level text dataset of data.h.
 */
#include "data.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

FILE *data_open_regular(const char *path, long max_bytes, long *size, char *why, size_t whylen, int *opened) {
    *opened = 0;
    // O_NONBLOCK: opening a FIFO for reading would wait for a writer; this way it opens at
    // once, and fstat refuses it.  It makes no difference to a regular file's reads.
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, whylen, "%s", strerror(errno));
        return NULL;
    }
    *opened = 1;
    struct stat st;
    const char *kind = NULL;
    FILE *f = NULL;
    if (fstat(fd, &st) != 0)
        snprintf(why, whylen, "%s", strerror(errno));
    else if (S_ISDIR(st.st_mode))
        kind = "a directory";
    else if (S_ISFIFO(st.st_mode))
        kind = "a FIFO (named pipe)";
    else if (S_ISCHR(st.st_mode))
        kind = "a character device";
    else if (S_ISBLK(st.st_mode))
        kind = "a block device";
    else if (S_ISSOCK(st.st_mode))
        kind = "a socket";
    else if (!S_ISREG(st.st_mode))
        kind = "a special file";
    else if (st.st_size > max_bytes)
        snprintf(why, whylen, "it is %lld bytes, more than the limit of %ld", (long long)st.st_size, max_bytes);
    else if (!(f = fdopen(fd, "rb")))
        snprintf(why, whylen, "%s", strerror(errno));
    if (kind) snprintf(why, whylen, "it is %s%s", kind, S_ISDIR(st.st_mode) ? "" : ", not a regular file");
    if (!f) {
        close(fd);
        return NULL;
    }
    if (size) *size = (long)st.st_size;
    return f;
}

int dataset_open(Dataset *d, const char *path, char *err, size_t errlen) {
    d->bytes = NULL;
    d->size = 0;
    if (!path) path = DATA_DEFAULT_PATH;
    char reason[128];
    int opened;
    long size = -1;
    FILE *f = data_open_regular(path, DATA_MAX_BYTES, &size, reason, sizeof reason, &opened);
    if (!f && !opened) {
        snprintf(err, errlen, "dataset: cannot open %s: %s%s", path, reason,
                 strcmp(path, DATA_DEFAULT_PATH) ? "" :
                 " (the default text comes with Debian's base-files; pass another text file)");
        return -1;
    }
    const char *why = f ? NULL : reason;
    unsigned char *bytes = NULL;
    if (why)
        ;
    else if (size == 0)
        why = "the file is empty";
    else if (!(bytes = malloc((size_t)size)))
        why = "out of memory";
    else if (fread(bytes, 1, (size_t)size, f) != (size_t)size)
        why = ferror(f) ? strerror(errno) : "the file got shorter while being read";
    if (why) {
        snprintf(err, errlen, "dataset: cannot read %s: %s", path, why);
        free(bytes);
        if (f) fclose(f);
        return -1;
    }
    fclose(f);
    d->bytes = bytes;
    d->size = (size_t)size;
    return 0;
}

void dataset_close(Dataset *d) {
    free(d->bytes);
    d->bytes = NULL;
    d->size = 0;
}

// splitmix64 finaliser: a well-mixed hash of one 64-bit word.
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int dataset_rows(const Dataset *d, uint64_t seed, int64_t step, int T, int row0, int nrows,
                 int *tokens) {
    if (d->size < (size_t)T + 1) return -1;
    size_t starts = d->size - (size_t)T; // offsets 0 .. size-T-1 hold T+1 bytes
    for (int r = 0; r < nrows; r++) {
        uint64_t h = mix64(seed ^ mix64((uint64_t)step ^ mix64((uint64_t)(row0 + r) + 0x9E3779B97F4A7C15ull)));
        const unsigned char *src = d->bytes + h % starts;
        for (int t = 0; t <= T; t++) tokens[(size_t)r * (T + 1) + t] = src[t];
    }
    return 0;
}
