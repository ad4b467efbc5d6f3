/*
 * stoker._jpeg.Engine: the whole CPU work of a batch of JPEG rows in one call, run by a pool of
 * native threads that never touch the interpreter.
 *
 * Per row: its random stream (order.py's SplitMix64 keys and uniforms), its crop plan (the planned
 * geometric ops of transforms/geometry.py, operation for operation in double precision: the same
 * integers), the decode parameters (stoker_plan_row), then region decode + resize + place + flip
 * into its row of the batch (stoker_render_row), and a status byte. The caller (a Python
 * coordinator thread) hands over a batch in one call, which resolves the rows' bytes under the GIL,
 * queues the batch, releases the GIL and waits on a condition variable until the pool has done
 * every row, the timeout passes or close() stops the pool; rows the pool refused (status != 0) are
 * the caller's, for its per-sample path. The pool's threads claim rows one at a time from the
 * oldest batch queued, so two coordinators' batches overlap and any thread count gives the same
 * pixels (a row's result depends on the row alone).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "crowd.h"
#include "engine.h"

#define NPARAM 17            /* jpeg_region.c's P_* parameters of a row */
#define NOT_DONE 30          /* status of a row the pool never reached (stopped, or timed out) */
#define PROG_WIDTH 10        /* doubles per planned op: kind, draw offset, then its parameters */
enum { OP_RRC = 1, OP_RESIZE = 2, OP_CENTER = 3, OP_FLIP = 4, OP_COVER = 5 };

/* ---- order.py's random streams ---- */
static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL, M1 = 0xBF58476D1CE4E5B9ULL, M2 = 0x94D049BB133111EBULL;

static uint64_t mix64(uint64_t z) {
    z += GOLDEN;
    z ^= z >> 30;
    z *= M1;
    z ^= z >> 27;
    z *= M2;
    z ^= z >> 31;
    return z;
}

