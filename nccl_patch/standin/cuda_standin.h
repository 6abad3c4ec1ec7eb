/* What a driver (an application stand-in) calls on the stand-in libcuda.so.1, linked directly: the
 * CUDA driver API calls PyTorch's stream and event handling comes down to, and the stand-in's own
 * compute "kernel" (cuda_standin.c describes the device model).
 */
#ifndef RANKWATCH_CUDA_STANDIN_H
#define RANKWATCH_CUDA_STANDIN_H

#include <stdint.h>

#include "../include/cuda_abi.h"

CUresult cuStreamCreate(CUstream* stream, unsigned int flags);
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuCtxSynchronize(void);
CUresult cuEventCreate(CUevent* event, unsigned int flags);
CUresult cuEventRecord(CUevent event, CUstream stream);

/* A compute kernel of duration_ns on the stream (longer on a slowed device). */
CUresult rwStandinLaunchKernel(CUstream stream, int64_t duration_ns);
/* The stand-in NCCL's stuck fault (cuda_standin.c): hold back new work on collective streams, then
 * stop one stream for good before the stuck operation. No-ops on a synchronous device. */
void rwStandinHoldCollectiveStreams(void);
void rwStandinStallStream(CUstream stream, int lead_in);
/* 1 when the device runs behind the host (RANKWATCH_STANDIN_DEVICE=async). */
int rwStandinDeviceIsAsync(void);

#endif
