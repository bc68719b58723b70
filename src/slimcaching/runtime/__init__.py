"""Distributed runtime: execute a placement with real processes, sockets and tensors (docs/runtime.md).

One subpackage per concern, each importing only those below it: :mod:`.config` (every default),
:mod:`.model` then :mod:`.cluster` (what every process loads and builds alike), :mod:`.net` (wire
format, security, transport), then :mod:`.node` (a server process) and :mod:`.device` (the user's
side), which never import each other, then :mod:`.harness` (running a cluster) and :mod:`.serving`
(``slimcaching serve``). The map of every module is in docs/development.md, "The runtime".

Needs the ``runtime`` extra (pyzmq, msgpack) and, for nodes and devices, the ``hf`` extra.
"""
