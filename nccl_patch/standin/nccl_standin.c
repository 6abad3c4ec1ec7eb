/* Stand-in libnccl.so.2: the public NCCL API with real cross-process semantics, no GPU.
 *
 * Ranks are processes (or threads). A communicator is a POSIX shared-memory segment named after
 * its unique id; every collective passes two central barriers in it (arrive, then depart), so no
 * member completes before every member arrived, and moves the data through per-rank slots when it
 * fits (host buffers stand in for device buffers; larger or 16-bit payloads are synchronised
 * only). Send/Recv are rendezvous on a per-(sender, receiver) mailbox. Calls between
 * ncclGroupStart/End are queued and progressed together at the outermost ncclGroupEnd, so the
 * usual send/recv exchanges inside a group do not deadlock. Misuse returns NCCL's error codes.
 * Like the real library, each public ncclX is a weak alias of a strong pncclX.
 * Where an operation runs: on an asynchronous stand-in device (libcuda.so.1 with
 * RANKWATCH_STANDIN_DEVICE=async) each operation (a whole group at its outermost ncclGroupEnd) is
 * launched onto its stream and the call returns at once, as the real library's does; the rendezvous
 * and data movement happen on the stream's executor, in stream order, and a group goes onto the stream
 * of its first operation. Otherwise (synchronous device, or no stand-in device) inside the call.
 * ncclCommDestroy waits for the communicator's launched operations (as ncclCommFinalize does).
 * NCCL-level faults come from the environment (faults.h): a slow link, an operation that never starts
 * on the GPU (its stream stopped before it), one that starts and never completes.
 * Members that meet at one collective with different operations, element counts or datatypes (a code
 * path taken on some ranks only) never complete it, as with the real library, whose kernels then wait
 * for data that never comes: each member publishes what it called before the rendezvous and compares
 * after it; nobody leaves, until the communicator is aborted.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../include/nccl_abi.h"
#include "faults.h"

#define STANDIN_VERSION 22807 /* reports itself as NCCL 2.28.7 */
#define SLOT_BYTES (256u * 1024u)
#define MAX_GROUP_OPS 4096
#define ID_MAGIC "RWNCCL01"

