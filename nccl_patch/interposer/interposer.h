/* Internal interface between the interposer's parts: ring writer, wrappers, GPU timing. */
#ifndef RANKWATCH_INTERPOSER_H
#define RANKWATCH_INTERPOSER_H

#include <stddef.h>
#include <stdint.h>

#include "../include/nccl_abi.h"
#include "../include/rankwatch_ring.h"

#define RW_EXPORT __attribute__((visibility("default")))
/* Hot thread-locals: initial-exec avoids a __tls_get_addr call per access (the library is preloaded,
 * so it is part of the initial TLS block). Large per-thread arrays stay in the default model. */
#define RW_HOT_TLS __thread __attribute__((tls_model("initial-exec")))

extern int rw_gpu_timing_enabled;

void* rw_resolve(const char* strong_name);
void rw_missing_symbol(const char* name);
uint64_t rw_fnv1a(const void* data, size_t len, uint64_t hash);
int64_t rw_realtime_ns(void);
rw_ring_header* rw_ring(void);

void rw_comm_register(ncclComm_t comm, uint64_t id, int op, uint64_t parent, int32_t detail);
void rw_note_gpu(ncclComm_t comm); /* gpu_identity.c: the header's gpu_index / gpu_uuid, once */
void rw_comm_forget(ncclComm_t comm);
uint64_t rw_comm_id(ncclComm_t comm);
uint32_t rw_comm_next_child(ncclComm_t comm);

uint64_t rw_begin(ncclComm_t comm, int op, size_t count, int dtype, int redop, int peer, cudaStream_t stream,
                  rw_record** out);
void rw_end(uint64_t index, rw_record* record, ncclResult_t result);
void rw_complete(uint64_t index, rw_record* record, ncclResult_t result, int64_t now);

void rw_group_start(void);
void rw_group_end(ncclResult_t result);
int rw_in_group(void);

/* GPU timing (gpu_timing.c): events around a call on its stream, completed by a poller thread. */
void rw_gpu_before(uint64_t index, rw_record* record, cudaStream_t stream);
void rw_gpu_after(uint64_t index, rw_record* record, cudaStream_t stream);
void rw_gpu_group_end(void);

#endif
