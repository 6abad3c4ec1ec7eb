/* Stand-in libcuda.so.1: a device with streams, on the host clock, no GPU.
 *
 * Two models, chosen once per process by RANKWATCH_STANDIN_DEVICE:
 *   sync  (default in this release) every launch runs inside the call that makes it: a kernel sleeps
 *         on the calling thread, an event completes when it is recorded, an NCCL operation blocks
 *         until its peers arrived. The host never runs ahead; host call times are GPU times.
 *   async as a real GPU: each stream is a FIFO executed in order by an executor thread of its own.
 *         Launches return at once; the host runs ahead of its device until it synchronises
 *         (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize) or a stream's launch queue is
 *         full (RANKWATCH_STANDIN_LAUNCH_QUEUE entries, default 1024, about as deep as real CUDA lets
 *         a host run ahead). Event records are timestamped when the executor reaches them, so
 *         cuEventQuery is not ready until then and cuEventElapsedTime measures the stream.
 * Work items: compute kernels with a duration (rwStandinLaunchKernel, the stand-in's own entry point
 * for drivers), event records, stream-waits-on-event, host functions (cuLaunchHostFunc) and NCCL
 * operations (rwStandinLaunchCollective: a host function the device counts, used by the stand-in
 * NCCL, which performs the collective's rendezvous on the executor).
 * Stream handles need not come from cuStreamCreate: any value (NULL included) names a stream of its
 * own, created at first use (NULL is a per-thread-default-like stream: it does not synchronise with
 * the others). Device faults (faults.h): kernels slowed by RANKWATCH_STANDIN_SLOWDOWN, and
 * RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL=N: the N-th kernel never ends and nothing runs after it.
 * The stand-in NCCL's stuck fault (RANKWATCH_STANDIN_STUCK_IN_CALL=N) stops the stream of the N-th
 * NCCL operation just before it, so its GPU work (and the start event recorded ahead of it) never
 * runs, as when earlier work on that stream never finishes: rwStandinHoldCollectiveStreams, called
 * once operation N-1 is launched, holds back what is launched afterwards on the streams that carry
 * collectives (released while a host thread that launches collectives blocks in a synchronisation or
 * on a full queue, so the host never deadlocks on the hold); rwStandinStallStream, at operation N,
 * keeps its stream stopped for good and releases the others.
 * rwStandinSetCapturing(stream, 1) marks a stream as capturing a CUDA graph (for tests).
 * RANKWATCH_STANDIN_DEVICE_CPUS=0,2-3: the CPUs the executors run on, whatever the process is pinned to.
 * A real GPU does not run on its host's CPU: a host starved by neighbours on its one core (the noisy
 * neighbour fault pins the rank there) launches late, and its device runs what it was given on time.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <time.h>

#include "cuda_standin.h"
#include "faults.h"

#define MAX_CAPTURING 64
#define MAX_STREAMS 256
#define DEFAULT_LAUNCH_QUEUE 1024
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_HANDLE 400

typedef void (*CUhostFn)(void* user_data);

struct CUevent_st {
  _Atomic uint64_t recorded;  /* records enqueued by the host (generation) */
  _Atomic uint64_t completed; /* the generation the executor last reached */
  _Atomic int64_t ns;         /* realtime when the executor reached it */
};

typedef enum { WORK_KERNEL, WORK_EVENT, WORK_WAIT, WORK_HOST } work_kind;

typedef struct {
  work_kind kind;
  int stops_device; /* the injected device stop: this kernel never ends */
  int64_t ns;       /* kernel duration */
  CUevent event;
  uint64_t generation;
  CUhostFn fn;
  void* arg;
} work;

typedef struct {
  uintptr_t handle;
  work* queue; /* ring of capacity entries: [completed, enqueued) are pending */
  uint64_t enqueued, completed;
  uint64_t limit; /* the executor runs items below this position only (UINT64_MAX: no hold) */
  int carries_collectives;
  pthread_cond_t has_work, has_room;
} stream_state;

static struct {
  int async;
  unsigned capacity;
  pthread_mutex_t lock;
  pthread_cond_t progress; /* broadcast whenever any work item completes */
  stream_state* streams[MAX_STREAMS];
  int stream_count;
  int stopped;
  int holding; /* the stuck fault is armed: collective streams hold back new work (see the top) */
  _Atomic uint64_t kernels_launched;
  _Atomic uint64_t collectives_launched;
} device = {.lock = PTHREAD_MUTEX_INITIALIZER, .progress = PTHREAD_COND_INITIALIZER};

