"""Megatron-core backend: sharded training engine on top of megatron-core (TP/PP/EP/DP).

`cpu_compat` makes real Megatron code run on CPU over gloo so CI exercises it; on a CUDA
machine it does nothing.
"""
