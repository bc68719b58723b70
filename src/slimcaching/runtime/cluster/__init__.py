"""What every process of a run builds alike from (scenario, placement, model): the cluster
layout (who holds what, what each hop costs), the run's context and cluster files, addresses."""