static pthread_once_t device_once = PTHREAD_ONCE_INIT;
static CUstream capturing[MAX_CAPTURING];
static struct CUctx_st* const the_context = (struct CUctx_st*)0x1;
static _Atomic uintptr_t next_stream_handle = 0x1000;
static __thread int launches_collectives; /* this host thread launched NCCL operations */

static void configure(void) {
  const char* mode = getenv("RANKWATCH_STANDIN_DEVICE");
  if (mode && strcmp(mode, "async") == 0) device.async = 1;
  else if (mode && *mode && strcmp(mode, "sync") != 0)
    fprintf(stderr, "rankwatch stand-in CUDA: ignoring RANKWATCH_STANDIN_DEVICE=%s (want sync or async)\n", mode);
  device.capacity = DEFAULT_LAUNCH_QUEUE;
  const char* depth = getenv("RANKWATCH_STANDIN_LAUNCH_QUEUE");
  if (depth && *depth) {
    char* end;
    errno = 0;
    long value = strtol(depth, &end, 10);
    if (errno || *end || value < 1 || value > 1 << 20)
      fprintf(stderr, "rankwatch stand-in CUDA: ignoring RANKWATCH_STANDIN_LAUNCH_QUEUE=%s (want 1..1048576)\n", depth);
    else
      device.capacity = (unsigned)value;
  }
}

static void ensure_configured(void) { pthread_once(&device_once, configure); }

int rwStandinDeviceIsAsync(void) {
  ensure_configured();
  return device.async;
}

/* ---- executing one work item ------------------------------------------------------------------------ */
static void complete_event(CUevent event, uint64_t generation) {
  atomic_store_explicit(&event->ns, rw_now_realtime_ns(), memory_order_relaxed);
  atomic_store_explicit(&event->completed, generation, memory_order_release);
}

static void sleep_until(int64_t deadline_monotonic_ns) {
  struct timespec until = {deadline_monotonic_ns / 1000000000, deadline_monotonic_ns % 1000000000};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
  }
}

/* Runs with device.lock held; drops it around kernels and host functions. */
static void execute_locked(const work* item) {
  switch (item->kind) {
    case WORK_KERNEL:
      if (item->stops_device) {
        device.stopped = 1;
        pthread_mutex_unlock(&device.lock);
        fprintf(stderr, "rankwatch stand-in CUDA: injected device stop: a kernel that never ends\n");
        rw_hang_forever();
      }
      pthread_mutex_unlock(&device.lock);
      sleep_until(rw_now_monotonic_ns() + item->ns);
      pthread_mutex_lock(&device.lock);
      break;
    case WORK_EVENT:
      complete_event(item->event, item->generation);
      break;
    case WORK_WAIT:
      while (atomic_load_explicit(&item->event->completed, memory_order_acquire) < item->generation)
        pthread_cond_wait(&device.progress, &device.lock);
      break;
    case WORK_HOST:
      pthread_mutex_unlock(&device.lock);
      item->fn(item->arg);
      pthread_mutex_lock(&device.lock);
      break;
  }
}

/* This executor on the CPUs RANKWATCH_STANDIN_DEVICE_CPUS lists ("0,2-3"), if it says; else where the
 * process runs. A list that cannot be parsed or applied is reported and left alone. */
static void place_executor(void) {
  const char* text = getenv("RANKWATCH_STANDIN_DEVICE_CPUS");
  if (!text || !*text) return;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const char* at = text;
  while (*at) {
    char* end;
    long first = strtol(at, &end, 10), last = first;
    if (end == at || first < 0 || first >= CPU_SETSIZE) goto bad;
    if (*end == '-') {
      at = end + 1;
      last = strtol(at, &end, 10);
      if (end == at || last < first || last >= CPU_SETSIZE) goto bad;
    }
    for (long cpu = first; cpu <= last; cpu++) CPU_SET((int)cpu, &cpus);
    if (*end == ',') end++;
    else if (*end) goto bad;
    at = end;
  }
  if (pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus) == 0) return;
bad:
  fprintf(stderr, "rankwatch stand-in CUDA: ignoring RANKWATCH_STANDIN_DEVICE_CPUS=%s\n", text);
}

