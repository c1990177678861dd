"""Communication benchmarks: the collectives' links and how the step hides them (overlap)."""
