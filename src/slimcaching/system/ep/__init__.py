"""Expert-parallel (EP) deployments on GPU clusters: every expert of every layer held at least
once, equal slots per GPU, tokens starting on every rank; their cost model and the expert maps
serving engines load."""
