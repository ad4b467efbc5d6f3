/*
 * The engine pool's size while other programs take its cores (crowd.c; `Workers(max_threads=)`).
 *
 * At equal priority the kernel shares a busy core among the runnable threads: beside one busy
 * process per core, a pool of one thread per core gets half the cores (measured: 0.48 of its
 * images/s alone). The pool keeps its share by running more threads while, and only while, other
 * processes take the cores it would use, and drops back as soon as they stop, or as soon as more
 * threads turn out to gain nothing (the other load is in another CPU cgroup or autogroup, whose
 * share threads do not change).
 */
#ifndef STOKER_CROWD_H
#define STOKER_CROWD_H

/* One measuring window of the pool: what the decision reads. Cores are averages over the window. */
typedef struct {
    double window_s;     /* its length */
    double pool_cpu_s;   /* CPU seconds of the pool's threads */
    double pool_wall_s;  /* wall seconds the pool's threads spent on rows (running or waiting for a core) */
    double others;       /* cores other processes used, on the CPUs this process may run on */
    double own;          /* cores this process's other threads used (the training loop, the workers) */
    double cores;        /* CPUs this process may run on */
} stoker_crowd_window;

/* What the decision remembers from window to window. */
typedef struct {
    int active;          /* the pool's threads taking rows now */
    double hold_until;   /* monotonic seconds: no growth before (the last growth from base gained nothing) */
    double rate_before;  /* the pool's cores before a growth from base, checked in the next window; 0: none */
    double gain;         /* the ratio of cores that growth should give (the fair-share model) */
} stoker_crowd_state;

/* Seconds a window lasts, and seconds growth is held off once it gained nothing. */
#define STOKER_CROWD_WINDOW_S 0.5
#define STOKER_CROWD_HOLD_S 10.0

/* The thread count the fair-share model asks for (base..most) after the window `w` with `active` threads. */
int stoker_crowd_target(int base, int most, int active, const stoker_crowd_window *w);

/* The next thread count after window `w` (ended at `now`), updating `s`: the model's target, except
 * that a growth from base is checked against the next window and undone (with growth held off for
 * STOKER_CROWD_HOLD_S) when the pool's cores did not rise by half the gain the model promised. */
int stoker_crowd_next(int base, int most, stoker_crowd_state *s, const stoker_crowd_window *w, double now);

/* Busy and total ticks, summed over the CPUs this thread may run on (Linux's /proc/stat); -1 where not
 * available (then the pool never grows). */
int stoker_cpu_ticks(unsigned long long *busy, unsigned long long *total, int *cpus);

/* The stoker processes of this user on this machine (other ranks of a job, a Loader's worker processes
 * and the process they feed), whose CPU is not another program's: a pool grows to keep its share
 * against other programs, never against another stoker process, whose pool would grow in turn and
 * take the cores from both training loops. A table of process ids in a small shared file
 * (/dev/shm/stoker-pools-UID, 0600, created once, STOKER_PEERS ids read at most, under flock), each
 * entry claimed by one Engine or one `mark()` and cleared when it stops; entries of processes that
 * ended are cleared by whoever reads them. Where the file cannot be used, nothing is excluded. */
#define STOKER_PEERS 256

/* An entry for this process: its index, or -1 (no file, or the table full). */
int stoker_mark(void);
void stoker_unmark(int entry);

/* What one Engine remembers of the others' CPU between windows. */
typedef struct {
    int n;
    int pid[STOKER_PEERS];
    unsigned long long ticks[STOKER_PEERS];
} stoker_peers;

/* CPU seconds the other stoker processes used since the last call (the first sight of one counts 0). */
double stoker_peers_cpu_s(stoker_peers *p);

#endif
