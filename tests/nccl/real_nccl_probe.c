/* Loaded with librankwatch-nccl.so preloaded, next to a real libnccl.so.2 opened as PyTorch opens it
 * (dlopen RTLD_LOCAL): prints, as JSON, where each wrapped symbol resolves, and what each call returns
 * through the interposer and straight from the library's pncclX. No GPU: calls fail, and must fail alike.
 * Usage: real_nccl_probe /path/to/libnccl.so.2
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "nccl_abi.h"

static const char* WRAPPED[] = {
    "ncclAllGather", "ncclAllReduce", "ncclAlltoAll", "ncclBcast", "ncclBroadcast", "ncclCommAbort",
    "ncclCommDestroy", "ncclCommInitAll", "ncclCommInitRank", "ncclCommInitRankConfig",
    "ncclCommInitRankScalable", "ncclCommShrink", "ncclCommSplit", "ncclGather", "ncclGroupEnd",
    "ncclGroupStart", "ncclRecv", "ncclReduce", "ncclReduceScatter", "ncclScatter", "ncclSend", NULL};

static void* library;

static void* via_interposer(const char* name) { return dlsym(RTLD_DEFAULT, name); }

static void* direct(const char* name) {
  char strong[128];
  snprintf(strong, sizeof strong, "p%s", name);
  return dlsym(library, strong);
}

typedef ncclResult_t (*init_rank_t)(ncclComm_t*, int, ncclUniqueId, int);
typedef ncclResult_t (*init_config_t)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
typedef ncclResult_t (*init_all_t)(ncclComm_t*, int, const int*);
typedef ncclResult_t (*all_reduce_t)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*send_t)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*group_t)(void);
typedef ncclResult_t (*split_t)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
typedef ncclResult_t (*comm_t)(ncclComm_t);

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    printf("{\"error\": \"%s\"}\n", dlerror());
    return 2;
  }
  int version = 0;
  ((ncclResult_t(*)(int*))dlsym(library, "ncclGetVersion"))(&version);
  printf("{\"version\": %d, \"symbols\": {", version);
  for (int i = 0; WRAPPED[i]; i++) {
    Dl_info info = {0};
    void* caller = via_interposer(WRAPPED[i]);
    if (caller) dladdr(caller, &info);
    printf("%s\"%s\": {\"called\": \"%s\", \"public\": %d, \"strong\": %d}", i ? ", " : "", WRAPPED[i],
           info.dli_fname ? info.dli_fname : "", dlsym(library, WRAPPED[i]) != NULL, direct(WRAPPED[i]) != NULL);
  }
  printf("}, \"calls\": {");
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  ncclResult_t got_id = ((ncclResult_t(*)(ncclUniqueId*))dlsym(library, "ncclGetUniqueId"))(&id);
  printf("\"ncclGetUniqueId\": [%d, %d]", got_id, got_id);
  ncclComm_t comm_a = NULL, comm_b = NULL;
#define BOTH(name, type, ...)                                                   \
  do {                                                                          \
    type a = (type)via_interposer(#name), b = (type)direct(#name);              \
    if (a && b) printf(", \"%s\": [%d, %d]", #name, a(__VA_ARGS__), b(__VA_ARGS__)); \
  } while (0)
  BOTH(ncclCommInitRank, init_rank_t, &comm_a, 1, id, 0);
  BOTH(ncclCommInitRankConfig, init_config_t, &comm_b, 1, id, 0, NULL);
  BOTH(ncclCommInitAll, init_all_t, &comm_a, 1, NULL);
  BOTH(ncclAllReduce, all_reduce_t, NULL, NULL, 1, ncclFloat32, ncclSum, NULL, NULL);
  BOTH(ncclSend, send_t, NULL, 1, ncclFloat32, 1, NULL, NULL);
  BOTH(ncclRecv, send_t, NULL, 1, ncclFloat32, 1, NULL, NULL);
  BOTH(ncclGroupStart, group_t);
  BOTH(ncclGroupEnd, group_t);
  BOTH(ncclCommSplit, split_t, NULL, 0, 0, &comm_a, NULL);
  BOTH(ncclCommDestroy, comm_t, NULL);
  printf("}, \"comms\": [%d, %d]}\n", comm_a != NULL, comm_b != NULL);
  return 0;
}
