/* The CUDA driver API calls rankwatch uses for GPU timing and the GPU's identity (loaded with
 * dlopen("libcuda.so.1")). */
#ifndef RANKWATCH_CUDA_ABI_H
#define RANKWATCH_CUDA_ABI_H

typedef int CUresult;
typedef struct CUevent_st* CUevent;
typedef struct CUstream_st* CUstream;
typedef struct CUctx_st* CUcontext;
typedef int CUdevice;
typedef struct CUuuid_st {
  char bytes[16];
} CUuuid;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_NOT_READY 600
#define CU_EVENT_DEFAULT 0
#define CU_STREAM_NON_BLOCKING 1
#define CU_STREAM_CAPTURE_STATUS_NONE 0

typedef CUresult (*cuEventCreate_t)(CUevent* event, unsigned int flags);
typedef CUresult (*cuEventRecord_t)(CUevent event, CUstream stream);
typedef CUresult (*cuEventQuery_t)(CUevent event);
typedef CUresult (*cuEventSynchronize_t)(CUevent event);
typedef CUresult (*cuEventElapsedTime_t)(float* milliseconds, CUevent start, CUevent end);
typedef CUresult (*cuStreamIsCapturing_t)(CUstream stream, int* status);
typedef CUresult (*cuStreamCreate_t)(CUstream* stream, unsigned int flags);
typedef CUresult (*cuCtxGetCurrent_t)(CUcontext* context);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext context);
typedef CUresult (*cuDeviceGet_t)(CUdevice* device, int ordinal);
typedef CUresult (*cuDeviceGetUuid_t)(CUuuid* uuid, CUdevice device);

#endif