/* draw j (from 0) of the stream `key`: order.uniforms */
static double uniform(uint64_t key, int64_t j) {
    return (double)(mix64(key ^ ((uint64_t)(j + 1) * M2)) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- geometry.py's PlanState, one row ---- */
typedef struct {
    double box[4], clip[4];
    int64_t grid[2], lh, lw;
    int flip, resampled;
    int64_t corner[2];  /* OP_COVER: the crop's top-left in the resized image (a batch's conditioning) */
} plan_state;

static int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

static void resample_here(plan_state *s) {
    memcpy(s->clip, s->box, sizeof(s->box));
    s->grid[0] = s->lh, s->grid[1] = s->lw;
    s->resampled = 1;
}

static void crop(plan_state *s, int64_t top, int64_t left, int64_t ch, int64_t cw, int64_t nh, int64_t nw) {
    double sy = s->box[2] / (double)s->lh, sx = s->box[3] / (double)s->lw;
    int64_t left_src = s->flip ? s->lw - left - cw : left;
    s->box[0] += (double)top * sy;
    s->box[1] += (double)left_src * sx;
    s->box[2] = (double)ch * sy;
    s->box[3] = (double)cw * sx;
    s->lh = nh, s->lw = nw;
    if (!s->resampled) {
        memcpy(s->clip, s->box, sizeof(s->box));
        s->grid[0] = s->lh, s->grid[1] = s->lw;
    }
}

/* _plan_rrc: torchvision's RandomResizedCrop.get_params (10 tries, then the central fallback) */
static void plan_rrc(plan_state *s, const double *op, uint64_t key, int64_t off) {
    double s0 = op[4], s1 = op[5], lr0 = op[6], lr1 = op[7], r0 = op[8], r1 = op[9];
    int64_t lh = s->lh, lw = s->lw, top = 0, left = 0, h = 0, w = 0;
    double area = (double)(lh * lw);
    int found = 0;
    for (int t = 0; t < 10 && !found; t++) {
        double target = area * (s0 + (s1 - s0) * uniform(key, off + t));
        double aspect = exp(lr0 + (lr1 - lr0) * uniform(key, off + 10 + t));
        double wd = rint(sqrt(target * aspect)), hd = rint(sqrt(target / aspect));
        if (wd > 0 && wd <= (double)lw && hd > 0 && hd <= (double)lh) {
            w = (int64_t)wd, h = (int64_t)hd, found = 1;
        }
    }
    if (found) {
        top = (int64_t)floor(uniform(key, off + 20) * (double)(lh - h + 1));
        left = (int64_t)floor(uniform(key, off + 21) * (double)(lw - w + 1));
    } else {
        double in_ratio = (double)lw / (double)lh;
        w = in_ratio < r0 ? lw : (in_ratio > r1 ? (int64_t)rint((double)lh * r1) : lw);
        h = in_ratio < r0 ? (int64_t)rint((double)lw / r0) : lh;
        top = floor_div(lh - h, 2), left = floor_div(lw - w, 2);
    }
    crop(s, top, left, h, w, (int64_t)op[2], (int64_t)op[3]);
    resample_here(s);
}

static void plan_resize(plan_state *s, const double *op) {
    if (op[2] < 0) {   /* (height, width) */
        s->lh = (int64_t)op[3], s->lw = (int64_t)op[4];
    } else {           /* the shorter side becomes `size`, the longer one truncated */
        int64_t size = (int64_t)op[2];
        int w_short = s->lw <= s->lh;
        int64_t shorter = w_short ? s->lw : s->lh, longer = w_short ? s->lh : s->lw;
        int64_t new_long = (int64_t)((double)size * (double)longer / (double)shorter);
        s->lh = w_short ? new_long : size;
        s->lw = w_short ? size : new_long;
    }
    resample_here(s);
}

/* geometry.cover_crop: resize keeping the aspect to cover (oh, ow), then crop it at random (two draws) or centred */
static void plan_cover(plan_state *s, const double *op, uint64_t key, int64_t off) {
    int64_t oh = (int64_t)op[2], ow = (int64_t)op[3];
    double lh = (double)s->lh, lw = (double)s->lw, sh = (double)oh / lh, sw = (double)ow / lw;
    double scale = sh > sw ? sh : sw;
    double rhd = rint(lh * scale), rwd = rint(lw * scale);
    int64_t rh = rhd > (double)oh ? (int64_t)rhd : oh, rw = rwd > (double)ow ? (int64_t)rwd : ow, top, left;
    if (op[4] != 0.0) {
        top = (int64_t)floor(uniform(key, off) * (double)(rh - oh + 1));
        left = (int64_t)floor(uniform(key, off + 1) * (double)(rw - ow + 1));
    } else {
        top = floor_div(rh - oh, 2), left = floor_div(rw - ow, 2);
    }
    s->lh = rh, s->lw = rw;
    resample_here(s);
    crop(s, top, left, oh, ow, oh, ow);
    s->corner[0] = top, s->corner[1] = left;
}

static int64_t center_offset(int64_t want, int64_t have) {
    return want > have ? -floor_div(want - have, 2) : (int64_t)rint((double)(have - want) / 2.0);
}

/* Run the planned ops (`prog`, PROG_WIDTH doubles each) on a stored h x w image with the stream `key`. */
static void plan_ops(const double *prog, int nops, uint64_t key, int64_t h, int64_t w, plan_state *s) {
    memset(s, 0, sizeof(*s));
    s->lh = h, s->lw = w;
    s->grid[0] = h, s->grid[1] = w;
    s->box[2] = (double)h, s->box[3] = (double)w;
    memcpy(s->clip, s->box, sizeof(s->box));
    for (int k = 0; k < nops; k++) {
        const double *op = prog + (size_t)k * PROG_WIDTH;
        int64_t off = (int64_t)op[1];
        switch ((int)op[0]) {
        case OP_RRC:
            plan_rrc(s, op, key, off);
            break;
        case OP_RESIZE:
            plan_resize(s, op);
            break;
        case OP_CENTER: {
            int64_t ch = (int64_t)op[2], cw = (int64_t)op[3];
            crop(s, center_offset(ch, s->lh), center_offset(cw, s->lw), ch, cw, ch, cw);
            break;
        }
        case OP_FLIP:
            s->flip ^= uniform(key, off) < op[2];
            break;
        case OP_COVER:
            plan_cover(s, op, key, off);
            break;
        }
    }
}

/* ---- the pool ---- */
typedef struct batch {
    const unsigned char **data;  /* each row's JPEG, or raw pixels (NULL: none) */
    size_t *len;
    const unsigned char *kinds;  /* per row: 0 a JPEG, 1 raw RGB pixels (stored height x width x 3); NULL: all JPEGs */
    int64_t *corners;            /* per row, written when planned: OP_COVER's (top, left); NULL: not asked */
    const int64_t *ids, *index, *sizes;  /* stream id and dataset index per row; stored (h, w) per index */
    Py_ssize_t nsizes;
    uint64_t stream;
    const double *prog;
    int nops, oh, ow, antialias, fast, full_size;
    double headroom, max_pixels;
    unsigned char *images, *status;
    Py_ssize_t rows, first, k;
    /* the float output (NULL: none): each row written done also mapped through `levels` into `floats` */
    unsigned char *floats;
    const unsigned char *levels;
    int itemsize, nchw;
    /* progress, under the engine's mutex */
    Py_ssize_t next, done;
    int cancelled;
    double busy;
    struct batch *link;
} batch_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work, done, park;
    batch_t *head, *tail;
    int stopping, nthreads, started, nice;
    pthread_t *threads;  /* room for `most`; threads past nthreads are started when the pool first grows */
    /* the pool's size under other programs' load (crowd.h), all under mu: threads numbered `active` and
     * above wait on `park`; a window's start (time, process CPU, the pool's CPU, the machine's ticks) */
    int most, active, peak, born;
    stoker_crowd_state crowd;
    double w_t0, w_proc, w_pool, w_wall, others, crowded_s;
    unsigned long long w_busy, w_total;
    int w_ok, measuring, mark;   /* mark: this process's entry among the stoker processes (crowd.h), or -1 */
    stoker_peers peers;
    pthread_mutex_t close_mu;  /* one close() joins the threads; another waits for it */
    int joined;
    pid_t owner;  /* the process whose threads these are: a fork()ed child has none of them */
} EngineObject;

/* In a fork()ed child the pool's threads do not exist and its mutexes may be held by a parent thread that
   was copied mid-row: the child never joins, signals, locks or destroys them, it only forgets the pool. */
static int forked(EngineObject *e) {
    return getpid() != e->owner;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* the loop of map_levels for values of type T (float, or the bits of a 2-byte float) */
#define MAP_LEVELS(T)                                                                   \
    do {                                                                                \
        const T *t = (const T *)levels;                                                 \
        T *dst = (T *)floats + (size_t)row * plane * 3;                                 \
        if (nchw) {                                                                     \
            T *d0 = dst, *d1 = dst + plane, *d2 = dst + 2 * plane;                      \
            for (size_t p = 0; p < plane; p++, src += 3) {                              \
                d0[p] = t[src[0]];                                                      \
                d1[p] = t[256 + src[1]];                                                \
                d2[p] = t[512 + src[2]];                                                \
            }                                                                           \
        } else {                                                                        \
            for (size_t p = 0; p < plane; p++, src += 3, dst += 3) {                    \
                dst[0] = t[src[0]];                                                     \
                dst[1] = t[256 + src[1]];                                               \
                dst[2] = t[512 + src[2]];                                               \
            }                                                                           \
        }                                                                               \
    } while (0)

/* Row `row` of the uint8 NHWC `images` (h x w x 3) through the per-channel tables `levels` (3 x 256 values of
 * `itemsize` bytes: float32, or float16/bfloat16 bits) into row `row` of `floats`: NCHW planes, or NHWC
 * (channels_last) when !nchw. A table lookup copies the value's bits, so the output is the table's arithmetic
 * bit for bit, whatever wrote the row. No GIL needed. */
static void map_levels(const unsigned char *images, Py_ssize_t row, int h, int w, const unsigned char *levels,
                       int itemsize, int nchw, unsigned char *floats) {
    size_t plane = (size_t)h * (size_t)w;
    const unsigned char *src = images + (size_t)row * plane * 3;
    if (itemsize == 4)
        MAP_LEVELS(float);
    else
        MAP_LEVELS(uint16_t);
}

static unsigned char render(const batch_t *b, Py_ssize_t i, stoker_decoder *dec) {
    if (b->data[i] == NULL)
        return 22;
    int64_t idx = b->index[i];
    if (idx < 0 || idx >= b->nsizes)
        return 24;
    int64_t h = b->sizes[2 * idx], w = b->sizes[2 * idx + 1];
    if (h <= 0 || w <= 0)
        return 20;
    plan_state s;
    plan_ops(b->prog, b->nops, mix64(b->stream ^ (uint64_t)b->ids[i]), h, w, &s);
    if (b->corners != NULL)
        b->corners[2 * i] = s.corner[0], b->corners[2 * i + 1] = s.corner[1];
    int64_t size[2] = {s.lh, s.lw}, p[NPARAM];
    int raw = b->kinds != NULL && b->kinds[i] == 1;   /* stored pixels: the window of the whole image, no decode */
    stoker_plan_row(s.box, s.clip, s.grid, h, w, size, (unsigned char)s.flip, b->first + i, b->oh, b->ow,
                    b->full_size || raw, b->headroom, p);
    unsigned char st = raw ? stoker_render_raw(p, b->data[i], b->len[i], b->images, b->rows, b->oh, b->ow,
                                               b->antialias, b->max_pixels)
                           : stoker_render_row(p, b->data[i], b->len[i], b->images, b->rows, b->oh, b->ow,
                                               b->antialias, b->fast, b->max_pixels, dec);
    if (st == 0 && b->floats != NULL)   /* the row just written, still in cache */
        map_levels(b->images, b->first + i, b->oh, b->ow, b->levels, b->itemsize, b->nchw, b->floats);
    return st;
}

static int finished(const batch_t *b) { return b->done == b->next && (b->next >= b->k || b->cancelled); }

static void *pool_thread(void *arg);

/* CPU seconds of `clock` (a thread's, or the process's), 0 where it cannot be read. */
static double cpu_s(clockid_t clock) {
    struct timespec ts;
    return clock_gettime(clock, &ts) == 0 ? (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 : 0.0;
}

static double pool_cpu_s(EngineObject *e) {
    double sum = 0.0;
#ifdef __linux__   /* elsewhere the pool keeps its size (crowd.c reads no ticks): no thread clocks needed */
    for (int t = 0; t < e->started; t++) {
        clockid_t clock;
        if (pthread_getcpuclockid(e->threads[t], &clock) == 0)
            sum += cpu_s(clock);
    }
#else
    (void)e;
#endif
    return sum;
}

/* The end of a measuring window, from the pool thread whose row ended it at `now` (called and returning
 * with mu held): the measurements taken with mu released (file reads: no other thread waits on them), the
 * window's figures to stoker_crowd_next, then the pool's size it gives (threads started the first time they
 * are needed; parked ones woken), and the next window begins. Where /proc/stat cannot be read the pool keeps
 * its size. One thread measures at a time (`measuring`), so it alone touches `peers` and `started` grows
 * only here. */
static void crowd_step(EngineObject *e, double now) {
    e->measuring = 1;
    pthread_mutex_unlock(&e->mu);
    unsigned long long busy = 0, total = 0;
    int cpus = 0, ok = stoker_cpu_ticks(&busy, &total, &cpus) == 0;
    double proc = cpu_s(CLOCK_PROCESS_CPUTIME_ID), pool = pool_cpu_s(e), peers = stoker_peers_cpu_s(&e->peers);
    pthread_mutex_lock(&e->mu);
    e->measuring = 0;
    if (e->w_ok && ok && total > e->w_total) {
        stoker_crowd_window w;
        w.window_s = now - e->w_t0;
        w.pool_cpu_s = pool - e->w_pool;
        w.pool_wall_s = e->w_wall;
        w.cores = cpus;
        /* the machine's busy cores on this process's CPUs, less this process's own and other stoker processes' */
        w.others = (double)(busy - e->w_busy) / (double)(total - e->w_total) * cpus - (proc - e->w_proc + peers) / w.window_s;
        if (w.others < 0)
            w.others = 0;
        e->others = w.others;
        if (e->active > e->nthreads)
            e->crowded_s += w.window_s;
        int before = e->active, n = stoker_crowd_next(e->nthreads, e->most, &e->crowd, &w, now);
        for (; e->started < n && !e->stopping; e->started++)
            if (pthread_create(&e->threads[e->started], NULL, pool_thread, e) != 0)
                break;   /* no more threads to be had: the pool grows no further */
        n = n < e->started ? n : e->started;
        e->crowd.active = n;
        __atomic_store_n(&e->active, n, __ATOMIC_RELAXED);   /* the `active` getter reads it without mu */
        if (n > e->peak)
            __atomic_store_n(&e->peak, n, __ATOMIC_RELAXED);
        if (n > before)
            pthread_cond_broadcast(&e->park);
    }
    e->w_t0 = now, e->w_proc = proc, e->w_pool = pool, e->w_wall = 0.0;
    e->w_busy = busy, e->w_total = total, e->w_ok = ok;
}

static void *pool_thread(void *arg) {
    EngineObject *e = (EngineObject *)arg;
#ifdef __linux__
    /* Linux's nice value is per thread: the pool yields a busy core to the training process's own threads
     * (nice 0) without losing any while they sleep; lowering a thread's priority needs no privilege */
    if (e->nice > 0)
        (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), e->nice);
    (void)pthread_setname_np(pthread_self(), "stoker-pool");   /* as `top -H` and /proc name it */
#endif
    stoker_decoder dec;
    int ok = stoker_decoder_init(&dec) == 0;
    pthread_mutex_lock(&e->mu);
    int me = e->born++;   /* threads numbered `active` and above are parked (crowd_step) */
    for (;;) {
        while (!e->stopping && (me >= e->active || e->head == NULL)) {
            if (me >= e->active && dec.scratch != NULL) {   /* parked: its scratch (the largest region it decoded)
                                                             * goes back until it takes rows again */
                free(dec.scratch);
                dec.scratch = NULL, dec.scratch_size = 0;
            }
            pthread_cond_wait(me >= e->active ? &e->park : &e->work, &e->mu);  /* close() broadcasts both */
        }
        if (e->stopping)
            break;
        batch_t *b = e->head;
        Py_ssize_t i = b->next++;
        if (b->next >= b->k) {  /* every row claimed: the next batch is the head */
            e->head = b->link;
            if (e->head == NULL)
                e->tail = NULL;
        }
        pthread_mutex_unlock(&e->mu);
        double t0 = now_s();
        unsigned char st = ok ? render(b, i, &dec) : 4;
        double t1 = now_s(), t = t1 - t0;
        pthread_mutex_lock(&e->mu);
        b->status[i] = st;
        b->busy += t;
        b->done++;
        if (finished(b))
            pthread_cond_broadcast(&e->done);
        e->w_wall += t;
        if (e->most > e->nthreads && !e->measuring && t1 - e->w_t0 >= STOKER_CROWD_WINDOW_S)
            crowd_step(e, t1);
    }
    pthread_mutex_unlock(&e->mu);
    stoker_decoder_free(&dec);
    return NULL;
}

static void unqueue(EngineObject *e, batch_t *b) {
    batch_t *prev = NULL;
    for (batch_t *q = e->head; q != NULL; prev = q, q = q->link) {
        if (q != b)
            continue;
        if (prev == NULL)
            e->head = q->link;
        else
            prev->link = q->link;
        if (e->tail == q)
            e->tail = prev;
        return;
    }
}

/* Stop the pool: queued rows are never started, each thread ends after its row, and every waiter wakes. */
static void engine_stop(EngineObject *e) {
    if (forked(e)) {
        e->stopping = 1, e->joined = 1, e->head = e->tail = NULL;
        return;
    }
    pthread_mutex_lock(&e->close_mu);
    if (!e->joined) {
        pthread_mutex_lock(&e->mu);
        e->stopping = 1;
        pthread_cond_broadcast(&e->work);
        pthread_cond_broadcast(&e->park);
        pthread_cond_broadcast(&e->done);
        pthread_mutex_unlock(&e->mu);
        for (int t = 0; t < e->started; t++)
            pthread_join(e->threads[t], NULL);
        e->joined = 1;
        stoker_unmark(e->mark);
    }
    pthread_mutex_unlock(&e->close_mu);
}

static PyObject *engine_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"threads", "nice", "most", NULL};
    int threads, nice = 0, most = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|ii", keywords, &threads, &nice, &most))
        return NULL;
    if (threads < 1 || threads > 1024 || most > 1024) {
        PyErr_Format(PyExc_ValueError, "Engine: threads must be 1..1024 and most at most 1024, got %d and %d",
                     threads, most);
        return NULL;
    }
    EngineObject *e = (EngineObject *)type->tp_alloc(type, 0);
    if (e == NULL)
        return NULL;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->close_mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->done, NULL);
    pthread_cond_init(&e->park, NULL);
    e->nthreads = threads;
    e->most = most > threads ? most : threads;
    e->active = e->peak = e->crowd.active = threads;
    e->mark = stoker_mark();   /* other pools do not grow against this process's CPU */
    e->owner = getpid();
    e->nice = nice < 0 ? 0 : (nice > 19 ? 19 : nice);
    e->threads = (pthread_t *)PyMem_Calloc((size_t)e->most, sizeof(pthread_t));
    if (e->threads == NULL) {
        Py_DECREF(e);
        return PyErr_NoMemory();
    }
    for (; e->started < threads; e->started++) {
        int rc = pthread_create(&e->threads[e->started], NULL, pool_thread, e);
        if (rc != 0) {
            Py_BEGIN_ALLOW_THREADS
            engine_stop(e);
            Py_END_ALLOW_THREADS
            Py_DECREF(e);
            errno = rc;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return (PyObject *)e;
}

static void engine_dealloc(EngineObject *e) {
    /* the safety net: an engine no one closed (garbage collection) still joins its threads */
    Py_BEGIN_ALLOW_THREADS
    engine_stop(e);
    Py_END_ALLOW_THREADS
    PyMem_Free(e->threads);
    if (!forked(e)) {
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->park);
        pthread_cond_destroy(&e->done);
        pthread_mutex_destroy(&e->mu);
        pthread_mutex_destroy(&e->close_mu);
    }
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *engine_close(EngineObject *e, PyObject *unused) {
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    engine_stop(e);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The buffers a call acquires, released once the batch is done. */
typedef struct {
    Py_buffer b[11];
    int got;
    Py_buffer *blocks;
    int64_t *ids;
    Py_ssize_t nblocks_got;
} held_t;

static void release(held_t *h) {
    for (int j = 0; j < h->got; j++)
        PyBuffer_Release(&h->b[j]);
    for (Py_ssize_t j = 0; j < h->nblocks_got; j++)
        PyBuffer_Release(&h->blocks[j]);
    PyMem_Free(h->blocks);
    PyMem_Free(h->ids);
}

static int get(held_t *h, PyObject *obj, int writable) {
    if (PyObject_GetBuffer(obj, &h->b[h->got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    h->got++;
    return 0;
}

/* floats: [rows, 3, h, w] (nchw) or [rows, h, w, 3] of 2- or 4-byte values for the uint8 images [rows, h, w, 3];
 * levels: 3 x 256 values of the same size. */
static int check_levels(const Py_buffer *images, const Py_buffer *fl, const Py_buffer *lv, int nchw) {
    if (images->ndim == 4 && fl->ndim == 4 && (fl->itemsize == 2 || fl->itemsize == 4) &&
        lv->len == 3 * 256 * fl->itemsize && fl->shape[0] == images->shape[0] &&
        fl->shape[nchw ? 2 : 1] == images->shape[1] && fl->shape[nchw ? 3 : 2] == images->shape[2] &&
        fl->shape[nchw ? 1 : 3] == 3 && images->shape[3] == 3)
        return 0;
    PyErr_Format(PyExc_ValueError, "floats must be [rows, 3, h, w] (nchw) or [rows, h, w, 3] of 2- or 4-byte values "
                 "for images uint8 [rows, h, w, 3], levels 3 x 256 values of the same size");
    return -1;
}

/* map_levels(images, rows, levels, floats, nchw): rows (int64 [k]) of uint8 NHWC `images` through the per-channel
 * tables `levels` into `floats`, as the pool writes its rows: the rows the pool refused, rendered in Python. */
static PyObject *map_levels_py(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[4];
    int nchw;
    if (!PyArg_ParseTuple(args, "OOOOp", &o[0], &o[1], &o[2], &o[3], &nchw))
        return NULL;
    Py_buffer b[4];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 4; got++)
        if (PyObject_GetBuffer(o[got], &b[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got == 3 ? PyBUF_WRITABLE : 0)) < 0)
            goto done;
    if (b[0].itemsize != 1 || b[1].itemsize != 8 || check_levels(&b[0], &b[3], &b[2], nchw) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "map_levels: images must be uint8 and rows int64");
        goto done;
    }
    const int64_t *rows = (const int64_t *)b[1].buf;
    Py_ssize_t k = b[1].len / 8;
    for (Py_ssize_t i = 0; i < k; i++)
        if (rows[i] < 0 || rows[i] >= b[0].shape[0]) {
            PyErr_Format(PyExc_IndexError, "map_levels: row %lld of %zd", (long long)rows[i], b[0].shape[0]);
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++)
        map_levels((const unsigned char *)b[0].buf, (Py_ssize_t)rows[i], (int)b[0].shape[1], (int)b[0].shape[2],
                   (const unsigned char *)b[2].buf, (int)b[3].itemsize, nchw, (unsigned char *)b[3].buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return result;
}

static PyObject *engine_run(EngineObject *e, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"blocks", "spans", "ids", "index", "sizes", "stream", "program", "images", "status",
                               "first", "out_h", "out_w", "full_size", "headroom", "antialias", "fast",
                               "max_pixels", "timeout", "floats", "levels", "nchw", "kinds", "corners", NULL};
    PyObject *blocks_obj, *spans_obj, *ids_obj, *index_obj, *sizes_obj, *prog_obj, *images_obj, *status_obj;
    PyObject *floats_obj = Py_None, *levels_obj = Py_None, *kinds_obj = Py_None, *corners_obj = Py_None;
    int nchw = 1;
    unsigned long long stream;
    Py_ssize_t first;
    int oh, ow, full_size, antialias, fast;
    double headroom, max_pixels, timeout;
    if (forked(e)) {
        PyErr_Format(PyExc_RuntimeError, "Engine.run: this pool's threads belong to process %ld, and this is a "
                     "fork()ed child (pid %ld) that has none of them: make a new Engine in the child",
                     (long)e->owner, (long)getpid());
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOKOOOniipdppdd|OOpOO", keywords, &blocks_obj, &spans_obj,
                                     &ids_obj, &index_obj, &sizes_obj, &stream, &prog_obj, &images_obj, &status_obj,
                                     &first, &oh, &ow, &full_size, &headroom, &antialias, &fast, &max_pixels, &timeout,
                                     &floats_obj, &levels_obj, &nchw, &kinds_obj, &corners_obj))
        return NULL;
    if (!stoker_jpeg_loaded()) {
        PyErr_SetString(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
        return NULL;
    }
    if (isnan(timeout)) {
        PyErr_SetString(PyExc_ValueError, "Engine.run: timeout must be seconds, got nan");
        return NULL;
    }
    /* an infinite timeout (Workers(timeout=float("inf"))) as a finite deadline (about 31 years): cast to
     * time_t, inf gave a deadline in the past, and the waiter re-took the mutex in a loop the pool's
     * threads could not get past */
    if (timeout > 1e9)
        timeout = 1e9;
    PyObject *blocks = PySequence_Fast(blocks_obj, "blocks must be a sequence of byte buffers");
    if (blocks == NULL)
        return NULL;
    held_t h;
    memset(&h, 0, sizeof(h));
    batch_t b;
    memset(&b, 0, sizeof(b));
    PyObject *result = NULL;
    if (get(&h, spans_obj, 0) < 0 || get(&h, ids_obj, 0) < 0 || get(&h, index_obj, 0) < 0 ||
        get(&h, sizes_obj, 0) < 0 || get(&h, prog_obj, 0) < 0 || get(&h, images_obj, 1) < 0 ||
        get(&h, status_obj, 1) < 0)
        goto out;
    Py_buffer *spans = &h.b[0], *ids = &h.b[1], *index = &h.b[2], *sizes = &h.b[3], *prog = &h.b[4],
              *images = &h.b[5], *status = &h.b[6];
    Py_ssize_t k = ids->len / 8, i64 = (Py_ssize_t)sizeof(int64_t);
    if (spans->len != k * 3 * i64 || index->len != k * i64 || sizes->len % (2 * i64) != 0 || status->len != k ||
        prog->len % (PROG_WIDTH * (Py_ssize_t)sizeof(double)) != 0 || images->ndim != 4 || images->shape[3] != 3 ||
        images->itemsize != 1 || images->shape[1] != oh || images->shape[2] != ow || first < 0 ||
        first + k > images->shape[0]) {
        PyErr_Format(PyExc_ValueError, "Engine.run: spans must be int64 [k, 3], ids and index int64 [k], sizes "
                     "int64 [n, 2], program float64 [ops, %d], status uint8 [k], images uint8 [rows, out_h, out_w, 3] "
                     "with rows first..first+k", PROG_WIDTH);
        goto out;
    }
    if ((floats_obj == Py_None) != (levels_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "Engine.run: floats and levels go together (both or neither)");
        goto out;
    }
    if (floats_obj != Py_None) {
        if (get(&h, floats_obj, 1) < 0 || get(&h, levels_obj, 0) < 0)
            goto out;
        Py_buffer *fl = &h.b[7], *lv = &h.b[8];
        if (check_levels(images, fl, lv, nchw) < 0)
            goto out;
        b.floats = (unsigned char *)fl->buf, b.levels = (const unsigned char *)lv->buf;
        b.itemsize = (int)fl->itemsize, b.nchw = nchw;
    }
    if (kinds_obj != Py_None) {   /* after floats and levels: h.b[7], h.b[8] are theirs when given */
        int at = h.got;
        if (get(&h, kinds_obj, 0) < 0)
            goto out;
        if (h.b[at].len != k || h.b[at].itemsize != 1) {
            PyErr_SetString(PyExc_ValueError, "Engine.run: kinds must be uint8 [k] (0 a JPEG, 1 raw pixels)");
            goto out;
        }
        b.kinds = (const unsigned char *)h.b[at].buf;
    }
    if (corners_obj != Py_None) {
        int at = h.got;
        if (get(&h, corners_obj, 1) < 0)
            goto out;
        if (h.b[at].len != k * 2 * i64 || h.b[at].itemsize != 8) {
            PyErr_SetString(PyExc_ValueError, "Engine.run: corners must be int64 [k, 2], C-contiguous");
            goto out;
        }
        b.corners = (int64_t *)h.b[at].buf;
    }
    size_t n = (size_t)(k > 0 ? k : 1);
    b.data = (const unsigned char **)PyMem_Calloc(n, sizeof(unsigned char *));
    b.len = (size_t *)PyMem_Calloc(n, sizeof(size_t));
    h.blocks = (Py_buffer *)PyMem_Calloc(n, sizeof(Py_buffer));
    h.ids = (int64_t *)PyMem_Calloc(n, sizeof(int64_t));
    if (b.data == NULL || b.len == NULL || h.blocks == NULL || h.ids == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    const int64_t *sp = (const int64_t *)spans->buf;
    Py_ssize_t nblocks = PySequence_Fast_GET_SIZE(blocks);
    unsigned char *st = (unsigned char *)status->buf;
    for (Py_ssize_t i = 0; i < k; i++) {  /* each block's buffer acquired once, however many rows read it */
        st[i] = NOT_DONE;
        int64_t id = sp[3 * i], lo = sp[3 * i + 1], hi = sp[3 * i + 2];
        if (id < 0)
            continue;   /* neither a JPEG nor raw pixels: the per-sample path's (status 22) */
        if (id >= nblocks) {
            PyErr_Format(PyExc_IndexError, "Engine.run: row %zd names block %lld of %zd", i, (long long)id, nblocks);
            goto out;
        }
        Py_ssize_t j = 0;
        while (j < h.nblocks_got && h.ids[j] != id)
            j++;
        if (j == h.nblocks_got) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(blocks, id), &h.blocks[j], PyBUF_SIMPLE) < 0)
                goto out;
            h.ids[j] = id;
            h.nblocks_got++;
        }
        if (lo < 0 || hi < lo || hi > h.blocks[j].len) {
            st[i] = 23;   /* bytes outside the block: the per-sample read reports it */
            continue;
        }
        b.data[i] = (const unsigned char *)h.blocks[j].buf + lo;
        b.len[i] = (size_t)(hi - lo);
    }
    b.ids = (const int64_t *)ids->buf, b.index = (const int64_t *)index->buf, b.sizes = (const int64_t *)sizes->buf;
    b.nsizes = sizes->len / (2 * i64);
    b.stream = (uint64_t)stream;
    b.prog = (const double *)prog->buf, b.nops = (int)(prog->len / (PROG_WIDTH * (Py_ssize_t)sizeof(double)));
    b.oh = oh, b.ow = ow, b.antialias = antialias, b.fast = fast, b.full_size = full_size;
    b.headroom = headroom, b.max_pixels = max_pixels;
    b.images = (unsigned char *)images->buf, b.status = st, b.rows = images->shape[0], b.first = first, b.k = k;
    int state = 0;  /* 0 done, 1 stopped by close(), 2 timed out */
    Py_ssize_t left = 0;
    double busy = 0.0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->mu);
    if (e->stopping)
        b.cancelled = 1, state = 1;
    else if (k > 0) {
        if (e->tail == NULL)
            e->head = e->tail = &b;
        else
            e->tail->link = &b, e->tail = &b;
        pthread_cond_broadcast(&e->work);
    }
    double deadline = now_s() + timeout;
    while (!finished(&b)) {
        if (!b.cancelled && (e->stopping || now_s() >= deadline)) {
            unqueue(e, &b);   /* rows not yet claimed stay NOT_DONE; rows in flight are waited for */
            b.cancelled = 1, state = e->stopping ? 1 : 2;
            continue;
        }
        if (b.cancelled) {
            pthread_cond_wait(&e->done, &e->mu);   /* the rows in flight: one image's work each */
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            double wait = deadline - now_s(), secs = floor(wait);
            ts.tv_sec += (time_t)secs;
            ts.tv_nsec += (long)((wait - secs) * 1e9);
            if (ts.tv_nsec >= 1000000000L)
                ts.tv_sec++, ts.tv_nsec -= 1000000000L;
            pthread_cond_timedwait(&e->done, &e->mu, &ts);
        }
    }
    busy = b.busy;
    pthread_mutex_unlock(&e->mu);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++)
        left += st[i] != 0;
    result = Py_BuildValue("ndi", left, busy, state);
