// Replaced by the simulated runtime.
