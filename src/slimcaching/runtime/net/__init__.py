"""Talking between processes: the wire format and typed messages, CURVE security, the ZeroMQ
transport, link emulation, peer health and the dispatch of expert requests."""
