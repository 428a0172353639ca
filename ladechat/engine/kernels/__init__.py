"""ladechat's compute for a step on the CPU: the C++ kernels (blocks.cpp: the GGUF blocks' products;
step_ops.cpp: norms, rotation, attention row by row, top-k) and how they are built (native), the
Linear modules that run them (q4, q6, q8; int4: torch's int4 kernel where no compiler builds ours),
the norms, the small ops and the attention functions. Nothing here reads a file or a model: load/
builds these from a model's weights."""
