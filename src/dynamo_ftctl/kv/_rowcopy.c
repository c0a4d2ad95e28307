/* Row copies for the paged KV block copier (dynamo_ftctl/kv/native.py loads this with ctypes).
 *
 * One call copies n rows of row_bytes bytes: row src_ids[i] of src to row dst_ids[i] of dst,
 * in one pass (torch has no single op for random rows to random rows: it needs a gather into
 * a staging buffer and a scatter out of it). A NULL id array means rows 0..n-1 of that side.
 * Ids are trusted: dynamo_ftctl.kv.copy validated them (range, duplicates, overlap).
 *
 * `threads` > 1 shares a call's rows, in pieces, among that many threads (the caller sets it
 * from torch's thread count, so a copy uses what torch's own copy_ would): torch's OpenMP
 * team when native.py hands it over (ftctl_use_openmp), else a pool of POSIX threads kept
 * from call to call (both below).
 *
 * With `stream` set, whole 64-byte lines of 16-byte aligned destination rows are written with
 * non-temporal stores (SSE2, every x86-64): a large copy then does not read each destination
 * line into the cache before overwriting it, which is a third of the memory traffic of a
 * cached copy. Other CPUs, and unaligned rows, use memcpy. Plain C11 (atomics) and pthreads, no
 * Python headers.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define FTCTL_SSE2 1
#endif

/* Bumped whenever an exported signature changes or one is added; native.py checks it. */
int ftctl_rowcopy_abi(void) { return 6; }

static void copy_streaming(char *dst, const char *src, int64_t bytes) {
#ifdef FTCTL_SSE2
    int64_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    if (i < bytes) memcpy(dst + i, src + i, (size_t)(bytes - i));
#else
    memcpy(dst, src, (size_t)bytes);
#endif
}

struct rows_job {
    char *dst;
    const char *src;
    int64_t dst_stride, src_stride, row_bytes, begin, end;
    const int64_t *dst_ids, *src_ids;
    int stream;
};

/* How many rows ahead a copy touches the first line of both sides' rows: scattered rows
 * each start with a TLB walk and a DRAM miss, which then overlap the rows in between
 * instead of stalling each row in turn (measured, 1k random 4 KiB rows from cold caches,
 * in C: 15% faster; one line, not the row: the hardware prefetcher takes it from there). */
#define FTCTL_AHEAD 4

/* Row i of one side of a job: by its id, or the i-th row of a run (ids NULL). */
#define ROW(base, ids, i, stride) ((base) + ((ids) ? (ids)[i] : (i)) * (stride))

static void copy_range(const struct rows_job *job) {
    int streamed = job->stream && ((uintptr_t)job->dst % 16 == 0) && (job->dst_stride % 16 == 0);
    for (int64_t i = job->begin; i < job->end; i++) {
        char *d = ROW(job->dst, job->dst_ids, i, job->dst_stride);
        const char *s = ROW(job->src, job->src_ids, i, job->src_stride);
        if (i + FTCTL_AHEAD < job->end) {
            __builtin_prefetch(ROW(job->dst, job->dst_ids, i + FTCTL_AHEAD, job->dst_stride), 1);
            __builtin_prefetch(ROW(job->src, job->src_ids, i + FTCTL_AHEAD, job->src_stride), 0);
        }
        if (streamed)
            copy_streaming(d, s, job->row_bytes);
        else
            memcpy(d, s, (size_t)job->row_bytes);
    }
#ifdef FTCTL_SSE2
    if (streamed) _mm_sfence(); /* the streamed stores land before the piece counts as done */
#endif
}

#define FTCTL_MAX_THREADS 64

