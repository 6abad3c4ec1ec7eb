/* GPU timing: CUDA events recorded around each traced call on its stream (after the outermost
 * ncclGroupEnd for grouped calls), completed by a background poller thread that turns them into
 * realtime GPU start/end in the record. Events come from a fixed pool created once; when the pool is
 * busy a call goes untimed (counted in the header), never blocked. Calls on a stream that is being
 * captured into a CUDA graph are not timed (recording an event there would break the capture).
 * Times are anchored to an event on a private idle stream (at the middle of the window between its
 * record and the return of its synchronisation, the narrowest of a few), re-anchored every few seconds
 * when a narrower window or the anchor's age allows, so the float milliseconds of cuEventElapsedTime
 * never span long. The GPU start is written as soon as the
 * stream reaches the start event, before the operation ends: a collective that started on the GPU and
 * never completes (a hang) shows a start and no end, one that never started shows neither.
 * RANKWATCH_GPU_POLL_US sets the poller's interval (default 1000 us). A process that ends right after
 * its last synchronisation (the end of training) gets one last pass at exit, so the GPU times of its
 * final calls are written rather than lost with the poller: a finished rank must not read as one whose
 * last collectives never started or ended (a hang).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "../include/cuda_abi.h"
#include "interposer.h"

#define SLOTS 4096
#define MAX_GROUPED 1024
#define REANCHOR_NS 5000000000LL
#define REANCHOR_SOON_NS 100000000LL /* while the anchor's window was wider than ANCHOR_GOOD_NS */
#define ANCHOR_GOOD_NS 100000LL
#define ANCHOR_DRIFT_PPM 20
#define POLL_NS 1000000L
#define EXIT_LOCK_WAIT_NS 1000000000L

enum { FREE = 0, STARTED = 1, READY = 2 };

typedef struct {
  _Atomic int state;
  CUevent start, end;
  CUstream stream;
  uint64_t index;
  rw_record* record;
  int start_written; /* gpu_start_ns is in the record, the end is not yet */
} gpu_slot;

static struct {
  cuEventCreate_t event_create;
  cuEventRecord_t event_record;
  cuEventQuery_t event_query;
  cuEventSynchronize_t event_sync;
  cuEventElapsedTime_t elapsed;
  cuStreamIsCapturing_t is_capturing;
  cuStreamCreate_t stream_create;
  cuCtxGetCurrent_t ctx_get;
  cuCtxSetCurrent_t ctx_set;
} cu;

static gpu_slot slots[SLOTS];
static _Atomic uint64_t cursor;
static int ready; /* 1 once the pool and the poller exist */
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUcontext context;
static CUstream anchor_stream;
static CUevent anchor_event, candidate_event;
static int64_t anchor_ns;
static int64_t anchor_error_ns = INT64_MAX; /* half the window the anchor event ran in */
static int64_t anchor_taken_ns;
static struct timespec poll_pause = {0, POLL_NS};
/* One pass over the slots at a time: the poller's, or the last one at exit (on the exiting thread). */
static pthread_mutex_t pass_lock = PTHREAD_MUTEX_INITIALIZER;
static pid_t owner; /* the process whose poller this is: a forked child inherits the exit handler, not the poller */
static RW_HOT_TLS int current = -1;
static __thread int grouped[MAX_GROUPED];
static __thread int grouped_count;

static void* poller(void* unused);
static void last_pass(void);

static void set_poll_interval(void) {
  const char* wanted = getenv("RANKWATCH_GPU_POLL_US");
  if (!wanted || !*wanted) return;
  char* rest = NULL;
  long long micros = strtoll(wanted, &rest, 10);
  if (*rest || micros < 1 || micros > 60000000LL) {
    fprintf(stderr, "rankwatch: ignoring RANKWATCH_GPU_POLL_US=%s (want 1..60000000)\n", wanted);
    return;
  }
  poll_pause.tv_sec = (time_t)(micros / 1000000);
  poll_pause.tv_nsec = (long)(micros % 1000000) * 1000;
}

static int load(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return 0;
#define SYM(field, name) cu.field = (typeof(cu.field))dlsym(lib, name)
  SYM(event_create, "cuEventCreate");
  SYM(event_record, "cuEventRecord");
  SYM(event_query, "cuEventQuery");
  SYM(event_sync, "cuEventSynchronize");
  SYM(elapsed, "cuEventElapsedTime");
  SYM(is_capturing, "cuStreamIsCapturing");
  SYM(stream_create, "cuStreamCreate");
  SYM(ctx_get, "cuCtxGetCurrent");
  SYM(ctx_set, "cuCtxSetCurrent");
#undef SYM
  return cu.event_create && cu.event_record && cu.event_query && cu.event_sync && cu.elapsed && cu.is_capturing &&
         cu.stream_create && cu.ctx_get && cu.ctx_set;
}

