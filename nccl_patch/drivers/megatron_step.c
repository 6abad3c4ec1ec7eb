/* A Megatron-shaped training loop over NCCL, one process per rank, for the stand-in NCCL.
 *
 *   megatron_step --tp T --pp P --steps S --rendezvous DIR [--microbatches M] [--compute-us U]
 *
 * Rank, world size from RANK / WORLD_SIZE. Layout as Megatron: rank = tp + T*(dp + D*pp). The world
 * communicator and the data-parallel ones are made by ncclCommInitRank (ids exchanged through files
 * in DIR), the tensor- and pipeline-parallel ones by ncclCommSplit of the world. Each step: for every
 * microbatch, forward (recv activations from the previous stage, compute, TP AllReduce, compute, TP
 * AllReduce, send to the next stage), then backward in reverse, then a DP AllReduce per gradient
 * bucket and one world AllReduce (loss). TP AllReduce results are checked, so a stand-in that moves
 * data wrongly fails the run. RANKWATCH_STANDIN_SLOWDOWN stretches this rank's compute and
 * RANKWATCH_STANDIN_HANG_BEFORE_CALL=N stops it before its N-th NCCL call (faults.h); link and
 * stuck-call faults act inside the stand-in.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../include/nccl_abi.h"
#include "../standin/faults.h"

#define CHECK(call)                                                                         \
  do {                                                                                     \
    ncclResult_t result_ = (call);                                                         \
    if (result_ != ncclSuccess) {                                                          \
      fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, ncclGetErrorString(result_)); \
      exit(2);                                                                             \
    }                                                                                      \
  } while (0)

static int rank = -1;
static uint64_t calls; /* NCCL calls made so far */

static void before_call(void) {
  uint64_t hang_at = rw_faults_get()->hang_before_call;
  if (++calls == hang_at) {
    fprintf(stderr, "rank %d: injected hang before NCCL call %llu\n", rank, (unsigned long long)calls);
    rw_hang_forever();
  }
}

/* A slow GPU (RANKWATCH_STANDIN_SLOWDOWN, from RANKWATCH_STANDIN_SLOWDOWN_FROM_CALL on) takes longer. */
static void compute(int64_t us) {
  const rw_faults* faults = rw_faults_get();
  double factor = calls >= faults->slowdown_from_call ? 1.0 + faults->slowdown : 1.0;
  rw_sleep_ns((int64_t)((double)us * 1000 * factor));
}

/* Rank `leader` of a group writes a fresh unique id to DIR/name; the others wait for it. */
static ncclUniqueId exchange_id(const char* dir, const char* name, int leader) {
  ncclUniqueId id;
  char path[4096], temporary[4200];
  snprintf(path, sizeof path, "%s/%s.id", dir, name);
  if (leader) {
    CHECK(ncclGetUniqueId(&id));
    snprintf(temporary, sizeof temporary, "%s.%d.tmp", path, getpid());
    FILE* out = fopen(temporary, "wb");
    if (!out || fwrite(&id, sizeof id, 1, out) != 1 || fclose(out) != 0 || rename(temporary, path) != 0) {
      fprintf(stderr, "rank %d: cannot write %s: %s\n", rank, path, strerror(errno));
      exit(2);
    }
    return id;
  }
  for (int tries = 0; tries < 60000; tries++) {
    FILE* in = fopen(path, "rb");
    if (in) {
      size_t got = fread(&id, sizeof id, 1, in);
      fclose(in);
      if (got == 1) return id;
    }
    rw_sleep_ns(1000000);
  }
  fprintf(stderr, "rank %d: no unique id appeared at %s within 60 s\n", rank, path);
  exit(2);
}

static int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0) return atoi(argv[i + 1]);
  return fallback;
}

static const char* arg_str(int argc, char** argv, const char* name) {
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0) return argv[i + 1];
  return NULL;
}

static void p2p(int send, float* buffer, size_t count, int peer, ncclComm_t comm) {
  before_call();
  CHECK(ncclGroupStart()); /* PyTorch wraps every point-to-point call in a group */
  if (send) CHECK(ncclSend(buffer, count, ncclFloat32, peer, comm, NULL));
  else CHECK(ncclRecv(buffer, count, ncclFloat32, peer, comm, NULL));
  CHECK(ncclGroupEnd());
}

