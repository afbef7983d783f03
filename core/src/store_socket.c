/*
 * store_socket.c: the store's socket helpers, for its server and its client alike
 * (store_internal.h): addresses, name lookups, listening, connecting and waiting by a deadline.
 */
#include "store_internal.h"

#include "comm.h" /* ms__now_s */

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <unistd.h>

void ms__sock_set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* latency only: best effort */
}

/* "10.0.0.2:41234" or "[::1]:41234" for a socket address. */
void ms__sock_addr_str(const struct sockaddr *sa, char *buf, size_t cap) {
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
        port = ntohs(in->sin_port);
        snprintf(buf, cap, "%s:%d", host, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
        port = ntohs(in6->sin6_port);
        snprintf(buf, cap, "[%s]:%d", host, port);
    } else {
        snprintf(buf, cap, "(address family %d)", sa->sa_family);
    }
}

/* getaddrinfo for TCP on host:port; on failure `why` says what went wrong. */
struct addrinfo *ms__sock_resolve(const char *host, int port, bool passive, char *why, size_t cap) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host, service, &hints, &res);
    if (rc != 0) {
        snprintf(why, cap, "resolving \"%s\": %s", host,
                 rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
        return NULL;
    }
    return res;
}

/* poll() on one fd until it is ready for `events` or the deadline passes (EINTR retried;
 * polled at least once, even past the deadline): 1 ready, 0 timed out, -1 with errno. */
int ms__sock_wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double ms = ceil((deadline - ms__now_s()) * 1e3);
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, ms <= 0 ? 0 : ms > INT_MAX ? INT_MAX : (int)ms);
        if (rc > 0) return 1;
        if (rc < 0 && errno != EINTR) return -1;
        if (rc == 0 && ms <= 0) return 0;
    }
}

/* A listening socket on addr (or on addr's wildcard when `any`): fd, or -1 with `why` and
 * errno. */
int ms__sock_listen(const struct addrinfo *ai, bool any, char *why, size_t cap) {
    struct sockaddr_storage sa;
    memcpy(&sa, ai->ai_addr, ai->ai_addrlen);
    if (any && sa.ss_family == AF_INET)
        ((struct sockaddr_in *)&sa)->sin_addr.s_addr = htonl(INADDR_ANY);
    if (any && sa.ss_family == AF_INET6) ((struct sockaddr_in6 *)&sa)->sin6_addr = in6addr_any;
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
        snprintf(why, cap, "socket: %s", strerror(errno));
        return -1;
    }
    int one = 1;
    const char *step;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
        step = "setsockopt(SO_REUSEADDR)";
    else if (bind(fd, (struct sockaddr *)&sa, ai->ai_addrlen) != 0) step = "bind";
    else if (listen(fd, SOMAXCONN) != 0) step = "listen";
    else return fd;
    int err = errno;
    char addr[80];
    ms__sock_addr_str((struct sockaddr *)&sa, addr, sizeof addr);
    snprintf(why, cap, "%s on %s: %s", step, addr, strerror(err));
    close(fd);
    errno = err;
    return -1;
}

/* One attempt on every address of host:port: a connected non-blocking fd, or -1 and why. */
int ms__sock_connect(const char *host, int port, double deadline, char *why, size_t cap) {
    struct addrinfo *res = ms__sock_resolve(host, port, false, why, cap);
    int fd = -1;
    for (const struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            snprintf(why, cap, "socket: %s", strerror(errno));
            continue;
        }
        int err = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
        if (err == EINPROGRESS) {
            int rc = ms__sock_wait_fd(fd, POLLOUT, deadline);
            socklen_t len = sizeof err;
            if (rc <= 0) err = rc == 0 ? ETIMEDOUT : errno;
            else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        }
        if (err == 0) break;
        char addr[80];
        ms__sock_addr_str(ai->ai_addr, addr, sizeof addr);
        snprintf(why, cap, "connect to %s: %s", addr, strerror(err));
        close(fd);
        fd = -1;
    }
    if (res) freeaddrinfo(res);
    return fd;
}

/* Drops the first k bytes of iov[0..*n), and the empty buffers at its front. */
struct iovec *ms__sock_iov_advance(struct iovec *iov, int *n, size_t k) {
    for (; *n > 0 && k >= iov->iov_len; iov++, (*n)--) k -= iov->iov_len;
    if (*n > 0) {
        iov->iov_base = (char *)iov->iov_base + k;
        iov->iov_len -= k;
    }
    return iov;
}
