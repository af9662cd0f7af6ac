"""Compute kernels of the engine's CPU hot path and the checks of what this CPU runs (cpu_isa). Nothing
here knows of sequences, schedules or servers."""
