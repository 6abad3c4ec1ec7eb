/* The rankwatch trace ring: one mmap'd file per traced process, read in place by the sidecar and
 * by rankwatch.analysis (analysis/ring.py mirrors this layout; keep the two in step).
 *
 * File = one 4096-byte header + `capacity` fixed-size 128-byte records (capacity a power of two).
 * Writers claim record index i with an atomic fetch-add on `next`; the record lives in slot
 * i % capacity. Its `stamp` is 2*i+1 while it is being written and 2*i+2 once complete, so a
 * reader knows which claim a slot holds and whether it is torn or overwritten. Fields that change
 * after publication (t_return_ns, gpu_*_ns, result, state) are single aligned 64/32-bit stores;
 * `state` is written last (release), so a reader that sees a state sees the fields it implies.
 * All times are CLOCK_REALTIME nanoseconds (the clock Megatrace logs), so records of different
 * processes on one host compare directly.
 */
#ifndef RANKWATCH_RING_H
#define RANKWATCH_RING_H

#include <stddef.h>
#include <stdint.h>

#define RW_RING_MAGIC "RWRING\0\0"
#define RW_RING_VERSION 2u           /* 2: the header names the GPU (gpu_index, gpu_uuid); readers take 1 and 2 */
#define RW_RING_HEADER_SIZE 4096u
#define RW_RECORD_SIZE 128u
#define RW_DEFAULT_CAPACITY (1u << 16) /* 8 MiB of records per process */

enum rw_op {
  RW_OP_NONE = 0,
  RW_OP_ALLREDUCE = 1,
  RW_OP_BROADCAST = 2,
  RW_OP_REDUCE = 3,
  RW_OP_ALLGATHER = 4,
  RW_OP_REDUCESCATTER = 5,
  RW_OP_ALLTOALL = 6,
  RW_OP_GATHER = 7,
  RW_OP_SCATTER = 8,
  RW_OP_SEND = 9,
  RW_OP_RECV = 10,
  /* communicator lifecycle: comm_id is the (new) communicator */
  RW_OP_COMM_INIT = 32,  /* peer = -1; aux = 0 */
  RW_OP_COMM_SPLIT = 33, /* peer = color; aux = parent comm id */
  RW_OP_COMM_SHRINK = 34,/* peer = excluded count; aux = parent comm id */
  RW_OP_COMM_DESTROY = 35,
  RW_OP_COMM_ABORT = 36,
};

enum rw_state {
  RW_STATE_EMPTY = 0,
  RW_STATE_ENTERED = 1,  /* the rank called NCCL; the call has not returned */
  RW_STATE_RETURNED = 2, /* NCCL returned (for grouped calls: the outermost ncclGroupEnd did) */
  RW_STATE_GPU_DONE = 3, /* GPU start/end known */
  RW_STATE_FAILED = 4,   /* NCCL returned an error (result holds it) */
};

enum rw_flags {
  RW_FLAG_GROUPED = 1u << 0,      /* issued inside ncclGroupStart/End */
  RW_FLAG_GPU_TIMED = 1u << 1,    /* GPU events were recorded for this call */
  RW_FLAG_GRAPH_CAPTURE = 1u << 2,/* the stream was capturing a CUDA graph: no GPU timing */
  RW_FLAG_IN_PROGRESS = 1u << 3,  /* NCCL returned ncclInProgress (non-blocking comm) */
};

enum rw_header_flags {
  RW_HEADER_GPU_TIMING = 1u << 0, /* GPU timing on */
  RW_HEADER_GPU_KNOWN = 1u << 1,  /* gpu_index / gpu_uuid are written (version 2; set once, after them) */
};

