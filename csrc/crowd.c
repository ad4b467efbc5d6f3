/*
 * The engine pool's size while other programs take its cores: the fair-share model and its check
 * (crowd.h), and the machine's CPU ticks it measures them by. No GIL, no allocation but the read of
 * /proc/stat once a window.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* sched_getaffinity, CPU_ISSET */
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#ifdef __linux__
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include "crowd.h"

#define GOAL 0.8       /* the share of its cores alone the pool sets out to keep */
#define CROWDED 0.5    /* runnable threads of other processes, on average, before the pool grows */
#define SATURATED 0.6  /* share of the window its active threads spent on rows: below, the pool waits for work */
#define RUNNING 0.9    /* share of a row's wall time its thread ran: above, no thread waits long for a core */

/* Runnable threads of other processes: each gets about the share of a core the pool's threads got
 * while on a row, so the cores they used over that share counts them. */
static double rivals(const stoker_crowd_window *w) {
    double run = w->pool_cpu_s / w->pool_wall_s;
    return w->others / (run > 0.01 ? run : 0.01);
}

/* Cores `threads` runnable pool threads get beside `n` rivals on `cores` CPUs (fair shares). */
static double cores_of(int threads, double n, double cores) {
    double fair = cores * threads / (threads + n);
    return fair < threads ? fair : threads;
}

int stoker_crowd_target(int base, int most, int active, const stoker_crowd_window *w) {
    if (most <= base || active < 1 || w->window_s <= 0 || w->pool_wall_s <= 0 || w->cores < 1)
        return base;
    double busy = w->pool_wall_s / (active * w->window_s), run = w->pool_cpu_s / w->pool_wall_s;
    /* counted in threads, not cores: the cores the others get fall as the pool grows, their threads do not */
    if (run >= RUNNING || rivals(w) < CROWDED)
        return base;   /* no other process takes the cores: the pool's own size */
    /* the share f of the runnable threads that gives the pool GOAL of the cores it would use alone:
     * A / (A + rivals) = f, f below 1 since the pool alone uses at most every core */
    double alone = base < w->cores ? base : w->cores, f = GOAL * alone / w->cores;
    double want = ceil(f * rivals(w) / (1.0 - f) - 1e-9);   /* (not a thread more for a rounding error) */
    if (busy < SATURATED) {   /* the threads also wait for work: as many as stay SATURATED busy (never growing) */
        double enough = ceil(active * busy / SATURATED);
        want = want < enough ? want : enough;
    }
    return want >= most ? most : want <= base ? base : (int)want;
}

int stoker_crowd_next(int base, int most, stoker_crowd_state *s, const stoker_crowd_window *w, double now) {
    double rate = w->window_s > 0 ? w->pool_cpu_s / w->window_s : 0.0;   /* cores the pool got */
    if (s->rate_before > 0) {   /* the first window after a growth from base: did it gain? */
        double before = s->rate_before, busy = w->window_s > 0 && s->active > 0
                                                   ? w->pool_wall_s / (s->active * w->window_s) : 0.0;
        s->rate_before = 0;
        /* under a quarter of the promised gain (and under 10%) while the threads stayed busy: the other
         * load's share is not by threads (another CPU cgroup, a hypervisor's steal); the pool's own size,
         * growth held off */
        double least = 1.0 + 0.25 * (s->gain - 1.0);
        if (busy >= SATURATED && rate < before * (least > 1.1 ? least : 1.1)) {
            s->hold_until = now + STOKER_CROWD_HOLD_S;
            return s->active = base;
        }
    }
    int n = stoker_crowd_target(base, most, s->active > 0 ? s->active : base, w);
    if (n > base && now < s->hold_until)
        n = base;
    if (n > base && s->active <= base) {   /* growth from base: checked against the next window */
        double r = rivals(w);
        s->rate_before = rate > 0 ? rate : 1e-9;
        s->gain = cores_of(n, r, w->cores) / cores_of(base, r, w->cores);
    }
    return s->active = n;
}

int stoker_cpu_ticks(unsigned long long *busy, unsigned long long *total, int *cpus) {
#ifdef __linux__
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof(mine), &mine) != 0)
        return -1;
    int fd = open("/proc/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t cap = 16384, len = 0;
    char *text = malloc(cap);
    for (ssize_t got = 1; text != NULL && got > 0;) {   /* the whole file: a line per CPU, then a few more */
        if (len + 1 == cap) {
            char *more = cap < ((size_t)1 << 24) ? realloc(text, cap * 2) : NULL;
            if (more == NULL) {
                free(text);
                text = NULL;
                break;
            }
            text = more, cap *= 2;
        }
        got = read(fd, text + len, cap - 1 - len);
        if (got > 0)
            len += (size_t)got;
    }
    close(fd);
    if (text == NULL)
        return -1;
    text[len] = '\0';
    *busy = *total = 0, *cpus = 0;
    for (char *line = text; line != NULL && *line != '\0';) {
        int cpu;
        unsigned long long user, nice, sys, idle, iowait, irq, soft, steal;
        if (sscanf(line, "cpu%d %llu %llu %llu %llu %llu %llu %llu %llu", &cpu, &user, &nice, &sys, &idle, &iowait,
                   &irq, &soft, &steal) == 9 && cpu >= 0 && cpu < CPU_SETSIZE && CPU_ISSET(cpu, &mine)) {
            unsigned long long b = user + nice + sys + irq + soft + steal;   /* guest time is in user's */
            *busy += b, *total += b + idle + iowait, (*cpus)++;
        }
        line = strchr(line, '\n');
        line = line != NULL ? line + 1 : NULL;
    }
    free(text);
    return *cpus > 0 ? 0 : -1;
#else
    (void)busy, (void)total, (void)cpus;
    return -1;
#endif
}

