"""Training: the run's lifecycle (run folder lock, checkpoints, preemption, registration at the
end), the process group, the DDP / DeepSpeed engines and the epoch loop. Imports the paper's
modules, data, store and evaluation."""