/* The worker pool: up to FTCTL_MAX_THREADS - 1 threads started by the first call that asks
 * for them and kept, so that a call costs a wake-up, not a pthread_create and join (tens of
 * microseconds against a 4 MiB copy of a few hundred).
 *
 * A call cuts its rows into pieces of about FTCTL_PIECE_BYTES and posts them; the caller's
 * thread and the woken workers claim pieces one at a time from one atomic word until none
 * is left, so a worker that wakes late (a busy host gives its core to someone else) only
 * copies less: the call never waits for a worker to start, only for pieces already claimed
 * to finish. That word holds the call's generation, its thread count and the next piece:
 * a worker claims a piece only with a compare-and-swap that also checks the generation, so
 * a worker that was slow to look can never copy a piece of a later call, and it reads the
 * call's job only after a claim, while the caller still waits for that piece.
 *
 * Between calls a worker spins a while (FTCTL_SPIN_NS: back-to-back calls, one per layer,
 * find it awake, as torch's OpenMP threads are) and then sleeps on a condition variable.
 * One call at a time uses the pool (`owner`): a concurrent caller copies on its own thread
 * rather than wait. fork() runs the handlers below: the child has no workers (fork copies
 * only the calling thread) and starts its own on its first threaded call. */
#define FTCTL_PIECE_BYTES (256 << 10)
#define FTCTL_SPIN_NS 50000L /* a worker's spin before it sleeps; a waiting caller's too */

#define FTCTL_MAX_PIECES (4 * FTCTL_MAX_THREADS) /* larger pieces for larger copies */

/* The posted word: generation (32 bits) | threads (8) | pieces (12) | next piece (12). */
#define POST(gen, threads, pieces) \
    (((uint64_t)(gen) << 32) | ((uint64_t)(threads) << 24) | ((uint64_t)(pieces) << 12))
#define POST_GEN(word) ((uint32_t)((word) >> 32))
#define POST_THREADS(word) ((int)(((word) >> 24) & 0xff))
#define POST_PIECES(word) ((uint32_t)(((word) >> 12) & 0xfff))
#define POST_NEXT(word) ((uint32_t)((word) & 0xfff))

static struct {
    pthread_mutex_t owner; /* held by the one call using the workers, and across fork() */
    pthread_mutex_t lock;  /* guards the sleeps below */
    pthread_cond_t wake;   /* idle workers sleep here */
    pthread_cond_t done;   /* a caller waiting for claimed pieces sleeps here */
    int started;           /* workers running, numbered 1..started */
    int sleepers;          /* workers asleep on wake */
    int caller_asleep;
    uint32_t gen;          /* the current call's generation (owner's) */
    struct rows_job job;   /* the current call; pieces of `piece_rows` rows */
    int64_t piece_rows;
    _Atomic uint64_t post;     /* POST(gen, threads, pieces) + next piece */
    _Atomic uint32_t finished; /* pieces of the current call copied */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, {0}, 0, 0, 0};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void before_fork(void) {
    pthread_mutex_lock(&pool.owner); /* no call is half done in the child's copy */
    pthread_mutex_lock(&pool.lock);
}

static void after_fork_parent(void) {
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.owner);
}

