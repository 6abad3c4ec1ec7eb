/* The public NCCL functions the interposer defines: record, forward to pncclX, record the return.
 * A thread-local depth guard makes NCCL's calls of its own public API (ncclBcast -> ncclBroadcast,
 * ncclCommInitAll -> ncclGetUniqueId, ...) pass straight through, so nothing is counted twice.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "interposer.h"

static RW_HOT_TLS int in_nccl;

#define REAL(name, type)                                                                   \
  static _Atomic(void*) real_##name;                                                       \
  static type resolve_##name(void) {                                                       \
    void* fn = atomic_load_explicit(&real_##name, memory_order_relaxed);                   \
    if (!fn) {                                                                             \
      fn = rw_resolve("p" #name);                                                          \
      atomic_store_explicit(&real_##name, fn, memory_order_relaxed);                       \
    }                                                                                      \
    return (type)fn;                                                                       \
  }

#define FORWARD_OR_FAIL(name, fn)    \
  if (!fn) {                         \
    rw_missing_symbol(#name);        \
    return ncclInvalidUsage;         \
  }

/* A traced call: begin a record, forward, end it (grouped calls end at the outermost GroupEnd). */
#define TRACED(name, type, op, comm, count, dtype, redop, peer, stream, args)              \
  type fn = resolve_##name();                                                             \
  FORWARD_OR_FAIL(name, fn)                                                               \
  if (in_nccl) return fn args;                                                            \
  in_nccl++;                                                                              \
  rw_record* record;                                                                      \
  uint64_t index = rw_begin(comm, op, count, (int)(dtype), (int)(redop), peer, stream, &record); \
  if (record && rw_gpu_timing_enabled) rw_gpu_before(index, record, stream);             \
  ncclResult_t result = fn args;                                                          \
  if (record && rw_gpu_timing_enabled) rw_gpu_after(index, record, stream);              \
  rw_end(index, record, result);                                                          \
  in_nccl--;                                                                              \
  return result;

typedef ncclResult_t (*reduce_fn)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*rooted_fn)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*bcast_fn)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*rooted_reduce_fn)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                                         cudaStream_t);
typedef ncclResult_t (*gather_fn)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*send_fn)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*recv_fn)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*void_fn)(void);
typedef ncclResult_t (*init_rank_fn)(ncclComm_t*, int, ncclUniqueId, int);
typedef ncclResult_t (*init_config_fn)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
typedef ncclResult_t (*init_scalable_fn)(ncclComm_t*, int, int, int, ncclUniqueId*, ncclConfig_t*);
typedef ncclResult_t (*init_all_fn)(ncclComm_t*, int, const int*);
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
typedef ncclResult_t (*shrink_fn)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int);
typedef ncclResult_t (*comm_fn)(ncclComm_t);

REAL(ncclAllReduce, reduce_fn)
REAL(ncclReduceScatter, reduce_fn)
REAL(ncclBroadcast, rooted_fn)
REAL(ncclGather, rooted_fn)
REAL(ncclScatter, rooted_fn)
REAL(ncclBcast, bcast_fn)
REAL(ncclReduce, rooted_reduce_fn)
REAL(ncclAllGather, gather_fn)
REAL(ncclAlltoAll, gather_fn)
REAL(ncclSend, send_fn)
REAL(ncclRecv, recv_fn)
REAL(ncclGroupStart, void_fn)
REAL(ncclGroupEnd, void_fn)
REAL(ncclCommInitRank, init_rank_fn)
REAL(ncclCommInitRankConfig, init_config_fn)
REAL(ncclCommInitRankScalable, init_scalable_fn)
REAL(ncclCommInitAll, init_all_fn)
REAL(ncclCommSplit, split_fn)
REAL(ncclCommShrink, shrink_fn)
REAL(ncclCommDestroy, comm_fn)
REAL(ncclCommAbort, comm_fn)

/* ---- collectives and point-to-point ----------------------------------------------------------------- */
RW_EXPORT ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                     ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclAllReduce, reduce_fn, RW_OP_ALLREDUCE, comm, count, datatype, op, -1, stream,
         (sendbuff, recvbuff, count, datatype, op, comm, stream))
}

RW_EXPORT ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                         ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                         cudaStream_t stream) {
  TRACED(ncclReduceScatter, reduce_fn, RW_OP_REDUCESCATTER, comm, recvcount, datatype, op, -1, stream,
         (sendbuff, recvbuff, recvcount, datatype, op, comm, stream))
}

RW_EXPORT ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                     int root, ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclBroadcast, rooted_fn, RW_OP_BROADCAST, comm, count, datatype, 255, root, stream,
         (sendbuff, recvbuff, count, datatype, root, comm, stream))
}

RW_EXPORT ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                                 cudaStream_t stream) {
  TRACED(ncclBcast, bcast_fn, RW_OP_BROADCAST, comm, count, datatype, 255, root, stream,
         (buff, count, datatype, root, comm, stream))
}

RW_EXPORT ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclReduce, rooted_reduce_fn, RW_OP_REDUCE, comm, count, datatype, op, root, stream,
         (sendbuff, recvbuff, count, datatype, op, root, comm, stream))
}

RW_EXPORT ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                                     ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclAllGather, gather_fn, RW_OP_ALLGATHER, comm, sendcount, datatype, 255, -1, stream,
         (sendbuff, recvbuff, sendcount, datatype, comm, stream))
}

RW_EXPORT ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                    ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclAlltoAll, gather_fn, RW_OP_ALLTOALL, comm, count, datatype, 255, -1, stream,
         (sendbuff, recvbuff, count, datatype, comm, stream))
}

RW_EXPORT ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclGather, rooted_fn, RW_OP_GATHER, comm, count, datatype, 255, root, stream,
         (sendbuff, recvbuff, count, datatype, root, comm, stream))
}

