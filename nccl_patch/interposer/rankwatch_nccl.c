/* librankwatch-nccl.so: traces every NCCL call of a process into an mmap'd ring (rankwatch_ring.h).
 *
 * Loaded with LD_PRELOAD, it defines the public ncclX functions; each records one entry and forwards
 * to the loaded NCCL's strong pncclX, found with dlopen("libnccl.so.2", RTLD_NOLOAD) because PyTorch
 * loads NCCL RTLD_LOCAL (RTLD_NEXT would miss it). It never links against NCCL, never blocks and never
 * allocates on the hot path, and guards against NCCL calling its own public API (no double count).
 * Anything that goes wrong (no trace directory, a full disk, a missing symbol) costs one warning on
 * stderr and leaves a pure pass-through: tracing must never hurt training.
 *
 * Environment: RANKWATCH_TRACE_DIR (alias NCCL_MEGATRACE_LOG_PATH; default /tmp/rankwatch-traces),
 * RANKWATCH_TRACE=0 (alias NCCL_MEGATRACE_ENABLE=0) disables, RANKWATCH_RING_RECORDS (slots, rounded
 * up to a power of two), RANKWATCH_SENSITIVITY_SECONDS (alias NCCL_MEGATRACE_SENSTIME in ms; stored in
 * the header for the sidecar), RANKWATCH_GPU_TIMING=1 (see gpu_timing.c), RANKWATCH_JOB_NAME,
 * RANKWATCH_NODE_NAME (recorded as the host name).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../include/nccl_abi.h"
#include "../include/rankwatch_ring.h"
#include "clock.h"
#include "interposer.h"

/* ---- configuration and the ring ------------------------------------------------------------------- */
static rw_ring_header* ring;          /* NULL: pass-through */
static rw_record* records;
static uint64_t ring_mask;
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;
static int32_t global_rank = -1;
static RW_HOT_TLS uint32_t thread_id;
int rw_gpu_timing_enabled;

static void warn(const char* what) {
  fprintf(stderr, "rankwatch: NCCL tracing off for pid %d: %s\n", (int)getpid(), what);
}

static const char* env_first(const char* a, const char* b) {
  const char* value = getenv(a);
  if (value && *value) return value;
  value = getenv(b);
  return value && *value ? value : NULL;
}

static int32_t env_int(const char* const* names, int count) {
  for (int i = 0; i < count; i++) {
    const char* value = getenv(names[i]);
    if (value && *value) return (int32_t)atoi(value);
  }
  return -1;
}

static inline int64_t realtime_ns(void) { return rw_now_ns(); }

int64_t rw_realtime_ns(void) { return rw_now_ns(); }

