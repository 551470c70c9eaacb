"""The control plane: jobs, plans, results, sampler settings, the page pool and the scheduler.

Pure Python; nothing here imports torch (a test enforces it)."""
