"""Triton attention kernels (paged split-KV decode, varlen prefill/extend) and the demo workload."""
