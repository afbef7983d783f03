/*
 * comm_async.c: per-rank communication threads that run queued calls in FIFO order.
 *
 * A worker serves one (world, world rank).  It is started by the first ms__async_submit for
 * that pair and lives until the world is freed (comm.c's world_free calls
 * ms__async_world_stop).  Its queue is a singly linked list of caller-owned tickets; the
 * worker pops the head, runs it with its lock released, and marks it done under the lock.
 * A failing call's message lives in the worker's thread-local buffer, so it is copied into
 * the ticket there and re-raised on the waiting thread by ms__async_wait.
 *
 * The registry of workers is a process-wide list under one lock: a submit looks its worker
 * up there (worlds are few, ranks per world few); stopping a world unlinks its workers
 * under the lock and joins them after releasing it.
 */
#include "comm.h"

#include <stdio.h>
#include <stdlib.h>

struct ms_async_worker {
    ms_world *world;          /* not retained: the world stops its workers when freed */
    int rank;                 /* world rank served */
    pthread_t thread;
    pthread_mutex_t lock;     /* guards the queue, `stop` and every queued ticket's `done` */
    pthread_cond_t work;      /* signalled when a ticket is queued or stop is set */
    pthread_cond_t done;      /* broadcast when a ticket completes */
    ms_ticket *head, *tail;   /* FIFO of queued tickets, not yet run */
    bool stop;
    ms_async_worker *next;    /* registry link */
};

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static ms_async_worker *registry; /* every running worker of every world */
static _Thread_local const ms_async_worker *current; /* the worker this thread is, if any */

/* ---------------------------------------------------------------- the worker thread */

static void *worker_main(void *p) {
    ms_async_worker *wk = p;
    current = wk;
    pthread_mutex_lock(&wk->lock);
    for (;;) {
        while (!wk->head && !wk->stop) pthread_cond_wait(&wk->work, &wk->lock);
        ms_ticket *t = wk->head;
        if (!t) break; /* stop, with nothing left to run */
        wk->head = t->next;
        if (!wk->head) wk->tail = NULL;
        pthread_mutex_unlock(&wk->lock);

        ms_status st = t->fn(t->arg);
        t->status = st;
        if (st) snprintf(t->message, sizeof t->message, "%s", ms_last_error());

        pthread_mutex_lock(&wk->lock);
        t->done = true; /* the caller may reuse t as soon as it sees this */
        pthread_cond_broadcast(&wk->done);
    }
    pthread_mutex_unlock(&wk->lock);
    return NULL;
}

static void worker_free(ms_async_worker *wk) {
    pthread_cond_destroy(&wk->done);
    pthread_cond_destroy(&wk->work);
    pthread_mutex_destroy(&wk->lock);
    free(wk);
}

/* The worker of (w, rank), started if needed; registry_lock held. */
static ms_status worker_get(ms_world *w, int rank, ms_async_worker **out) {
    for (ms_async_worker *wk = registry; wk; wk = wk->next)
        if (wk->world == w && wk->rank == rank) {
            *out = wk;
            return MS_OK;
        }
    ms_async_worker *wk = calloc(1, sizeof *wk);
    if (!wk) return ms__fail(MS_ERR_OOM, "out of memory starting the communication thread of rank %d", rank);
    wk->world = w;
    wk->rank = rank;
    pthread_mutex_init(&wk->lock, NULL);
    pthread_cond_init(&wk->work, NULL);
    pthread_cond_init(&wk->done, NULL);
    int err = pthread_create(&wk->thread, NULL, worker_main, wk);
    if (err) {
        worker_free(wk);
        return ms__fail(MS_ERR_INTERNAL, "cannot start the communication thread of rank %d (pthread_create: error %d)",
                        rank, err);
    }
    wk->next = registry;
    registry = wk;
    *out = wk;
    return MS_OK;
}

/* ---------------------------------------------------------------- interface */

ms_status ms__async_submit(ms_world *w, int world_rank, ms_ticket *t, ms_async_fn fn, void *arg) {
    if (!w || !t || !fn) return ms__fail(MS_ERR_ARG, "async_submit: NULL argument");
    if (world_rank < 0 || world_rank >= w->size)
        return ms__fail(MS_ERR_ARG, "async_submit: rank %d is out of range for a world of %d ranks", world_rank,
                        w->size);
    ms_async_worker *wk = NULL;
    pthread_mutex_lock(&registry_lock);
    ms_status st = worker_get(w, world_rank, &wk);
    pthread_mutex_unlock(&registry_lock);
    if (st) return st;

    *t = (ms_ticket){.fn = fn, .arg = arg, .worker = wk};
    pthread_mutex_lock(&wk->lock);
    if (wk->tail) wk->tail->next = t;
    else wk->head = t;
    wk->tail = t;
    pthread_cond_signal(&wk->work);
    pthread_mutex_unlock(&wk->lock);
    return ms__ok();
}

ms_status ms__async_wait(ms_ticket *t) {
    ms_async_worker *wk = t->worker;
    pthread_mutex_lock(&wk->lock);
    while (!t->done) pthread_cond_wait(&wk->done, &wk->lock);
    pthread_mutex_unlock(&wk->lock);
    return t->status ? ms__fail(t->status, "%s", t->message) : ms__ok();
}

bool ms__async_elsewhere(ms_world *w, int world_rank) {
    if (current && current->world == w && current->rank == world_rank) return false;
    bool found = false;
    pthread_mutex_lock(&registry_lock);
    for (ms_async_worker *wk = registry; wk && !found; wk = wk->next) found = wk->world == w && wk->rank == world_rank;
    pthread_mutex_unlock(&registry_lock);
    return found;
}

ms_status ms__async_run(ms_world *w, int world_rank, ms_async_fn fn, void *arg) {
    if (current && current->world == w && current->rank == world_rank) return fn(arg);
    ms_ticket t;
    ms_status st = ms__async_submit(w, world_rank, &t, fn, arg);
    return st ? st : ms__async_wait(&t);
}

void ms__async_world_stop(ms_world *w) {
    ms_async_worker *stopping = NULL;
    pthread_mutex_lock(&registry_lock);
    for (ms_async_worker **link = &registry; *link;) {
        ms_async_worker *wk = *link;
        if (wk->world != w) {
            link = &wk->next;
            continue;
        }
        *link = wk->next;
        wk->next = stopping;
        stopping = wk;
    }
    pthread_mutex_unlock(&registry_lock);

    while (stopping) {
        ms_async_worker *wk = stopping;
        stopping = wk->next;
        pthread_mutex_lock(&wk->lock);
        wk->stop = true;
        pthread_cond_signal(&wk->work);
        pthread_mutex_unlock(&wk->lock);
        pthread_join(wk->thread, NULL);
        worker_free(wk);
    }
}