static void create_ring(void) {
  const char* enabled = env_first("RANKWATCH_TRACE", "NCCL_MEGATRACE_ENABLE");
  if (enabled && strcmp(enabled, "0") == 0) return; /* asked for: silent pass-through */
  rw_clock_init();
  const char* dir = env_first("RANKWATCH_TRACE_DIR", "NCCL_MEGATRACE_LOG_PATH");
  if (!dir) dir = "/tmp/rankwatch-traces";

  uint64_t capacity = RW_DEFAULT_CAPACITY;
  const char* wanted = getenv("RANKWATCH_RING_RECORDS");
  if (wanted && *wanted) {
    uint64_t value = strtoull(wanted, NULL, 10);
    if (value >= 64 && value <= (1ull << 26)) {
      capacity = 64;
      while (capacity < value) capacity <<= 1;
    } else {
      fprintf(stderr, "rankwatch: ignoring RANKWATCH_RING_RECORDS=%s (want 64..67108864)\n", wanted);
    }
  }

  /* The node's name: RANKWATCH_NODE_NAME (the operator sets it from spec.nodeName; a pod's own
   * host name is the pod's), else the host name. */
  char host[64] = {0};
  const char* node = getenv("RANKWATCH_NODE_NAME");
  if (node && *node) strncpy(host, node, sizeof(host) - 1);
  else gethostname(host, sizeof(host) - 1);
  mkdir(dir, 0755); /* may exist; failures surface at open */
  char path[4096];
  snprintf(path, sizeof(path), "%s/rankwatch-%s-%d.ring", dir, host, (int)getpid());
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    char message[4200];
    snprintf(message, sizeof(message), "cannot create %s: %s", path, strerror(errno));
    warn(message);
    return;
  }
  size_t bytes = RW_RING_HEADER_SIZE + capacity * RW_RECORD_SIZE;
  int err = posix_fallocate(fd, 0, (off_t)bytes); /* a full disk fails here, not as SIGBUS later */
  if (err) {
    char message[4200];
    snprintf(message, sizeof(message), "cannot reserve %zu bytes for %s: %s", bytes, path, strerror(err));
    warn(message);
    close(fd);
    unlink(path);
    return;
  }
  void* base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    warn("mmap of the ring failed");
    unlink(path);
    return;
  }
  rw_ring_header* header = base;
  header->version = RW_RING_VERSION;
  header->header_size = RW_RING_HEADER_SIZE;
  header->record_size = RW_RECORD_SIZE;
  header->flags = rw_gpu_timing_enabled ? RW_HEADER_GPU_TIMING : 0u;
  header->gpu_index = -1; /* until the first communicator says (gpu_identity.c) */
  header->capacity = capacity;
  header->start_realtime_ns = realtime_ns();
  struct timespec mono;
  clock_gettime(CLOCK_MONOTONIC, &mono);
  header->start_monotonic_ns = (int64_t)mono.tv_sec * 1000000000 + mono.tv_nsec;
  header->pid = (int32_t)getpid();
  static const char* const rank_names[] = {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"};
  static const char* const local_names[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"};
  static const char* const world_names[] = {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"};
  header->global_rank = global_rank = env_int(rank_names, 4);
  header->local_rank = env_int(local_names, 3);
  header->world_size = env_int(world_names, 4);
  memcpy(header->hostname, host, sizeof(header->hostname));
  const char* job = getenv("RANKWATCH_JOB_NAME");
  if (job) strncpy(header->job, job, sizeof(header->job) - 1);
  const char* seconds = getenv("RANKWATCH_SENSITIVITY_SECONDS");
  const char* millis = getenv("NCCL_MEGATRACE_SENSTIME");
  if (seconds && *seconds) header->sensitivity_ms = (int32_t)(atof(seconds) * 1000);
  else if (millis && *millis) header->sensitivity_ms = (int32_t)atoi(millis);
  int (*version)(int*) = (int (*)(int*))rw_resolve("pncclGetVersion");
  if (version) version(&header->nccl_version);
  records = (rw_record*)((char*)base + RW_RING_HEADER_SIZE);
  ring_mask = capacity - 1;
  memcpy(header->magic, RW_RING_MAGIC, 8);
  atomic_thread_fence(memory_order_release);
  ring = header;
}

static _Atomic int ring_tried;

static inline int tracing(void) {
  if (__builtin_expect(!atomic_load_explicit(&ring_tried, memory_order_acquire), 0)) {
    pthread_once(&ring_once, create_ring);
    atomic_store_explicit(&ring_tried, 1, memory_order_release);
  }
  return ring != NULL;
}

/* ---- resolving NCCL ------------------------------------------------------------------------------- */
void* rw_resolve(const char* strong_name) {
  static void* handle;
  if (!handle) handle = dlopen("libnccl.so.2", RTLD_NOLOAD | RTLD_LAZY);
  if (!handle) handle = dlopen("libnccl.so", RTLD_NOLOAD | RTLD_LAZY);
  void* symbol = handle ? dlsym(handle, strong_name) : NULL;
  if (!symbol) symbol = dlsym(RTLD_NEXT, strong_name);     /* NCCL linked, not dlopen'ed */
  if (!symbol) symbol = dlsym(RTLD_NEXT, strong_name + 1); /* no pncclX: the next ncclX */
  return symbol;
}

void rw_missing_symbol(const char* name) {
  fprintf(stderr, "rankwatch: %s is not in the loaded NCCL; returning ncclInvalidUsage\n", name);
}

/* ---- communicators: a fixed open-addressing table keyed by the handle ------------------------------ */
#define COMM_SLOTS 8192
#define TOMBSTONE ((uintptr_t)1)

typedef struct {
  _Atomic uintptr_t key;
  uint64_t id;
  int32_t rank, nranks;
  _Atomic uint64_t collectives;
  _Atomic uint64_t* sends;    /* per peer */
  _Atomic uint64_t* receives; /* per peer */
  _Atomic uint32_t children;  /* splits and shrinks of this comm */
} comm_entry;

static comm_entry comms[COMM_SLOTS];
static pthread_mutex_t comms_lock = PTHREAD_MUTEX_INITIALIZER; /* writers only (comm creation) */

static inline size_t comm_hash(uintptr_t key) { return (size_t)((key >> 4) * 0x9E3779B97F4A7C15ull) & (COMM_SLOTS - 1); }

static comm_entry* comm_find(ncclComm_t comm) {
  uintptr_t key = (uintptr_t)comm;
  for (size_t i = comm_hash(key), n = 0; n < COMM_SLOTS; i = (i + 1) & (COMM_SLOTS - 1), n++) {
    uintptr_t present = atomic_load_explicit(&comms[i].key, memory_order_acquire);
    if (present == key) return &comms[i];
    if (present == 0) return NULL;
  }
  return NULL;
}

uint64_t rw_fnv1a(const void* data, size_t len, uint64_t hash) {
  const unsigned char* bytes = data;
  for (size_t i = 0; i < len; i++) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

/* Called after NCCL created `comm` (not on the hot path: allocation and a lock are fine here). */
void rw_comm_register(ncclComm_t comm, uint64_t id, int op, uint64_t parent, int32_t detail) {
  if (!comm) return;
  int32_t rank = -1, nranks = -1;
  ncclResult_t (*count)(const ncclComm_t, int*) = (ncclResult_t(*)(const ncclComm_t, int*))rw_resolve("pncclCommCount");
  ncclResult_t (*user_rank)(const ncclComm_t, int*) =
      (ncclResult_t(*)(const ncclComm_t, int*))rw_resolve("pncclCommUserRank");
  if (count && count(comm, &nranks) != ncclSuccess) nranks = -1;
  if (user_rank && user_rank(comm, &rank) != ncclSuccess) rank = -1;
  pthread_mutex_lock(&comms_lock);
  uintptr_t key = (uintptr_t)comm;
  comm_entry* entry = NULL;
  for (size_t i = comm_hash(key), n = 0; n < COMM_SLOTS; i = (i + 1) & (COMM_SLOTS - 1), n++) {
    uintptr_t present = atomic_load(&comms[i].key);
    if (present == 0 || present == TOMBSTONE || present == key) {
      entry = &comms[i];
      break;
    }
  }
  if (entry) {
    free((void*)entry->sends);
    free((void*)entry->receives);
    entry->id = id;
    entry->rank = rank;
    entry->nranks = nranks;
    atomic_store(&entry->collectives, 0);
    atomic_store(&entry->children, 0);
    entry->sends = nranks > 0 ? calloc((size_t)nranks, sizeof(uint64_t)) : NULL;
    entry->receives = nranks > 0 ? calloc((size_t)nranks, sizeof(uint64_t)) : NULL;
    atomic_store_explicit(&entry->key, key, memory_order_release);
  }
  pthread_mutex_unlock(&comms_lock);
  if (!entry) fprintf(stderr, "rankwatch: more than %d live communicators; %p is not traced\n", COMM_SLOTS, (void*)comm);
  rw_note_gpu(comm);
  rw_record* record;
  uint64_t index = rw_begin(comm, op, 0, 0, 255, detail, NULL, &record);
  if (record) {
    record->aux = parent;
    rw_end(index, record, ncclSuccess);
  }
}

void rw_comm_forget(ncclComm_t comm) {
  comm_entry* entry = comm_find(comm);
  if (entry) atomic_store_explicit(&entry->key, TOMBSTONE, memory_order_release);
}

uint64_t rw_comm_id(ncclComm_t comm) {
  comm_entry* entry = comm_find(comm);
  return entry ? entry->id : 0;
}

uint32_t rw_comm_next_child(ncclComm_t comm) {
  comm_entry* entry = comm_find(comm);
  return entry ? atomic_fetch_add(&entry->children, 1) + 1 : 0;
}

/* ---- groups ---------------------------------------------------------------------------------------- */
#define MAX_PENDING 1024
static RW_HOT_TLS int group_depth;
static RW_HOT_TLS uint64_t group_id;
static RW_HOT_TLS int pending_count;
static __thread struct { uint64_t index; rw_record* record; } pending[MAX_PENDING];
static _Atomic uint64_t next_group_id = 1;

void rw_group_start(void) {
  if (group_depth++ == 0) group_id = atomic_fetch_add_explicit(&next_group_id, 1, memory_order_relaxed);
}

void rw_group_end(ncclResult_t result) {
  if (group_depth == 0) return; /* unbalanced: NCCL reports it */
  if (--group_depth > 0) return;
  int64_t now = realtime_ns();
  int count = pending_count;
  pending_count = 0;
  group_id = 0;
  if (rw_gpu_timing_enabled) rw_gpu_group_end();
  for (int i = 0; i < count; i++) rw_complete(pending[i].index, pending[i].record, result, now);
}

int rw_in_group(void) { return group_depth > 0; }

/* ---- records --------------------------------------------------------------------------------------- */
static inline uint32_t tid(void) {
  if (!thread_id) thread_id = (uint32_t)syscall(SYS_gettid);
  return thread_id;
}

uint64_t rw_begin(ncclComm_t comm, int op, size_t count, int dtype, int redop, int peer, cudaStream_t stream,
                  rw_record** out) {
  *out = NULL;
  if (!tracing()) return 0;
  uint64_t index = atomic_fetch_add_explicit((_Atomic uint64_t*)&ring->next, 1, memory_order_relaxed);
  rw_record* record = &records[index & ring_mask];
  atomic_store_explicit((_Atomic uint64_t*)&record->stamp, 2 * index + 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);

  comm_entry* entry = comm_find(comm);
  uint64_t seq = 0;
  if (entry) {
    if (op == RW_OP_SEND && entry->sends && peer >= 0 && peer < entry->nranks)
      seq = atomic_fetch_add_explicit(&entry->sends[peer], 1, memory_order_relaxed) + 1;
    else if (op == RW_OP_RECV && entry->receives && peer >= 0 && peer < entry->nranks)
      seq = atomic_fetch_add_explicit(&entry->receives[peer], 1, memory_order_relaxed) + 1;
    else if (op < RW_OP_COMM_INIT)
      seq = atomic_fetch_add_explicit(&entry->collectives, 1, memory_order_relaxed) + 1;
  }
  record->comm_id = entry ? entry->id : 0;
  record->seq = seq;
  record->count = count;
  record->stream = (uint64_t)(uintptr_t)stream;
  record->t_call_ns = realtime_ns();
  record->t_return_ns = 0;
  record->gpu_start_ns = 0;
  record->gpu_end_ns = 0;
  record->aux = 0;
  record->group_id = group_depth ? group_id : 0;
  record->rank = entry ? entry->rank : -1;
  record->nranks = entry ? entry->nranks : -1;
  record->global_rank = global_rank;
  record->peer = peer;
  record->result = 0;
  record->tid = tid();
  record->op = (uint8_t)op;
  record->dtype = (uint8_t)dtype;
  record->redop = (uint8_t)(redop >= 0 && redop < 255 ? redop : 255);
  record->flags = group_depth ? RW_FLAG_GROUPED : 0;
  record->reserved = 0;
  atomic_store_explicit((_Atomic uint8_t*)&record->state, RW_STATE_ENTERED, memory_order_relaxed);
  atomic_store_explicit((_Atomic uint64_t*)&record->stamp, 2 * index + 2, memory_order_release);
  /* The next call's slot is likely cold (the ring is larger than the cache): fetch it now. */
  rw_record* next = &records[(index + 1) & ring_mask];
  __builtin_prefetch(next, 1, 3);
  __builtin_prefetch((char*)next + 64, 1, 3);
  *out = record;
  return index;
}

/* Finish a record whose call returned at `now`; skipped if its slot was reused meanwhile. */
void rw_complete(uint64_t index, rw_record* record, ncclResult_t result, int64_t now) {
  if (atomic_load_explicit((_Atomic uint64_t*)&record->stamp, memory_order_acquire) != 2 * index + 2) {
    atomic_fetch_add_explicit((_Atomic uint32_t*)&ring->lost_updates, 1, memory_order_relaxed);
    return;
  }
  /* Stamps of one call may come from two CPUs or straddle a re-anchor of the TSC clock: a few ns of
   * disagreement must never make a call end before it began. */
  record->t_return_ns = now > record->t_call_ns ? now : record->t_call_ns;
  record->result = (int32_t)result;
  if (result == ncclInProgress) record->flags |= RW_FLAG_IN_PROGRESS;
  uint8_t state = (result == ncclSuccess || result == ncclInProgress) ? RW_STATE_RETURNED : RW_STATE_FAILED;
  if (state == RW_STATE_RETURNED && (record->flags & RW_FLAG_GPU_TIMED)) {
    /* The GPU poller may have written the end already (work that ran before the call returned) and seen
     * the call not returned yet: then the GPU_DONE state is this side's to write (see gpu_timing.c). */
    atomic_store_explicit((_Atomic uint8_t*)&record->state, state, memory_order_seq_cst);
    if (atomic_load_explicit((_Atomic int64_t*)&record->gpu_end_ns, memory_order_seq_cst) != 0) {
      uint8_t returned = RW_STATE_RETURNED;
      atomic_compare_exchange_strong_explicit((_Atomic uint8_t*)&record->state, &returned, RW_STATE_GPU_DONE,
                                              memory_order_seq_cst, memory_order_seq_cst);
    }
    return;
  }
  atomic_store_explicit((_Atomic uint8_t*)&record->state, state, memory_order_release);
}

void rw_end(uint64_t index, rw_record* record, ncclResult_t result) {
  if (!record) return;
  if (group_depth > 0 && result == ncclSuccess) {
    if (pending_count < MAX_PENDING) {
      pending[pending_count].index = index;
      pending[pending_count].record = record;
      pending_count++;
      return;
    }
  }
  rw_complete(index, record, result, realtime_ns());
}

rw_ring_header* rw_ring(void) { return tracing() ? ring : NULL; }

__attribute__((constructor)) static void rw_init(void) {
  const char* gpu = getenv("RANKWATCH_GPU_TIMING");
  rw_gpu_timing_enabled = gpu && strcmp(gpu, "1") == 0;
}
