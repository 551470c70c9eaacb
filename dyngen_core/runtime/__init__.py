"""The runtime: `DynamicGenerator` (the only place that wires components), the step runner,
CUDA graphs, overlapped steps, `generate`, and the background engine."""
