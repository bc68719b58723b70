"""Distributed runtime: execute a placement with real processes, sockets and tensors (docs/runtime.md).

Modules: :mod:`config` (every default), :mod:`protocol` (versioned wire format and typed,
validated messages), :mod:`addresses` (``host:port``), :mod:`security` (CURVE keys, who may send
which op, connection cap), :mod:`admin` (the operator's requests), :mod:`tensors` (torch <-> wire
arrays), :mod:`linkemu` (user-space link emulation), :mod:`weights` (per-expert slicing of
safetensors checkpoints), :mod:`routing` (cluster layout and the routing table from scenario +
placement), :mod:`cluster` (resolved inputs of a run), :mod:`transport` + :mod:`executor` +
:mod:`node` (an edge server / cloud process: sockets and timers, compute, request handling),
:mod:`device` (the user's side, hooked into the transformers model), :mod:`launch` (local
subprocesses; Ray), :mod:`session` (a whole run and its per-token report against the prediction),
:mod:`calibrate` and :mod:`tiny` (a tiny test model).

Needs the ``runtime`` extra (pyzmq, msgpack) and, for nodes and devices, the ``hf`` extra.
"""
