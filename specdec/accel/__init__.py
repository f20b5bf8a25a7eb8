"""How to run the core's steps fast: compiled passes, overlapped and pipelined step runners, packed
linear layers, CUDA graphs and the host-sync counter. The core runs without any of it; the engine
takes these through its passes seam (`specdec.core.types.Passes`)."""