#define API(ret, name, ...)                                              \
  ret name(__VA_ARGS__) __attribute__((weak, alias("p" #name)));          \
  ret p##name(__VA_ARGS__)

/* ---- shared memory of one communicator --------------------------------------------------------- */
typedef struct {
  _Atomic uint32_t sent;     /* sends posted by the sender to this receiver */
  _Atomic uint32_t received; /* of those, received */
} mailbox;

typedef struct {
  _Atomic uint32_t attached; /* ranks that finished attaching (init barrier) */
  _Atomic uint32_t detached; /* ranks that destroyed their handle (last one unlinks) */
  _Atomic uint32_t count;    /* central barrier: arrivals in the current round */
  _Atomic uint32_t round;    /* central barrier: completed rounds */
  _Atomic uint32_t host_count; /* the host-side barrier of ncclCommSplit: not stream-ordered, so */
  _Atomic uint32_t host_round; /* it must not share the collectives' barrier */
  uint32_t nranks;
  uint32_t pad;
  /* followed by: uint64 call[nranks] (what each member called in the current collective);
   * int32 global_rank[nranks]; int32 split_color[nranks]; int32 split_key[nranks];
   * mailbox[nranks * nranks] (index sender * nranks + receiver); then nranks data slots. */
} shm_header;

struct ncclComm {
  uint64_t id;         /* stable across members: from the unique id / parent + split */
  int rank, nranks;
  shm_header* shm;
  size_t shm_bytes;
  char shm_name[96];
  _Atomic uint64_t* calls; /* per member: the signature of its current collective (call_signature) */
  int32_t* global_ranks;
  int32_t* split_color;
  int32_t* split_key;
  mailbox* mailboxes;
  unsigned char* slots;
  uint32_t collectives;  /* collectives this rank started on this comm */
  uint32_t* sends;       /* per peer: sends posted */
  uint32_t* receives;    /* per peer: receives completed */
  uint32_t children;     /* splits and shrinks made from this comm */
  _Atomic uint32_t launched, finished; /* operations handed to the device, and of those completed */
  ncclResult_t async_error;
  int destroyed;
  _Atomic int aborting; /* ncclCommAbort: operations waiting for peers give up */
};

static size_t shm_size(int nranks) {
  size_t n = (size_t)nranks;
  size_t bytes = sizeof(shm_header) + n * sizeof(uint64_t) + 3 * n * sizeof(int32_t) + n * n * sizeof(mailbox);
  bytes = (bytes + 4095) & ~(size_t)4095;
  return bytes + n * SLOT_BYTES;
}

static uint64_t fnv1a(const void* data, size_t len, uint64_t hash) {
  const unsigned char* bytes = data;
  for (size_t i = 0; i < len; i++) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

static const char* session(void) {
  const char* value = getenv("RANKWATCH_STANDIN_SESSION");
  return value && *value ? value : "default";
}

static int32_t my_global_rank(void) {
  const char* names[] = {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"};
  for (size_t i = 0; i < sizeof(names) / sizeof(*names); i++) {
    const char* value = getenv(names[i]);
    if (value && *value) return (int32_t)atoi(value);
  }
  return -1;
}

/* ---- waiting: spin, then yield, then sleep with backoff (no CPU burnt by a hung peer) ------------ */
typedef struct { unsigned spins; int64_t sleep_ns; } backoff;

static void backoff_wait(backoff* state) {
  if (state->spins < 64) {
    state->spins++;
    return;
  }
  if (state->spins < 96) {
    state->spins++;
    sched_yield();
    return;
  }
  state->sleep_ns = state->sleep_ns ? state->sleep_ns * 2 : 2000;
  if (state->sleep_ns > 200000) state->sleep_ns = 200000;
  rw_sleep_ns(state->sleep_ns);
}

/* ---- attaching to a communicator's segment -------------------------------------------------------- */
static ncclResult_t map_segment(ncclComm_t comm) {
  size_t bytes = shm_size(comm->nranks);
  int fd = shm_open(comm->shm_name, O_CREAT | O_RDWR, 0600);
  if (fd < 0) {
    fprintf(stderr, "rankwatch stand-in NCCL: shm_open %s: %s\n", comm->shm_name, strerror(errno));
    return ncclSystemError;
  }
  struct stat st;
  if (fstat(fd, &st) == 0 && (size_t)st.st_size < bytes && ftruncate(fd, (off_t)bytes) != 0) {
    fprintf(stderr, "rankwatch stand-in NCCL: ftruncate %s: %s\n", comm->shm_name, strerror(errno));
    close(fd);
    return ncclSystemError;
  }
  void* base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return ncclSystemError;
  comm->shm = base;
  comm->shm_bytes = bytes;
  size_t n = (size_t)comm->nranks;
  unsigned char* cursor = (unsigned char*)base + sizeof(shm_header);
  comm->calls = (_Atomic uint64_t*)cursor;
  comm->global_ranks = (int32_t*)(comm->calls + n);
  comm->split_color = comm->global_ranks + n;
  comm->split_key = comm->split_color + n;
  comm->mailboxes = (mailbox*)(comm->split_key + n);
  comm->slots = (unsigned char*)base + (bytes - n * SLOT_BYTES);
  comm->sends = calloc(n, sizeof(uint32_t));
  comm->receives = calloc(n, sizeof(uint32_t));
  return comm->sends && comm->receives ? ncclSuccess : ncclSystemError;
}

/* Attach and wait until every member has (the init barrier). */
static ncclResult_t attach(ncclComm_t comm) {
  ncclResult_t result = map_segment(comm);
  if (result != ncclSuccess) return result;
  comm->global_ranks[comm->rank] = my_global_rank();
  atomic_fetch_add(&comm->shm->attached, 1);
  backoff wait = {0, 0};
  while (atomic_load(&comm->shm->attached) < (uint32_t)comm->nranks) backoff_wait(&wait);
  return ncclSuccess;
}

static ncclResult_t comm_create(uint64_t id, int nranks, int rank, ncclComm_t* out) {
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  ncclComm_t comm = calloc(1, sizeof(*comm));
  if (!comm) return ncclSystemError;
  comm->id = id;
  comm->rank = rank;
  comm->nranks = nranks;
  snprintf(comm->shm_name, sizeof(comm->shm_name), "/rwnccl-%s-%016llx", session(), (unsigned long long)id);
  ncclResult_t result = attach(comm);
  if (result != ncclSuccess) {
    free(comm);
    return result;
  }
  *out = comm;
  return ncclSuccess;
}

static uint64_t id_of(const ncclUniqueId* unique) {
  return fnv1a(unique->internal, NCCL_UNIQUE_ID_BYTES, 1469598103934665603ull);
}

/* ---- operations and their progress ---------------------------------------------------------------- */
typedef enum { K_ALLREDUCE, K_BROADCAST, K_REDUCE, K_ALLGATHER, K_REDUCESCATTER, K_ALLTOALL, K_GATHER,
               K_SCATTER, K_SEND, K_RECV } op_kind;

typedef struct {
  op_kind kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t dtype;
  ncclRedOp_t redop;
  int root; /* or peer */
  ncclComm_t comm;
  cudaStream_t stream;
  int stuck;      /* the injected fault: this operation's GPU work never starts (asynchronous device) */
  int never_ends; /* the injected fault: this operation starts on the GPU and never completes */
  int phase;      /* collectives: 0 not posted, 1 arrived, 2 results read, 3 mismatched (never completes) */
  uint32_t target; /* barrier round or mailbox count to wait for */
  int64_t not_before_ns; /* link latency: do not post before this time */
} op_t;

static size_t dtype_size(ncclDataType_t dtype) {
  switch (dtype) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

/* Bytes of the largest slot an op needs; 0 when it is synchronised only (16-bit types are not
 * reduced on the host, and payloads larger than a slot are not moved). Equal on every member. */
static size_t slot_bytes(const op_t* op) {
  size_t element = dtype_size(op->dtype);
  if (element == 2 || element == 0 || op->kind == K_SEND || op->kind == K_RECV) return 0;
  size_t elements = op->count;
  if (op->kind == K_REDUCESCATTER || op->kind == K_ALLTOALL || op->kind == K_SCATTER)
    elements *= (size_t)op->comm->nranks;
  size_t bytes = elements * element;
  return bytes <= SLOT_BYTES ? bytes : 0;
}

/* What this rank contributes: the root alone for broadcast/scatter, everyone otherwise. */
static int contributes(const op_t* op) {
  if (!op->send) return 0;
  if (op->kind == K_BROADCAST || op->kind == K_SCATTER) return op->comm->rank == op->root;
  return 1;
}

#define REDUCE_CASE(T)                                                                    \
  {                                                                                      \
    T* out = (T*)dst;                                                                    \
    for (size_t i = 0; i < count; i++) {                                                 \
      T acc = ((const T*)(slots))[offset + i];                                           \
      for (int r = 1; r < nranks; r++) {                                                 \
        T v = ((const T*)(slots + (size_t)r * SLOT_BYTES))[offset + i];                  \
        switch (redop) {                                                                 \
          case ncclProd: acc = (T)(acc * v); break;                                      \
          case ncclMax: acc = v > acc ? v : acc; break;                                  \
          case ncclMin: acc = v < acc ? v : acc; break;                                  \
          default: acc = (T)(acc + v); break;                                            \
        }                                                                                \
      }                                                                                  \
      if (redop == ncclAvg) acc = (T)(acc / (T)nranks);                                  \
      out[i] = acc;                                                                      \
    }                                                                                    \
  }                                                                                      \
  break;

static void reduce_slots(void* dst, const unsigned char* slots, int nranks, size_t offset, size_t count,
                         ncclDataType_t dtype, ncclRedOp_t redop) {
  switch (dtype) {
    case ncclInt8: REDUCE_CASE(int8_t)
    case ncclUint8: REDUCE_CASE(uint8_t)
    case ncclInt32: REDUCE_CASE(int32_t)
    case ncclUint32: REDUCE_CASE(uint32_t)
    case ncclInt64: REDUCE_CASE(int64_t)
    case ncclUint64: REDUCE_CASE(uint64_t)
    case ncclFloat32: REDUCE_CASE(float)
    case ncclFloat64: REDUCE_CASE(double)
    default: break;
  }
}

/* Results are computed between the two barriers, from every rank's slot. */
static void compute_result(op_t* op) {
  ncclComm_t comm = op->comm;
  size_t element = dtype_size(op->dtype);
  if (!slot_bytes(op) || !op->recv) return;
  const unsigned char* slots = comm->slots;
  int n = comm->nranks, me = comm->rank;
  size_t block = op->count * element;
  switch (op->kind) {
    case K_ALLREDUCE: reduce_slots(op->recv, slots, n, 0, op->count, op->dtype, op->redop); break;
    case K_REDUCE:
      if (me == op->root) reduce_slots(op->recv, slots, n, 0, op->count, op->dtype, op->redop);
      break;
    case K_REDUCESCATTER:
      reduce_slots(op->recv, slots, n, (size_t)me * op->count, op->count, op->dtype, op->redop);
      break;
    case K_BROADCAST: memcpy(op->recv, slots + (size_t)op->root * SLOT_BYTES, block); break;
    case K_ALLGATHER:
      for (int r = 0; r < n; r++) memcpy((unsigned char*)op->recv + r * block, slots + (size_t)r * SLOT_BYTES, block);
      break;
    case K_ALLTOALL:
      for (int r = 0; r < n; r++)
        memcpy((unsigned char*)op->recv + r * block, slots + (size_t)r * SLOT_BYTES + (size_t)me * block, block);
      break;
    case K_GATHER:
      if (me == op->root)
        for (int r = 0; r < n; r++) memcpy((unsigned char*)op->recv + r * block, slots + (size_t)r * SLOT_BYTES, block);
      break;
    case K_SCATTER: memcpy(op->recv, slots + (size_t)op->root * SLOT_BYTES + (size_t)me * block, block); break;
    default: break;
  }
}

static void barrier_post_on(_Atomic uint32_t* count, _Atomic uint32_t* rounds, uint32_t nranks, uint32_t* target) {
  uint32_t round = atomic_load(rounds);
  *target = round + 1;
  if (atomic_fetch_add(count, 1) + 1 == nranks) {
    atomic_store(count, 0);
    atomic_store(rounds, round + 1);
  }
}

static void barrier_post(ncclComm_t comm, uint32_t* target) {
  barrier_post_on(&comm->shm->count, &comm->shm->round, (uint32_t)comm->nranks, target);
}

static int barrier_done(ncclComm_t comm, uint32_t target) {
  return (int32_t)(atomic_load(&comm->shm->round) - target) >= 0;
}

/* Every member, on the host (ncclCommSplit): a barrier of its own. */
static void host_barrier(ncclComm_t comm) {
  uint32_t target;
  barrier_post_on(&comm->shm->host_count, &comm->shm->host_round, (uint32_t)comm->nranks, &target);
  backoff wait = {0, 0};
  while ((int32_t)(atomic_load(&comm->shm->host_round) - target) < 0) backoff_wait(&wait);
}

static int is_link_fault(ncclComm_t comm, int peer) {
  const rw_faults* f = rw_faults_get();
  return f->link_latency_ns > 0 && f->link_peer >= 0 && comm->global_ranks[peer] == f->link_peer;
}

/* What a collective's members must agree on: operation, datatype and element count. */
static uint64_t call_signature(const op_t* op) {
  return (uint64_t)op->kind | (uint64_t)(op->dtype & 0xff) << 8 | (uint64_t)op->count << 16;
}

/* After the arrival barrier: 1 when every member called the same collective as this one. */
static int members_agree(const op_t* op) {
  ncclComm_t comm = op->comm;
  uint64_t mine = call_signature(op);
  for (int r = 0; r < comm->nranks; r++)
    if (atomic_load(&comm->calls[r]) != mine) return 0;
  return 1;
}

static const char* const KIND_NAMES[] = {"AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter",
                                         "AlltoAll", "Gather", "Scatter", "Send", "Recv"};

/* Advance one op as far as it goes without blocking; 1 when complete. */
static int step(op_t* op) {
  ncclComm_t comm = op->comm;
  int peer = op->root;
  switch (op->kind) {
    case K_SEND: {
      mailbox* box = &comm->mailboxes[(size_t)comm->rank * comm->nranks + peer];
      if (op->phase == 0) {
        if (is_link_fault(comm, peer) && !op->not_before_ns)
          op->not_before_ns = rw_now_monotonic_ns() + rw_faults_get()->link_latency_ns;
        if (op->not_before_ns && rw_now_monotonic_ns() < op->not_before_ns) return 0;
        op->target = ++comm->sends[peer];
        atomic_store(&box->sent, op->target);
        op->phase = 1;
      }
      return (int32_t)(atomic_load(&box->received) - op->target) >= 0;
    }
    case K_RECV: {
      mailbox* box = &comm->mailboxes[(size_t)peer * comm->nranks + comm->rank];
      if (op->phase == 0) {
        op->target = comm->receives[peer] + 1;
        op->phase = 1;
      }
      if (op->phase == 1) {
        if ((int32_t)(atomic_load(&box->sent) - op->target) < 0) return 0;
        if (is_link_fault(comm, peer) && !op->not_before_ns)
          op->not_before_ns = rw_now_monotonic_ns() + rw_faults_get()->link_latency_ns;
        if (op->not_before_ns && rw_now_monotonic_ns() < op->not_before_ns) return 0;
        comm->receives[peer] = op->target;
        atomic_store(&box->received, op->target);
        op->phase = 2;
      }
      return 1;
    }
    default:
      if (op->phase == 0) {
        size_t bytes = slot_bytes(op);
        if (op->kind != K_REDUCESCATTER && op->kind != K_ALLTOALL && op->kind != K_SCATTER)
          bytes = bytes ? op->count * dtype_size(op->dtype) : 0;
        if (bytes && contributes(op)) memcpy(comm->slots + (size_t)comm->rank * SLOT_BYTES, op->send, bytes);
        atomic_store(&comm->calls[comm->rank], call_signature(op));
        comm->collectives++;
        barrier_post(comm, &op->target);
        op->phase = 1;
      }
      if (op->phase == 3) return 0;
      if (op->phase == 1) {
        if (!barrier_done(comm, op->target)) return 0;
        if (!members_agree(op)) { /* nobody posts the second barrier: every member waits forever */
          fprintf(stderr,
                  "rankwatch stand-in NCCL: collective %u of communicator %016llx: its members called different "
                  "collectives (this rank %s of %zu elements, datatype %d): it never completes\n",
                  comm->collectives, (unsigned long long)comm->id, KIND_NAMES[op->kind], op->count, (int)op->dtype);
          op->phase = 3;
          return 0;
        }
        compute_result(op);
        barrier_post(comm, &op->target); /* nobody reuses its slot before all have read */
        op->phase = 2;
      }
      return barrier_done(comm, op->target);
  }
}

/* ---- groups and issuing ----------------------------------------------------------------------------- */
static __thread int group_depth;
static __thread int group_error;
static __thread int group_size;
static __thread op_t group_ops[MAX_GROUP_OPS];
static _Atomic uint64_t calls_issued;

static void progress(op_t* ops, int count) {
  backoff wait = {0, 0};
  int remaining = count;
  char done[MAX_GROUP_OPS] = {0};
  while (remaining) {
    int advanced = 0;
    for (int i = 0; i < count; i++) {
      if (done[i]) continue;
      /* collectives on one comm pass its barrier in program order */
      int blocked = 0;
      if (ops[i].kind != K_SEND && ops[i].kind != K_RECV)
        for (int j = 0; j < i && !blocked; j++)
          blocked = !done[j] && ops[j].comm == ops[i].comm && ops[j].kind != K_SEND && ops[j].kind != K_RECV;
      if (blocked) continue;
      int phase = ops[i].phase;
      if (step(&ops[i])) {
        done[i] = 1;
        remaining--;
        advanced = 1;
      } else if (ops[i].phase != phase) {
        advanced = 1;
      }
    }
    if (advanced) {
      wait = (backoff){0, 0};
      continue;
    }
    for (int i = 0; i < count; i++)
      if (!done[i] && atomic_load(&ops[i].comm->aborting)) return; /* the communicator was aborted */
    backoff_wait(&wait);
  }
}

/* ---- the device the operations run on ------------------------------------------------------------- */
typedef void (*host_fn)(void*);
static struct {
  int async;
  int (*launch)(cudaStream_t stream, host_fn fn, void* arg);
  void (*hold)(void);                /* the stuck fault: see cuda_standin.c */
  void (*stall)(cudaStream_t stream, int lead_in);
} device;
static pthread_once_t device_once = PTHREAD_ONCE_INIT;

/* The stand-in libcuda.so.1 when it is loadable (it runs operations on its streams, or inline when
 * synchronous, and counts them for its fail-slow onset); a real one (no rwStandin symbols) or none
 * leaves every operation inside its call. */
static void find_device(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return;
  int (*is_async)(void) = (int (*)(void))dlsym(lib, "rwStandinDeviceIsAsync");
  device.launch = (int (*)(cudaStream_t, host_fn, void*))dlsym(lib, "rwStandinLaunchCollective");
  device.hold = (void (*)(void))dlsym(lib, "rwStandinHoldCollectiveStreams");
  device.stall = (void (*)(cudaStream_t, int))dlsym(lib, "rwStandinStallStream");
  if (!is_async) device.launch = NULL;
  device.async = device.launch && is_async();
}

static int device_is_async(void) {
  pthread_once(&device_once, find_device);
  return device.async;
}

typedef struct {
  int count;
  int owned; /* a copy of the operations on the heap (asynchronous), or the caller's (inline) */
  op_t* ops;
} launched_ops;

/* On the stream's executor: the rendezvous and data movement of one operation or group. */
static void run_launched(void* arg) {
  launched_ops* batch = arg;
  for (int i = 0; i < batch->count; i++)
    if (batch->ops[i].never_ends || batch->ops[i].stuck) { /* stuck: reached only without a stall */
      fprintf(stderr, "rankwatch stand-in NCCL: injected fault: this operation never completes\n");
      rw_hang_forever();
    }
  progress(batch->ops, batch->count);
  for (int i = 0; i < batch->count; i++) atomic_fetch_add(&batch->ops[i].comm->finished, 1);
  if (batch->owned) free(batch);
}

/* Hand one operation or a group to the device; without a stand-in device, perform it here. */
static ncclResult_t launch(op_t* ops, int count) {
  if (!device.launch) {
    progress(ops, count);
    return ncclSuccess;
  }
  launched_ops inline_batch = {count, 0, ops}, *batch = &inline_batch;
  if (device.async) { /* the call returns before the operation runs: keep a copy */
    batch = malloc(sizeof(launched_ops) + (size_t)count * sizeof(op_t));
    if (!batch) return ncclSystemError;
    *batch = (launched_ops){count, 1, (op_t*)(batch + 1)};
    memcpy(batch->ops, ops, (size_t)count * sizeof(op_t));
  }
  for (int i = 0; i < count; i++) atomic_fetch_add(&ops[i].comm->launched, 1);
  int stuck = 0;
  for (int i = 0; i < count; i++) stuck |= ops[i].stuck;
  if (stuck && device.stall) {
    fprintf(stderr, "rankwatch stand-in NCCL: injected fault: this operation never starts on the GPU\n");
    device.stall(ops[0].stream, count); /* its stream stops before it (and its GPU start events) */
  }
  if (device.launch(ops[0].stream, run_launched, batch) != 0) {
    for (int i = 0; i < count; i++) atomic_fetch_add(&ops[i].comm->finished, 1);
    if (batch->owned) free(batch);
    return ncclUnhandledCudaError;
  }
  /* The stuck fault, armed once the operation before it is launched: what is launched after this
   * (its start event) must not run before the stuck operation is known. */
  const rw_faults* f = rw_faults_get();
  if (device.async && device.hold && f->stuck_in_call > 1 && atomic_load(&calls_issued) == f->stuck_in_call - 1)
    device.hold();
  return ncclSuccess;
}

static ncclResult_t issue(op_t op) {
  if (!op.comm || op.comm->destroyed) return ncclInvalidArgument;
  if (op.count && !op.recv && op.kind != K_SEND && op.kind != K_REDUCE && op.kind != K_GATHER) return ncclInvalidArgument;
  if ((op.kind == K_SEND || op.kind == K_RECV || op.kind == K_BROADCAST || op.kind == K_REDUCE ||
       op.kind == K_GATHER || op.kind == K_SCATTER) &&
      (op.root < 0 || op.root >= op.comm->nranks))
    return ncclInvalidArgument;
  if ((op.kind == K_SEND || op.kind == K_RECV) && op.root == op.comm->rank) return ncclInvalidUsage;
  if (op.dtype < 0 || op.dtype >= ncclNumTypes) return ncclInvalidArgument;
  if (op.redop < 0) return ncclInvalidArgument;

  const rw_faults* f = rw_faults_get();
  uint64_t call = atomic_fetch_add(&calls_issued, 1) + 1;
  int async = device_is_async();
  if (f->stuck_in_call && call == f->stuck_in_call) {
    if (!async) rw_hang_forever(); /* the call itself never returns */
    op.stuck = 1;                  /* the operation never starts on the device */
  }
  if (f->never_ends_call && call == f->never_ends_call) {
    if (!async) rw_hang_forever();
    op.never_ends = 1; /* the operation starts on the device and never completes */
  }

  if (group_depth > 0) {
    if (group_size == MAX_GROUP_OPS) {
      group_error = 1;
      return ncclInvalidUsage;
    }
    group_ops[group_size++] = op;
    return ncclSuccess;
  }
  return launch(&op, 1);
}

/* ---- public API ------------------------------------------------------------------------------------- */
API(ncclResult_t, ncclGetVersion, int* version) {
  if (!version) return ncclInvalidArgument;
  *version = STANDIN_VERSION;
  return ncclSuccess;
}

API(ncclResult_t, ncclGetUniqueId, ncclUniqueId* unique) {
  if (!unique) return ncclInvalidArgument;
  memset(unique, 0, sizeof(*unique));
  memcpy(unique->internal, ID_MAGIC, 8);
  int fd = open("/dev/urandom", O_RDONLY);
  if (fd < 0 || read(fd, unique->internal + 8, 24) != 24) {
    if (fd >= 0) close(fd);
    return ncclSystemError;
  }
  close(fd);
  return ncclSuccess;
}

API(ncclResult_t, ncclCommInitRank, ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  if (memcmp(commId.internal, ID_MAGIC, 8) != 0) return ncclInvalidArgument;
  return comm_create(id_of(&commId), nranks, rank, comm);
}

API(ncclResult_t, ncclCommInitRankConfig, ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
    ncclConfig_t* config) {
  (void)config;
  return pncclCommInitRank(comm, nranks, commId, rank);
}

API(ncclResult_t, ncclCommInitRankScalable, ncclComm_t* newcomm, int nranks, int myrank, int nId,
    ncclUniqueId* commIds, ncclConfig_t* config) {
  (void)config;
  if (nId < 1 || !commIds) return ncclInvalidArgument;
  return pncclCommInitRank(newcomm, nranks, commIds[0], myrank);
}

API(ncclResult_t, ncclCommInitAll, ncclComm_t* comms, int ndev, const int* devlist) {
  (void)devlist;
  if (!comms || ndev < 1) return ncclInvalidArgument;
  ncclUniqueId unique;
  ncclResult_t result = pncclGetUniqueId(&unique);
  if (result != ncclSuccess) return result;
  /* One process holds every rank: attach them all before anyone waits on the init barrier. */
  uint64_t id = id_of(&unique);
  for (int rank = 0; rank < ndev; rank++) {
    ncclComm_t comm = calloc(1, sizeof(*comm));
    if (!comm) return ncclSystemError;
    comm->id = id;
    comm->rank = rank;
    comm->nranks = ndev;
    snprintf(comm->shm_name, sizeof(comm->shm_name), "/rwnccl-%s-%016llx", session(), (unsigned long long)id);
    comms[rank] = comm;
  }
  for (int rank = 0; rank < ndev; rank++) {
    ncclResult_t mapped = map_segment(comms[rank]);
    if (mapped != ncclSuccess) return mapped;
    comms[rank]->global_ranks[rank] = -1;
    atomic_fetch_add(&comms[rank]->shm->attached, 1);
  }
  return ncclSuccess;
}

API(ncclResult_t, ncclCommSplit, ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  (void)config;
  if (!comm || !newcomm || comm->destroyed || (color < 0 && color != NCCL_SPLIT_NOCOLOR)) return ncclInvalidArgument;
  if (group_depth > 0) return ncclInvalidUsage; /* the stand-in splits outside groups only */
  comm->split_color[comm->rank] = color;
  comm->split_key[comm->rank] = key;
  host_barrier(comm);
  int nranks = 0, rank = 0;
  for (int r = 0; r < comm->nranks; r++) {
    if (comm->split_color[r] != color) continue;
    if (comm->split_key[r] < key || (comm->split_key[r] == key && r < comm->rank)) rank++;
    nranks++;
  }
  host_barrier(comm); /* colors are read before anyone splits again */
  uint32_t split = ++comm->children;
  if (color == NCCL_SPLIT_NOCOLOR) {
    *newcomm = NULL;
    return ncclSuccess;
  }
  uint64_t child = fnv1a(&split, sizeof split, fnv1a(&color, sizeof color, comm->id));
  return comm_create(child, nranks, rank, newcomm);
}

API(ncclResult_t, ncclCommShrink, ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
    ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags) {
  (void)config;
  (void)shrinkFlags;
  if (!comm || !newcomm || comm->destroyed || excludeRanksCount < 0 || (excludeRanksCount && !excludeRanksList))
    return ncclInvalidArgument;
  int rank = comm->rank, excluded_below = 0;
  for (int i = 0; i < excludeRanksCount; i++) {
    if (excludeRanksList[i] == comm->rank) return ncclInvalidArgument; /* excluded ranks do not call */
    if (excludeRanksList[i] < comm->rank) excluded_below++;
  }
  rank -= excluded_below;
  uint32_t shrink = ++comm->children;
  int marker = -2; /* distinct from every split color */
  uint64_t child = fnv1a(&shrink, sizeof shrink, fnv1a(&marker, sizeof marker, comm->id));
  return comm_create(child, comm->nranks - excludeRanksCount, rank, newcomm);
}

/* Destroy waits for the communicator's launched operations (they use the segment); abort makes them
 * give up and waits at most a second, then leaves the segment mapped for any that never return. */
static ncclResult_t release(ncclComm_t comm, int abort) {
  if (!comm || comm->destroyed) return ncclInvalidArgument;
  comm->destroyed = 1;
  if (abort) atomic_store(&comm->aborting, 1);
  int64_t give_up = rw_now_monotonic_ns() + 1000000000;
  int pending = 0;
  backoff wait = {0, 0};
  while ((pending = atomic_load(&comm->finished) != atomic_load(&comm->launched))) {
    if (abort && rw_now_monotonic_ns() > give_up) break;
    backoff_wait(&wait);
  }
  if (atomic_fetch_add(&comm->shm->detached, 1) + 1 == (uint32_t)comm->nranks) shm_unlink(comm->shm_name);
  if (pending) return ncclSuccess;
  munmap(comm->shm, comm->shm_bytes);
  free(comm->sends);
  free(comm->receives);
  /* the handle itself stays allocated so that late misuse is reported, not a crash */
  return ncclSuccess;
}

API(ncclResult_t, ncclCommFinalize, ncclComm_t comm) { return comm && !comm->destroyed ? ncclSuccess : ncclInvalidArgument; }
API(ncclResult_t, ncclCommDestroy, ncclComm_t comm) { return release(comm, 0); }
API(ncclResult_t, ncclCommAbort, ncclComm_t comm) { return release(comm, 1); }

API(ncclResult_t, ncclCommCount, const ncclComm_t comm, int* count) {
  if (!comm || !count || comm->destroyed) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

API(ncclResult_t, ncclCommUserRank, const ncclComm_t comm, int* rank) {
  if (!comm || !rank || comm->destroyed) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

/* The device the process's communicators run on: its LOCAL_RANK, as torchrun's ranks pick theirs
 * (torch.cuda.set_device(local_rank)); 0 without one. */
API(ncclResult_t, ncclCommCuDevice, const ncclComm_t comm, int* device) {
  if (!comm || !device) return ncclInvalidArgument;
  const char* local_rank = getenv("LOCAL_RANK");
  *device = local_rank && *local_rank ? atoi(local_rank) : 0;
  return ncclSuccess;
}

API(ncclResult_t, ncclCommGetAsyncError, ncclComm_t comm, ncclResult_t* asyncError) {
  if (!comm || !asyncError) return ncclInvalidArgument;
  *asyncError = comm->async_error;
  return ncclSuccess;
}

API(const char*, ncclGetErrorString, ncclResult_t result) {
  static const char* names[] = {"no error", "unhandled cuda error", "unhandled system error", "internal error",
                                "invalid argument", "invalid usage", "remote process exited or there was a network error",
                                "NCCL operation in progress"};
  return result >= 0 && result < ncclNumResults ? names[result] : "unknown result code";
}

API(const char*, ncclGetLastError, ncclComm_t comm) {
  (void)comm;
  return "";
}

#define COLLECTIVE(kind_, send_, recv_, count_, dtype_, redop_, root_, comm_) \
  issue((op_t){.kind = kind_, .send = send_, .recv = recv_, .count = count_, .dtype = dtype_, \
               .redop = redop_, .root = root_, .comm = comm_, .stream = stream})

API(ncclResult_t, ncclAllReduce, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return COLLECTIVE(K_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, 0, comm);
}

API(ncclResult_t, ncclBroadcast, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
    ncclComm_t comm, cudaStream_t stream) {
  /* only the root's sendbuff matters; others pass theirs through the slot unused */
  return COLLECTIVE(K_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum, root, comm);
}

API(ncclResult_t, ncclBcast, void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
    cudaStream_t stream) {
  /* Like the real library, through its own public (interposable) API: a tracer must not count it twice. */
  return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

API(ncclResult_t, ncclReduce, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return COLLECTIVE(K_REDUCE, sendbuff, recvbuff, count, datatype, op, root, comm);
}

API(ncclResult_t, ncclAllGather, const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
    ncclComm_t comm, cudaStream_t stream) {
  return COLLECTIVE(K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm);
}

API(ncclResult_t, ncclReduceScatter, const void* sendbuff, void* recvbuff, size_t recvcount,
    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return COLLECTIVE(K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, 0, comm);
}

API(ncclResult_t, ncclAlltoAll, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    ncclComm_t comm, cudaStream_t stream) {
  return COLLECTIVE(K_ALLTOALL, sendbuff, recvbuff, count, datatype, ncclSum, 0, comm);
}

API(ncclResult_t, ncclGather, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
    ncclComm_t comm, cudaStream_t stream) {
  return COLLECTIVE(K_GATHER, sendbuff, recvbuff, count, datatype, ncclSum, root, comm);
}

API(ncclResult_t, ncclScatter, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
    ncclComm_t comm, cudaStream_t stream) {
  return COLLECTIVE(K_SCATTER, sendbuff, recvbuff, count, datatype, ncclSum, root, comm);
}

API(ncclResult_t, ncclSend, const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
    cudaStream_t stream) {
  return COLLECTIVE(K_SEND, sendbuff, NULL, count, datatype, ncclSum, peer, comm);
}

API(ncclResult_t, ncclRecv, void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
    cudaStream_t stream) {
  return COLLECTIVE(K_RECV, NULL, recvbuff, count, datatype, ncclSum, peer, comm);
}

API(ncclResult_t, ncclGroupStart, void) {
  group_depth++;
  return ncclSuccess;
}

API(ncclResult_t, ncclGroupEnd, void) {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  int failed = group_error;
  group_error = 0;
  int count = group_size;
  group_size = 0;
  if (failed) return ncclInvalidUsage;
  if (!count) return ncclSuccess;
  device_is_async(); /* finds the device */
  return launch(group_ops, count);
}
