"""The model: config, decoder layers, MoE, RoPE, tensor/expert-parallel sharding, CPU linears."""