static void tp_allreduce(float* buffer, size_t count, int tp_rank, int tp_size, ncclComm_t tp) {
  for (size_t i = 0; i < count; i++) buffer[i] = (float)(tp_rank + 1);
  before_call();
  CHECK(ncclAllReduce(buffer, buffer, count, ncclFloat32, ncclSum, tp, NULL));
  float expected = (float)(tp_size * (tp_size + 1) / 2);
  if (buffer[0] != expected || buffer[count - 1] != expected) {
    fprintf(stderr, "rank %d: TP AllReduce gave %g, expected %g\n", rank, buffer[0], expected);
    exit(3);
  }
}

int main(int argc, char** argv) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the launcher */
  const char* rank_env = getenv("RANK");
  const char* world_env = getenv("WORLD_SIZE");
  const char* dir = arg_str(argc, argv, "--rendezvous");
  int tp_size = arg_int(argc, argv, "--tp", 1), pp_size = arg_int(argc, argv, "--pp", 1);
  int steps = arg_int(argc, argv, "--steps", 10), microbatches = arg_int(argc, argv, "--microbatches", 2);
  int compute_us = arg_int(argc, argv, "--compute-us", 2000);
  if (!rank_env || !world_env || !dir) {
    fprintf(stderr, "usage: RANK=r WORLD_SIZE=w %s --rendezvous DIR [--tp T --pp P --steps S ...]\n", argv[0]);
    return 2;
  }
  rank = atoi(rank_env);
  int world = atoi(world_env);
  if (tp_size < 1 || pp_size < 1 || world % (tp_size * pp_size) != 0 || rank < 0 || rank >= world) {
    fprintf(stderr, "rank %d: tp %d x pp %d must divide world size %d\n", rank, tp_size, pp_size, world);
    return 2;
  }
  int dp_size = world / (tp_size * pp_size);
  int tp_rank = rank % tp_size, dp_rank = (rank / tp_size) % dp_size, pp_rank = rank / (tp_size * dp_size);

  ncclComm_t world_comm, tp_comm, pp_comm, dp_comm;
  ncclUniqueId world_id = exchange_id(dir, "world", rank == 0);
  CHECK(ncclCommInitRank(&world_comm, world, world_id, rank));
  CHECK(ncclCommSplit(world_comm, dp_rank + dp_size * pp_rank, tp_rank, &tp_comm, NULL));
  CHECK(ncclCommSplit(world_comm, tp_rank + tp_size * dp_rank, pp_rank, &pp_comm, NULL));
  char name[64];
  snprintf(name, sizeof name, "dp-%d", tp_rank + tp_size * pp_rank);
  ncclUniqueId dp_id = exchange_id(dir, name, dp_rank == 0);
  CHECK(ncclCommInitRank(&dp_comm, dp_size, dp_id, dp_rank));

  enum { ACTIVATIONS = 4096, BUCKET = 16384, BUCKETS = 2 };
  float* activations = calloc(ACTIVATIONS, sizeof(float));
  float* bucket = calloc(BUCKET, sizeof(float));
  float loss = 1.0f;
  for (int step = 0; step < steps; step++) {
    for (int m = 0; m < microbatches; m++) {
      if (pp_rank > 0) p2p(0, activations, ACTIVATIONS, pp_rank - 1, pp_comm);
      compute(compute_us);
      tp_allreduce(activations, ACTIVATIONS, tp_rank, tp_size, tp_comm);
      compute(compute_us);
      tp_allreduce(activations, ACTIVATIONS, tp_rank, tp_size, tp_comm);
      if (pp_rank < pp_size - 1) p2p(1, activations, ACTIVATIONS, pp_rank + 1, pp_comm);
    }
    for (int m = 0; m < microbatches; m++) {
      if (pp_rank < pp_size - 1) p2p(0, activations, ACTIVATIONS, pp_rank + 1, pp_comm);
      compute(2 * compute_us);
      tp_allreduce(activations, ACTIVATIONS, tp_rank, tp_size, tp_comm);
      if (pp_rank > 0) p2p(1, activations, ACTIVATIONS, pp_rank - 1, pp_comm);
    }
    for (int b = 0; b < BUCKETS; b++) {
      before_call();
      CHECK(ncclAllReduce(bucket, bucket, BUCKET, ncclBfloat16, ncclSum, dp_comm, NULL));
    }
    before_call();
    CHECK(ncclAllReduce(&loss, &loss, 1, ncclFloat32, ncclAvg, world_comm, NULL));
  }
  CHECK(ncclCommDestroy(dp_comm));
  CHECK(ncclCommDestroy(pp_comm));
  CHECK(ncclCommDestroy(tp_comm));
  CHECK(ncclCommDestroy(world_comm));
  free(activations);
  free(bucket);
  return 0;
}
