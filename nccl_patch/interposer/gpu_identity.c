/* The GPU a traced process runs on, in its ring header: the CUDA device ordinal of its first
 * communicator (ncclCommCuDevice) and that device's UUID (cuDeviceGet, cuDeviceGetUuid), so a
 * diagnosis names the GPU beside the rank and the node (nvidia-smi, DCGM and the device plugin name
 * GPUs by UUID; the ordinal is the process's own, after CUDA_VISIBLE_DEVICES). Written once, after the
 * first communicator exists (NCCL has initialised CUDA on that device by then), off the hot path;
 * RW_HEADER_GPU_KNOWN is set after the fields, so a reader that sees the flag sees them. Without a
 * driver that has these calls the index alone is written; without ncclCommCuDevice, nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <string.h>

#include "../include/cuda_abi.h"
#include "interposer.h"

void rw_note_gpu(ncclComm_t comm) {
  static atomic_int noted;
  rw_ring_header* header = rw_ring();
  if (!header || !comm || atomic_exchange(&noted, 1)) return;
  ncclResult_t (*comm_device)(const ncclComm_t, int*) =
      (ncclResult_t(*)(const ncclComm_t, int*))rw_resolve("pncclCommCuDevice");
  int ordinal = -1;
  if (!comm_device || comm_device(comm, &ordinal) != ncclSuccess || ordinal < 0) return;
  header->gpu_index = ordinal;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  cuDeviceGet_t device_get = lib ? (cuDeviceGet_t)dlsym(lib, "cuDeviceGet") : NULL;
  cuDeviceGetUuid_t device_uuid = lib ? (cuDeviceGetUuid_t)dlsym(lib, "cuDeviceGetUuid") : NULL;
  CUdevice device;
  CUuuid uuid;
  if (device_get && device_uuid && device_get(&device, ordinal) == CUDA_SUCCESS &&
      device_uuid(&uuid, device) == CUDA_SUCCESS)
    memcpy(header->gpu_uuid, uuid.bytes, sizeof(header->gpu_uuid));
  atomic_fetch_or_explicit((_Atomic uint32_t*)&header->flags, RW_HEADER_GPU_KNOWN, memory_order_release);
}
