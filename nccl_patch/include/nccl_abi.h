/* The slice of NCCL's public C ABI that rankwatch interposes and that the stand-in implements.
 * Declared here (types and signatures as NCCL 2.18-2.30 publish them; tests/nccl/test_real_nccl.py
 * compares them with the nccl.h of NVIDIA's wheels) so that nothing needs CUDA or NCCL headers at
 * build time. Every public ncclX has a strong pncclX twin (PMPI style).
 */
#ifndef RANKWATCH_NCCL_ABI_H
#define RANKWATCH_NCCL_ABI_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ncclComm* ncclComm_t;
typedef struct CUstream_st* cudaStream_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclTimeout = 8, /* NCCL >= 2.30 */
  ncclNumResults = 9
} ncclResult_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5,
               ncclMaxRedOp = 0x7fffffff } ncclRedOp_t;

typedef enum {
  ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
  ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9, ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11, ncclNumTypes = 12
} ncclDataType_t;

/* Opaque to rankwatch: only passed through. */
typedef struct ncclConfig ncclConfig_t;

#define NCCL_SPLIT_NOCOLOR -1

#define RW_NCCL_API(ret, name, ...) ret name(__VA_ARGS__); ret p##name(__VA_ARGS__);

RW_NCCL_API(ncclResult_t, ncclGetVersion, int* version)
RW_NCCL_API(ncclResult_t, ncclGetUniqueId, ncclUniqueId* uniqueId)
RW_NCCL_API(ncclResult_t, ncclCommInitRank, ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)
RW_NCCL_API(ncclResult_t, ncclCommInitRankConfig, ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
            ncclConfig_t* config)
RW_NCCL_API(ncclResult_t, ncclCommInitRankScalable, ncclComm_t* newcomm, int nranks, int myrank, int nId,
            ncclUniqueId* commIds, ncclConfig_t* config)
RW_NCCL_API(ncclResult_t, ncclCommInitAll, ncclComm_t* comm, int ndev, const int* devlist)
RW_NCCL_API(ncclResult_t, ncclCommSplit, ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
            ncclConfig_t* config)
RW_NCCL_API(ncclResult_t, ncclCommShrink, ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
            ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags)
RW_NCCL_API(ncclResult_t, ncclCommFinalize, ncclComm_t comm)
RW_NCCL_API(ncclResult_t, ncclCommDestroy, ncclComm_t comm)
RW_NCCL_API(ncclResult_t, ncclCommAbort, ncclComm_t comm)
RW_NCCL_API(ncclResult_t, ncclCommCount, const ncclComm_t comm, int* count)
RW_NCCL_API(ncclResult_t, ncclCommUserRank, const ncclComm_t comm, int* rank)
RW_NCCL_API(ncclResult_t, ncclCommCuDevice, const ncclComm_t comm, int* device)
RW_NCCL_API(ncclResult_t, ncclCommGetAsyncError, ncclComm_t comm, ncclResult_t* asyncError)
RW_NCCL_API(const char*, ncclGetErrorString, ncclResult_t result)
RW_NCCL_API(const char*, ncclGetLastError, ncclComm_t comm)
RW_NCCL_API(ncclResult_t, ncclAllReduce, const void* sendbuff, void* recvbuff, size_t count,
            ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclBroadcast, const void* sendbuff, void* recvbuff, size_t count,
            ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclBcast, void* buff, size_t count, ncclDataType_t datatype, int root,
            ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclReduce, const void* sendbuff, void* recvbuff, size_t count,
            ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclAllGather, const void* sendbuff, void* recvbuff, size_t sendcount,
            ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclReduceScatter, const void* sendbuff, void* recvbuff, size_t recvcount,
            ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclAlltoAll, const void* sendbuff, void* recvbuff, size_t count,
            ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclGather, const void* sendbuff, void* recvbuff, size_t count,
            ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclScatter, const void* sendbuff, void* recvbuff, size_t count,
            ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclSend, const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
            ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclRecv, void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
            ncclComm_t comm, cudaStream_t stream)
RW_NCCL_API(ncclResult_t, ncclGroupStart, void)
RW_NCCL_API(ncclResult_t, ncclGroupEnd, void)

#ifdef __cplusplus
}
#endif
#endif