RW_EXPORT ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                   int root, ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclScatter, rooted_fn, RW_OP_SCATTER, comm, count, datatype, 255, root, stream,
         (sendbuff, recvbuff, count, datatype, root, comm, stream))
}

RW_EXPORT ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                ncclComm_t comm, cudaStream_t stream) {
  TRACED(ncclSend, send_fn, RW_OP_SEND, comm, count, datatype, 255, peer, stream,
         (sendbuff, count, datatype, peer, comm, stream))
}

RW_EXPORT ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                                cudaStream_t stream) {
  TRACED(ncclRecv, recv_fn, RW_OP_RECV, comm, count, datatype, 255, peer, stream,
         (recvbuff, count, datatype, peer, comm, stream))
}

/* ---- groups ----------------------------------------------------------------------------------------- */
RW_EXPORT ncclResult_t ncclGroupStart(void) {
  void_fn fn = resolve_ncclGroupStart();
  FORWARD_OR_FAIL(ncclGroupStart, fn)
  if (in_nccl) return fn();
  ncclResult_t result = fn();
  if (result == ncclSuccess) rw_group_start();
  return result;
}

RW_EXPORT ncclResult_t ncclGroupEnd(void) {
  void_fn fn = resolve_ncclGroupEnd();
  FORWARD_OR_FAIL(ncclGroupEnd, fn)
  if (in_nccl) return fn();
  in_nccl++;
  ncclResult_t result = fn();
  in_nccl--;
  rw_group_end(result);
  return result;
}

/* ---- communicators: ids equal on every member ------------------------------------------------------- */
static uint64_t id_of_unique(const ncclUniqueId* ids, int count) {
  return rw_fnv1a(ids, sizeof(ncclUniqueId) * (size_t)count, 1469598103934665603ull);
}

static uint64_t child_id(uint64_t parent, uint32_t counter, int32_t color) {
  uint64_t hash = rw_fnv1a(&parent, sizeof parent, 1469598103934665603ull);
  hash = rw_fnv1a(&counter, sizeof counter, hash);
  return rw_fnv1a(&color, sizeof color, hash);
}

#define COMM_CALL(name, type, args, on_success)  \
  type fn = resolve_##name();                    \
  FORWARD_OR_FAIL(name, fn)                      \
  if (in_nccl) return fn args;                   \
  in_nccl++;                                     \
  ncclResult_t result = fn args;                 \
  if (result == ncclSuccess || result == ncclInProgress) { on_success; } \
  in_nccl--;                                     \
  return result;

RW_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  COMM_CALL(ncclCommInitRank, init_rank_fn, (comm, nranks, commId, rank),
            rw_comm_register(*comm, id_of_unique(&commId, 1), RW_OP_COMM_INIT, 0, -1))
}

RW_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                              ncclConfig_t* config) {
  COMM_CALL(ncclCommInitRankConfig, init_config_fn, (comm, nranks, commId, rank, config),
            rw_comm_register(*comm, id_of_unique(&commId, 1), RW_OP_COMM_INIT, 0, -1))
}

RW_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                                ncclUniqueId* commIds, ncclConfig_t* config) {
  COMM_CALL(ncclCommInitRankScalable, init_scalable_fn, (newcomm, nranks, myrank, nId, commIds, config),
            rw_comm_register(*newcomm, id_of_unique(commIds, nId > 0 ? nId : 0), RW_OP_COMM_INIT, 0, -1))
}

static _Atomic uint32_t init_all_calls;

RW_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  /* every member lives in this process: an id from (pid, call number) is equal on all of them */
  COMM_CALL(ncclCommInitAll, init_all_fn, (comms, ndev, devlist), {
    uint32_t call = atomic_fetch_add(&init_all_calls, 1) + 1;
    uint64_t id = child_id((uint64_t)getpid(), call, -3);
    for (int i = 0; i < ndev; i++) rw_comm_register(comms[i], id, RW_OP_COMM_INIT, 0, -1);
  })
}

RW_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  /* every member calls split, NOCOLOR ranks included, so the per-parent counter agrees */
  uint32_t counter = rw_comm_next_child(comm);
  uint64_t parent = rw_comm_id(comm);
  COMM_CALL(ncclCommSplit, split_fn, (comm, color, key, newcomm, config),
            if (*newcomm) rw_comm_register(*newcomm, child_id(parent, counter, color), RW_OP_COMM_SPLIT, parent, color))
}

RW_EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
                                      ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags) {
  uint32_t counter = rw_comm_next_child(comm);
  uint64_t parent = rw_comm_id(comm);
  COMM_CALL(ncclCommShrink, shrink_fn, (comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags),
            if (*newcomm) rw_comm_register(*newcomm, child_id(parent, counter, -2), RW_OP_COMM_SHRINK, parent,
                                           excludeRanksCount))
}

static ncclResult_t end_comm(comm_fn fn, ncclComm_t comm, int op) {
  if (in_nccl || !comm) return fn(comm); /* NULL: no communicator ends, nothing to record */
  in_nccl++;
  rw_record* record;
  uint64_t index = rw_begin(comm, op, 0, 0, 255, -1, NULL, &record);
  ncclResult_t result = fn(comm);
  rw_end(index, record, result);
  rw_comm_forget(comm);
  in_nccl--;
  return result;
}

RW_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  comm_fn fn = resolve_ncclCommDestroy();
  FORWARD_OR_FAIL(ncclCommDestroy, fn)
  return end_comm(fn, comm, RW_OP_COMM_DESTROY);
}

RW_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  comm_fn fn = resolve_ncclCommAbort();
  FORWARD_OR_FAIL(ncclCommAbort, fn)
  return end_comm(fn, comm, RW_OP_COMM_ABORT);
}
