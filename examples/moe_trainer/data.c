/*
 * data.c: the byte-level text dataset of data.h.
 */
#include "data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int dataset_open(Dataset *d, const char *path, char *err, size_t errlen) {
    d->bytes = NULL;
    d->size = 0;
    if (!path) path = DATA_DEFAULT_PATH;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "dataset: cannot open %s: %s%s", path, strerror(errno),
                 strcmp(path, DATA_DEFAULT_PATH) ? "" :
                 " (the default text comes with Debian's base-files; pass another text file)");
        return -1;
    }
    // fopen opens a directory on Linux (its reads fail), and a pipe cannot be measured.
    struct stat st;
    const char *why = NULL;
    long size = -1;
    unsigned char *bytes = NULL;
    if (fstat(fileno(f), &st) != 0)
        why = strerror(errno);
    else if (S_ISDIR(st.st_mode))
        why = "it is a directory";
    else if (!S_ISREG(st.st_mode))
        why = "it is not a regular file";
    else if (fseek(f, 0, SEEK_END) != 0 || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0)
        why = strerror(errno);
    else if (size == 0)
        why = "the file is empty";
    else if (!(bytes = malloc((size_t)size)))
        why = "out of memory";
    else if (fread(bytes, 1, (size_t)size, f) != (size_t)size)
        why = ferror(f) ? strerror(errno) : "the file got shorter while being read";
    if (why) {
        snprintf(err, errlen, "dataset: cannot read %s: %s", path, why);
        free(bytes);
        fclose(f);
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
