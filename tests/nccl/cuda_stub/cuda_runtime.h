/* The two names NCCL's public nccl.h takes from the CUDA runtime headers, so that it compiles here
 * without a CUDA toolkit (tests/nccl/test_real_nccl.py compares it with rankwatch's nccl_abi.h). */
#ifndef RANKWATCH_CUDA_RUNTIME_STUB_H
#define RANKWATCH_CUDA_RUNTIME_STUB_H
#define CUDART_VERSION 12000
typedef struct CUstream_st* cudaStream_t;
#endif
