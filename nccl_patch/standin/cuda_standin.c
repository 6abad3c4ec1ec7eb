/* Stand-in libcuda.so.1: just the event and stream calls rankwatch's GPU timing uses, on the host
 * clock. A stream "executes" everything at once, so an event completes when it is recorded.
 * rwStandinSetCapturing(stream, 1) marks a stream as capturing a CUDA graph (for tests).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "../include/cuda_abi.h"

struct CUevent_st {
  int64_t ns;
  int recorded;
};

#define MAX_CAPTURING 64
static CUstream capturing[MAX_CAPTURING];
static struct CUctx_st* const the_context = (struct CUctx_st*)0x1;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  (void)flags;
  if (!event) return 1;
  *event = calloc(1, sizeof(**event));
  return *event ? CUDA_SUCCESS : 2;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
  (void)stream;
  if (!event) return 400;
  event->ns = now_ns();
  event->recorded = 1;
  return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent event) { return event && event->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY; }

CUresult cuEventSynchronize(CUevent event) { return event ? CUDA_SUCCESS : 400; }

CUresult cuEventElapsedTime(float* milliseconds, CUevent start, CUevent end) {
  if (!milliseconds || !start || !end) return 1;
  if (!start->recorded || !end->recorded) return CUDA_ERROR_NOT_READY;
  *milliseconds = (float)((double)(end->ns - start->ns) / 1e6);
  return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent event) {
  free(event);
  return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  (void)flags;
  static int streams;
  *stream = (CUstream)(uintptr_t)(0x1000 + ++streams);
  return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, int* status) {
  *status = 0;
  for (int i = 0; i < MAX_CAPTURING; i++)
    if (capturing[i] == stream && stream) *status = 1;
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

void rwStandinSetCapturing(CUstream stream, int on) {
  for (int i = 0; i < MAX_CAPTURING; i++) {
    if (on && !capturing[i]) {
      capturing[i] = stream;
      return;
    }
    if (!on && capturing[i] == stream) capturing[i] = NULL;
  }
}
