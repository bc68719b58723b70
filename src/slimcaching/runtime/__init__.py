"""Distributed runtime: execute a placement with real processes, sockets and tensors (SPEC §7).

Modules: :mod:`protocol` (versioned wire format), :mod:`linkemu` (user-space link emulation),
:mod:`weights` (per-expert slicing of safetensors checkpoints), :mod:`routing` (cluster layout and
the routing table from scenario + placement), :mod:`node` (edge server / cloud process),
:mod:`device` (the user's side, hooked into the transformers model), :mod:`launch` (local
subprocesses; Ray) and :mod:`metrics` (per-token records with their prediction).

Needs the ``runtime`` extra (pyzmq, msgpack) and, for nodes and devices, the ``hf`` extra.
"""
