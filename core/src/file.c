/*
 * file.c: what a path names (ms_file_stat), for the readers of configs, indexes, policies
 * and checkpoint headers, which refuse anything but a regular file before opening it.
 */
#include "ms_internal.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

const char *ms_file_kind_name(ms_file_kind kind) {
    switch (kind) {
    case MS_FILE_REGULAR: return "regular file";
    case MS_FILE_DIRECTORY: return "directory";
    case MS_FILE_FIFO: return "FIFO (named pipe)";
    case MS_FILE_CHAR_DEVICE: return "character device";
    case MS_FILE_BLOCK_DEVICE: return "block device";
    case MS_FILE_SOCKET: return "socket";
    case MS_FILE_OTHER: return "special file";
    }
    return NULL;
}

ms_status ms_file_stat(const char *path, ms_file_kind *kind, int64_t *size) {
    MS_NOT_NULL(path);
    MS_NOT_NULL(kind);
    MS_NOT_NULL(size);
    struct stat st;
    if (stat(path, &st) != 0) {
        int err = errno;
        return ms__fail(MS_ERR_IO, "%s: %s", path, strerror(err));
    }
    ms_file_kind k = MS_FILE_OTHER;
    if (S_ISREG(st.st_mode)) k = MS_FILE_REGULAR;
    else if (S_ISDIR(st.st_mode)) k = MS_FILE_DIRECTORY;
    else if (S_ISFIFO(st.st_mode)) k = MS_FILE_FIFO;
    else if (S_ISCHR(st.st_mode)) k = MS_FILE_CHAR_DEVICE;
    else if (S_ISBLK(st.st_mode)) k = MS_FILE_BLOCK_DEVICE;
    else if (S_ISSOCK(st.st_mode)) k = MS_FILE_SOCKET;
    *kind = k;
    *size = k == MS_FILE_REGULAR ? (int64_t)st.st_size : 0;
    return ms__ok();
}
