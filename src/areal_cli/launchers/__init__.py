"""How workers are launched on a node (torchrun), shared by every scheduler and the doctor."""