/* ---- the stoker processes of this user (crowd.h) ---- */
#ifdef __linux__
/* The table's file, opened once per process (a fork()ed child shares it). Read and written with pread and
 * pwrite under flock, never mapped: a file cut short by someone else reads as free entries, where a mapping
 * would fault. */
static int table_fd = -1;
#define TABLE_BYTES (STOKER_PEERS * (int)sizeof(int32_t))

static int peers_file(void) {
    int fd = __atomic_load_n(&table_fd, __ATOMIC_ACQUIRE);
    if (fd >= 0)
        return fd;
    char path[64];
    snprintf(path, sizeof(path), "/dev/shm/stoker-pools-%u", (unsigned)getuid());
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return -1;
    struct stat st;
    /* only a plain file of this user's, readable by no one else: another user's file is not a table of ours */
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid() || (st.st_mode & 077) != 0) {
        close(fd);
        return -1;
    }
    int none = -1;
    if (!__atomic_compare_exchange_n(&table_fd, &none, fd, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        close(fd);   /* another thread opened it first */
        return none;
    }
    return fd;
}

/* flock, bounded: whoever holds the lock holds it for microseconds, so a holder that was stopped (a debugger,
 * SIGSTOP) costs a caller 10 ms and the table's use this once, never a hang */
static int lock_table(int fd, int how) {
    for (int i = 0; i < 20; i++) {
        if (flock(fd, how | LOCK_NB) == 0)
            return 0;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return -1;
        struct timespec pause = {0, 500000};
        nanosleep(&pause, NULL);
    }
    return -1;
}

/* The table into `t` (entries past the file's end read 0) under a lock of `how`; the lock stays held. */
static int read_table(int fd, int how, int32_t *t) {
    if (lock_table(fd, how) != 0)
        return -1;
    memset(t, 0, TABLE_BYTES);
    ssize_t got = pread(fd, t, TABLE_BYTES, 0);
    (void)got;   /* short or failed: the rest are free entries */
    return 0;
}

static void write_entry(int fd, int i, int32_t pid) {
    (void)!pwrite(fd, &pid, sizeof(pid), (off_t)i * (off_t)sizeof(pid));
}

static int alive(int32_t pid) {
    return kill(pid, 0) == 0 || errno != ESRCH;
}

int stoker_mark(void) {
    int fd = peers_file();
    int32_t t[STOKER_PEERS], me = (int32_t)getpid();
    if (fd < 0 || read_table(fd, LOCK_EX, t) != 0)
        return -1;
    int entry = -1;
    for (int pass = 0; pass < 2 && entry < 0; pass++)   /* a free entry, else one of a process that ended */
        for (int i = 0; i < STOKER_PEERS && entry < 0; i++)
            if (t[i] == 0 || (pass == 1 && t[i] != me && !alive(t[i])))
                entry = i;
    if (entry >= 0)
        write_entry(fd, entry, me);
    flock(fd, LOCK_UN);
    return entry;
}

void stoker_unmark(int entry) {
    int fd = __atomic_load_n(&table_fd, __ATOMIC_ACQUIRE);
    int32_t t[STOKER_PEERS];
    if (fd < 0 || entry < 0 || entry >= STOKER_PEERS || read_table(fd, LOCK_EX, t) != 0)
        return;
    if (t[entry] == (int32_t)getpid())
        write_entry(fd, entry, 0);
    flock(fd, LOCK_UN);
}

/* utime + stime of process `pid` in clock ticks (/proc/PID/stat), or 0 with *gone set where it ended */
static unsigned long long process_ticks(int32_t pid, int *gone) {
    char path[48], text[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    *gone = fd < 0 && errno == ENOENT;
    if (fd < 0)
        return 0;
    ssize_t got = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (got <= 0)
        return 0;
    text[got] = '\0';
    char *at = strrchr(text, ')');   /* the command name may hold spaces and parentheses: fields after its end */
    unsigned long long utime = 0, stime = 0;
    if (at == NULL || sscanf(at + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) != 2)
        return 0;
    return utime + stime;
}

double stoker_peers_cpu_s(stoker_peers *p) {
    int fd = __atomic_load_n(&table_fd, __ATOMIC_ACQUIRE);
    int32_t t[STOKER_PEERS], me = (int32_t)getpid();
    if (fd < 0 || read_table(fd, LOCK_SH, t) != 0)
        return 0.0;
    flock(fd, LOCK_UN);
    stoker_peers now = {0};
    double seconds = 0.0;
    for (int i = 0; i < STOKER_PEERS; i++) {
        int32_t pid = t[i];
        int seen = 0, gone = 0;
        for (int j = 0; j < now.n && !seen; j++)
            seen = now.pid[j] == pid;
        if (pid <= 0 || pid == me || seen)
            continue;
        unsigned long long ticks = process_ticks(pid, &gone);
        if (gone) {   /* it ended without clearing its entry (killed): clear it for it, if it is still its */
            int32_t again[STOKER_PEERS];
            if (read_table(fd, LOCK_EX, again) == 0) {
                if (again[i] == pid)
                    write_entry(fd, i, 0);
                flock(fd, LOCK_UN);
            }
            continue;
        }
        for (int j = 0; j < p->n; j++)
            if (p->pid[j] == pid && ticks > p->ticks[j])
                seconds += (double)(ticks - p->ticks[j]);
        now.pid[now.n] = pid, now.ticks[now.n++] = ticks;
    }
    *p = now;
    return seconds / (double)sysconf(_SC_CLK_TCK);
}
#else
int stoker_mark(void) { return -1; }
void stoker_unmark(int entry) { (void)entry; }
double stoker_peers_cpu_s(stoker_peers *p) { (void)p; return 0.0; }
#endif