out:
    PyMem_Free((void *)b.data);
    PyMem_Free(b.len);
    release(&h);
    Py_DECREF(blocks);
    return result;
}

static PyObject *engine_threads(EngineObject *e, void *closure) {
    (void)closure;
    return PyLong_FromLong(e->nthreads);
}

/* the pool's size figures (crowd.h): closure 0 active, 1 peak, 2 most; read without the mutex (atomic loads),
 * so a caller holding the GIL never waits for a window's measurements */
static PyObject *engine_count(EngineObject *e, void *closure) {
    int which = (int)(intptr_t)closure;
    if (forked(e))
        return PyLong_FromLong(0);
    return PyLong_FromLong(which == 0 ? __atomic_load_n(&e->active, __ATOMIC_RELAXED)
                           : which == 1 ? __atomic_load_n(&e->peak, __ATOMIC_RELAXED) : e->most);
}

/* closure 0: the cores other processes used in the last window; 1: seconds the pool ran above its size */
static PyObject *engine_figure(EngineObject *e, void *closure) {
    double v;
    if (forked(e))
        return PyFloat_FromDouble(0.0);
    pthread_mutex_lock(&e->mu);
    v = closure == NULL ? e->others : e->crowded_s;
    pthread_mutex_unlock(&e->mu);
    return PyFloat_FromDouble(v);
}

