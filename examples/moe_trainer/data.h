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
#include <stdio.h>

// Present on every Debian machine (package base-files).
#define DATA_DEFAULT_PATH "/usr/share/common-licenses/GPL-3"

typedef struct {
    unsigned char *bytes; // (size) the whole file
    size_t size;
} Dataset;

// The largest text dataset_open reads (it holds the whole file in memory).
#define DATA_MAX_BYTES (1L << 30)

// Opens path for reading when it is a regular file of at most max_bytes, refusing anything
// else before a read could block or never end: a FIFO (opened without waiting for a
// writer), a directory, a device such as /dev/zero, a socket.  Returns the stream (and its
// size in *size when size is not NULL), or NULL with the reason in why ("No such file or
// directory", "it is a directory", "it is a FIFO (named pipe), not a regular file", "it is
// N bytes, more than the limit of M") and *opened saying whether open(2) succeeded.
FILE *data_open_regular(const char *path, long max_bytes, long *size, char *why, size_t whylen, int *opened);

// Reads the file at path (NULL: DATA_DEFAULT_PATH): a regular file of at most DATA_MAX_BYTES
// (data_open_regular). Returns 0, or -1 with the reason in err and *d left empty.
// dataset_close frees it (idempotent).
int dataset_open(Dataset *d, const char *path, char *err, size_t errlen);
void dataset_close(Dataset *d);

// tokens (nrows, T+1) = rows [row0, row0 + nrows) of global step `step`. Returns 0, or -1
// when the text is shorter than T+1 bytes.
int dataset_rows(const Dataset *d, uint64_t seed, int64_t step, int T, int row0, int nrows,
                 int *tokens);

#endif