/* The anchor event ran somewhere between its record and the return of its synchronisation: its time is
 * the middle of that window, within half its width. The window is wide when this thread or the device
 * was descheduled (a loaded machine: tens of ms), so a re-anchor records a few candidates and keeps the
 * narrowest, and replaces the anchor in use only with a better one; the anchor's error grows with its
 * age (the GPU clock drifts against CLOCK_REALTIME, and cuEventElapsedTime's float loses precision over
 * long spans), so an old anchor is replaced in the end. The header keeps the largest error of an anchor
 * in use: what any GPU time of this ring may be off against the host's times. */
static int64_t aged_error(int64_t now) {
  if (anchor_error_ns == INT64_MAX) return INT64_MAX;
  return anchor_error_ns + (now - anchor_taken_ns) / 1000000 * ANCHOR_DRIFT_PPM;
}

static void reanchor(void) {
  for (int attempt = 0; attempt < 5; attempt++) {
    int64_t before = rw_realtime_ns();
    if (cu.event_record(candidate_event, anchor_stream) != CUDA_SUCCESS || cu.event_sync(candidate_event) != CUDA_SUCCESS)
      return;
    int64_t after = rw_realtime_ns();
    int64_t error = (after - before) / 2;
    if (error < aged_error(after)) {
      CUevent used = anchor_event;
      anchor_event = candidate_event;
      candidate_event = used;
      anchor_ns = before + error;
      anchor_error_ns = error;
      anchor_taken_ns = after;
      rw_ring_header* header = rw_ring();
      if (header && error > header->gpu_clock_error_ns) header->gpu_clock_error_ns = error;
    }
    if (error < ANCHOR_GOOD_NS) return;
  }
}

