/* nccl.h includes it; nothing of it is needed to compare the ABI. */
