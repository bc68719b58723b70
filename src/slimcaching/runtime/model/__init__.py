"""The model's pieces a node or device loads: per-expert weights from safetensors, the partial
(skeleton) model, tensors on the wire, a tiny test model."""
