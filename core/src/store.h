/*
 * store.h: a small TCP key-value store for rendezvous, like PyTorch's TCPStore.  Rank 0
 * serves it and every rank (rank 0 too) joins it as a client: ms__store_open, or
 * ms__store_open_env under torchrun-style launchers.  A key is set once; a get waits until
 * its key is set.  One ms_store is one client connection: use it from one thread at a time.
 * Several stores may live in one process (the tests run ranks as threads).
 */
#ifndef MS_STORE_H
#define MS_STORE_H

#include "ms_internal.h"

#include <stddef.h>

/* One client connection.  The wire protocol and the server's design are described in
 * store_internal.h and store_server.c. */
typedef struct ms_store ms_store;

enum {
    MS_STORE_KEY_MAX = 255,          /* bytes in a key (no NUL) */
    MS_STORE_VALUE_MAX = 1024 * 1024 /* bytes in a value */
};

/* Joins the store at host:port (an IPv4 or IPv6 address or a host name) as `rank` of
 * `world` ranks.  Rank 0 also serves it, from a background thread: it listens on host:port
 * (SO_REUSEADDR), or on every interface of that address family when host is not an address
 * of this machine (a NAT or service address that routes to it).  Clients retry connecting
 * until timeout_s (> 0) has passed, since the server may start later; timeout_s then bounds
 * every wait of the store.  Errors name host:port and what failed.  The server refuses a
 * client whose rank has already joined or whose world size differs from rank 0's. */
ms_status ms__store_open(ms_store **out, const char *host, int port, int rank, int world,
                         double timeout_s);
/* The same from the environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which
 * launchers in the torchrun style set for the one process per rank they start (the NCCL
 * backend passes its world's unique id through the store: rank 0 sets a key, the others get
 * it).  Every missing or malformed variable is named in the error, with the value seen and
 * what is expected.  Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the store at
 * MASTER_ADDR:MASTER_PORT is torchrun's own: every rank joins it as a client, in PyTorch's
 * TCPStore protocol, its keys under "moonshard/<TORCHELASTIC_RUN_ID>/<restart count>/";
 * there a second set of a key overwrites it, and a dead peer shows as a timeout
 * (store_client.c, "torchrun's store"). */
ms_status ms__store_open_env(ms_store **out, double timeout_s);

int ms__store_rank(const ms_store *s);
int ms__store_world(const ms_store *s);

/* Sets key (1..MS_STORE_KEY_MAX bytes) to len bytes (<= MS_STORE_VALUE_MAX) at value.
 * Keys are set once and never change or go away while the store is served: setting a key
 * that is already set is MS_ERR_ARG. */
ms_status ms__store_set(ms_store *s, const char *key, const void *value, size_t len);
/* Waits until key is set, copies up to cap bytes of its value into value (NULL when cap is
 * 0) and sets *len to the value's full length.  MS_ERR_TIMEOUT naming the key and the
 * seconds waited after the store's timeout; MS_ERR_PEER naming the rank when a rank's
 * connection ended without closing the store (a crashed process) before the key was set,
 * instead of waiting out the timeout. */
ms_status ms__store_get(ms_store *s, const char *key, void *value, size_t cap, size_t *len);
/* Every rank arrives before any leaves: rank r sets "barrier/<name>/<r>" and gets every
 * other rank's key, all within one timeout.  Each barrier needs its own name (its keys are
 * set once). */
ms_status ms__store_barrier(ms_store *s, const char *name);

/* Closes the client (s may be NULL).  On rank 0 this also stops serving, once every rank
 * has closed or left, or at the latest one timeout after rank 0 closed: rank 0 closes last
 * in effect, so the others can still fetch what they need. */
void ms__store_close(ms_store *s);

#endif /* MS_STORE_H */