typedef struct rw_record {
  uint64_t stamp;          /*   0: 2*i+1 while written, 2*i+2 when complete */
  uint64_t comm_id;        /*   8: equal on every member of the communicator */
  uint64_t seq;            /*  16: collectives: per-communicator number (1, 2, ...), equal across
                                  members; send/recv: per (communicator, peer, direction) number,
                                  so the n-th Send a->b matches the n-th Recv b<-a */
  uint64_t count;          /*  24: element count */
  uint64_t stream;         /*  32: cudaStream_t as an integer */
  int64_t t_call_ns;       /*  40: CLOCK_REALTIME when the rank called NCCL */
  int64_t t_return_ns;     /*  48: when the call (or its group) returned; 0 until then */
  int64_t gpu_start_ns;    /*  56: GPU start (realtime-aligned), 0 when unknown */
  int64_t gpu_end_ns;      /*  64: GPU end, 0 when unknown */
  uint64_t aux;            /*  72: lifecycle records: parent comm id */
  uint64_t group_id;       /*  80: calls of one ncclGroupStart/End share it; 0 when not grouped */
  int32_t rank;            /*  88: rank in the communicator */
  int32_t nranks;          /*  92: communicator size */
  int32_t global_rank;     /*  96: rank in the job (RANK env, else -1) */
  int32_t peer;            /* 100: send/recv peer; root of broadcast/reduce/gather/scatter; -1 */
  int32_t result;          /* 104: ncclResult_t once returned */
  uint32_t tid;            /* 108: OS thread id of the caller */
  uint8_t op;              /* 112: enum rw_op */
  uint8_t dtype;           /* 113: ncclDataType_t */
  uint8_t redop;           /* 114: ncclRedOp_t (255 when dynamic or not applicable) */
  uint8_t state;           /* 115: enum rw_state */
  uint32_t flags;          /* 116: enum rw_flags */
  uint64_t reserved;       /* 120 */
} rw_record;

typedef struct rw_ring_header {
  char magic[8];             /*    0: RW_RING_MAGIC */
  uint32_t version;          /*    8: RW_RING_VERSION */
  uint32_t header_size;      /*   12: RW_RING_HEADER_SIZE */
  uint32_t record_size;      /*   16: RW_RECORD_SIZE */
  uint32_t flags;            /*   20: enum rw_header_flags (atomic) */
  uint64_t capacity;         /*   24: slots (power of two) */
  uint64_t next;             /*   32: records ever claimed (atomic) */
  int64_t start_realtime_ns; /*   40 */
  int64_t start_monotonic_ns;/*   48 */
  int32_t pid;               /*   56 */
  int32_t global_rank;       /*   60: RANK / OMPI_COMM_WORLD_RANK, -1 when unknown */
  int32_t local_rank;        /*   64: LOCAL_RANK, -1 when unknown */
  int32_t world_size;        /*   68: WORLD_SIZE, -1 when unknown */
  int32_t nccl_version;      /*   72: ncclGetVersion() of the loaded NCCL */
  uint32_t lost_updates;     /*   76: completions that found their slot overwritten (atomic) */
  char hostname[64];         /*   80 */
  char job[64];              /*  144: RANKWATCH_JOB_NAME */
  int32_t sensitivity_ms;    /*  208: RANKWATCH_SENSITIVITY_SECONDS (or NCCL_MEGATRACE_SENSTIME), 0 unset */
  uint32_t gpu_skipped;      /*  212: calls not GPU-timed because every event slot was busy (atomic) */
  int64_t gpu_clock_error_ns;/*  216: GPU times may be off against host times by up to this (the widest
                                      window of a clock anchor in use); 0 without GPU timing */
  int32_t gpu_index;         /*  224: CUDA device ordinal of the process's first communicator (version 2) */
  uint8_t gpu_uuid[16];      /*  228: its cuDeviceGetUuid, as nvidia-smi's GPU-<uuid> (version 2) */
  /* the rest up to header_size is zero */
} rw_ring_header;

#ifdef __cplusplus
static_assert(sizeof(rw_record) == RW_RECORD_SIZE, "record size");
#else
_Static_assert(sizeof(rw_record) == RW_RECORD_SIZE, "record size");
_Static_assert(sizeof(rw_ring_header) <= RW_RING_HEADER_SIZE, "header size");
_Static_assert(offsetof(rw_ring_header, gpu_index) == 224 && offsetof(rw_ring_header, gpu_uuid) == 228,
               "header layout (analysis/ring.py reads these offsets)");
#endif

#endif