static void after_fork_child(void) {
    /* Only the forking thread exists here: no workers, and the sync objects may still
     * record the parent's sleepers, so they start afresh. */
    pthread_mutex_init(&pool.owner, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = pool.sleepers = pool.caller_asleep = 0;
}

static void register_atfork(void) {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void spin_pause(void) {
#ifdef FTCTL_SSE2
    _mm_pause();
#endif
}

/* Claim and copy pieces of generation `gen` until none is left (`self` is the caller's
 * thread 0 or a worker's number, which joins only when the call asked for that many). */
static void copy_pieces(uint32_t gen, int self) {
    uint64_t word = atomic_load_explicit(&pool.post, memory_order_acquire);
    for (;;) {
        if (POST_GEN(word) != gen || self >= POST_THREADS(word) ||
            POST_NEXT(word) >= POST_PIECES(word))
            return;
        if (!atomic_compare_exchange_weak_explicit(&pool.post, &word, word + 1,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        struct rows_job piece = pool.job;
        piece.begin = (int64_t)POST_NEXT(word) * pool.piece_rows;
        piece.end = piece.begin + pool.piece_rows < pool.job.end ? piece.begin + pool.piece_rows
                                                                : pool.job.end;
        copy_range(&piece);
        if (atomic_fetch_add_explicit(&pool.finished, 1, memory_order_acq_rel) + 1 ==
            POST_PIECES(word)) {
            pthread_mutex_lock(&pool.lock);
            if (pool.caller_asleep) pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
        word = atomic_load_explicit(&pool.post, memory_order_acquire);
    }
}

static void *work_loop(void *arg) {
    int self = (int)(intptr_t)arg;
    uint32_t seen = POST_GEN(atomic_load(&pool.post));
    for (;;) {
        uint32_t gen = seen;
        int64_t until = now_ns() + FTCTL_SPIN_NS;
        for (int i = 0; gen == seen; i++) {
            gen = POST_GEN(atomic_load_explicit(&pool.post, memory_order_acquire));
            if (gen != seen || ((i & 63) == 63 && now_ns() > until)) break;
            spin_pause();
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.lock);
            pool.sleepers++;
            while ((gen = POST_GEN(atomic_load(&pool.post))) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pool.sleepers--;
            pthread_mutex_unlock(&pool.lock);
        }
        seen = gen;
        copy_pieces(gen, self);
    }
    return NULL;
}

/* Start workers until workers 1..threads - 1 run; returns how many threads a call can use
 * (fewer when the system refuses a thread). Called with pool.owner held. */
static int start_workers(int threads) {
    pthread_once(&atfork_once, register_atfork);
    while (pool.started < threads - 1) {
        pthread_attr_t attr;
        pthread_t tid;
        if (pthread_attr_init(&attr) != 0) break;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&tid, &attr, work_loop, (void *)(intptr_t)(pool.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.started++;
    }
    return pool.started + 1 < threads ? pool.started + 1 : threads;
}

/* torch's own intra-op threads, when its parallel backend is OpenMP: GOMP_parallel (the
 * GNU OpenMP entry point `#pragma omp parallel` compiles to, which torch's at::parallel_for
 * uses and LLVM's and Intel's runtimes export too), found by native.py in the process and
 * handed over with ftctl_use_openmp. A copy then runs on the very threads torch's copy_
 * runs on: they spin for a few milliseconds after each torch op, so a pool of our own
 * would wait for one of them to leave its core. GNU OpenMP cannot be used in a child of
 * fork() (its threads are gone but it believes them there): a child uses the pool. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel;
static pid_t gomp_pid;

void ftctl_use_openmp(gomp_parallel_fn parallel) {
    gomp_parallel = parallel;
    gomp_pid = getpid();
}

struct team_copy {
    struct rows_job job;
    int64_t piece_rows;
    int64_t pieces;
    _Atomic int64_t next;
};

static void team_member(void *arg) {
    struct team_copy *team = arg;
    for (;;) {
        int64_t k = atomic_fetch_add_explicit(&team->next, 1, memory_order_relaxed);
        if (k >= team->pieces) return;
        struct rows_job piece = team->job;
        piece.begin = k * team->piece_rows;
        piece.end = piece.begin + team->piece_rows < team->job.end
                        ? piece.begin + team->piece_rows : team->job.end;
        copy_range(&piece);
    }
}

/* `threads` > 1 shares the rows, in pieces, among the caller's thread and threads - 1 others:
 * torch's OpenMP team when handed over (and this is not a child of fork()), else pool
 * workers. When another call holds the pool, or no worker can be started, the caller's
 * thread copies them all; so it does a copy of one piece or less. */
void ftctl_copy_rows(char *dst, int64_t dst_stride, const char *src, int64_t src_stride,
                     const int64_t *dst_ids, const int64_t *src_ids, int64_t n,
                     int64_t row_bytes, int stream, int threads) {
    struct rows_job job = {dst, src, dst_stride, src_stride, row_bytes, 0, n,
                           dst_ids, src_ids, stream};
    int64_t piece_rows = FTCTL_PIECE_BYTES / (row_bytes > 0 ? row_bytes : 1);
    if (piece_rows < 1) piece_rows = 1;
    if (piece_rows * FTCTL_MAX_PIECES < n)
        piece_rows = (n + FTCTL_MAX_PIECES - 1) / FTCTL_MAX_PIECES;
    if (threads > FTCTL_MAX_THREADS) threads = FTCTL_MAX_THREADS;
    if (n > piece_rows && threads > 1 && gomp_parallel && getpid() == gomp_pid) {
        struct team_copy team = {job, piece_rows, (n + piece_rows - 1) / piece_rows, 0};
        gomp_parallel(team_member, &team, (unsigned)threads, 0);
        return;
    }
    if (n <= piece_rows || threads < 2 || pthread_mutex_trylock(&pool.owner) != 0) {
        copy_range(&job);
        return;
    }
    threads = start_workers(threads);
    if (threads < 2) {
        pthread_mutex_unlock(&pool.owner);
        copy_range(&job);
        return;
    }
    uint32_t pieces = (uint32_t)((n + piece_rows - 1) / piece_rows);
    pool.job = job;
    pool.piece_rows = piece_rows;
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    pool.gen++;
    atomic_store_explicit(&pool.post, POST(pool.gen, threads, pieces), memory_order_release);
    pthread_mutex_lock(&pool.lock);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    copy_pieces(pool.gen, 0);
    /* Every piece is claimed: wait for the workers' last ones. */
    int64_t until = now_ns() + FTCTL_SPIN_NS;
    for (int i = 0; atomic_load_explicit(&pool.finished, memory_order_acquire) != pieces;
         i++) {
        if ((i & 63) == 63 && now_ns() > until) {
            pthread_mutex_lock(&pool.lock);
            pool.caller_asleep = 1;
            while (atomic_load_explicit(&pool.finished, memory_order_acquire) != pieces)
                pthread_cond_wait(&pool.done, &pool.lock);
            pool.caller_asleep = 0;
            pthread_mutex_unlock(&pool.lock);
            break;
        }
        spin_pause();
    }
    pthread_mutex_unlock(&pool.owner);
}

/* Check n (>= 1) block ids of a cache of num_blocks blocks in one pass (plus one over a
 * byte per block when they are not ascending). Returns the first id (>= 0) when they are
 * one ascending run (ids[i] == ids[0] + i), -3 when ascending, -4 when distinct but
 * unordered, -1 when an id is out of range or repeats (the caller then finds which, to
 * name it), -2 when out of memory. */
int64_t ftctl_check_ids(const int64_t *ids, int64_t n, int64_t num_blocks) {
    int ascending = 1;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num_blocks) return -1;
        if (i && ids[i] <= ids[i - 1]) ascending = 0;
    }
    if (ascending) return ids[n - 1] - ids[0] == n - 1 ? ids[0] : -3;
    unsigned char *seen = calloc((size_t)num_blocks, 1);
    if (!seen) return -2;
    int64_t status = -4;
    for (int64_t i = 0; i < n && status == -4; i++) {
        if (seen[ids[i]]) status = -1;
        seen[ids[i]] = 1;
    }
    free(seen);
    return status;
}

/* key_out = key ascending, other_out = other in the same order, for n distinct checked ids
 * of a cache of num_blocks blocks (a counting sort). Returns 0, or -2 when out of memory. */
static int sort_pairs(const int64_t *key, const int64_t *other, int64_t n, int64_t num_blocks,
                     int64_t *key_out, int64_t *other_out) {
    int64_t *slot = malloc((size_t)num_blocks * sizeof(int64_t));
    if (!slot) return -2;
    memset(slot, 0xff, (size_t)num_blocks * sizeof(int64_t)); /* every slot -1 */
    for (int64_t i = 0; i < n; i++) slot[key[i]] = i;
    int64_t j = 0;
    for (int64_t b = 0; b < num_blocks && j < n; b++) {
        if (slot[b] >= 0) {
            key_out[j] = b;
            other_out[j] = other[slot[b]];
            j++;
        }
    }
    free(slot);
    return 0;
}

struct pair {
    int64_t key, other;
};

static int by_key(const void *a, const void *b) {
    int64_t x = ((const struct pair *)a)->key, y = ((const struct pair *)b)->key;
    return (x > y) - (x < y);
}

/* As sort_pairs, for any n distinct checked ids: a counting sort when the cache has
 * few more slots than ids (one pass over num_blocks), else qsort. out holds 2n: the sorted
 * keys, then the others. Returns 0, or -2 when out of memory. */
static int sort_by_key(const int64_t *key, const int64_t *other, int64_t n, int64_t num_blocks,
                       int64_t *out) {
    if (num_blocks <= 16 * n + 4096) return sort_pairs(key, other, n, num_blocks, out, out + n);
    struct pair *pairs = malloc((size_t)n * sizeof(struct pair));
    if (!pairs) return -2;
    for (int64_t i = 0; i < n; i++) pairs[i] = (struct pair){key[i], other[i]};
    qsort(pairs, (size_t)n, sizeof(struct pair), by_key);
    for (int64_t i = 0; i < n; i++) {
        out[i] = pairs[i].key;
        out[n + i] = pairs[i].other;
    }
    free(pairs);
    return 0;
}

/* One whole host copy, in one call: check both id lists (as ftctl_check_ids), order the
 * rows, then copy n rows of row_bytes in each of `layers` layers. `at` holds 4 * layers
 * values: the destination layers' addresses, the source layers', then their row strides
 * in bytes (destination, source). A side whose ids are one ascending run is copied as a
 * slice. When the source is not a run and either the destination is not one either or
 * the copy streams its stores (n * row_bytes >= stream_min), the source is read in
 * ascending order: the reads, which stall, then walk memory forwards, while the streamed
 * stores go anywhere at no cost. A smaller copy's stores go through the cache, which
 * reads each destination line first: there a destination run is written in order.
 * Returns 0, -1 when an id is out of range or repeats (the caller names it), -2 when out
 * of memory (nothing was copied in either case). */
int64_t ftctl_copy_blocks(int64_t layers, const int64_t *at, const int64_t *dst_ids,
                          int64_t dst_blocks, const int64_t *src_ids, int64_t src_blocks,
                          int64_t n, int64_t row_bytes, int64_t stream_min, int threads) {
    if (n <= 0) return 0;
    int64_t d_run = ftctl_check_ids(dst_ids, n, dst_blocks);
    if (d_run == -1 || d_run == -2) return d_run;
    int64_t s_run = ftctl_check_ids(src_ids, n, src_blocks);
    if (s_run == -1 || s_run == -2) return s_run;
    int stream = n * row_bytes >= stream_min;
    const int64_t *d = dst_ids, *s = src_ids;
    int64_t *sorted = NULL;
    if (s_run == -4 && (d_run < 0 || stream)) { /* -3: ascending already */
        sorted = malloc(2 * (size_t)n * sizeof(int64_t));
        if (!sorted || sort_by_key(src_ids, dst_ids, n, src_blocks, sorted)) {
            free(sorted);
            return -2;
        }
        s = sorted;
        d = sorted + n;
        d_run = -4; /* a destination run is now written out of order: by its ids */
    }
    for (int64_t l = 0; l < layers; l++) {
        int64_t d_stride = at[2 * layers + l], s_stride = at[3 * layers + l];
        char *dst = (char *)(intptr_t)at[l] + (d_run >= 0 ? d_run * d_stride : 0);
        const char *src = (const char *)(intptr_t)at[layers + l] + (s_run >= 0 ? s_run * s_stride : 0);
        ftctl_copy_rows(dst, d_stride, src, s_stride, d_run >= 0 ? NULL : d,
                        s_run >= 0 ? NULL : s, n, row_bytes, stream, threads);
    }
    free(sorted);
    return 0;
}
