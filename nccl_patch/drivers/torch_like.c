/* libtorch_like.so: stands for libtorch_cuda in tests. It links against libnccl.so.2 (DT_NEEDED) and is
 * itself loaded with dlopen(RTLD_LOCAL) (Python ctypes does that), so NCCL ends up in a local scope
 * exactly as under PyTorch, and its calls reach NCCL through ordinary symbol binding, where an
 * LD_PRELOAD interposer can see them. One generic entry point keeps the test surface small; tl_compute
 * and tl_work_allreduce issue work as PyTorch does on the stand-in device (compute on a compute stream,
 * the collective on the process group's own stream, ordered by events both ways).
 */
#include <stdint.h>
#include <stdlib.h>

#include "../include/nccl_abi.h"
#include "../standin/cuda_standin.h"

enum { TL_ALLREDUCE = 1, TL_BROADCAST = 2, TL_REDUCE = 3, TL_ALLGATHER = 4, TL_REDUCESCATTER = 5, TL_ALLTOALL = 6,
       TL_GATHER = 7, TL_SCATTER = 8, TL_SEND = 9, TL_RECV = 10, TL_BCAST = 11 };

int tl_call(int op, ncclComm_t comm, const void* send, void* recv, size_t count, int dtype, int redop, int root,
            uintptr_t stream) {
  cudaStream_t s = (cudaStream_t)stream;
  ncclDataType_t t = (ncclDataType_t)dtype;
  ncclRedOp_t r = (ncclRedOp_t)redop;
  switch (op) {
    case TL_ALLREDUCE: return ncclAllReduce(send, recv, count, t, r, comm, s);
    case TL_BROADCAST: return ncclBroadcast(send, recv, count, t, root, comm, s);
    case TL_REDUCE: return ncclReduce(send, recv, count, t, r, root, comm, s);
    case TL_ALLGATHER: return ncclAllGather(send, recv, count, t, comm, s);
    case TL_REDUCESCATTER: return ncclReduceScatter(send, recv, count, t, r, comm, s);
    case TL_ALLTOALL: return ncclAlltoAll(send, recv, count, t, comm, s);
    case TL_GATHER: return ncclGather(send, recv, count, t, root, comm, s);
    case TL_SCATTER: return ncclScatter(send, recv, count, t, root, comm, s);
    case TL_SEND: return ncclSend(send, count, t, root, comm, s);
    case TL_RECV: return ncclRecv(recv, count, t, root, comm, s);
    case TL_BCAST: return ncclBcast(recv, count, t, root, comm, s);
    default: return ncclInvalidArgument;
  }
}

int tl_unique_id(ncclUniqueId* id) { return ncclGetUniqueId(id); }
int tl_init(ncclComm_t* comm, int nranks, const ncclUniqueId* id, int rank) { return ncclCommInitRank(comm, nranks, *id, rank); }
int tl_init_all(ncclComm_t* comms, int ndev) { return ncclCommInitAll(comms, ndev, NULL); }
int tl_split(ncclComm_t comm, int color, int key, ncclComm_t* out) { return ncclCommSplit(comm, color, key, out, NULL); }
int tl_shrink(ncclComm_t comm, int* excluded, int count, ncclComm_t* out) {
  return ncclCommShrink(comm, excluded, count, out, NULL, 0);
}
int tl_destroy(ncclComm_t comm) { return ncclCommDestroy(comm); }
int tl_abort(ncclComm_t comm) { return ncclCommAbort(comm); }
int tl_group_start(void) { return ncclGroupStart(); }
int tl_group_end(void) { return ncclGroupEnd(); }

/* A compute kernel of `us` microseconds on the stream (the stand-in device's own entry point). */
int tl_compute(uintptr_t stream, int64_t us) { return rwStandinLaunchKernel((CUstream)stream, us * 1000); }

/* ProcessGroupNCCL's allreduce: the NCCL stream waits for the compute stream, the collective goes on
 * the NCCL stream, and work.wait() makes the compute stream (not the host) wait for its result. */
int tl_work_allreduce(uintptr_t compute, uintptr_t nccl, ncclComm_t comm, const void* send, void* recv, size_t count) {
  static __thread CUevent ready, done;
  if (!ready && (cuEventCreate(&ready, CU_EVENT_DEFAULT) || cuEventCreate(&done, CU_EVENT_DEFAULT))) return -1;
  if (cuEventRecord(ready, (CUstream)compute) || cuStreamWaitEvent((CUstream)nccl, ready, 0)) return -1;
  int result = ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, comm, (cudaStream_t)nccl);
  if (result) return result;
  if (cuEventRecord(done, (CUstream)nccl) || cuStreamWaitEvent((CUstream)compute, done, 0)) return -1;
  return 0;
}
