"""Run safety: stage-folder decisions, resume, the run lock, graceful stop, the non-finite guard, checkpoints."""