static void* executor(void* argument) {
  stream_state* stream = argument;
  place_executor();
  pthread_mutex_lock(&device.lock);
  for (;;) {
    while (stream->completed == stream->enqueued || stream->completed >= stream->limit || device.stopped)
      pthread_cond_wait(&stream->has_work, &device.lock);
    work item = stream->queue[stream->completed % device.capacity];
    execute_locked(&item);
    stream->completed++;
    pthread_cond_broadcast(&device.progress);
    pthread_cond_signal(&stream->has_room);
  }
  return NULL;
}

static stream_state* find_stream(CUstream handle) {
  for (int i = 0; i < device.stream_count; i++)
    if (device.streams[i]->handle == (uintptr_t)handle) return device.streams[i];
  return NULL;
}

/* The stream named by a handle, created (with its executor) at first launch. Called with the lock held. */
static stream_state* stream_of(CUstream handle) {
  stream_state* known = find_stream(handle);
  if (known) return known;
  if (device.stream_count == MAX_STREAMS) {
    fprintf(stderr, "rankwatch stand-in CUDA: more than %d streams; launch refused\n", MAX_STREAMS);
    return NULL;
  }
  stream_state* stream = calloc(1, sizeof(*stream));
  if (!stream) return NULL;
  stream->queue = calloc(device.capacity, sizeof(work));
  if (!stream->queue) {
    free(stream);
    return NULL;
  }
  stream->handle = (uintptr_t)handle;
  stream->limit = UINT64_MAX;
  pthread_cond_init(&stream->has_work, NULL);
  pthread_cond_init(&stream->has_room, NULL);
  pthread_t thread;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&thread, &attr, executor, stream) != 0) {
    free(stream->queue);
    free(stream);
    return NULL;
  }
  device.streams[device.stream_count++] = stream;
  return stream;
}

/* ---- the stuck fault's hold (see the top) ---------------------------------------------------------- */
static void hold_locked(void) {
  for (int i = 0; i < device.stream_count; i++)
    if (device.streams[i]->carries_collectives) device.streams[i]->limit = device.streams[i]->enqueued;
}

static void release_locked(void) {
  for (int i = 0; i < device.stream_count; i++) {
    device.streams[i]->limit = UINT64_MAX;
    pthread_cond_signal(&device.streams[i]->has_work);
  }
}

/* A host thread that launches collectives is about to block on the device: let held work run. */
static int release_for_wait_locked(void) {
  if (!device.holding || !launches_collectives) return 0;
  release_locked();
  return 1;
}

static void rehold_after_wait_locked(int released) {
  if (released && device.holding) hold_locked();
}