/* plan_batch(ids, index, sizes, stream, program, box, clip, grid, size, flip): the pool's plan of each row,
 * written into box, clip (float64 [k, 4]), grid, size (int64 [k, 2]) and flip (uint8 [k]); for tests. */
static PyObject *plan_batch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[9];
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOKOOOOOO", &o[0], &o[1], &o[2], &stream, &o[3], &o[4], &o[5], &o[6], &o[7],
                          &o[8]))
        return NULL;
    Py_buffer b[9];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 9; got++)
        if (PyObject_GetBuffer(o[got], &b[got], PyBUF_C_CONTIGUOUS | (got >= 4 ? PyBUF_WRITABLE : 0)) < 0)
            goto out;
    Py_ssize_t k = b[0].len / 8, nsizes = b[2].len / 16;
    if (b[1].len != k * 8 || b[4].len != k * 32 || b[5].len != k * 32 || b[6].len != k * 16 || b[7].len != k * 16 ||
        b[8].len != k || b[3].len % (PROG_WIDTH * 8) != 0) {
        PyErr_SetString(PyExc_ValueError, "plan_batch: ids, index int64 [k]; box, clip float64 [k, 4]; grid, size "
                        "int64 [k, 2]; flip uint8 [k]");
        goto out;
    }
    const int64_t *ids = (const int64_t *)b[0].buf, *index = (const int64_t *)b[1].buf, *sizes = (const int64_t *)b[2].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t idx = index[i];
        if (idx < 0 || idx >= nsizes) {
            PyErr_Format(PyExc_IndexError, "plan_batch: index %lld outside the %zd sizes", (long long)idx, nsizes);
            goto out;
        }
        plan_state s;
        plan_ops((const double *)b[3].buf, (int)(b[3].len / (PROG_WIDTH * 8)), mix64((uint64_t)stream ^ (uint64_t)ids[i]),
                 sizes[2 * idx], sizes[2 * idx + 1], &s);
        memcpy((double *)b[4].buf + 4 * i, s.box, sizeof(s.box));
        memcpy((double *)b[5].buf + 4 * i, s.clip, sizeof(s.clip));
        memcpy((int64_t *)b[6].buf + 2 * i, s.grid, sizeof(s.grid));
        ((int64_t *)b[7].buf)[2 * i] = s.lh, ((int64_t *)b[7].buf)[2 * i + 1] = s.lw;
        ((unsigned char *)b[8].buf)[i] = (unsigned char)s.flip;
    }
    result = Py_None;
    Py_INCREF(result);
out:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return result;
}

/* ---- the GPU columns' rows of a batch: planned, windowed and laid out in one call ---- */
#define GEO_COLUMNS 15  /* loading/jobs.py's GEO_COLUMNS: row, flip, h, w, src[4], dst[4], padded, planned, index */

static int is_i64(const Py_buffer *b) {
    char c = b->format == NULL ? 'B' : b->format[strlen(b->format) - 1];
    return b->itemsize == 8 && (c == 'l' || c == 'q');
}

static int is_f64(const Py_buffer *b) {
    return b->itemsize == 8 && b->format != NULL && b->format[strlen(b->format) - 1] == 'd';
}

/* jobs.crop_windows for one row: transforms.crop_window(box, h, w, h, w, oh, ow) in the same double-precision
 * steps (nearbyint under the default rounding mode rounds halves to even, as np.rint and round() do). Writes
 * src and dst (y0, y1, x0, x1) and returns whether the window is padded. */
static int crop_window_row(const double *box, int64_t hi, int64_t wi, int64_t oh, int64_t ow, int64_t *src,
                           int64_t *dst) {
    double h = (double)hi, w = (double)wi, fy = h / h, fx = w / w, toh = (double)oh, tow = (double)ow;
    double y0 = box[0] * fy, x0 = box[1] * fx;
    double y1 = y0 + box[2] * fy, x1 = x0 + box[3] * fx;
    double ry0 = nearbyint(y0), rx0 = nearbyint(x0), ry1 = nearbyint(y1), rx1 = nearbyint(x1);
    double iy0 = fmin(h - 1, fmax(0.0, ry0)), ix0 = fmin(w - 1, fmax(0.0, rx0));
    double iy1 = fmin(h, fmax(iy0 + 1, ry1)), ix1 = fmin(w, fmax(ix0 + 1, rx1));
    int padded = ry0 < 0 || rx0 < 0 || ry1 > h || rx1 > w;
    src[0] = (int64_t)iy0, src[1] = (int64_t)iy1, src[2] = (int64_t)ix0, src[3] = (int64_t)ix1;
    dst[0] = 0, dst[1] = oh, dst[2] = 0, dst[3] = ow;
    if (padded) {
        double bh = fmax(y1 - y0, 1e-9), bw = fmax(x1 - x0, 1e-9);
        double ty0 = fmin(toh - 1, fmax(0.0, nearbyint((iy0 - y0) * toh / bh)));
        double tx0 = fmin(tow - 1, fmax(0.0, nearbyint((ix0 - x0) * tow / bw)));
        double ty1 = fmax(ty0 + 1, fmin(toh, nearbyint((iy1 - y0) * toh / bh)));
        double tx1 = fmax(tx0 + 1, fmin(tow, nearbyint((ix1 - x0) * tow / bw)));
        dst[0] = (int64_t)ty0, dst[1] = (int64_t)ty1, dst[2] = (int64_t)tx0, dst[3] = (int64_t)tx1;
    }
    return padded;
}

