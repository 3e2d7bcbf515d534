"""Each device's speed beside the core: the CPU's product forms and measured costs, CUDA's graphs, --compile."""