/* Queue one item on a stream (async) or run it here and now (sync). Blocks while the queue is full. */
static CUresult launch(CUstream handle, work item) {
  ensure_configured();
  if (!device.async) {
    switch (item.kind) {
      case WORK_KERNEL:
        if (item.stops_device) {
          fprintf(stderr, "rankwatch stand-in CUDA: injected device stop: a kernel that never ends\n");
          rw_hang_forever();
        }
        rw_sleep_ns(item.ns);
        break;
      case WORK_EVENT: complete_event(item.event, item.generation); break;
      case WORK_WAIT: break; /* everything before it already ran */
      case WORK_HOST: item.fn(item.arg); break;
    }
    return CUDA_SUCCESS;
  }
  pthread_mutex_lock(&device.lock);
  stream_state* stream = stream_of(handle);
  if (!stream) {
    pthread_mutex_unlock(&device.lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (stream->enqueued - stream->completed >= device.capacity) {
    int released = release_for_wait_locked();
    while (stream->enqueued - stream->completed >= device.capacity) pthread_cond_wait(&stream->has_room, &device.lock);
    rehold_after_wait_locked(released);
  }
  stream->queue[stream->enqueued % device.capacity] = item;
  stream->enqueued++;
  pthread_cond_signal(&stream->has_work);
  pthread_mutex_unlock(&device.lock);
  return CUDA_SUCCESS;
}

/* ---- the stand-in's own entry points ---------------------------------------------------------------- */
/* A compute kernel of duration_ns on the stream (longer on a slowed device, see faults.h). */
CUresult rwStandinLaunchKernel(CUstream stream, int64_t duration_ns) {
  if (duration_ns < 0) return CUDA_ERROR_INVALID_VALUE;
  const rw_faults* faults = rw_faults_get();
  uint64_t collectives = atomic_load(&device.collectives_launched);
  double factor = collectives >= faults->slowdown_from_call ? 1.0 + faults->slowdown : 1.0;
  work item = {.kind = WORK_KERNEL, .ns = (int64_t)((double)duration_ns * factor)};
  uint64_t kernel = atomic_fetch_add(&device.kernels_launched, 1) + 1;
  item.stops_device = faults->device_stop_at_kernel && kernel == faults->device_stop_at_kernel;
  return launch(stream, item);
}

/* An NCCL operation: fn runs on the stream's executor (inline when the device is synchronous). */
CUresult rwStandinLaunchCollective(CUstream stream, CUhostFn fn, void* arg) {
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  atomic_fetch_add(&device.collectives_launched, 1);
  launches_collectives = 1;
  ensure_configured();
  if (device.async) {
    pthread_mutex_lock(&device.lock);
    stream_state* state = stream_of(stream);
    if (state) state->carries_collectives = 1;
    pthread_mutex_unlock(&device.lock);
  }
  return launch(stream, (work){.kind = WORK_HOST, .fn = fn, .arg = arg});
}

/* The stuck fault, armed: work launched from now on onto streams that carry collectives waits. */
void rwStandinHoldCollectiveStreams(void) {
  ensure_configured();
  if (!device.async) return;
  pthread_mutex_lock(&device.lock);
  device.holding = 1;
  hold_locked();
  pthread_mutex_unlock(&device.lock);
}

/* The stuck fault, at its operation: this stream runs nothing from its last `lead_in` items on (the
 * event records a tracer put just ahead of the operation, one per call of a group: its GPU start),
 * nor the operation, nor anything after; the other streams are released. What came before (the end
 * of the previous operation) still runs when it was held; without a hold, whatever already ran. */
void rwStandinStallStream(CUstream stream, int lead_in) {
  ensure_configured();
  if (!device.async) return;
  pthread_mutex_lock(&device.lock);
  stream_state* state = stream_of(stream);
  device.holding = 0;
  if (state) {
    uint64_t back = lead_in > 0 && (uint64_t)lead_in < state->enqueued ? (uint64_t)lead_in : 0;
    uint64_t stop_at = state->enqueued - back;
    uint64_t ran = state->limit != UINT64_MAX ? state->limit : state->completed; /* may have run */
    if (stop_at < ran) stop_at = ran < state->enqueued ? ran : state->enqueued;
    release_locked();
    state->limit = stop_at;
  } else {
    release_locked();
  }
  pthread_mutex_unlock(&device.lock);
}

void rwStandinSetCapturing(CUstream stream, int on) {
  for (int i = 0; i < MAX_CAPTURING; i++) {
    if (on && !capturing[i]) {
      capturing[i] = stream;
      return;
    }
    if (!on && capturing[i] == stream) capturing[i] = NULL;
  }
}

/* ---- CUDA driver API ---------------------------------------------------------------------------------- */
CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* user_data) {
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  return launch(stream, (work){.kind = WORK_HOST, .fn = fn, .arg = user_data});
}

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  (void)flags;
  if (!event) return CUDA_ERROR_INVALID_VALUE;
  *event = calloc(1, sizeof(**event));
  return *event ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  uint64_t generation = atomic_fetch_add(&event->recorded, 1) + 1;
  return launch(stream, (work){.kind = WORK_EVENT, .event = event, .generation = generation});
}

static int event_done(CUevent event) {
  return atomic_load_explicit(&event->completed, memory_order_acquire) >= atomic_load(&event->recorded);
}