/* plan_gpu_rows(spans, ids, index, heights, widths, stream, program, first, (out_h, out_w), geo, box, at, src)
 *     -> (rows taken, bytes)
 * The rows of a chunk (row first + i is dataset row index[i], its stream keyed by ids[i]) that the GPU takes:
 * those with JPEG bytes (spans[i] = (block, lo, hi), block >= 0) and a stored size. Each is planned as the
 * pool plans it (plan_ops), its crop windows computed as jobs.crop_windows computes them, and written, taken
 * rows first in chunk order: geo (int64 [k, GEO_COLUMNS]), box (float64 [k, 4]), at (int64 [k, 2]: its bytes'
 * (start, end) with the rows back to back from 0) and src (int64 [k, 3]: its spans row, for gather_spans). */
static PyObject *plan_gpu_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[11];
    unsigned long long stream;
    Py_ssize_t first;
    long long oh, ow;
    if (!PyArg_ParseTuple(args, "OOOOOKOn(LL)OOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &stream, &o[5], &first, &oh,
                          &ow, &o[6], &o[7], &o[8], &o[9]))
        return NULL;
    Py_buffer b[10];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 10; got++)
        if (PyObject_GetBuffer(o[got], &b[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got >= 6 ? PyBUF_WRITABLE : 0))
            < 0)
            goto out;
    Py_ssize_t k = b[1].len / 8, n = b[3].len / 8;
    int typed = 1;
    for (int j = 0; j < 10; j++)
        typed &= (j == 5 || j == 7) ? is_f64(&b[j]) : is_i64(&b[j]);
    if (!typed || b[0].len != k * 24 || b[2].len != k * 8 || b[4].len != n * 8 || b[5].len % (PROG_WIDTH * 8) != 0 ||
        b[6].len != k * GEO_COLUMNS * 8 || b[7].len != k * 32 || b[8].len != k * 16 || b[9].len != k * 24 ||
        oh < 1 || ow < 1) {
        PyErr_SetString(PyExc_ValueError, "plan_gpu_rows: spans int64 [k, 3]; ids, index int64 [k]; heights, widths "
                        "int64 [n]; program float64 [ops, 10]; geo int64 [k, 15]; box float64 [k, 4]; at int64 [k, 2]; "
                        "src int64 [k, 3]; out_h, out_w positive");
        goto out;
    }
    const int64_t *spans = (const int64_t *)b[0].buf, *ids = (const int64_t *)b[1].buf,
                  *index = (const int64_t *)b[2].buf, *heights = (const int64_t *)b[3].buf,
                  *widths = (const int64_t *)b[4].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (index[i] < 0 || index[i] >= n) {
            PyErr_Format(PyExc_IndexError, "plan_gpu_rows: index %lld outside the %zd sizes", (long long)index[i], n);
            goto out;
        }
        if (spans[3 * i] >= 0 && spans[3 * i + 2] < spans[3 * i + 1]) {
            PyErr_Format(PyExc_ValueError, "plan_gpu_rows: row %zd's bytes end (%lld) before they start (%lld)", i,
                         (long long)spans[3 * i + 2], (long long)spans[3 * i + 1]);
            goto out;
        }
    }
    const double *prog = (const double *)b[5].buf;
    int nops = (int)(b[5].len / (PROG_WIDTH * 8));
    int64_t *geo = (int64_t *)b[6].buf, *at = (int64_t *)b[8].buf, *src = (int64_t *)b[9].buf;
    double *box = (double *)b[7].buf;
    Py_ssize_t taken = 0;
    int64_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t idx = index[i], h = heights[idx], w = widths[idx];
        const int64_t *sp = spans + 3 * i;
        if (sp[0] < 0 || h <= 0 || w <= 0)
            continue;
        plan_state s;
        plan_ops(prog, nops, mix64((uint64_t)stream ^ (uint64_t)ids[i]), h, w, &s);
        int64_t *g = geo + taken * GEO_COLUMNS;
        g[0] = first + i, g[1] = s.flip, g[2] = h, g[3] = w;
        g[12] = crop_window_row(s.box, h, w, oh, ow, g + 4, g + 8);
        g[13] = 1, g[14] = idx;
        memcpy(box + 4 * taken, s.box, sizeof(s.box));
        memcpy(src + 3 * taken, sp, 3 * sizeof(int64_t));
        at[2 * taken] = total;
        total += sp[2] - sp[1];
        at[2 * taken + 1] = total;
        taken++;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nL", taken, (long long)total);
out:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return result;
}

static PyMethodDef engine_methods[] = {
    {"run", (PyCFunction)(void (*)(void))engine_run, METH_VARARGS | METH_KEYWORDS,
     "run(blocks, spans, ids, index, sizes, stream, program, images, status, first, out_h, out_w, full_size,\n"
     "    headroom, antialias, fast, max_pixels, timeout, floats=None, levels=None, nchw=True)\n"
     "    -> (rows left, busy seconds, state)\n\n"
     "Plan, decode, resize, place and flip each row i's JPEG (bytes spans[i, 1]..spans[i, 2] of\n"
     "blocks[spans[i, 0]]) into images[first + i] on the pool's threads, the GIL released until every row\n"
     "is done, `timeout` seconds pass or close() stops the pool (state 0, 2, 1). status[i]: 0 written, else\n"
     "the caller's (30: never started). With floats and levels each written row is also mapped through\n"
     "levels (3 x 256 values) into floats[first + i] (as map_levels does), while it is in cache."},
    {"close", (PyCFunction)engine_close, METH_NOARGS,
     "close(): stop the pool and join its threads (rows queued are never started; repeatable)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef engine_getset[] = {
    {"threads", (getter)engine_threads, NULL, "the pool's own thread count", NULL},
    {"active", (getter)engine_count, NULL, "the pool's threads taking rows now (more than threads while other "
     "processes take its cores)", (void *)0},
    {"peak", (getter)engine_count, NULL, "the most threads the pool has run at once", (void *)1},
    {"most", (getter)engine_count, NULL, "the most threads the pool may run (most=)", (void *)2},
    {"others", (getter)engine_figure, NULL, "cores other processes used on this process's CPUs in the pool's "
     "last measuring window (0 before one ended, and where the pool does not grow)", NULL},
    {"crowded_s", (getter)engine_figure, NULL, "seconds the pool ran more threads than its own count", (void *)1},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stoker._jpeg.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine(threads, nice=0, most=0): a pool of native threads that render whole batches of JPEG rows\n"
              "(run()); on Linux each runs at the given nice value (0..19, lower priority than the caller's\n"
              "threads), and while other processes take its cores the pool runs up to `most` threads (crowd.h).",
    .tp_new = engine_new,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
    .tp_getset = engine_getset,
};

/* gather_spans(blocks, spans, out, offsets) -> bytes copied: row i's bytes spans[i, 1]..spans[i, 2] of
 * blocks[spans[i, 0]] copied to out[offsets[i]:], for every row whose block is not -1 (the other rows
 * are the caller's; offsets int64 [k], of any positive stride); the GPU decode's JPEG bytes of a batch into
 * its staging buffer in one call, the copies made with the GIL released. */
static PyObject *gather_spans(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *blocks_obj, *spans_obj, *out_obj, *off_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &blocks_obj, &spans_obj, &out_obj, &off_obj))
        return NULL;
    PyObject *blocks = PySequence_Fast(blocks_obj, "blocks must be a sequence of byte buffers");
    if (blocks == NULL)
        return NULL;
    Py_buffer sp = {0}, out = {0}, off = {0};
    Py_buffer *bufs = NULL;
    int64_t *ids = NULL;
    const unsigned char **src = NULL;
    Py_ssize_t got = 0, k = 0, nblocks = PySequence_Fast_GET_SIZE(blocks);
    PyObject *result = NULL;
    if (PyObject_GetBuffer(spans_obj, &sp, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    if (PyObject_GetBuffer(off_obj, &off, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        goto done;
    k = off.ndim == 1 ? off.shape[0] : -1;
    if (k < 0 || sp.len != k * 24 || !is_i64(&off) || (k > 1 && (off.strides[0] <= 0 || off.strides[0] % 8 != 0))) {
        PyErr_SetString(PyExc_ValueError, "gather_spans: spans int64 [k, 3], offsets int64 [k] (any positive stride)");
        goto done;
    }
    Py_ssize_t step = k > 1 ? off.strides[0] / 8 : 1;
    bufs = (Py_buffer *)PyMem_Calloc(k ? k : 1, sizeof(Py_buffer));
    ids = (int64_t *)PyMem_Calloc(k ? k : 1, sizeof(int64_t));
    src = (const unsigned char **)PyMem_Calloc(k ? k : 1, sizeof(*src));
    if (bufs == NULL || ids == NULL || src == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *s = (const int64_t *)sp.buf, *o = (const int64_t *)off.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t id = s[3 * i], lo = s[3 * i + 1], hi = s[3 * i + 2];
        if (id < 0)
            continue;
        Py_ssize_t j = 0;
        while (j < got && ids[j] != id)
            j++;
        if (j == got) {
            if (id >= nblocks) {
                PyErr_Format(PyExc_IndexError, "gather_spans: row %zd names block %lld of %zd", i, (long long)id,
                             nblocks);
                goto done;
            }
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(blocks, id), &bufs[j], PyBUF_SIMPLE) < 0)
                goto done;
            ids[got++] = id;
        }
        if (lo < 0 || hi < lo || hi > bufs[j].len || o[i * step] < 0 || o[i * step] > out.len - (hi - lo)) {  /* no overflow */
            PyErr_Format(PyExc_ValueError, "gather_spans: row %zd's bytes %lld..%lld (of %zd) do not fit at offset "
                         "%lld of %zd", i, (long long)lo, (long long)hi, bufs[j].len, (long long)o[i * step], out.len);
            goto done;
        }
        src[i] = (const unsigned char *)bufs[j].buf + lo;
        total += hi - lo;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++)
        if (src[i] != NULL)
            memcpy((unsigned char *)out.buf + o[i * step], src[i], (size_t)(s[3 * i + 2] - s[3 * i + 1]));
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(total);
done:
    for (Py_ssize_t j = 0; j < got; j++)
        PyBuffer_Release(&bufs[j]);
    PyMem_Free(bufs);
    PyMem_Free(ids);
    PyMem_Free((void *)src);
    if (sp.obj != NULL)
        PyBuffer_Release(&sp);
    if (out.obj != NULL)
        PyBuffer_Release(&out);
    if (off.obj != NULL)
        PyBuffer_Release(&off);
    Py_DECREF(blocks);
    return result;
}

/* crowd_next(base, most, (active, hold_until, rate_before, gain), (window_s, pool_cpu_s, pool_wall_s, others,
 * cores), now) -> the state after that window (crowd.h's stoker_crowd_next): for tests. */
static PyObject *crowd_next(PyObject *self, PyObject *args) {
    (void)self;
    int base, most;
    double now;
    stoker_crowd_state s;
    stoker_crowd_window w;
    if (!PyArg_ParseTuple(args, "ii(iddd)(ddddd)d", &base, &most, &s.active, &s.hold_until, &s.rate_before, &s.gain,
                          &w.window_s, &w.pool_cpu_s, &w.pool_wall_s, &w.others, &w.cores, &now))
        return NULL;
    stoker_crowd_next(base, most, &s, &w, now);
    return Py_BuildValue("(iddd)", s.active, s.hold_until, s.rate_before, s.gain);
}

/* mark() -> entry: this process among the stoker processes whose CPU no engine pool grows against (crowd.h);
 * unmark(entry) clears it. For a process with no Engine of its own (the one worker processes feed). */
static PyObject *mark_py(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(stoker_mark());
}

static PyObject *unmark_py(PyObject *self, PyObject *arg) {
    (void)self;
    long entry = PyLong_AsLong(arg);
    if (entry == -1 && PyErr_Occurred())
        return NULL;
    stoker_unmark((int)entry);
    Py_RETURN_NONE;
}

static PyMethodDef module_functions[] = {
    {"mark", mark_py, METH_NOARGS,
     "mark() -> entry: this process among the stoker processes no engine pool grows against (-1: not\n"
     "recorded); unmark(entry) clears it."},
    {"unmark", unmark_py, METH_O, "unmark(entry): clear what mark() recorded."},
    {"crowd_next", crowd_next, METH_VARARGS,
     "crowd_next(base, most, (active, hold_until, rate_before, gain), (window_s, pool_cpu_s, pool_wall_s, others,\n"
     "cores), now) -> (active, hold_until, rate_before, gain): the pool's size after one measuring window, as the\n"
     "engine decides it (for tests)."},
    {"plan_batch", plan_batch, METH_VARARGS,
     "plan_batch(ids, index, sizes, stream, program, box, clip, grid, size, flip): each row's plan as the\n"
     "engine computes it (for tests)."},
    {"plan_gpu_rows", plan_gpu_rows, METH_VARARGS,
     "plan_gpu_rows(spans, ids, index, heights, widths, stream, program, first, (out_h, out_w), geo, box, at, src)\n"
     "    -> (rows taken, bytes): the GPU's rows of a chunk (those with JPEG bytes and a stored size), each planned\n"
     "as the engine plans it and its crop windows computed as jobs.crop_windows does, written taken rows first:\n"
     "geo (jobs.GEO_COLUMNS), box, at (the bytes' spans, back to back from 0) and src (the spans rows)."},
    {"gather_spans", gather_spans, METH_VARARGS,
     "gather_spans(blocks, spans, out, offsets) -> int: row i's bytes spans[i, 1]..spans[i, 2] of\n"
     "blocks[spans[i, 0]] copied to out[offsets[i]:] (rows of block -1 skipped; offsets int64 [k], any\n"
     "stride), the GIL released for the\n"
     "copies; returns the bytes copied."},
    {"map_levels", map_levels_py, METH_VARARGS,
     "map_levels(images, rows, levels, floats, nchw): rows (int64) of uint8 images [n, h, w, 3] through the\n"
     "per-channel tables levels (3 x 256 values of 2 or 4 bytes) into floats ([n, 3, h, w] when nchw, else\n"
     "[n, h, w, 3]), the GIL released."},
    {NULL, NULL, 0, NULL},
};

int stoker_engine_add(PyObject *module) {
    if (PyType_Ready(&EngineType) < 0 || PyModule_AddObjectRef(module, "Engine", (PyObject *)&EngineType) < 0)
        return -1;
    return PyModule_AddFunctions(module, module_functions);
}
