"""The runtime: `DynamicGenerator` (the only place that wires components) and its blocking
`generate`, the step runner, CUDA graphs, overlapped steps, and the background engine."""