static void init(void) {
  if (!load()) {
    fprintf(stderr, "rankwatch: RANKWATCH_GPU_TIMING=1 but libcuda.so.1 (with the event API) is not loadable; "
                    "GPU times stay empty\n");
    return;
  }
  if (cu.ctx_get(&context) != CUDA_SUCCESS || cu.stream_create(&anchor_stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
      cu.event_create(&anchor_event, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
      cu.event_create(&candidate_event, CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
    fprintf(stderr, "rankwatch: no CUDA context at the first traced call; GPU times stay empty\n");
    return;
  }
  for (int i = 0; i < SLOTS; i++)
    if (cu.event_create(&slots[i].start, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
        cu.event_create(&slots[i].end, CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
      fprintf(stderr, "rankwatch: cuEventCreate failed; GPU times stay empty\n");
      return;
    }
  reanchor();
  set_poll_interval();
  pthread_t thread;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&thread, &attr, poller, NULL) != 0) return;
  owner = getpid();
  atexit(last_pass); /* before the CUDA library's own destructors (they run after atexit handlers) */
  ready = 1;
}

void rw_gpu_before(uint64_t index, rw_record* record, cudaStream_t stream) {
  pthread_once(&init_once, init);
  current = -1;
  if (!ready) return;
  int status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (cu.is_capturing((CUstream)stream, &status) != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE) {
    record->flags |= RW_FLAG_GRAPH_CAPTURE;
    return;
  }
  int slot = (int)(atomic_fetch_add_explicit(&cursor, 1, memory_order_relaxed) % SLOTS);
  int expected = FREE;
  if (!atomic_compare_exchange_strong(&slots[slot].state, &expected, STARTED)) {
    rw_ring_header* header = rw_ring();
    if (header) atomic_fetch_add_explicit((_Atomic uint32_t*)&header->gpu_skipped, 1, memory_order_relaxed);
    return;
  }
  slots[slot].stream = (CUstream)stream;
  slots[slot].index = index;
  slots[slot].record = record;
  slots[slot].start_written = 0;
  cu.event_record(slots[slot].start, (CUstream)stream);
  record->flags |= RW_FLAG_GPU_TIMED;
  current = slot;
}

static void finish(int slot) {
  cu.event_record(slots[slot].end, slots[slot].stream);
  atomic_store_explicit(&slots[slot].state, READY, memory_order_release);
}

void rw_gpu_after(uint64_t index, rw_record* record, cudaStream_t stream) {
  (void)index, (void)record, (void)stream;
  int slot = current;
  current = -1;
  if (slot < 0) return;
  if (rw_in_group() && grouped_count < MAX_GROUPED) {
    grouped[grouped_count++] = slot; /* enqueued on the stream only at the outermost ncclGroupEnd */
    return;
  }
  finish(slot);
}

void rw_gpu_group_end(void) {
  for (int i = 0; i < grouped_count; i++) finish(grouped[i]);
  grouped_count = 0;
}

static void complete(gpu_slot* slot) {
  rw_record* record = slot->record;
  float start_ms = 0, end_ms = 0;
  int timed = cu.elapsed(&start_ms, anchor_event, slot->start) == CUDA_SUCCESS &&
              cu.elapsed(&end_ms, anchor_event, slot->end) == CUDA_SUCCESS;
  if (timed && atomic_load_explicit((_Atomic uint64_t*)&record->stamp, memory_order_acquire) == 2 * slot->index + 2) {
    record->gpu_start_ns = anchor_ns + (int64_t)((double)start_ms * 1e6);
    /* The end may be ready before the host call has returned (the work ran at once): the host's return
     * then finds the end written and moves the state on itself (rw_complete); sequentially consistent
     * store and load on both sides, so at least one of the two sees the other's write. */
    atomic_store_explicit((_Atomic int64_t*)&record->gpu_end_ns, anchor_ns + (int64_t)((double)end_ms * 1e6),
                          memory_order_seq_cst);
    uint8_t returned = RW_STATE_RETURNED;
    atomic_compare_exchange_strong_explicit((_Atomic uint8_t*)&record->state, &returned, RW_STATE_GPU_DONE,
                                            memory_order_seq_cst, memory_order_seq_cst);
  }
  atomic_store_explicit(&slot->state, FREE, memory_order_release);
}

/* The stream reached the start event while the operation still runs: publish the start alone. */
static void write_start(gpu_slot* slot) {
  rw_record* record = slot->record;
  float start_ms = 0;
  if (cu.event_query(slot->start) != CUDA_SUCCESS || cu.elapsed(&start_ms, anchor_event, slot->start) != CUDA_SUCCESS)
    return;
  if (atomic_load_explicit((_Atomic uint64_t*)&record->stamp, memory_order_acquire) == 2 * slot->index + 2)
    record->gpu_start_ns = anchor_ns + (int64_t)((double)start_ms * 1e6);
  slot->start_written = 1;
}

/* Completes every slot whose end the stream reached, publishes the start of those still running. */
static void pass(void) {
  uint64_t end = atomic_load_explicit(&cursor, memory_order_relaxed);
  uint64_t begin = end > SLOTS ? end - SLOTS : 0;
  for (uint64_t i = begin; i < end; i++) {
    gpu_slot* slot = &slots[i % SLOTS];
    if (atomic_load_explicit(&slot->state, memory_order_acquire) != READY) continue;
    if (cu.event_query(slot->end) == CUDA_SUCCESS) complete(slot);
    else if (!slot->start_written) write_start(slot);
  }
}

/* At exit the poller may be a pass behind (it sleeps between passes, and on a loaded machine it may not
 * have run since the last synchronisation): one more pass writes what the stream reached. It never waits
 * for the device; the lock is awaited a bounded time (a poller stuck in a re-anchor on a stopped device
 * must not keep the process from ending). */
static void last_pass(void) {
  if (getpid() != owner) return; /* a forked child (CUDA is unusable there; the parent's pass is the parent's) */
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += EXIT_LOCK_WAIT_NS / 1000000000L;
  if (pthread_mutex_timedlock(&pass_lock, &deadline) != 0) return;
  CUcontext own = NULL;
  int switched = cu.ctx_get(&own) == CUDA_SUCCESS && own != context && cu.ctx_set(context) == CUDA_SUCCESS;
  pass();
  if (switched) cu.ctx_set(own);
  pthread_mutex_unlock(&pass_lock);
}

static void* poller(void* unused) {
  (void)unused;
  cu.ctx_set(context);
  int64_t last_anchor = rw_realtime_ns();
  for (;;) {
    nanosleep(&poll_pause, NULL);
    pthread_mutex_lock(&pass_lock);
    pass();
    int64_t since = rw_realtime_ns() - last_anchor;
    if (since > REANCHOR_NS || (since > REANCHOR_SOON_NS && anchor_error_ns > ANCHOR_GOOD_NS)) {
      reanchor();
      last_anchor = rw_realtime_ns();
    }
    pthread_mutex_unlock(&pass_lock);
  }
  return NULL;
}