/* As real CUDA: an event never recorded counts as complete. */
CUresult cuEventQuery(CUevent event) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  return event_done(event) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent event) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  uint64_t generation = atomic_load(&event->recorded);
  pthread_mutex_lock(&device.lock);
  int released = 0;
  if (atomic_load_explicit(&event->completed, memory_order_acquire) < generation) released = release_for_wait_locked();
  while (atomic_load_explicit(&event->completed, memory_order_acquire) < generation)
    pthread_cond_wait(&device.progress, &device.lock);
  rehold_after_wait_locked(released);
  pthread_mutex_unlock(&device.lock);
  return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float* milliseconds, CUevent start, CUevent end) {
  if (!milliseconds || !start || !end) return CUDA_ERROR_INVALID_VALUE;
  if (!atomic_load(&start->recorded) || !atomic_load(&end->recorded)) return CUDA_ERROR_INVALID_HANDLE;
  if (!event_done(start) || !event_done(end)) return CUDA_ERROR_NOT_READY;
  int64_t from = atomic_load_explicit(&start->ns, memory_order_relaxed);
  int64_t to = atomic_load_explicit(&end->ns, memory_order_relaxed);
  *milliseconds = (float)((double)(to - from) / 1e6);
  return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent event) {
  free(event);
  return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  (void)flags;
  if (!stream) return CUDA_ERROR_INVALID_VALUE;
  *stream = (CUstream)(atomic_fetch_add(&next_stream_handle, 1) + 1);
  return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream stream) {
  (void)stream; /* its executor stays for the life of the process; pending work still runs */
  return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  (void)flags;
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  uint64_t generation = atomic_load(&event->recorded);
  if (!generation || event_done(event)) return CUDA_SUCCESS;
  return launch(stream, (work){.kind = WORK_WAIT, .event = event, .generation = generation});
}

CUresult cuStreamQuery(CUstream handle) {
  ensure_configured();
  if (!device.async) return CUDA_SUCCESS;
  pthread_mutex_lock(&device.lock);
  stream_state* stream = find_stream(handle); /* never launched on: idle */
  int idle = !stream || stream->completed == stream->enqueued;
  pthread_mutex_unlock(&device.lock);
  return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuStreamSynchronize(CUstream handle) {
  ensure_configured();
  if (!device.async) return CUDA_SUCCESS;
  pthread_mutex_lock(&device.lock);
  stream_state* stream = find_stream(handle); /* never launched on: nothing to wait for */
  if (stream) {
    uint64_t target = stream->enqueued;
    int released = stream->completed < target ? release_for_wait_locked() : 0;
    while (stream->completed < target) pthread_cond_wait(&device.progress, &device.lock);
    rehold_after_wait_locked(released);
  }
  pthread_mutex_unlock(&device.lock);
  return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
  ensure_configured();
  if (!device.async) return CUDA_SUCCESS;
  pthread_mutex_lock(&device.lock);
  int count = device.stream_count;
  uint64_t targets[MAX_STREAMS];
  for (int i = 0; i < count; i++) targets[i] = device.streams[i]->enqueued;
  int released = release_for_wait_locked();
  for (int i = 0; i < count; i++)
    while (device.streams[i]->completed < targets[i]) pthread_cond_wait(&device.progress, &device.lock);
  rehold_after_wait_locked(released);
  pthread_mutex_unlock(&device.lock);
  return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, int* status) {
  *status = 0;
  for (int i = 0; i < MAX_CAPTURING; i++)
    if (capturing[i] == stream && stream) *status = 1;
  return CUDA_SUCCESS;
}

/* Devices by ordinal (the process's, after CUDA_VISIBLE_DEVICES): the stand-in has any of the first 64;
 * each has a UUID fixed by its node (RANKWATCH_NODE_NAME, else the host name) and ordinal, as a real
 * GPU's is by its board, so two ranks on one node never share one and a rerun names the same. */
#define STANDIN_DEVICES 64

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  if (!device || ordinal < 0 || ordinal >= STANDIN_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice device) {
  if (!uuid || device < 0 || device >= STANDIN_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  char node[64] = {0};
  const char* name = getenv("RANKWATCH_NODE_NAME");
  if (name && *name) strncpy(node, name, sizeof(node) - 1);
  else gethostname(node, sizeof(node) - 1);
  for (int half = 0; half < 2; half++) { /* two FNV-1a 64 hashes of (half, ordinal, node) */
    uint64_t hash = (0xcbf29ce484222325ull ^ (uint64_t)(half + 1)) * 0x100000001b3ull;
    hash = (hash ^ (uint64_t)(device + 1)) * 0x100000001b3ull;
    for (const char* c = node; *c; c++) hash = (hash ^ (uint8_t)*c) * 0x100000001b3ull;
    memcpy(uuid->bytes + 8 * half, &hash, 8);
  }
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* context) {
  *context = the_context;
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext context) {
  (void)context;
  return CUDA_SUCCESS;
}
