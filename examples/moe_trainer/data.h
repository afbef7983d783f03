/*
 * data.h: a text file as a byte-level dataset, and deterministic batches a data-parallel
 * group can split by rows.
 *
 * Row r of global step s is the T+1 bytes starting at an offset drawn from (seed, s, r)
 * alone, so every rank computes the same global batch without talking to the others, and
 * rank k of n takes rows [k*B/n, (k+1)*B/n) of it.
 */
#ifndef MOE_DATA_H
#define MOE_DATA_H

#include <stddef.h>
#include <stdint.h>

// Present on every Debian machine (package base-files).
#define DATA_DEFAULT_PATH "/usr/share/common-licenses/GPL-3"

typedef struct {
    unsigned char *bytes; // (size) the whole file
    size_t size;
} Dataset;

// Reads the file at path (NULL: DATA_DEFAULT_PATH). Returns 0, or -1 with the reason in err
// and *d left empty. dataset_close frees it (idempotent).
int dataset_open(Dataset *d, const char *path, char *err, size_t errlen);
void dataset_close(Dataset *d);

// tokens (nrows, T+1) = rows [row0, row0 + nrows) of global step `step`. Returns 0, or -1
// when the text is shorter than T+1 bytes.
int dataset_rows(const Dataset *d, uint64_t seed, int64_t step, int T, int row0, int nrows,
                 int *tokens);

#endif
